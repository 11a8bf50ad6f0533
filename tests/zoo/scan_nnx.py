"""A GPT-like NNX model whose blocks run as one `nnx.scan`, the way NNX ports stack them.

The blocks are made by `nnx.vmap` under `nnx.split_rngs` (one module, each
parameter stacked on a leading layer axis) and run by `nnx.scan` with the
residual stream as its carry; one fused qkv projection. `scan=False` keeps the
same blocks in an `nnx.List` run by a Python loop; `remat=True` runs each scanned
layer under `nnx.remat` (nothing saved), as the Flax guide's scan-over-layers does.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, DIM, HEADS, LAYERS = 64, 32, 4, 2


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, HEADS, d // HEADS)
                   for a in jnp.split(self.qkv(self.norm1(x)), 3, axis=-1))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
        x = x + self.o(o)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    def __init__(self, scan: bool = True, *, remat: bool = False, rngs: nnx.Rngs):
        self.scan, self.remat = scan, remat
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        if scan:
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(rngs)
            self.blocks = blocks(rngs)
        else:
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan:
            call = lambda x, block: block(x)  # noqa: E731
            if self.remat:
                call = nnx.remat(call, policy=jax.checkpoint_policies.nothing_saveable)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return call(x, block)
            x = run(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x)


def model(scan: bool = True, remat: bool = False) -> GPT:
    """Abstract (ShapeDtypeStruct parameters), for `--model tests/zoo/scan_nnx.py:model`."""
    return nnx.eval_shape(lambda: GPT(scan, remat=remat, rngs=nnx.Rngs(0)))
