"""A diffusion transformer (DiT, Peebles & Xie 2023) in flax.linen, written as DiT ports write one.

Image latents [batch, 8, 8, 4] are patchified (2x2 patches, a linear embedding),
a sinusoidal timestep embedding goes through an MLP to the conditioning vector
c, and each `DiTBlock` modulates its pre-norms with adaLN-Zero: a `Dense` of
silu(c) gives shift, scale and gate for attention and MLP. The final layer
modulates once more, projects each token back to a patch, and unpatchifies.
The model predicts the noise; the loss is the mean squared error against it.

`build()` returns (model, batch, loss): batch (noisy latents float32 [B, 8, 8, 4],
timesteps int32 [B], noise float32 [B, 8, 8, 4]); the model is called as
model(latents, timesteps, noise), ignoring the noise, which the loss reads.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

SIZE, CHANNELS, PATCH, DIM, HEADS, LAYERS, BATCH = 8, 4, 2, 32, 4, 2, 2


def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


def timestep_embedding(t, dim: int = DIM, max_period: float = 10_000.0):
    """Sinusoidal embedding of integer timesteps t [B] -> [B, dim] (DiT's, from ADM)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half) / half)
    args = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, n, _ = x.shape
        qkv = nn.Dense(3 * DIM, name="qkv")(x).reshape(b, n, 3, HEADS, DIM // HEADS)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        weights = nn.dot_product_attention_weights(q, k)
        return nn.Dense(DIM, name="proj")(jnp.einsum("bhqk,bkhd->bqhd", weights, v)
                                          .reshape(b, n, DIM))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(DIM, name="fc2")(nn.gelu(nn.Dense(4 * DIM, name="fc1")(x),
                                                 approximate=True))


class DiTBlock(nn.Module):
    @nn.compact
    def __call__(self, x, c):
        modulation = nn.Dense(6 * DIM, kernel_init=nn.initializers.zeros,
                              name="adaLN_modulation")(nn.silu(c))
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(modulation, 6, axis=-1)
        norm = lambda name: nn.LayerNorm(use_scale=False, use_bias=False, name=name)  # noqa: E731
        x = x + gate1[:, None] * Attention(name="attn")(modulate(norm("norm1")(x), shift1,
                                                                  scale1))
        return x + gate2[:, None] * Mlp(name="mlp")(modulate(norm("norm2")(x), shift2, scale2))


class DiT(nn.Module):
    @nn.compact
    def __call__(self, latents, timesteps, noise=None):
        del noise  # the loss's target
        b, grid = latents.shape[0], SIZE // PATCH
        patches = latents.reshape(b, grid, PATCH, grid, PATCH, CHANNELS)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(b, grid * grid, -1)
        x = nn.Dense(DIM, name="x_embedder")(patches)
        x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, grid * grid, DIM))
        c = nn.Dense(DIM, name="t_embed_1")(timestep_embedding(timesteps))
        c = nn.Dense(DIM, name="t_embed_2")(nn.silu(c))
        for i in range(LAYERS):
            x = DiTBlock(name=f"blocks_{i}")(x, c)
        shift, scale = jnp.split(nn.Dense(2 * DIM, name="final_adaLN")(nn.silu(c)), 2, axis=-1)
        x = modulate(nn.LayerNorm(use_scale=False, use_bias=False, name="final_norm")(x),
                     shift, scale)
        x = nn.Dense(PATCH * PATCH * CHANNELS, name="final_linear")(x)
        x = x.reshape(b, grid, grid, PATCH, PATCH, CHANNELS).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, SIZE, SIZE, CHANNELS)


def loss(predicted_noise, batch):
    """Mean squared error of the predicted noise against the batch's noise (DDPM's
    simple loss, Ho et al. 2020)."""
    return jnp.mean((predicted_noise - batch[2]) ** 2)


def batch(size: int = BATCH) -> tuple:
    """(noisy latents float32 [size, 8, 8, 4], timesteps int32 [size], noise)."""
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    shape = (size, SIZE, SIZE, CHANNELS)
    return (jax.random.normal(k1, shape), jax.random.randint(k2, (size,), 0, 1000),
            jax.random.normal(k3, shape))


def build():
    """(model, batch, loss), as `--model tests/zoo/dit_linen.py:build` takes it."""
    return DiT(), batch(), loss
