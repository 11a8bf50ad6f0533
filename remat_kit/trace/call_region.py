"""One call of a block, run under a role-named policy on a model that tags no roles itself.

A preset that keeps values by dataflow role (MaxText's `minimal`, Megatron's `selective`) selects
nothing on a model without those `checkpoint_name`s; for such a call the wrappers trace the block
alone, mark it as one region and `build` it through `trace.regions`, so the wrapped model
compiles to the program `compare --model` measured. Also `Region`, `once`, `policy_line`.
Docs: docs/wrappers.md ("Role presets on a model that tags no roles").
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import jax

from remat_kit.trace import own_remat, regions, wrapping
from remat_kit.trace.validate import check_names, policy_notes

KEY = "remat_kit_call"


@dataclasses.dataclass(frozen=True)
class Region:
    """A block's call made by `build`: `run(*leaves)` gives its output; `notes` are
    compare's notes on what the policy selects there, which `warn` raises; `passed`
    per flat output, whether it is an input passed through (`regions.passed_through`)."""

    run: Callable
    notes: tuple[str, ...]
    passed: tuple[bool, ...] = ()

    def warn(self) -> None:
        """Warns each note (Python's filters show each once per place), at every use of
        a kept region, not only the first trace."""
        for note in self.notes:
            warnings.warn(note, stacklevel=4)


def build(fn: Callable, leaves: Sequence, num_params: int, call: wrapping.RoleCall,
          where: str) -> Region:
    """`fn` (a block's call on flat array inputs, its first `num_params` the block's
    parameters) as a `Region` whose run(*leaves) gives fn's output, checkpointed under
    `call.policy` with its dataflow roles tagged.

    Its notes: compare's note where the policy still selects nothing (a role the
    block lacks: fused attention has no `attn_logits`), in one line, and where the
    block runs remat regions of its own around part of its work, which stay inside the
    policy's region. A remat of the whole block in its call is taken over
    (`own_remat.find`), as `rk.remat_model` takes it over.

    Raises:
      UnknownTagError: `call.validate` and the policy names a tag the tagged
        block never emits.
    """
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
    marked = jax.checkpoint(fn, policy=wrapping.Marker(KEY))
    closed, shape = jax.make_jaxpr(marked, return_shape=True)(*structs)
    mine = own_remat.find(closed.jaxpr, KEY)  # a remat of the whole block: the policy's now
    program, found = regions.build(closed, None, KEY, num_params, mine.taken)
    if call.validate:
        check_names(call.policy, program.emitted, where=where)
    out = tuple(filter(None, [policy_line(where, call.policy, program, found)]))
    own = sum(r.count for r in mine.kept())
    if own:
        out += (f"{where}: the block already runs {own} remat region"
                f"{'s' if own > 1 else ''} of its own; they stay, nested inside the "
                "policy's region",)
    run, tree = program.function((call.policy,)), jax.tree.structure(shape)
    return Region(lambda *xs: jax.tree.unflatten(tree, run(*xs)), out,
                  regions.passed_through(closed.jaxpr))


def policy_line(where: str, policy, program: regions.Regions, found) -> str | None:
    """compare's notes on what `policy` selects in `program` (roles `found`), in one
    line naming `where`; None where it selects what it names."""
    notes = policy_notes(policy, program.emitted, found.notes())
    return f"{where}: {policy}: {'; '.join(notes)}" if notes else None


def key_of(*parts):
    """`parts` as a cache key, or None where one is unhashable (then made each time)."""
    try:
        hash(parts)
    except TypeError:
        return None
    return parts


# Programs kept per cache: a long-lived process (a notebook, a sweep over shapes) keeps the
# most recently used ones, not every traced jaxpr it ever made.
KEPT = 64


def once(built: dict, key, make):
    """`make()`, kept in `built` under `key` (None: an unhashable call, made each time);
    past `KEPT` entries the least recently used one is dropped."""
    if key is None:
        return make()
    if key in built:
        built[key] = built.pop(key)  # now the most recently used
        return built[key]
    built[key] = made = make()
    if len(built) > KEPT:
        del built[next(iter(built))]
    return made


__all__ = ["KEY", "Region", "build", "key_of", "once", "policy_line"]
