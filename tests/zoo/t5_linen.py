"""A T5-like encoder-decoder in linen, written the way Hugging Face transformers writes its
Flax T5: one stack class for the encoder and the decoder (`is_decoder`), each holding blocks
named "0", "1", ...; the first block of each stack holds an extra parameter, the relative
position bias table, computes the bias and hands it to the blocks after it; each block a
list of sub-layers (self-attention, cross-attention in the decoder, feed-forward) that are
not whole layers. The LM head is tied to the shared embedding.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab] (the encoder reads the same
tokens: a toy, for the layer map).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, D, HEADS, LAYERS, BUCKETS = 64, 32, 4, 2, 8


class T5Attention(nn.Module):
    causal: bool = False
    has_relative_attention_bias: bool = False

    @nn.compact
    def __call__(self, x, kv, bias):
        b, t, d = x.shape
        q = nn.DenseGeneral((HEADS, d // HEADS), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((HEADS, d // HEADS), use_bias=False, name="k")(kv)
        v = nn.DenseGeneral((HEADS, d // HEADS), use_bias=False, name="v")(kv)
        if self.has_relative_attention_bias:
            table = nn.Embed(BUCKETS, HEADS, name="relative_attention_bias")
            rel = jnp.arange(kv.shape[1])[None] - jnp.arange(t)[:, None]
            bias = table(jnp.clip(rel, -(BUCKETS // 2), BUCKETS // 2 - 1) + BUCKETS // 2)
            bias = bias.transpose(2, 0, 1)[None]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + (0.0 if bias is None else bias)
        if self.causal:
            scores = jnp.where(jnp.tril(jnp.ones((t, kv.shape[1]), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o")(out), bias


class T5LayerSelfAttention(nn.Module):
    causal: bool = False
    has_relative_attention_bias: bool = False

    @nn.compact
    def __call__(self, x, bias):
        y = nn.RMSNorm(name="layer_norm")(x)
        y, bias = T5Attention(self.causal, self.has_relative_attention_bias,
                              name="SelfAttention")(y, y, bias)
        return x + y, bias


class T5LayerCrossAttention(nn.Module):
    @nn.compact
    def __call__(self, x, enc):
        y, _ = T5Attention(name="EncDecAttention")(nn.RMSNorm(name="layer_norm")(x), enc, None)
        return x + y


class T5LayerFF(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.RMSNorm(name="layer_norm")(x)
        y = nn.Dense(D, use_bias=False, name="wo")(nn.relu(nn.Dense(4 * D, use_bias=False,
                                                                    name="wi")(y)))
        return x + y


class T5Block(nn.Module):
    is_decoder: bool = False
    has_relative_attention_bias: bool = False

    @nn.compact
    def __call__(self, x, bias, enc=None):
        x, bias = T5LayerSelfAttention(self.is_decoder, self.has_relative_attention_bias,
                                       name="layer_0")(x, bias)
        if self.is_decoder:
            x = T5LayerCrossAttention(name="layer_1")(x, enc)
        return T5LayerFF(name=f"layer_{2 if self.is_decoder else 1}")(x), bias


class T5Stack(nn.Module):
    is_decoder: bool = False

    def setup(self):
        self.block = [T5Block(self.is_decoder, i == 0, name=str(i)) for i in range(LAYERS)]
        self.final_layer_norm = nn.RMSNorm()

    def __call__(self, x, enc=None):
        bias = None
        for block in self.block:
            x, bias = block(x, bias, enc)
        return self.final_layer_norm(x)


class T5(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        shared = nn.Embed(VOCAB, D, name="shared")
        enc = T5Stack(name="encoder")(shared(tokens))
        x = T5Stack(is_decoder=True, name="decoder")(shared(tokens), enc)
        return shared.attend(x * D ** -0.5)


def model() -> T5:
    """For `remat-kit --model tests/zoo/t5_linen.py:model`."""
    return T5()
