"""A model's own remat regions (`nn.remat`, `nnx.remat`, `jax.checkpoint` in its code), and
which of them remat_kit takes over.

`find` lists them (`Found`, `OwnRegion`): a region that is exactly one marked layer's remat (a
library's `gradient_checkpointing` flag, MaxText's scan body) is taken over by the policy being
measured, so `none` means no remat; any other stays under every policy, and the map says so.
Also `count`, `policy_name`. Docs: docs/models.md ("A Flax model, no glue", step 5).
"""

from __future__ import annotations

import dataclasses

from remat_kit.trace import wrapping
from remat_kit.trace.marked import is_marked, region, sub_jaxprs

# Equations that compute nothing: beside a remat region, it is still the whole layer.
_PLUMBING = frozenset({"name", "reshape", "convert_element_type", "copy", "copy_p", "squeeze",
                       "expand_dims"})
# Primitives whose FLOPs make a region more than a layer's wrapper.
_WORK = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class OwnRegion:
    """Regions of the model's own of one kind.

    Attributes:
      policy: the JAX policy's name, e.g. "nothing_saveable" (nn.remat's default),
        "save_only_these_names", "dots_saveable".
      count: how many the forward pass enters (a scan body's once per trip).
      where: "each layer" (wraps one whole layer, or is the whole of one), "inside a
        layer", "around several layers" or "outside every layer".
      merged: written with `prevent_cse=False` outside every loop, where XLA is free to
        merge its recomputation with the forward pass (common-subexpression
        elimination): as written it may save as much as no remat (XLA CPU does).
    """

    policy: str
    count: int
    where: str
    merged: bool = False

    @property
    def taken_over(self) -> bool:
        """Whether the policy being measured replaces it (a whole layer's remat)."""
        return self.where == "each layer"

    def text(self) -> str:
        """E.g. "2 x jax.checkpoint(nothing_saveable) around each layer, taken over"."""
        cse = ("; as written, prevent_cse=False outside a scan lets XLA merge its recompute "
               "with the forward (CSE), saving as much as no remat: write prevent_cse=True, "
               "or scan the layers") if self.merged else ""
        if self.taken_over:
            return (f"{self.count} x jax.checkpoint({self.policy}) around each layer, "
                    f"taken over{cse}")
        return (f"{self.count} x jax.checkpoint({self.policy}) {self.where}, kept under "
                f"every policy (not a whole layer){cse}")


@dataclasses.dataclass(frozen=True)
class Found:
    """The model's own remat: its kinds (`OwnRegion`) and the ids of the region jaxprs the
    policy takes over (`regions.build(taken=)`)."""

    regions: tuple[OwnRegion, ...]
    taken: frozenset

    def kept(self) -> tuple[OwnRegion, ...]:
        """The regions that stay under every policy."""
        return tuple(r for r in self.regions if not r.taken_over)


def policy_name(policy) -> str:
    """A JAX remat policy's name: None is `nothing_saveable` (jax.checkpoint's default);
    a function its name without `.<locals>` (save_only_these_names' closure)."""
    if policy is None:
        return "nothing_saveable"
    name = getattr(policy, "__qualname__", None) or type(policy).__name__
    return name.split(".<locals>")[0]


def _work(jaxpr, memo: dict) -> int:
    """The matmuls and convolutions in `jaxpr`, at any depth."""
    if id(jaxpr) not in memo:
        memo[id(jaxpr)] = sum((eqn.primitive.name in _WORK)
                              + sum(_work(s, memo) for s in sub_jaxprs(eqn)) for eqn in jaxpr.eqns)
    return memo[id(jaxpr)]


def _only(body, pick, memo: dict):
    """The one top-level equation of `body` that `pick` selects where it is all `body`
    computes: every matmul of `body` is inside it and the equations beside it only tag,
    reshape or cast (`_PLUMBING`), else None. A norm or a residual add beside it makes it
    part of a layer: a remat around the MLP alone is not the layer's."""
    hits = [e for e in body.eqns if pick(e)]
    if len(hits) != 1 or any(e is not hits[0] and e.primitive.name not in _PLUMBING
                             for e in body.eqns):
        return None
    inner = region(hits[0])[0]
    return hits[0] if _work(inner, memo) == _work(body, memo) else None


def find(jaxpr, key: str) -> Found:
    """The own remat regions of a jaxpr traced with its layers marked `Marker(key)`."""
    counts: dict[tuple[str, str], int] = {}
    taken: set[int] = set()
    memo: dict = {}

    def own(eqn) -> bool:
        r = region(eqn)
        return r is not None and not isinstance(r[2], wrapping.Marker)

    def marks(jaxpr) -> int:
        return sum(is_marked(e, key) + sum(marks(s) for s in sub_jaxprs(e)) for e in jaxpr.eqns)

    def walk(jaxpr, trips: int, in_layer: bool, in_loop: bool = False) -> None:
        for eqn in jaxpr.eqns:
            r = region(eqn)
            if is_marked(eqn, key):
                whole = _only(r[0], own, memo)
                if whole is not None:
                    taken.add(id(region(whole)[0]))
                walk(r[0], trips, True, in_loop)
                continue
            merged = own(eqn) and not r[3] and not in_loop
            if own(eqn) and id(r[0]) not in taken:
                if not in_layer and _only(r[0], lambda e: is_marked(e, key), memo):
                    taken.add(id(r[0]))
                    where = "each layer"
                else:
                    where = ("inside a layer" if in_layer else "around several layers"
                             if marks(r[0]) else "outside every layer")
                found = (policy_name(r[2]), where, merged)
                counts[found] = counts.get(found, 0) + trips
            elif own(eqn):
                found = (policy_name(r[2]), "each layer", merged)
                counts[found] = counts.get(found, 0) + trips
            loop = eqn.primitive.name in ("scan", "while")
            k = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            for sub in sub_jaxprs(eqn):
                walk(sub, trips * k, in_layer, in_loop or loop)

    walk(jaxpr, 1, False)
    return Found(tuple(OwnRegion(p, n, w, m) for (p, w, m), n in counts.items()),
                 frozenset(taken))


def count(jaxpr, key: str) -> int:
    """Own remat regions the forward pass enters, a scan's body once per trip."""
    return sum(r.count for r in find(jaxpr, key).regions)


__all__ = ["Found", "OwnRegion", "count", "find", "policy_name"]
