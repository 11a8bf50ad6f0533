"""A Llama-like flax.nnx model whose parameters carry their mesh axes, as NNX model ports
write one: `nnx.Linear(kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")))`
and `nnx.Param(..., out_sharding=...)` naming mesh axes directly (no logical rules).

Built with eager sharding off, so it builds without a mesh (`nnx.use_eager_sharding`).
Its activations are split along the batch over the data axes of the context mesh
(`jax.set_mesh`, as its training loop sets it): without that constraint XLA's
propagation runs the forward attention on the whole batch on every device.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 64, 32, 4, 64, 2


def _batch_split(x):
    """x split along its batch over the context mesh's data axes, if any."""
    axes = tuple(a for a in ("data", "fsdp") if a in jax.sharding.get_abstract_mesh().axis_names)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes)) if axes else x


def _linear(din, dout, sharding, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding)
    return nnx.Linear(din, dout, use_bias=False, kernel_init=init, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.qkv = _linear(DIM, 3 * DIM, ("fsdp", "tensor"), rngs)
        self.out = _linear(DIM, DIM, ("tensor", "fsdp"), rngs)
        self.mlp_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.up = _linear(DIM, 2 * HIDDEN, ("fsdp", "tensor"), rngs)
        self.down = _linear(HIDDEN, DIM, ("tensor", "fsdp"), rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, HEADS, d // HEADS)
                   for a in jnp.split(self.qkv(self.attn_norm(x)), 3, -1))
        att = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        x = x + self.out(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(att, -1), v)
                         .reshape(b, t, d))
        gate, up = jnp.split(self.up(self.mlp_norm(x)), 2, -1)
        return x + self.down(nnx.silu(gate) * up)


class Llama(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, DIM)),
                                   out_sharding=("tensor", "fsdp"))
        self.layers = nnx.List([Block(rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.lm_head = _linear(DIM, VOCAB, ("fsdp", "tensor"), rngs)

    def __call__(self, tokens):
        x = _batch_split(self.embedding[...][tokens])
        for layer in self.layers:
            x = _batch_split(layer(x))
        return self.lm_head(self.norm(x))


def model() -> Llama:
    """For `remat-kit --model tests/zoo/logical_nnx.py:model`."""
    with nnx.use_eager_sharding(False):
        return Llama(rngs=nnx.Rngs(0))
