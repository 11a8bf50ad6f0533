"""A T5-like encoder-decoder in linen: two encoder layers, then two decoder layers (causal
self-attention and cross-attention on the encoder's output), two repeated block classes.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab] (the encoder reads the
same tokens: a toy, for the block search).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

V, D, H, L = 64, 32, 4, 2

class Attn(nn.Module):
    causal: bool = False

    @nn.compact
    def __call__(self, x, kv):
        b, t, d = x.shape
        s_ = kv.shape[1]
        q = nn.DenseGeneral((H, d // H), name="q")(x)
        k = nn.DenseGeneral((H, d // H), name="k")(kv)
        v = nn.DenseGeneral((H, d // H), name="v")(kv)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.causal:
            w = jnp.where(jnp.tril(jnp.ones((t, s_), bool)), w, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v)
        return nn.DenseGeneral(d, axis=(-2, -1), name="o")(o)

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="wo")(nn.relu(nn.Dense(4 * D, name="wi")(x)))

class EncoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.RMSNorm()(x)
        x = x + Attn()(y, y)
        return x + MLP()(nn.RMSNorm()(x))

class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x, enc):
        y = nn.RMSNorm()(x)
        x = x + Attn(causal=True)(y, y)
        x = x + Attn()(nn.RMSNorm()(x), enc)
        return x + MLP()(nn.RMSNorm()(x))

class T5(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(V, D)
        enc = emb(tokens)
        for i in range(L):
            enc = EncoderLayer(name=f"enc{i}")(enc)
        x = emb(tokens)
        for i in range(L):
            x = DecoderLayer(name=f"dec{i}")(x, enc)
        return emb.attend(x)

def model() -> T5:
    """For `remat-kit --model tests/zoo/encdec_linen.py:model`."""
    return T5()
