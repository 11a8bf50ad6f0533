"""A llama2-like decoder in flax.linen that names its own values, as a training codebase's does.

Like MaxText's llama2 decoder (its `layers/decoders.py`, `attentions.py`, `linears.py`): each
layer tags its input `decoder_layer_input`, the attention op's output `attention_out` (MaxText's
name for what remat_kit calls `context`), the attention output projection `out_proj` and the MLP
output `mlpwo`, with `jax.ad_checkpoint.checkpoint_name`. Our code, written in that layout: RMS
norms, a SwiGLU MLP (`wi_0`, `wi_1`, `wo`), untied embeddings.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The names the model emits itself, beside those remat_kit infers.
OWN_TAGS = ("decoder_layer_input", "attention_out", "out_proj", "mlpwo")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 64
    layers: int = 2
    emb: int = 32
    mlp: int = 64
    heads: int = 4
    dtype: str = "float32"  # activations; parameters stay float32, as MaxText's weight_dtype


class Attention(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c, (b, t, _) = self.cfg, x.shape
        hd = c.emb // c.heads
        q, k, v = (nn.DenseGeneral((c.heads, hd), use_bias=False, dtype=c.dtype, name=n)(x)
                   for n in ("query", "key", "value"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
        out = checkpoint_name(out, "attention_out")
        out = nn.DenseGeneral(c.emb, axis=(-2, -1), use_bias=False, dtype=c.dtype,
                              name="out")(out)
        return checkpoint_name(out, "out_proj")


class Mlp(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        gate = nn.Dense(c.mlp, use_bias=False, dtype=c.dtype, name="wi_0")(x)
        up = nn.Dense(c.mlp, use_bias=False, dtype=c.dtype, name="wi_1")(x)
        out = nn.Dense(c.emb, use_bias=False, dtype=c.dtype, name="wo")(nn.silu(gate) * up)
        return checkpoint_name(out, "mlpwo")


class DecoderLayer(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x):
        x = checkpoint_name(x, "decoder_layer_input")
        norm = lambda name: nn.RMSNorm(dtype=self.cfg.dtype, name=name)  # noqa: E731
        x = x + Attention(self.cfg, name="self_attention")(norm("pre_attn_norm")(x))
        return x + Mlp(self.cfg, name="mlp")(norm("post_attn_norm")(x))


class Decoder(nn.Module):
    cfg: DecoderConfig = DecoderConfig()

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.emb, dtype=c.dtype, name="token_embedder")(tokens)
        for i in range(c.layers):
            x = DecoderLayer(c, name=f"layers_{i}")(x)
        return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="logits_dense")(
            nn.RMSNorm(dtype=c.dtype, name="decoder_norm")(x)).astype(jnp.float32)


def make(batch: int, seq: int, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    abstract: params as ShapeDtypeStructs (for tracing only)."""
    model = Decoder()
    tokens = jnp.zeros((batch, seq), jnp.int32)
    init = lambda key: model.init(key, tokens)["params"]
    params = jax.eval_shape(init, jax.random.key(0)) if abstract else jax.jit(init)(
        jax.random.key(0))
    return model, params, lambda p, tok: model.apply({"params": p}, tok).logits


def model() -> Decoder:
    """The model alone, for `remat-kit --model tests/zoo/own_tags_linen.py:model`."""
    return Decoder()


def vs_estimator_decoder() -> Decoder:
    """At vs_estimator.py's sizes (MaxText's llama2 decoder there: 2 layers, emb 2048, MLP 8192, 8
    heads of 256, vocab 8192, bf16 activations, float32 weights), for
    benchmarks/vs_estimator.py: `--model tests/zoo/own_tags_linen.py:vs_estimator_decoder`."""
    return Decoder(DecoderConfig(vocab=8192, layers=2, emb=2048, mlp=8192, heads=8,
                                 dtype="bfloat16"))
