"""NanoMoE from PyPI (`nano-moe-jax`, flax.linen), built at tiny size with random init.

A third-party model used unedited: fused qkv Dense split in three, learned
positions, a mixture of GELU expert MLPs behind a softmax router, and a tuple
output (logits, aux_loss).

tokens int32 [batch, seq] -> (logits float32 [batch, seq, vocab], aux_loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from nano_moe.config import NanoMoEConfig
from nano_moe.model import NanoMoE

CONFIG = NanoMoEConfig(vocab_size=64, n_layers=2, n_heads=4, d_model=32, d_ff=64, n_experts=2,
                       top_k=1, block_size=32, dropout_rate=0.0)


def make(batch: int, seq: int, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    abstract: params as ShapeDtypeStructs (for tracing only)."""
    model = NanoMoE(CONFIG)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok)[0]

