"""Remat regions in a traced jaxpr: which equations are regions, which are our marked
blocks (a region whose policy is a `Marker`, `remat_kit.trace.wrapping`), how many the
forward pass enters, and the jaxprs an equation runs inside (sub-jaxprs, a call's body).

Both remat modes are read: `remat2`/`checkpoint` equations, and jax_remat3's staged
hi-primitive (`RematTraced`). `remat_kit.trace.regions` runs the blocks found here under
policies.
Docs: docs/models.md ("A Flax model, no glue").
"""

from __future__ import annotations

from jax.extend.core import ClosedJaxpr

from remat_kit.trace import wrapping
from remat_kit.trace.validate import tag_of

CALLS = ("pjit", "jit", "closed_call", "core_call")


def region(eqn):
    """(jaxpr, consts, policy, prevent_cse) of a remat equation under either remat
    mode (jax_remat3 stages remat as a hi-primitive), or None for other equations."""
    prim = eqn.params.get("_prim")
    params = getattr(prim, "params", None) if prim is not None else eqn.params
    if eqn.primitive.name not in ("remat2", "checkpoint") and (
            prim is None or type(prim).__name__ != "RematTraced"):
        return None
    jaxpr = params["jaxpr"]
    consts = jaxpr.consts if isinstance(jaxpr, ClosedJaxpr) else ()
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return jaxpr, consts, params.get("policy"), params.get("prevent_cse", True)


def is_marked(eqn, key: str) -> bool:
    """Whether `eqn` is a remat region whose policy is `Marker(key)`."""
    r = region(eqn)
    return r is not None and isinstance(r[2], wrapping.Marker) and r[2].key == key


def sub_jaxprs(eqn):
    """The sub-jaxprs (Jaxpr objects) an equation holds, under either remat mode."""
    prim = eqn.params.get("_prim")
    params = getattr(prim, "params", {}) if prim is not None else eqn.params
    for value in params.values():
        yield from wrapping.jaxprs_in(value)


def count_marked(jaxpr, key: str, trips: bool = True) -> int:
    """Marked regions the forward pass enters, a scan's body counted once per trip
    (`trips`), or once (the regions the jaxpr holds)."""
    n = 0
    for eqn in jaxpr.eqns:
        if is_marked(eqn, key):
            n += 1
            continue
        k = eqn.params.get("length", 1) if trips and eqn.primitive.name == "scan" else 1
        n += k * sum(count_marked(sub, key, trips) for sub in sub_jaxprs(eqn))
    return n


def tags_in_regions(jaxpr) -> set[str]:
    """The `checkpoint_name` tags `jaxpr` emits inside a remat region, at any depth: a tag
    a model emits only outside every region is one no remat policy saves or recomputes."""
    found: set[str] = set()

    def walk(jaxpr, inside: bool) -> None:
        for eqn in jaxpr.eqns:
            if inside and (tag := tag_of(eqn)) is not None:
                found.add(tag)
            for sub in sub_jaxprs(eqn):
                walk(sub, inside or region(eqn) is not None)

    walk(jaxpr, False)
    return found


def call_body(eqn):
    """The jaxpr of a jit-ed call or remat region the interpreter runs inline."""
    r = region(eqn)
    if r is not None:
        return r[0]
    if eqn.primitive.name in CALLS:
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        return getattr(closed, "jaxpr", closed)
    return None


__all__ = ["CALLS", "call_body", "count_marked", "is_marked", "region", "sub_jaxprs", "tags_in_regions"]
