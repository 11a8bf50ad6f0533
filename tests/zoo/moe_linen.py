"""A flax.linen mixture-of-experts decoder on `jax.lax.ragged_dot`, tagging nothing.

Each block: LayerNorm, causal softmax attention, LayerNorm, then a top-k router (Dense to
`experts` logits, in `router_dtype`) over gated SiLU expert MLPs: the routed token copies
sorted by expert (`argsort`), group sizes by `bincount`, three `ragged_dot`s, the outputs
unsorted and combined by the softmax of the top-k logits.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    layers: int = 2
    embed: int = 32
    heads: int = 2
    experts: int = 4
    top_k: int = 2
    hidden: int = 64
    router_dtype: str = "float32"


class MoE(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, d = x.shape
        init = nn.initializers.lecun_normal()
        wi_0 = self.param("wi_0", init, (c.experts, d, c.hidden))
        wi_1 = self.param("wi_1", init, (c.experts, d, c.hidden))
        wo = self.param("wo", init, (c.experts, c.hidden, d))
        logits = nn.Dense(c.experts, use_bias=False, dtype=jnp.dtype(c.router_dtype),
                          name="router")(x)
        top, chosen = jax.lax.top_k(logits, c.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat)
        tokens = jnp.take(x.reshape(-1, d), order // c.top_k, axis=0)
        sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
        h = nn.silu(jax.lax.ragged_dot(tokens, wi_0, sizes)) * jax.lax.ragged_dot(
            tokens, wi_1, sizes)
        out = jax.lax.ragged_dot(h, wo, sizes)[jnp.argsort(order)]
        return jnp.einsum("bskd,bsk->bsd", out.reshape(b, t, c.top_k, d), weights)


class Block(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, d = x.shape
        qkv = nn.Dense(3 * d, use_bias=False, name="qkv")(nn.LayerNorm(name="ln_1")(x))
        q, k, v = (a.reshape(b, t, c.heads, d // c.heads)
                   for a in jnp.split(qkv, 3, axis=-1))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // c.heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v)
        x = x + nn.Dense(d, use_bias=False, name="out")(y.reshape(b, t, d))
        return x + MoE(c, name="moe")(nn.LayerNorm(name="ln_2")(x))


class MoELM(nn.Module):
    cfg: MoEConfig = MoEConfig()

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        wte = nn.Embed(c.vocab, c.embed, name="wte")
        x = wte(tokens)
        for i in range(c.layers):
            x = Block(c, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


def make(batch: int, seq: int, abstract: bool = False, **config):
    """(model, params, forward(params, tokens) -> logits) of a `MoEConfig(**config)`, random
    init; abstract: params as ShapeDtypeStructs (for tracing only)."""
    model = MoELM(MoEConfig(**config))
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok)
