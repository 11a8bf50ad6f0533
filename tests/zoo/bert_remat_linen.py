"""A BERT-style encoder in linen, written the way Hugging Face transformers writes its Flax
BERT: a layer collection module holding layers named "0", "1", ..., each layer class wrapped
in `nn.remat` (static_argnums for its flags) when the config's `gradient_checkpointing` is
set, bidirectional attention with an additive padding mask, post-layer norms, and a masked-LM
head tied to the word embeddings.

tokens int32 [batch, seq] -> MLM logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    max_position_embeddings: int = 32
    gradient_checkpointing: bool = True


class BertSelfAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        b, t, d = hidden.shape
        h = self.config.num_attention_heads
        q, k, v = (nn.Dense(d, name=n)(hidden).reshape(b, t, h, d // h)
                   for n in ("query", "key", "value"))
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, -1e9)
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h) + bias)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)


class BertAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        out = BertSelfAttention(self.config, name="self")(hidden, mask, deterministic)
        out = nn.Dense(self.config.hidden_size, name="output_dense")(out)
        return nn.LayerNorm(name="output_LayerNorm")(out + hidden)


class BertLayer(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        hidden = BertAttention(self.config, name="attention")(hidden, mask, deterministic)
        inner = nn.gelu(nn.Dense(self.config.intermediate_size, name="intermediate")(hidden))
        out = nn.Dense(self.config.hidden_size, name="output")(inner)
        return nn.LayerNorm(name="output_LayerNorm")(out + hidden)


class BertLayerCollection(nn.Module):
    config: BertConfig

    def setup(self):
        layer = (nn.remat(BertLayer, static_argnums=(3,))
                 if self.config.gradient_checkpointing else BertLayer)
        self.layers = [layer(self.config, name=str(i))
                       for i in range(self.config.num_hidden_layers)]

    def __call__(self, hidden, mask, deterministic: bool = True):
        for layer in self.layers:
            hidden = layer(hidden, mask, deterministic)
        return hidden


class BertForMaskedLM(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, input_ids):
        cfg = self.config
        words = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="word_embeddings")
        positions = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                             name="position_embeddings")
        mask = jnp.ones_like(input_ids)
        hidden = words(input_ids) + positions(jnp.arange(input_ids.shape[1])[None])
        hidden = nn.LayerNorm(name="embeddings_LayerNorm")(hidden)
        hidden = BertLayerCollection(cfg, name="encoder")(hidden, mask, True)
        hidden = nn.LayerNorm(name="predictions_LayerNorm")(
            nn.gelu(nn.Dense(cfg.hidden_size, name="predictions_transform")(hidden)))
        return words.attend(hidden)


def model(gradient_checkpointing: bool = True) -> BertForMaskedLM:
    """For `remat-kit --model tests/zoo/bert_linen.py:model`."""
    return BertForMaskedLM(BertConfig(gradient_checkpointing=gradient_checkpointing))
