"""A GQA language model in flax.nnx written the way `dantinox` (PyPI) writes its backbone.

The patterns remat_kit first failed on there: `pytree=False` modules holding their
blocks in a plain Python list; a fused qkv `nnx.Linear` cut with `jax.lax.split`;
grouped heads as 5-D [batch, kv_heads, group, seq, head] arrays; a rotary embedding
that writes its even and odd halves with `out.at[..., 0::2].set(...)` (a scatter);
`nnx.Dropout(0.0, rngs=rngs)` (RngCount state the call leaves alone); blocks returning
`(x, cache, 0.0)` (a constant output); a head tied to the embedding.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 64, 32, 4, 2, 2
HEAD = DIM // HEADS


def rope(x):
    """Interleaved rotary embedding on x [B, kv_heads, group, T, HEAD], written with
    scatters into an empty array."""
    t = x.shape[3]
    angle = jnp.arange(t)[:, None] / 10_000.0 ** (jnp.arange(0, HEAD, 2) / HEAD)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = jnp.empty_like(x)
    out = out.at[..., 0::2].set(even * cos - odd * sin)
    return out.at[..., 1::2].set(even * sin + odd * cos)


class Attention(nnx.Module, pytree=False):
    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(DIM, DIM + 2 * KV_HEADS * HEAD, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(DIM, DIM, rngs=rngs)
        self.attn_dropout = nnx.Dropout(0.0, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jax.lax.split(self.qkv(x), (DIM, KV_HEADS * HEAD, KV_HEADS * HEAD), axis=-1)
        q = q.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD).transpose(0, 2, 3, 1, 4)
        k, v = (z.reshape(b, t, KV_HEADS, 1, HEAD).transpose(0, 2, 3, 1, 4) for z in (k, v))
        q, k = rope(q), rope(k)
        scores = q @ jnp.swapaxes(k, -2, -1) / math.sqrt(HEAD)
        causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
        probs = self.attn_dropout(jax.nn.softmax(scores + jnp.where(causal, 0.0, -1e9)))
        y = (probs @ v).transpose(0, 3, 1, 2, 4).reshape(b, t, DIM)
        return self.o_proj(y)


class Block(nnx.Module, pytree=False):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
        self.attention = Attention(rngs)
        self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
        self.up_proj = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down_proj = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        gate, data = jnp.split(self.up_proj(self.norm2(x)), 2, axis=-1)
        return x + self.down_proj(jax.nn.silu(gate) * data), None, 0.0


class Transformer(nnx.Module, pytree=False):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = [Block(rngs) for _ in range(LAYERS)]
        self.norm_f = nnx.RMSNorm(DIM, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h, _, _ = block(h)
        return self.norm_f(h) @ self.embed.embedding[...].T


def model() -> Transformer:
    return Transformer(nnx.Rngs(0))
