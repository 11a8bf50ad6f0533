"""A Llama-like language model in flax.nnx, written the way NNX model ports write one.

Its own `nnx.Param`-based linear layer applied as `x @ self.w[...]`,
`nnx.RMSNorm`, grouped-query attention (keys and values repeated per query
group), RoPE, a SwiGLU MLP with separate gate and up projections, and
`nnx.jit` on the model's `__call__`.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    layers: int = 2
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 48


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) * din ** -0.5)

    def __call__(self, x):
        return x @ self.w[...]


def rope(x, theta=10_000.0):
    """x [B, T, N, H]: interleaved-free half rotation."""
    t, h = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, h, 2) / h)
    ang = jnp.outer(jnp.arange(t), freqs)[None, :, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                            x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], axis=-1)


class Attention(nnx.Module):
    def __init__(self, c: LlamaConfig, *, rngs):
        self.c, hd = c, c.dim // c.heads
        self.wq = Linear(c.dim, c.heads * hd, rngs=rngs)
        self.wk = Linear(c.dim, c.kv_heads * hd, rngs=rngs)
        self.wv = Linear(c.dim, c.kv_heads * hd, rngs=rngs)
        self.wo = Linear(c.heads * hd, c.dim, rngs=rngs)

    def __call__(self, x):
        c, (b, t, _) = self.c, x.shape
        hd = c.dim // c.heads
        q = rope(self.wq(x).reshape(b, t, c.heads, hd))
        k = rope(self.wk(x).reshape(b, t, c.kv_heads, hd))
        v = self.wv(x).reshape(b, t, c.kv_heads, hd)
        k = jnp.repeat(k, c.heads // c.kv_heads, axis=2)
        v = jnp.repeat(v, c.heads // c.kv_heads, axis=2)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(hd)
        scores = scores + jnp.triu(jnp.full((t, t), -jnp.inf), 1)
        out = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype) @ v
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class FeedForward(nnx.Module):
    def __init__(self, c: LlamaConfig, *, rngs):
        self.w1 = Linear(c.dim, c.hidden, rngs=rngs)
        self.w3 = Linear(c.dim, c.hidden, rngs=rngs)
        self.w2 = Linear(c.hidden, c.dim, rngs=rngs)

    def __call__(self, x):
        return self.w2(nnx.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nnx.Module):
    def __init__(self, c: LlamaConfig, *, rngs):
        self.attention = Attention(c, rngs=rngs)
        self.feed_forward = FeedForward(c, rngs=rngs)
        self.attention_norm = nnx.RMSNorm(c.dim, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(c.dim, rngs=rngs)

    def __call__(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nnx.Module):
    def __init__(self, c: LlamaConfig = LlamaConfig(), *, rngs: nnx.Rngs):
        self.tok_embeddings = nnx.Embed(c.vocab, c.dim, rngs=rngs)
        self.layers = nnx.List([TransformerBlock(c, rngs=rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.dim, rngs=rngs)
        self.output = Linear(c.dim, c.vocab, rngs=rngs)

    @nnx.jit
    def __call__(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def make(batch: int, seq: int, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    params is the model's nnx.Param state; abstract: ShapeDtypeStructs (for tracing only)."""
    build = lambda: Llama(rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build) if abstract else nnx.jit(build)()
    graphdef, params = nnx.split(model, nnx.Param)
    return model, params, lambda p, tok: nnx.merge(graphdef, p)(tok)
