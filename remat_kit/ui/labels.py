"""What a table's title and caption say about the model and the run, made true.

* The dtype (`dtype_label`): the parameters' and the activations', both where
  they differ. A bf16 model often keeps float32 parameters (flax's
  `param_dtype`), so the parameters alone would title a bf16 run "float32".
* A table where every policy failed (`failed_caption`) says what failed,
  not how the rows would have been ranked.
Docs: docs/compare.md ("What it prints").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from remat_kit.policy.policy import Policy
from remat_kit.trace.validate import all_eqns


def _most(counts: Counter) -> str | None:
    """The most counted key (the wider dtype on a tie), None for none."""
    if not counts:
        return None
    return max(counts, key=lambda d: (counts[d], jnp.dtype(d).itemsize))


def params_dtype(params) -> str | None:
    """The floating dtype holding the most parameter bytes; None where none floats."""
    counts = Counter()
    for leaf in jax.tree.leaves(params):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            counts[str(jnp.dtype(leaf.dtype))] += leaf.size * jnp.dtype(leaf.dtype).itemsize
    return _most(counts)


def activation_dtype(workload) -> str | None:
    """The dtype a workload computes in: that of most of the floating matmul
    (dot_general) outputs of its loss without remat, every nested jaxpr (a
    scan's body, a jit-ed call) walked into. None where it has no float matmul."""
    loss = workload.loss_for_policy(Policy(remat=False))
    jaxpr = jax.make_jaxpr(loss)(*workload.args).jaxpr
    return _most(Counter(str(eqn.outvars[0].aval.dtype) for eqn in all_eqns(jaxpr)
                         if eqn.primitive.name == "dot_general"
                         and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)))


def dtype_label(params: str | None, activations: str | None) -> str:
    """'bfloat16' where parameters and activations agree, else both named:
    'bfloat16 activations, float32 parameters'; '-' where neither is known."""
    if params is None or activations is None or params == activations:
        return activations or params or "-"
    return f"{activations} activations, {params} parameters"


def failed_caption(report_rows: Sequence[dict], compiled_by: str) -> str | None:
    """A caption for rows that all failed, each kind of error once with the
    policies it failed: 'no policy compiled (XLA TPU compile (v5e:1x1, AOT);
    ...): none, full: JaxRuntimeError: RESOURCE_EXHAUSTED: E1000 (each row
    gives the whole message)'; None where a row compiled (or there are none).
    The kind is an error's first three ': '-separated fields, at most 100
    characters."""
    if not report_rows or any(d["error"] is None for d in report_rows):
        return None
    kinds: dict[str, list[str]] = {}
    for d in report_rows:
        kind = ": ".join(d["error"].splitlines()[0].split(": ")[:3])[:100]
        kinds.setdefault(kind, []).extend(d["names"])
    return (f"no policy compiled ({compiled_by}): "
            + "; ".join(f"{', '.join(names)}: {kind}" for kind, names in kinds.items())
            + " (each row gives the whole message)")


__all__ = ["activation_dtype", "dtype_label", "failed_caption", "params_dtype"]
