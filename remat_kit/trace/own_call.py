"""What a model's own `__call__` computes outside every layer and every module.

A bare `x @ w.T` with a tied embedding, a final `jnp.tanh`, a position slice added: operations
that hold no parameter of their own, which `own_call` names from the one traced jaxpr's name
stacks, as "the model's own call: 2 ops (slice, add)" in the model map.
How equations are attributed: docs/models.md ("The model map").
"""

from __future__ import annotations

from collections import Counter

from jax.extend.core import Literal

from remat_kit.trace import marked

# Calls whose body is traced inline: their equations are counted, not the call.
_CALLS = frozenset({"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr", "remat2", "checkpoint", "scan", "while", "cond"})
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def _ops(jaxpr, key: str, prefix: str, live: set):
    """(full name stack, primitive name) of each equation outside every marked region
    that reads the inputs (`live`: the variables that depend on them; an iota, a
    position table of constants, is no computation on the batch or the parameters)."""
    for eqn in jaxpr.eqns:
        reads = [not isinstance(v, Literal) and v in live for v in eqn.invars]
        if any(reads):
            live.update(eqn.outvars)
        if not any(reads) or marked.is_marked(eqn, key) or eqn.primitive.name == "name":
            continue  # name: a checkpoint_name tag
        stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        if eqn.primitive.name not in _CALLS:
            yield stack, eqn.primitive.name
            continue
        for sub in marked.sub_jaxprs(eqn):  # operands by position where they line up
            inner = (set(v for v, r in zip(sub.invars, reads) if r)
                     if len(sub.invars) == len(reads) else set(sub.invars))
            yield from _ops(sub, key, stack, inner)


def own_call(jaxpr, key: str, root: str | None) -> str | None:
    """The map's `outside` entry for the model's own call, e.g. "the model's own call:
    3 ops (transpose, dot_general, tanh)", None where it computes nothing of its own.

    Args:
      jaxpr: the traced loss (a `jax.core.Jaxpr`), its layers marked with `key`.
      key: the marker key of the layer regions (`remat_kit.flax.from_model.KEY`).
      root: the root module's scope name (a linen model's name or class name, an NNX
        model's class name), or None where the root is not scoped: matmuls with no
        scope then count.
    """
    found = [prim for stack, prim in _ops(jaxpr, key, "", set(jaxpr.invars))
             if (root is not None and stack == root) or (not stack and prim in _MATMULS)]
    if not found:
        return None
    kinds = ", ".join(dict(Counter(found)))
    return f"the model's own call: {len(found)} op{'s' if len(found) > 1 else ''} ({kinds})"


__all__ = ["own_call"]
