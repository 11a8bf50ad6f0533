"""A scanned Llama-like linen model whose attention is `nn.DenseGeneral` with 3-D
logical axes, as MaxText writes it: q/k/v kernels [embed, heads, kv], the output
projection [heads, kv, embed] contracting (heads, kv); the MLP and head 2-D; the
layers one `nn.scan` with the stacked axis named "layers"; no rules of its own
(remat_kit's, MaxText's names, apply).

Flax's `nn.DenseGeneral` builds such a kernel flat and reshapes it, so its boxed
initializer constrains a 2-D array by 3 names (google/flax#3676).
`model(whole_kernels=True)` is the same model with each kernel made whole by
`self.param` (MaxText's own DenseGeneral): the same parameters, the same program.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 64, 32, 4, 64, 2
INIT = nn.initializers.lecun_normal()


class WholeKernel(nn.Module):
    """`nn.DenseGeneral` without bias, its kernel made at its own shape."""

    features: int | tuple[int, ...]
    axes: tuple[str, ...]
    axis: int | tuple[int, ...] = -1

    @nn.compact
    def __call__(self, x):
        axis = (self.axis,) if isinstance(self.axis, int) else self.axis
        axis = tuple(a % x.ndim for a in axis)
        features = (self.features,) if isinstance(self.features, int) else self.features
        kernel = self.param("kernel", nn.with_logical_partitioning(INIT, self.axes),
                            tuple(x.shape[a] for a in axis) + features)
        return jax.lax.dot_general(x, kernel, ((axis, tuple(range(len(axis)))), ((), ())))


def dense(whole: bool, features, axes, name, axis=-1) -> nn.Module:
    if whole:
        return WholeKernel(features, axes, axis, name=name)
    return nn.DenseGeneral(features, axis=axis, use_bias=False, name=name,
                           kernel_init=nn.with_logical_partitioning(INIT, axes))


class Block(nn.Module):
    whole_kernels: bool = False

    @nn.compact
    def __call__(self, x, _):
        t, d = x.shape[1], x.shape[2]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        y = nn.RMSNorm(name="attn_norm")(x)
        q, k, v = (dense(self.whole_kernels, (HEADS, d // HEADS), ("embed", "heads", "kv"), n)(y)
                   for n in ("query", "key", "value"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v)
        x = x + dense(self.whole_kernels, d, ("heads", "kv", "embed"), "out", (-2, -1))(o)
        y = nn.RMSNorm(name="mlp_norm")(x)
        h = nn.silu(dense(self.whole_kernels, HIDDEN, ("embed", "mlp"), "wi")(y))
        return x + dense(self.whole_kernels, d, ("mlp", "embed"), "wo")(h), None


class Model(nn.Module):
    whole_kernels: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, name="embed", embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS, in_axes=nn.broadcast,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(self.whole_kernels, name="layers")(x, None)
        x = nn.RMSNorm(name="final_norm")(x)
        return dense(self.whole_kernels, VOCAB, ("embed", "vocab"), "head")(x)


def model(whole_kernels: bool = False) -> Model:
    return Model(whole_kernels)
