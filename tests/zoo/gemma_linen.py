"""A Gemma-like language model in flax.linen, written the way the Gemma library writes one.

Its own `Einsum` and `RMSNorm` layers (no flax Dense/RMSNorm), grouped-query
attention with one fused key/value einsum, RoPE, a query scalar, logit
softcapping, a gated GELU MLP whose gate and up kernels are one stacked
parameter, a ClassVar pseudo-field, and `nn.jit` on the model's `__call__`.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

_MASK = -2.3819763e38


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab: int = 64
    layers: int = 2
    embed: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    hidden: int = 64
    softcap: float = 50.0


class Einsum(nn.Module):
    """A weight of `shape` applied by an einsum equation given at call time."""

    shape: tuple[int, ...]

    @nn.compact
    def __call__(self, eqn: str, x):
        w = self.param("w", nn.initializers.normal(0.05), self.shape)
        return jnp.einsum(eqn, x, w)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def apply_rope(x, positions, base=10_000):
    """x [B, T, N, H]; positions int [B, T]."""
    half = x.shape[-1] // 2
    timescale = base ** (2 * jnp.arange(half) / x.shape[-1])
    angle = positions[..., None, None] / timescale
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        c = self.cfg
        q = Einsum((c.heads, c.embed, c.head_dim), name="q_einsum")("BTD,NDH->BTNH", x)
        k, v = Einsum((2, c.kv_heads, c.embed, c.head_dim), name="kv_einsum")(
            "BSD,CKDH->CBSKH", x)
        q = apply_rope(q, positions) * c.head_dim ** -0.5
        k = apply_rope(k, positions)
        b, t, n, h = q.shape
        q = q.reshape(b, t, c.kv_heads, n // c.kv_heads, h)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k).reshape(b, t, n, -1)
        logits = jnp.tanh(logits / c.softcap) * c.softcap
        logits = jnp.where(mask[:, :, None, :], logits, _MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
        probs = probs.reshape(b, t, c.kv_heads, n // c.kv_heads, -1)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, n, h)
        return Einsum((c.heads, c.head_dim, c.embed), name="attn_vec_einsum")(
            "BTNH,NHD->BTD", encoded)


class FeedForward(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        w = self.param("gating_einsum", nn.initializers.normal(0.05), (2, c.hidden, c.embed))
        gate = jax.nn.gelu(jnp.dot(x, w[0].T))
        up = jnp.dot(x, w[1].T)
        wo = self.param("linear", nn.initializers.normal(0.05), (c.hidden, c.embed))
        return jnp.dot(gate * up, wo)


class Block(nn.Module):
    cfg: GemmaConfig

    @nn.compact
    def __call__(self, x, positions, mask):
        x = x + Attention(self.cfg, name="attn")(RMSNorm(name="pre_attention_norm")(x),
                                                 positions, mask)
        return x + FeedForward(self.cfg, name="mlp")(RMSNorm(name="pre_ffw_norm")(x))


class Gemma(nn.Module):
    cfg: GemmaConfig = GemmaConfig()
    INFO: ClassVar[dict] = {"family": "gemma-like", "source": "tests/zoo"}

    @nn.jit
    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        table = self.param("input_embedding", nn.initializers.normal(1.0), (c.vocab, c.embed))
        x = table[tokens] * jnp.sqrt(c.embed).astype(jnp.float32)
        t = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        for i in range(c.layers):
            x = Block(c, name=f"layer_{i}")(x, positions, mask)
        x = RMSNorm(name="final_norm")(x)
        return x @ table.T


def make(batch: int, seq: int, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    abstract: params as ShapeDtypeStructs (for tracing only)."""
    model = Gemma()
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok)
