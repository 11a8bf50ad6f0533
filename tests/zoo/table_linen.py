"""A linen LM whose rotary sin/cos table is built once before its blocks and passed to each.

`LM(table="jnp")` builds it with jnp from an iota in `__call__` (a computed value of
the traced loss); `LM(table="numpy")` in numpy (a constant of it); `scan=True` runs
the blocks as one `nn.scan`, the table broadcast to every layer. The same model
otherwise: tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

V, D, H, L = 64, 32, 4, 2

def rotate(x, sin, cos):
    a, b = jnp.split(x, 2, -1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

class Block(nn.Module):
    @nn.compact
    def __call__(self, x, sin, cos):
        b, t, d = x.shape
        y = nn.RMSNorm()(x)
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(y).reshape(b, t, H, d // H)
                   for n in "qkv")
        q, k = rotate(q, sin, cos), rotate(k, sin, cos)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // H)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False, name="o")(o)
        y = nn.RMSNorm()(x)
        return x + nn.Dense(d, name="wo")(nn.gelu(nn.Dense(4 * d, name="wi")(y)))

class Scanned(nn.Module):
    """The block as nn.scan runs it: (carry, broadcast inputs) -> (carry, None)."""

    @nn.compact
    def __call__(self, x, sin, cos):
        return Block(name="block")(x, sin, cos), None


class LM(nn.Module):
    table: str = "jnp"
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        t, half = tokens.shape[1], D // H // 2
        xp = jnp if self.table == "jnp" else np
        freqs = 1.0 / 10000 ** (xp.arange(half) / half)
        ang = xp.outer(xp.arange(t), freqs)[None, :, None, :].astype(xp.float32)
        sin, cos = xp.sin(ang), xp.cos(ang)
        emb = nn.Embed(V, D)
        x = emb(tokens)
        if self.scan:
            stack = nn.scan(Scanned, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=L, in_axes=(nn.broadcast, nn.broadcast))
            x, _ = stack(name="b")(x, sin, cos)
        for i in range(0 if self.scan else L):
            x = Block(name=f"b{i}")(x, sin, cos)
        return emb.attend(x)

def model() -> LM:
    """For `remat-kit --model tests/zoo/table_linen.py:model`."""
    return LM()
