"""A GPT-like linen model whose blocks run as one `nn.scan`, as MaxText and T5X stack them.

`nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True})` over a
block that returns (carry, None); its parameters are stacked on a leading layer
axis. `Unrolled` is the same model with the blocks in a Python loop.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, EMBED, HEADS, LAYERS = 64, 32, 4, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        b, t, d = x.shape
        y = nn.LayerNorm(name="ln_1")(x)
        q, k, v = (nn.Dense(d, name=n)(y).reshape(b, t, HEADS, d // HEADS) for n in "qkv")
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, name="o")(o)
        y = nn.LayerNorm(name="ln_2")(x)
        return x + nn.Dense(d, name="wo")(nn.gelu(nn.Dense(4 * d, name="wi")(y))), None


class GPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(VOCAB, EMBED, name="wte")
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS, in_axes=nn.broadcast)
        x, _ = stack(name="h")(emb(tokens), None)
        return emb.attend(nn.LayerNorm(name="ln_f")(x))


class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(VOCAB, EMBED, name="wte")
        x = emb(tokens)
        for i in range(LAYERS):
            x, _ = Block(name=f"h_{i}")(x, None)
        return emb.attend(nn.LayerNorm(name="ln_f")(x))


def model() -> GPT:
    """For `remat-kit --model tests/zoo/scan_linen.py:model`."""
    return GPT()
