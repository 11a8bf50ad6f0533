"""Which modules of a model not ours are its layers (the units each remat region wraps).

`pick_block` takes the unit its own library would remat: of the classes holding submodules and
running at least two layers, the one whose instances hold the most parameters (ties: the
outermost), unless it is a container of stacks, plus every other such class lying apart from
those layers (an encoder's beside a decoder's). `block=` names them instead (`ModelError`).
The rule, with examples: docs/models.md ("A Flax model, no glue", step 2).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

from remat_kit.errors import UnknownModuleError
from remat_kit.trace.model_map import Layer, stacks_of


class ModelError(ValueError):
    """The model is not a language model remat_kit can measure without glue."""


def has_parameters(model, params) -> None:
    """ModelError where `model` holds no parameters (`params`, a pytree): its loss has no
    gradient, so there is no backward pass and nothing to rematerialize."""
    import jax
    if not jax.tree.leaves(params):
        raise ModelError(f"{type(model).__name__} has no parameters: its loss has no gradient, "
                         "so there is no backward pass and nothing to rematerialize")


# Of a container's parameters, the share its inner layers hold that makes it a stack.
_STACK_SHARE = 0.9


class Blocks(tuple):
    """The layer classes of a model: one, or several whose layers lie apart (an
    encoder's layers and a decoder's). A tuple of classes, so `isinstance(m, blocks)`
    holds for a layer of any; `__name__` joins their names ("EncoderLayer+DecoderLayer")."""

    @property
    def __name__(self) -> str:
        return "+".join(c.__name__ for c in self)


class Instance(NamedTuple):
    """One module instance: its path, class, parameter structure ((key path, shape,
    dtype) per leaf), its scalars, and the layers it runs (a scan's length, else 1)."""

    path: tuple
    cls: type
    structure: tuple
    size: int
    copies: int = 1


class Pick(NamedTuple):
    """The layer classes `pick_block` found; the repeated classes left out where the
    user named the layers ("EncoderLayer x2": those run without remat under every
    policy, so the reports say so); the layers, in the model's order, as the model map
    lists them; and what holds parameters outside every layer ("wte",
    "encoder/final_layer_norm")."""

    cls: Blocks
    others: tuple[str, ...]
    layers: tuple[Layer, ...] = ()
    outside: tuple[str, ...] = ()


def pick_block(instances: list[Instance], block=None, loose: tuple = ()) -> Pick:
    """The layer classes of a model from its module instances, in the order the model
    calls them (see the module docstring); `block`: a class, a name, several as a tuple
    or "A,B", instead. `loose`: the model's own parameters held by no submodule
    (a position table of the root's), outside every layer too.

    No such class: a Pick of no layers (nothing to remat; the map says so).

    Raises:
      UnknownModuleError: `block` names no class of the model.
    """
    classes = {i.cls.__name__: i.cls for i in instances}
    paths = [i.path for i in instances]

    def composite(path) -> bool:  # holds modules of its own: a layer, not a Dense or a norm
        return any(_inside(q, path) for q in paths)

    by_class: dict[type, list[Instance]] = {}
    for i in instances:
        by_class.setdefault(i.cls, []).append(i)
    order = {i.path: n for n, i in enumerate(instances)}  # the model's call order
    pick = lambda blocks, others: _pick(by_class, order, blocks, others, loose)  # noqa: E731
    if block is not None:
        picked = _named(by_class, block, classes)
        apart = _apart(by_class, picked, composite)
        return pick(picked, tuple(f"{c.__name__} x{n}" for c, n in apart))
    candidates = {c: ins for c, ins in by_class.items()
                  if sum(i.copies for i in ins) >= 2 and composite(ins[0].path)}
    containers = _containers(candidates, composite)
    ranked = sorted((c for c in candidates if c not in containers),
                    key=lambda c: (sum(i.size for i in candidates[c]),
                                   -sum(i.copies for i in candidates[c])), reverse=True)
    if not ranked:
        return pick(Blocks(), ())
    best = ranked[0]
    apart = dict(_apart(by_class, Blocks((best,)), composite))
    return pick(Blocks(c for c in by_class if c is best or c in apart), ())


def _named(by_class, block, classes) -> Blocks:
    wanted = (block.split(",") if isinstance(block, str)
              else tuple(block) if isinstance(block, (tuple, list)) else (block,))
    picked = []
    for want in wanted:
        name = want.strip() if isinstance(want, str) else getattr(want, "__name__", str(want))
        hits = [c for c in by_class if c.__name__ == name or c is want]
        if not hits:
            raise UnknownModuleError(name, sorted(classes),
                                     message="the block class matches no module of the model")
        picked.append(max(hits, key=lambda c: len(by_class[c])))
    return Blocks(dict.fromkeys(picked))


def _pick(by_class, order: dict, blocks: Blocks, others: tuple, loose: tuple) -> Pick:
    """The Pick of `blocks`: every instance of theirs not inside another, in call order
    (`order`: {path: position})."""
    chosen = [i for c in blocks for i in by_class[c]]
    chosen = [i for i in chosen if not any(_inside(i.path, o.path) for o in chosen)]
    chosen.sort(key=lambda i: order[i.path])
    rest = [p for p in order if not any(_inside(p, i.path) or _inside(i.path, p) or p == i.path
                                        for i in chosen)]
    outside = tuple("/".join(map(str, p)) for p in rest
                    if not any(_inside(p, q) for q in rest)) + tuple(map(str, loose))
    return Pick(blocks, others, _layers(chosen), outside)


def _layers(chosen: list[Instance]) -> tuple[Layer, ...]:
    """The map's layers: each structure numbered per class, labelled by what sets it
    apart from the class's other structures in the same stack."""
    numbers: dict[tuple, int] = {}
    for i in chosen:
        numbers.setdefault((i.cls, i.structure), sum(c is i.cls for c, _ in numbers))
    plain = [Layer("/".join(map(str, i.path)), i.cls.__name__, numbers[(i.cls, i.structure)],
                   "", i.size, i.copies) for i in chosen]
    out = []
    for stack in stacks_of(plain):
        for layer in stack.layers:
            kin = {x.structure: x for x in stack.layers if x.cls == layer.cls}
            structures = {n: _keys(chosen, x.path) for n, x in kin.items()}
            label = _label(structures.pop(layer.structure), list(structures.values()))
            out.append(dataclasses.replace(layer, label=label))
    return tuple(out)


def _keys(chosen: list[Instance], path: str) -> set:
    inst = next(i for i in chosen if "/".join(map(str, i.path)) == path)
    return {(k, shape) for k, shape, _ in inst.structure}


def _label(mine: set, others: list[set]) -> str:
    """What `mine` (a structure's (key path, shape) leaves) holds that no other has, by
    its shallowest unshared module or parameter name; else what it lacks; "" alone."""
    if not others:
        return ""

    def prefixes(leaves):
        return {k[:n] for k, _ in leaves for n in range(1, len(k) + 1)}

    theirs, own = set.union(*map(prefixes, others)), prefixes(mine)
    only = sorted({p for p in own - theirs if p[:-1] in theirs or len(p) == 1}, key=len)
    if only:
        return "+".join(dict.fromkeys(p[-1] for p in only[:2]))
    lacks = sorted({p for p in theirs - own if p[:-1] in own or len(p) == 1}, key=len)
    return f"no {lacks[0][-1]}" if lacks else "other shapes"


def _indexed(names: list, cls: type) -> bool:
    """Whether sibling module names form a sequence (an NNX list's 0, 1; linen's
    "0", "layers_1"), not flax's automatic ClassName_0 names."""
    heads = set()
    for name in names:
        if isinstance(name, int) or str(name).isdigit():
            heads.add("")
            continue
        m = re.fullmatch(r"(.*?)_?(\d+)", str(name))
        if m is None or m.group(1) == cls.__name__:
            return False
        heads.add(m.group(1))
    return len(heads) == 1


def _containers(candidates: dict, composite) -> set:
    """The candidate classes that hold stacks of layers, not layers: those whose every
    composite child is one of two or more layers of another candidate (named as a
    sequence, or holding nine tenths of its parameters: `_holds_stack`), and those
    whose instances hold an instance of such a class (a T5 stack around its block
    collection)."""
    found = {c for c in candidates if _holds_stack(candidates, c, composite)}
    grew = True
    while grew:
        grew = False
        for c, ins in candidates.items():
            if c not in found and any(_inside(i.path, o.path) for o in ins for d in found
                                      for i in candidates[d]):
                found.add(c)
                grew = True
    return found


def _holds_stack(candidates: dict, cls: type, composite) -> bool:
    """Whether `cls`'s instances hold a stack of another candidate's layers: two or more
    with no other candidate between, and no composite child beside them (an MoE's
    experts beside its block's attention are not a stack)."""
    every = [i.path for ins in candidates.values() for i in ins]
    for outer in candidates[cls]:
        for other, ins in candidates.items():
            inner = [i for i in ins if other is not cls and _inside(i.path, outer.path)
                     and not any(_inside(i.path, q) and _inside(q, outer.path) for q in every)]
            beside = [q for q in every if q[:-1] == outer.path and composite(q)
                      and q not in {i.path for i in inner}]
            if len(inner) >= 2 and not beside and (
                    _indexed([i.path[-1] for i in inner], other)
                    or sum(i.size for i in inner) >= _STACK_SHARE * outer.size):
                return True
    return False


def unremat_note(others: tuple[str, ...], cls: type) -> tuple[str, ...]:
    """The reports' note on the repeated blocks left out (`Pick.others`)."""
    if not others:
        return ()
    one = len(others) == 1
    what = "another repeated block class" if one else "other repeated block classes"
    names = ",".join([cls.__name__.replace("+", ","), *(o.split()[0] for o in others)])
    return (f"{', '.join(others)}: {what}, outside the {cls.__name__} blocks: "
            f"{'it runs' if one else 'they run'} without remat under every policy here; "
            f"name {'it' if one else 'them'} too with --block {names} (block=)",)


def _inside(path: tuple, outer: tuple) -> bool:
    return len(path) > len(outer) and path[:len(outer)] == outer


def _apart(by_class: dict, blocks: Blocks, composite) -> list[tuple[type, int]]:
    """(class, layers) of each other class running two layers or more with instances
    neither inside nor around a `blocks` layer, outermost ones only (an encoder's
    layers beside a decoder's; not the attention inside either)."""
    chosen = [i.path for c in blocks for i in by_class[c]]
    apart = {}
    for c, ins in by_class.items():
        out = [i for i in ins if c not in blocks and not any(
            _inside(i.path, q) or _inside(q, i.path) for q in chosen)]
        if sum(i.copies for i in out) >= 2 and composite(out[0].path):
            apart[c] = out
    outer = [i.path for ins in apart.values() for i in ins]
    return [(c, sum(i.copies for i in ins)) for c, ins in apart.items()
            if not any(_inside(i.path, q) for i in ins for q in outer)]


__all__ = ["Blocks", "Instance", "ModelError", "Pick", "has_parameters", "pick_block",
           "unremat_note"]
