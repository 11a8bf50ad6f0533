"""A linen language model with its attention's softmax written out by hand, as
numerics-minded code writes it: the max subtracted (and held out of the gradient),
exp, sum, then either the probabilities `e / sum(e)` times V, or the
unnormalized exps times V, divided by the sum afterwards (a flash-attention-like
order). Options also put `jnp.where` / `jnp.clip` on the embeddings before the
first block and `nn.jit` on the model's `__call__`.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

SOFTMAXES = ("jax", "normalize", "divide_after")


def attend(q, k, v, softmax: str):
    """q, k, v [batch, seq, heads, head_dim] -> [batch, seq, heads, head_dim]."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    if softmax == "jax":
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(axis=-1, keepdims=True)))
    total = e.sum(axis=-1, keepdims=True)
    if softmax == "normalize":
        return jnp.einsum("bhqk,bkhd->bqhd", e / total, v)
    return jnp.einsum("bhqk,bkhd->bqhd", e, v) / total.transpose(0, 2, 1, 3)


class Block(nn.Module):
    softmax: str = "jax"

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        y = nn.LayerNorm(name="ln_1")(x)
        q, k, v = (nn.Dense(d, name=n)(y).reshape(b, t, 4, d // 4) for n in "qkv")
        x = x + nn.Dense(d, name="o")(attend(q, k, v, self.softmax).reshape(b, t, d))
        return x + nn.Dense(d, name="wo")(nn.gelu(nn.Dense(2 * d, name="wi")(
            nn.LayerNorm(name="ln_2")(x))))


class LM(nn.Module):
    softmax: str = "jax"
    before: str = ""  # "where" or "clip": a masked or clipped embedding

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="wte")(tokens)
        if self.before == "where":
            x = jnp.where(tokens[..., None] > 0, x, -1e9)
        elif self.before == "clip":
            x = jnp.clip(x, -3, 3)
        for i in range(2):
            x = Block(self.softmax, name=f"h_{i}")(x)
        return nn.Dense(64, name="head")(x)


class JitLM(LM):
    """`nn.jit` on `__call__`, as some linen codebases compile their model."""

    @nn.jit
    def __call__(self, tokens):
        return super().__call__(tokens)


class RematLM(nn.Module):
    """Blocks built with `nn.remat` of their own: the model already rematerializes."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="wte")(tokens)
        for i in range(2):
            x = nn.remat(Block)(name=f"h_{i}")(x)
        return nn.Dense(64, name="head")(x)


def jit_model() -> JitLM:
    """For `remat-kit fit --model tests/zoo/softmax_linen.py:jit_model`."""
    return JitLM()
