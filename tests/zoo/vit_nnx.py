"""A vision transformer (Dosovitskiy et al. 2021) in flax.nnx, written as NNX ports write one.

A patch embedding by an `nnx.Conv` with stride = kernel = patch size, a learned
class token and position embedding, pre-norm encoder blocks (`nnx.MultiHeadAttention`
style attention written out: q/k/v `nnx.Linear`, softmax, out projection; an MLP
with GELU), `nnx.Dropout` after attention and MLP drawing from `nnx.Rngs` (its
RNG count is state the call updates), a final LayerNorm and a classifier head
on the class token.

images float32 [batch, 16, 16, 3] -> logits float32 [batch, CLASSES];
`build()` returns (model, batch, loss): batch {"image", "label" int32 [batch]},
loss the mean softmax cross-entropy against the labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

SIZE, PATCH, DIM, HEADS, LAYERS, CLASSES, BATCH = 16, 4, 32, 4, 2, 10, 2


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.query = nnx.Linear(DIM, DIM, rngs=rngs)
        self.key = nnx.Linear(DIM, DIM, rngs=rngs)
        self.value = nnx.Linear(DIM, DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x):
        b, n, _ = x.shape
        split = lambda y: y.reshape(b, n, HEADS, DIM // HEADS)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(DIM // HEADS)
        probs = jax.nn.softmax(scores, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, DIM))


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.fc2 = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


class EncoderBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = Attention(rngs)
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = Mlp(rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class VisionTransformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.1):
        self.patch_embed = nnx.Conv(3, DIM, (PATCH, PATCH), strides=(PATCH, PATCH), rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, DIM)))
        tokens = (SIZE // PATCH) ** 2 + 1
        self.pos_embed = nnx.Param(jax.random.normal(rngs.params(), (1, tokens, DIM)) * 0.02)
        self.blocks = nnx.List([EncoderBlock(rngs, dropout) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, CLASSES, rngs=rngs)

    def __call__(self, image):
        x = self.patch_embed(image)
        b = x.shape[0]
        x = x.reshape(b, -1, DIM)
        x = jnp.concatenate([jnp.broadcast_to(self.cls_token[...], (b, 1, DIM)), x], axis=1)
        x = x + self.pos_embed[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def loss(logits, batch):
    """Mean softmax cross-entropy of the class logits against batch["label"]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def batch(size: int = BATCH) -> dict:
    """Random images and labels: {"image": float32 [size, 16, 16, 3], "label": int32 [size]}."""
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"image": jax.random.normal(k1, (size, SIZE, SIZE, 3)),
            "label": jax.random.randint(k2, (size,), 0, CLASSES)}


def build():
    """(model, batch, loss), as `--model tests/zoo/vit_nnx.py:build` takes it."""
    return VisionTransformer(nnx.Rngs(params=0, dropout=1)), batch(), loss
