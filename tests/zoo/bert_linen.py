"""A BERT-style encoder (Devlin et al. 2019) in flax.linen, written as Hugging Face's Flax BERT is.

Word, position and token-type embeddings with a LayerNorm; post-norm layers of
self-attention (separate query/key/value `nn.Dense`, an additive mask from
`attention_mask`, `nn.dot_product_attention_weights`) and a GELU intermediate /
output MLP, each sublayer's output added back and normalized; a masked-LM head
(a transform, a LayerNorm, and a decoder to the vocabulary).

`__call__(input_ids, attention_mask)`: int32 [batch, seq] each -> logits float32
[batch, seq, VOCAB]. `build()` returns (model, batch, loss): batch a dict
{"input_ids", "attention_mask", "labels"} int32 [batch, seq]; the model takes the
first two by name, the loss the labels (-100: not predicted, as Hugging Face writes it).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

VOCAB, DIM, HEADS, LAYERS, MAX_LEN, BATCH, SEQ = 64, 32, 4, 2, 64, 2, 16


class BertSelfAttention(nn.Module):
    @nn.compact
    def __call__(self, hidden, mask_bias):
        b, t, _ = hidden.shape
        heads = lambda y: y.reshape(b, t, HEADS, DIM // HEADS)  # noqa: E731
        query = heads(nn.Dense(DIM, name="query")(hidden))
        key = heads(nn.Dense(DIM, name="key")(hidden))
        value = heads(nn.Dense(DIM, name="value")(hidden))
        weights = nn.dot_product_attention_weights(query, key, bias=mask_bias)
        return jnp.einsum("...hqk,...khd->...qhd", weights, value).reshape(b, t, DIM)


class BertLayer(nn.Module):
    @nn.compact
    def __call__(self, hidden, mask_bias):
        attn = nn.Dense(DIM, name="attention_output")(
            BertSelfAttention(name="attention")(hidden, mask_bias))
        hidden = nn.LayerNorm(epsilon=1e-12, name="attention_norm")(attn + hidden)
        inner = nn.gelu(nn.Dense(4 * DIM, name="intermediate")(hidden), approximate=False)
        return nn.LayerNorm(epsilon=1e-12, name="output_norm")(
            nn.Dense(DIM, name="output")(inner) + hidden)


class BertForMaskedLM(nn.Module):
    @nn.compact
    def __call__(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        hidden = (nn.Embed(VOCAB, DIM, name="word_embeddings")(input_ids)
                  + nn.Embed(MAX_LEN, DIM, name="position_embeddings")(jnp.arange(t))[None]
                  + nn.Embed(2, DIM, name="token_type_embeddings")(jnp.zeros_like(input_ids)))
        hidden = nn.LayerNorm(epsilon=1e-12, name="embeddings_norm")(hidden)
        # [batch, 1, 1, seq]: 0 where attended, a large negative number where masked
        mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, -1e9)
        for i in range(LAYERS):
            hidden = BertLayer(name=f"layer_{i}")(hidden, mask_bias)
        hidden = nn.LayerNorm(epsilon=1e-12, name="transform_norm")(
            nn.gelu(nn.Dense(DIM, name="transform")(hidden)))
        return nn.Dense(VOCAB, name="decoder")(hidden)


def loss(logits, batch):
    """Mean cross-entropy over the positions whose label is not -100."""
    labels = batch["labels"]
    keep = labels != -100
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, labels,
                                                                                  0))
    return jnp.sum(per_token * keep) / jnp.maximum(keep.sum(), 1)


def batch(size: int = BATCH, seq: int = SEQ) -> dict:
    """Token ids, a mask with the last quarter padded, and labels on every third token."""
    ids = jax.random.randint(jax.random.key(3), (size, seq), 0, VOCAB)
    mask = jnp.broadcast_to(jnp.arange(seq) < seq - seq // 4, (size, seq)).astype(jnp.int32)
    labels = jnp.where(jnp.arange(seq) % 3 == 0, ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build():
    """(model, batch, loss), as `--model tests/zoo/bert_linen.py:build` takes it."""
    return BertForMaskedLM(), batch(), loss
