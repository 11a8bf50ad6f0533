"""An NNX Llama whose attention is a fused kernel, as production JAX code calls one.

`attention` picks it:
- "splash": TPU splash attention as MaxText calls it: a causal (or, with
  `window`, local) `MultiHeadMask`, `make_splash_mqa` under `jax.vmap` over
  the batch and the key/value heads (grouped-query heads), segment ids, and
  `residual_checkpoint_name="context"` naming the kernel's result and
  logsumexp;
- "flash": the TPU flash kernel (`pallas.ops.tpu.flash_attention`, causal);
- "dpa": `jax.nn.dot_product_attention`, `implementation` None, "xla" or "cudnn"
  (traced with remat_kit's stand-in where this machine cannot build the cuDNN call,
  `remat_kit.trace.stand_in`);
- "einsum": the same causal attention written out (the twin the kernels are
  checked against).
`interpret=True` runs splash in interpret mode (on a CPU). `scan=True` stacks the
layers and runs them by `nnx.scan`, as MaxText's scanned decoder does.
`maxtext_splash()` and `cudnn()` are `--model` factories.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    vocab: int = 128
    layers: int = 2
    dim: int = 256
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 128
    hidden: int = 256
    attention: str = "splash"
    window: int | None = None  # splash only: a local mask of this many keys back
    implementation: str | None = None  # "dpa" only
    interpret: bool = False
    dtype: str = "float32"  # of the activations (parameters stay float32)
    scan: bool = False  # the layers stacked and run by nnx.scan


def _splash(c: KernelConfig, q, k, v):
    """q [b, s, h, d], k/v [b, s, kv, d] -> [b, s, h, d] by splash (module docstring)."""
    b, s, h, d = q.shape
    group = h // c.kv_heads
    one = masks.CausalMask((s, s)) if c.window is None else masks.LocalMask(
        (s, s), (c.window, 0), offset=0)
    kernel = splash.make_splash_mqa(masks.MultiHeadMask([one] * group), head_shards=1,
                                    q_seq_shards=1, residual_checkpoint_name="context",
                                    interpret=c.interpret)
    segments = splash.SegmentIds(q=jnp.ones((b, s), jnp.int32), kv=jnp.ones((b, s), jnp.int32))
    qg = q.reshape(b, s, c.kv_heads, group, d).transpose(0, 2, 3, 1, 4) / jnp.sqrt(d)
    per_kv = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over the kv heads
    out = jax.vmap(per_kv)(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segments)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


def _repeat(c: KernelConfig, k):
    return jnp.repeat(k, c.heads // c.kv_heads, axis=2)


def attend(c: KernelConfig, q, k, v):
    """q [b, s, heads, d], k/v [b, s, kv_heads, d] -> [b, s, heads, d], causal."""
    if c.attention == "splash":
        return _splash(c, q, k, v)
    if c.attention == "flash":
        out = tpu_flash.flash_attention(
            q.transpose(0, 2, 1, 3), _repeat(c, k).transpose(0, 2, 1, 3),
            _repeat(c, v).transpose(0, 2, 1, 3), causal=True, sm_scale=q.shape[-1] ** -0.5)
        return out.transpose(0, 2, 1, 3)
    if c.attention == "dpa":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=c.implementation)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, _repeat(c, k)) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), _repeat(c, v))


class Block(nnx.Module):
    def __init__(self, c: KernelConfig, *, rngs):
        self.c = c
        kw = {"dtype": jnp.dtype(c.dtype), "rngs": rngs}
        self.ln1, self.ln2 = nnx.RMSNorm(c.dim, **kw), nnx.RMSNorm(c.dim, **kw)
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, **kw)
        self.q = linear(c.dim, c.heads * c.head_dim)
        self.k = linear(c.dim, c.kv_heads * c.head_dim)
        self.v = linear(c.dim, c.kv_heads * c.head_dim)
        self.o = linear(c.heads * c.head_dim, c.dim)
        self.gate, self.up = linear(c.dim, c.hidden), linear(c.dim, c.hidden)
        self.down = linear(c.hidden, c.dim)

    def __call__(self, x):
        b, s, _ = x.shape
        c = self.c
        h = self.ln1(x)
        q = self.q(h).reshape(b, s, c.heads, c.head_dim)
        k = self.k(h).reshape(b, s, c.kv_heads, c.head_dim)
        v = self.v(h).reshape(b, s, c.kv_heads, c.head_dim)
        x = x + self.o(attend(c, q, k, v).reshape(b, s, -1))
        h = self.ln2(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class KernelLM(nnx.Module):
    """Embed, `c.layers` x `BLOCK` (scanned where `c.scan`), RMSNorm, tied logits."""

    BLOCK = Block  # a subclass's own layer (tests/zoo/moe_nnx.py)

    def __init__(self, c: KernelConfig, *, rngs: nnx.Rngs):
        block = type(self).BLOCK
        self.scan = c.scan
        self.embed = nnx.Embed(c.vocab, c.dim, dtype=jnp.dtype(c.dtype), rngs=rngs)
        if c.scan:
            @nnx.split_rngs(splits=c.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return block(c, rngs=rngs)
            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([block(c, rngs=rngs) for _ in range(c.layers)])
        self.norm = nnx.RMSNorm(c.dim, dtype=jnp.dtype(c.dtype), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)
            x = run(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.embed.attend(self.norm(x))


def make(batch: int, seq: int, abstract: bool = False, **config):
    """(model, params, forward(params, tokens) -> logits) of a `KernelConfig(**config)`,
    random init; abstract: ShapeDtypeStructs (for tracing and AOT compiles only)."""
    del batch, seq  # any batch, and a seq the kernel's blocks (128) divide
    build = lambda: KernelLM(KernelConfig(**config), rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build) if abstract else nnx.jit(build)()
    graphdef, params = nnx.split(model, nnx.Param)
    return model, params, lambda p, tok: nnx.merge(graphdef, p)(tok)


def maxtext_splash() -> KernelLM:
    """`--model` factory: MaxText's decoder at its TPU production setting (attention=flash,
    i.e. splash with `residual_checkpoint_name="context"` and a segment-id mask; scanned
    layers), 2 layers of d 256, bf16 activations; abstract."""
    c = KernelConfig(attention="splash", scan=True, dtype="bfloat16")
    return nnx.eval_shape(lambda: KernelLM(c, rngs=nnx.Rngs(0)))


def cudnn() -> KernelLM:
    """`--model` factory: `jax.nn.dot_product_attention(implementation="cudnn")`, causal,
    grouped-query heads (2 of 64 over 1 key/value head), bf16 activations; abstract."""
    c = KernelConfig(attention="dpa", implementation="cudnn", head_dim=64, dtype="bfloat16")
    return nnx.eval_shape(lambda: KernelLM(c, rngs=nnx.Rngs(0)))
