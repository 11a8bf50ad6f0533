"""How large a reference transformer's train step can be before it cannot fit or compile.

`size_bound` bounds `fit`'s search over batch or sequence length for a
`TransformerConfig` from its attention scores, logits and MLP buffers; the
reference models' `Workload.size_bound` is this function with the config and
mesh bound.
Docs: docs/fit.md.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.sharding import Mesh

from remat_kit import mesh as rk_mesh
from remat_kit.models.config import TransformerConfig

# The most elements of one buffer in a step compiled for CPU or GPU. XLA's CPU
# compiler aborts the whole process (SIGFPE, in the tiled fusion emitter it shares
# with XLA GPU) on train steps of tiny whose attention scores have power-of-two
# shapes from 2**36 elements: [1, 4, 2**17, 2**17] under dots, [2, 4, 2**18, 2**18]
# under full; [2, 4, 2**16, 2**16] under dots and [1, 4, 2**18, 2**18] under full
# compile. A signal cannot be caught, so no step with a buffer past int32 indexing
# is compiled there.
MAX_ELEMENTS = 1 << 31
_TILED = ("cpu", "gpu")


def size_bound(cfg: TransformerConfig, vary: str, fixed: int, budget_bytes: int,
               floor_bytes: int = 0, platform: str = "cpu",
               mesh: Mesh | None = None) -> tuple[int, bool]:
    """The largest `vary` size whose step might fit the budget and can be compiled.

    One layer's attention scores [batch, heads, seq, seq] (per device: batch
    over data x fsdp, heads over tensor) are a whole buffer in every policy's
    step, in the activation dtype or wider, alive with the parameters and the
    optimizer state (`floor_bytes`): no size whose scores alone outgrow
    budget - floor fits. On CPU and GPU no buffer may pass `MAX_ELEMENTS`: the
    scores, nor the [batch, seq, max(vocab, mlp_dim)] logits and MLP values.

    Args:
      fixed: the other size (the global batch when vary="seq", else the seq).
      platform: the target's, e.g. "cpu", "gpu", "tpu".
    Returns:
      (size, exact): exact is True when the budget set the bound (a policy
      that fits there has its exact answer: one unit more cannot fit), False
      when the compiler's limit did (a policy that fits there is capped).
    """
    split = rk_mesh.axis_size(mesh, "batch")
    heads = max(1, cfg.num_heads // rk_mesh.axis_size(mesh, "heads"))
    width = max(cfg.vocab_size, cfg.mlp_dim)
    budget_elements = max(0, budget_bytes - floor_bytes) // jnp.dtype(cfg.dtype).itemsize
    if vary == "seq":
        b = max(1, fixed // split)
        by_budget = math.isqrt(budget_elements // (b * heads))
        by_compiler = min(math.isqrt(MAX_ELEMENTS // (b * heads)), MAX_ELEMENTS // (b * width))
    else:
        by_budget = budget_elements // (heads * fixed * fixed) * split
        by_compiler = min(MAX_ELEMENTS // (heads * fixed * fixed),
                          MAX_ELEMENTS // (fixed * width)) * split
    if platform not in _TILED:
        return by_budget, True
    return min(by_budget, by_compiler), by_budget < by_compiler


__all__ = ["MAX_ELEMENTS", "size_bound"]
