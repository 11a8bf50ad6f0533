"""A Griffin-like hybrid in linen, written the way RecurrentGemma writes its Flax model:
residual blocks whose temporal mixer is, by a block-type pattern, either a recurrent block
(a gated linear recurrence, RG-LRU-like, run by `jax.lax.scan` over time, after a short
causal conv) or a local (sliding-window) attention block, each followed by a gated MLP; the
residual block class wrapped in `nn.remat` when `gradient_checkpointing` is set.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, WIDTH, HEADS, WINDOW = 64, 32, 4, 4
PATTERN = ("recurrent", "attention")


class RGLRU(nn.Module):
    """h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t), a_t = sigmoid(lambda)^(8 r_t)."""

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        gate_x = jax.nn.sigmoid(nn.Dense(d, name="input_gate")(x))
        gate_a = jax.nn.sigmoid(nn.Dense(d, name="a_gate")(x))
        log_a = -8.0 * gate_a * jax.nn.softplus(self.param("a_param", nn.initializers.ones,
                                                           (d,)))
        a = jnp.exp(log_a)
        normed = x * gate_x * jnp.sqrt(1 - jnp.exp(2 * log_a))

        def step(h, inputs):
            a_t, x_t = inputs
            h = a_t * h + x_t
            return h, h

        _, ys = jax.lax.scan(step, jnp.zeros_like(x[:, 0]),
                             (a.swapaxes(0, 1), normed.swapaxes(0, 1)))
        return ys.swapaxes(0, 1)


class RecurrentBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(WIDTH, name="linear_y")(x))
        h = nn.Conv(WIDTH, (4,), padding="CAUSAL", feature_group_count=WIDTH,
                    name="conv_1d")(nn.Dense(WIDTH, name="linear_x")(x))
        return nn.Dense(WIDTH, name="linear_out")(RGLRU(name="rg_lru")(h) * y)


class LocalAttentionBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(x).reshape(b, t, HEADS, d // HEADS)
                   for n in ("proj_q", "proj_k", "proj_v"))
        i, j = jnp.arange(t)[:, None], jnp.arange(t)[None]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        logits = jnp.where((j <= i) & (j > i - WINDOW), logits, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
        return nn.Dense(d, name="proj_final")(out.reshape(b, t, d))


class MLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        gate = nn.gelu(nn.Dense(2 * WIDTH, name="ffw_up_0")(x))
        return nn.Dense(WIDTH, name="ffw_down")(gate * nn.Dense(2 * WIDTH, name="ffw_up_1")(x))


class ResidualBlock(nn.Module):
    temporal_block_type: str

    @nn.compact
    def __call__(self, x):
        y = nn.RMSNorm(name="temporal_pre_norm")(x)
        if self.temporal_block_type == "recurrent":
            y = RecurrentBlock(name="recurrent_block")(y)
        else:
            y = LocalAttentionBlock(name="attention_block")(y)
        x = x + y
        return x + MLPBlock(name="mlp_block")(nn.RMSNorm(name="channel_pre_norm")(x))


class Griffin(nn.Module):
    num_layers: int = 2
    gradient_checkpointing: bool = False

    def setup(self):
        self.embedder = nn.Embed(VOCAB, WIDTH)
        block = nn.remat(ResidualBlock) if self.gradient_checkpointing else ResidualBlock
        self.blocks = [block(PATTERN[i % len(PATTERN)], name=f"blocks_{i}")
                       for i in range(self.num_layers)]
        self.final_norm = nn.RMSNorm()

    def __call__(self, tokens):
        x = self.embedder(tokens) * jnp.sqrt(WIDTH)
        for block in self.blocks:
            x = block(x)
        return self.embedder.attend(self.final_norm(x))


def model(gradient_checkpointing: bool = False) -> Griffin:
    """For `remat-kit --model tests/zoo/hybrid_linen.py:model`."""
    return Griffin(gradient_checkpointing=gradient_checkpointing)


def remat_model() -> Griffin:
    """The library's default: `gradient_checkpointing=True`."""
    return Griffin(gradient_checkpointing=True)
