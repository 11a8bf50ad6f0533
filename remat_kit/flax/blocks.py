"""Which module classes of a model not ours are its blocks (the layers each remat region
wraps), from its module instances: the class holding submodules instantiated at least twice
with one parameter structure whose instances hold the most parameters, and every other such
class whose instances lie apart from those (an encoder's layers beside a decoder's)."""

from __future__ import annotations

from typing import NamedTuple

from remat_kit.errors import UnknownModuleError


class Blocks(tuple):
    """The block classes of a model: one, or several whose layers lie apart (an
    encoder's layers and a decoder's). A tuple of classes, so `isinstance(m, blocks)`
    holds for a layer of any; `__name__` joins their names ("EncoderLayer+DecoderLayer")."""

    @property
    def __name__(self) -> str:
        return "+".join(c.__name__ for c in self)


class Pick(NamedTuple):
    """The block classes `pick_block` found, how many layers run them, and the
    repeated block classes left out where the user named the blocks ("EncoderLayer
    x2"): those run without remat under every policy, so the reports say so."""

    cls: Blocks
    count: int
    others: tuple[str, ...]


def pick_block(instances: dict[tuple, list], block, copies: dict | None = None) -> Pick:
    """The block classes and their count, from {(class, structure, size): [instance
    ids]} and {instance id: layers it runs} (`copies`: a scanned stack's one instance
    runs its scan's length of layers; default 1 each).

    Found: the module class holding submodules, instantiated at least twice with one
    structure, whose instances hold the most parameters (ties: the outermost), and
    with it every other such class whose instances lie apart from its blocks, the
    outermost ones (an encoder's layers beside a decoder's). `block`: a class, a name,
    several as a tuple or "A,B", instead.

    Raises:
      UnknownModuleError: `block` names no class of the model, or no class that
        holds submodules (layers of its own) is instantiated twice with one structure.
    """
    classes = {cls.__name__: cls for cls, _, _ in instances}
    paths = {tuple(p) for ids in instances.values() for p in ids}

    def composite(path) -> bool:  # holds modules of its own: a block, not a Dense or a norm
        return any(_inside(q, path) for q in paths)

    def count(ids) -> int:
        return sum((copies or {}).get(tuple(i), 1) for i in ids)

    if block is not None:
        wanted = (block.split(",") if isinstance(block, str)
                  else tuple(block) if isinstance(block, (tuple, list)) else (block,))
        picked = {}
        for want in wanted:
            name = want.strip() if isinstance(want, str) else getattr(want, "__name__", str(want))
            hits = [(len(ids), cls) for (cls, _, _), ids in instances.items()
                    if cls.__name__ == name or cls is want]
            if not hits:
                raise UnknownModuleError(name, sorted(classes),
                                         message="the block class matches no module of the "
                                                 "model")
            n, cls = max(hits, key=lambda h: h[0])
            picked[cls] = n
        blocks = Blocks(picked)
        return Pick(blocks, sum(picked.values()), tuple(
            f"{c.__name__} x{n}" for c, n in _apart(instances, blocks, composite, count)))
    best = None
    for (cls, _, size), ids in instances.items():
        n = count(ids)
        if n < 2 or not composite(tuple(ids[0])):
            continue
        rank = (len(ids) * size, -n)  # most parameters covered, then the outermost
        if best is None or rank > best[0]:
            best = (rank, cls, n)
    if best is None:
        raise UnknownModuleError(
            None, sorted(classes),
            message="no module class holding submodules is instantiated twice with one "
                    "parameter structure, so there is no repeated block (a one-layer model?); "
                    "name the block with --block NAME (block=) or give a function "
                    "(batch, seq) -> rk.Workload")
    apart = dict(_apart(instances, Blocks((best[1],)), composite, count))
    order = [c for c, _, _ in instances if c is best[1] or c in apart]  # the model's order
    return Pick(Blocks(dict.fromkeys(order)), best[2] + sum(apart.values()), ())


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


def _apart(instances, blocks: Blocks, composite, count) -> list[tuple[type, int]]:
    """(class, layers) of each other repeated block class with instances neither
    inside nor around a `blocks` block, outermost ones only (an encoder's layers
    beside a decoder's; not the attention inside either)."""
    chosen = [tuple(p) for (c, _, _), ids in instances.items() if c in blocks for p in ids]
    apart = {}
    for (c, _, _), ids in instances.items():
        out = [tuple(p) for p in ids if c not in blocks and not any(
            _inside(tuple(p), q) or _inside(q, tuple(p)) for q in chosen)]
        if count(out) >= 2 and composite(out[0]):
            apart.setdefault(c, []).extend(out)
    outer = [p for ps in apart.values() for p in ps]
    return [(c, count(ps)) for c, ps in apart.items()
            if not any(_inside(p, q) for p in ps for q in outer)]


__all__ = ["Blocks", "Pick", "pick_block", "unremat_note"]
