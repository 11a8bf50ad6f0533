"""An NNX mixture-of-experts decoder whose experts run as grouped matmuls, as MaxText's
sparse path (`sparse_matmul=True`) runs them.

Each block: RMSNorm, causal softmax attention, RMSNorm, then a top-k router over
`experts` gated SiLU MLPs. The routed tokens are sorted by expert (`argsort` of the
top-k indices), their group sizes counted (`bincount`), and the three expert matmuls
run over the sorted rows; the outputs are unsorted and combined by the routing weights.
`matmul` picks the grouped matmul:
- "gmm": the megablox Pallas kernel (`jax.experimental.pallas.ops.tpu.megablox.gmm`,
  TPU; `interpret=True` runs it on a CPU);
- "ragged_dot": `jax.lax.ragged_dot` (every platform).
`tags=True` names the values as MaxText's `layers/moe.py` does: `moe_x_sorted`, the gate
and up matmuls `mlpwi_0`/`moe_mlpwi_0` and `moe_mlpwi_1`, the down matmul
`mlpwo`/`moe_mlpwo`, and the routing indices `moe_routing_maps`. `router_dtype` is the
router logits' (bf16 makes top-k ties possible). `scan=True` stacks the layers under
`nnx.scan`. `maxtext_megablox()` is a `--model` factory.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

from tests.zoo.kernel_nnx import KernelLM


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 128
    layers: int = 2
    dim: int = 128
    heads: int = 2
    head_dim: int = 64
    experts: int = 4
    top_k: int = 2
    hidden: int = 256
    matmul: str = "gmm"
    tags: bool = True
    interpret: bool = False
    dtype: str = "float32"  # of the activations (parameters stay float32)
    router_dtype: str = "float32"
    scan: bool = False
    shared: int = 0  # hidden width of one dense shared expert beside the routed ones; 0: none
    expert_parallel: int = 0  # chips of the mesh axis `expert` the experts are split over


def _name(c: MoEConfig, x, *names: str):
    for name in names if c.tags else ():
        x = checkpoint_name(x, name)
    return x


def grouped(c: MoEConfig, x, w, group_sizes):
    """x [m, k] sorted by group, w [groups, k, n], group_sizes int32 [groups] -> [m, n]."""
    if c.matmul == "gmm":
        return megablox_gmm(x, w.astype(x.dtype), group_sizes, x.dtype,
                            interpret=c.interpret)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)


class MoE(nnx.Module):
    """Routed experts (and, where `c.shared`, one dense gated MLP beside them, as
    DeepSeek's and Llama 4's shared expert). `route`, `experts` and `combine` are the
    pieces an expert-parallel layer (`moe_ep_nnx.py`) runs around its all-to-alls."""

    def __init__(self, c: MoEConfig, *, rngs):
        self.c = c
        init = nnx.initializers.lecun_normal()
        # The expert axis (if any) splits the experts' weights: each chip holds its own.
        over = {"out_sharding": ("expert", None, None)} if c.expert_parallel else {}
        param = lambda *shape: nnx.Param(init(rngs.params(), shape), **over)  # noqa: E731
        self.router = nnx.Linear(c.dim, c.experts, use_bias=False, rngs=rngs)
        self.wi_0 = param(c.experts, c.dim, c.hidden)
        self.wi_1 = param(c.experts, c.dim, c.hidden)
        self.wo = param(c.experts, c.hidden, c.dim)
        if c.shared:
            dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
            self.shared_gate, self.shared_up = dense(c.dim, c.shared), dense(c.dim, c.shared)
            self.shared_down = dense(c.shared, c.dim)

    def route(self, x):
        """x [b, s, d] -> (expert ids int32 [b·s·k], their sort order [b·s·k], routing
        weights [b, s, k])."""
        c = self.c
        logits = self.router(x.astype(c.router_dtype))
        weights, chosen = jax.lax.top_k(logits, c.top_k)  # [b, s, k]
        weights = jax.nn.softmax(weights.astype(jnp.float32), axis=-1).astype(x.dtype)
        flat = _name(c, chosen.reshape(-1), "moe_routing_maps")
        return flat, _name(c, jnp.argsort(flat), "moe_routing_maps"), weights

    def experts(self, rows, sizes, wi_0, wi_1, wo):
        """rows [m, d] sorted by expert, sizes int32 [experts] -> [m, d]: the gated SiLU
        MLP of each row's expert, three grouped matmuls."""
        c = self.c
        h0 = _name(c, grouped(c, rows, wi_0, sizes), "mlpwi_0", "moe_mlpwi_0")
        h1 = _name(c, grouped(c, rows, wi_1, sizes), "moe_mlpwi_1")
        return _name(c, grouped(c, nnx.silu(h0) * h1, wo, sizes), "mlpwo", "moe_mlpwo")

    def combine(self, out, order, weights, shape):
        """out [b·s·k, d] in sorted order -> [b, s, d], weighted by the routing."""
        b, s, d = shape
        unsorted = out[jnp.argsort(order)].reshape(b, s, self.c.top_k, d)
        return jnp.einsum("bskd,bsk->bsd", unsorted, weights)

    def dense(self, x):
        """The shared expert's gated SiLU MLP of x [b, s, d], or 0 where there is none."""
        if not self.c.shared:
            return 0.0
        return self.shared_down(nnx.silu(self.shared_gate(x)) * self.shared_up(x))

    def __call__(self, x):
        c = self.c
        flat, order, weights = self.route(x)
        sorted_x = _name(c, jnp.take(x.reshape(-1, x.shape[-1]), order // c.top_k, axis=0),
                         "moe_x_sorted")
        sizes = jnp.bincount(flat, length=c.experts).astype(jnp.int32)
        out = self.experts(sorted_x, sizes, self.wi_0[...], self.wi_1[...], self.wo[...])
        return self.combine(out, order, weights, x.shape) + self.dense(x)


class Block(nnx.Module):
    MOE = MoE  # a subclass's own expert layer (tests/zoo/moe_ep_nnx.py)

    def __init__(self, c: MoEConfig, *, rngs):
        self.c = c
        kw = {"dtype": jnp.dtype(c.dtype), "rngs": rngs}
        self.ln1, self.ln2 = nnx.RMSNorm(c.dim, **kw), nnx.RMSNorm(c.dim, **kw)
        self.qkv = nnx.Linear(c.dim, 3 * c.heads * c.head_dim, use_bias=False, **kw)
        self.o = nnx.Linear(c.heads * c.head_dim, c.dim, use_bias=False, **kw)
        self.moe = type(self).MOE(c, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        c = self.c
        q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, s, 3 * c.heads, c.head_dim), 3,
                            axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.o(ctx.reshape(b, s, -1))
        return x + self.moe(self.ln2(x))


class MoELM(KernelLM):
    BLOCK = Block


def make(batch: int, seq: int, abstract: bool = False, **config):
    """(model, params, forward(params, tokens) -> logits) of a `MoEConfig(**config)`,
    random init; abstract: ShapeDtypeStructs (for tracing and AOT compiles only).
    gmm needs batch x seq x top_k rows a multiple of its 128-row tile."""
    del batch, seq
    build = lambda: MoELM(MoEConfig(**config), rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build) if abstract else nnx.jit(build)()
    graphdef, params = nnx.split(model, nnx.Param)
    return model, params, lambda p, tok: nnx.merge(graphdef, p)(tok)


def maxtext_megablox() -> MoELM:
    """`--model` factory: MaxText's sparse MoE on its TPU production kernel (megablox gmm),
    tagged as MaxText tags it, scanned layers, bf16 activations; abstract."""
    c = MoEConfig(scan=True, dtype="bfloat16")
    return nnx.eval_shape(lambda: MoELM(c, rngs=nnx.Rngs(0)))
