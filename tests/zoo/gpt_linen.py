"""A GPT-2-like language model in flax.linen, written the way small GPT repos write one.

One fused qkv Dense (3 * embed, split in three), learned positions, an MLP
whose output matmul is a raw `h @ self.param(...)`, an attention module that
shares its scope with its parent (`nn.share_scope`), and a dataclass output
with `.logits`.

tokens int32 [batch, seq] -> GPTOutput(logits float32 [batch, seq, vocab]).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    layers: int = 2
    embed: int = 32
    heads: int = 4
    max_len: int = 32


@flax.struct.dataclass
class GPTOutput:
    logits: jax.Array


class CausalSelfAttention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        qkv = nn.Dense(3 * d, name="c_attn")(x)
        q, k, v = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)
                   for a in jnp.split(qkv, 3, axis=-1))
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / jnp.sqrt(d // h))
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        y = jax.nn.softmax(att, axis=-1) @ v
        return nn.Dense(d, name="c_proj")(y.transpose(0, 2, 1, 3).reshape(b, t, d))


class Attn(nn.Module):
    """Wraps the attention; its parameters live in this module's scope."""

    cfg: GPTConfig

    def setup(self):
        self.inner = CausalSelfAttention(self.cfg)
        nn.share_scope(self, self.inner)

    def __call__(self, x):
        return self.inner(x)


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        d = self.cfg.embed
        h = nn.gelu(nn.Dense(4 * d, name="c_fc")(x))
        w = self.param("c_proj", nn.initializers.normal(0.02), (4 * d, d))
        return h @ w + self.param("c_proj_bias", nn.initializers.zeros_init(), (d,))


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        x = x + Attn(self.cfg, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + MLP(self.cfg, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    cfg: GPTConfig = GPTConfig()

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        wte = nn.Embed(c.vocab, c.embed, name="wte")
        pos = self.param("wpe", nn.initializers.normal(0.02), (c.max_len, c.embed))
        x = wte(tokens) + pos[: tokens.shape[1]]
        for i in range(c.layers):
            x = Block(c, name=f"h_{i}")(x)
        return GPTOutput(logits=wte.attend(nn.LayerNorm(name="ln_f")(x)))


def make(batch: int, seq: int, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    abstract: params as ShapeDtypeStructs (for tracing only)."""
    model = GPT()
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok).logits


def model() -> GPT:
    """The model alone, for `remat-kit --model tests/zoo/gpt_linen.py:model`."""
    return GPT()
