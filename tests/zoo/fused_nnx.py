"""An NNX language model whose attention is `jax.nn.dot_product_attention`, with a dict output.

nnx.Linear projections, nnx.LayerNorm, a SwiGLU MLP whose gate and up
projections are one nnx.Linear (split in two), and {"logits": ...} out.
`attention` picks the attention function: jax.nn.dot_product_attention (the
XLA implementation on a CPU, which keeps the scores) or any function of
(q, k, v) [batch, seq, heads, head_dim], e.g. a fused kernel.

tokens int32 [batch, seq] -> {"logits": float32 [batch, seq, vocab]}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


def causal_dpa(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def one_op_attention(q, k, v):
    """Attention as one opaque op, as cuDNN's fused kernel traces: an FFI call
    (traced only; it has no implementation to run)."""
    return jax.ffi.ffi_call("fused_attention_fwd", jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k, v)


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    vocab: int = 64
    layers: int = 2
    dim: int = 32
    heads: int = 4
    hidden: int = 48


class Block(nnx.Module):
    def __init__(self, c: FusedConfig, attention: Callable, *, rngs):
        self.c, self.attention = c, attention
        self.ln1 = nnx.LayerNorm(c.dim, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.dim, rngs=rngs)
        self.q = nnx.Linear(c.dim, c.dim, rngs=rngs)
        self.k = nnx.Linear(c.dim, c.dim, rngs=rngs)
        self.v = nnx.Linear(c.dim, c.dim, rngs=rngs)
        self.o = nnx.Linear(c.dim, c.dim, rngs=rngs)
        self.up = nnx.Linear(c.dim, 2 * c.hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.hidden, c.dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        heads = lambda a: a.reshape(b, t, self.c.heads, d // self.c.heads)
        h = self.ln1(x)
        ctx = self.attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)))
        x = x + self.o(ctx.reshape(b, t, d))
        gate, up = jnp.split(self.up(self.ln2(x)), 2, axis=-1)
        return x + self.down(nnx.silu(gate) * up)


class FusedLM(nnx.Module):
    def __init__(self, c: FusedConfig = FusedConfig(), attention: Callable = causal_dpa, *,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.dim, rngs=rngs)
        self.blocks = nnx.List([Block(c, attention, rngs=rngs) for _ in range(c.layers)])
        self.ln_f = nnx.LayerNorm(c.dim, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return {"logits": self.embed.attend(self.ln_f(x))}


def make(batch: int, seq: int, attention: Callable = causal_dpa, abstract: bool = False):
    """(model, params, forward(params, tokens) -> logits) at tiny size, random init;
    params is the model's nnx.Param state; abstract: ShapeDtypeStructs (for tracing only)."""
    build = lambda: FusedLM(attention=attention, rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build) if abstract else nnx.jit(build)()
    graphdef, params = nnx.split(model, nnx.Param)
    return model, params, lambda p, tok: nnx.merge(graphdef, p)(tok)["logits"]
