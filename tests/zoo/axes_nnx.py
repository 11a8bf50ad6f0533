"""A flax.nnx model built over a mesh of its own with axis names of its own: every
parameter's metadata names logical axes, its own rules (`sharding_rules=`) and its mesh
(`nnx.with_partitioning(..., mesh=MESH)`), and its activations are pinned to that mesh
(`with_sharding_constraint` on a `NamedSharding`), the batch over replica x shard.

`model()`: stage:1, replica:2, shard:2, model:1, expert:1 (`axes_linen.FIVE`) over this
machine's first 4 devices in order [0, 2, 1, 3].

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tests.zoo.axes_linen import FIVE, FIVE_RULES, PERMUTED, own_mesh

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 64, 32, 4, 64, 2


class Block(nnx.Module):
    def __init__(self, mesh, rngs: nnx.Rngs):
        def linear(din, dout, names):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names, mesh=mesh,
                                         sharding_rules=FIVE_RULES)
            return nnx.Linear(din, dout, use_bias=False, kernel_init=init, rngs=rngs)

        self.mesh = mesh
        self.qkv = linear(DIM, 3 * DIM, ("embed", "heads"))
        self.out = linear(DIM, DIM, ("heads", "embed"))
        self.up = linear(DIM, 2 * HIDDEN, ("embed", "mlp"))
        self.down = linear(HIDDEN, DIM, ("mlp", "embed"))

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in jnp.split(self.qkv(x), 3, -1))
        att = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        x = x + self.out(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(att, -1), v)
                         .reshape(b, t, d))
        gate, up = jnp.split(self.up(x), 2, -1)
        return pin(x + self.down(nnx.silu(gate) * up), self.mesh)


def pin(x, mesh):
    """x split along its batch over the model's own batch axes (none: x)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, PartitionSpec(("replica", "shard"))))


class Llama(nnx.Module):
    def __init__(self, mesh, rngs: nnx.Rngs):
        self.mesh = mesh
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, DIM)),
                                   out_sharding=("vocab", "embed"), mesh=mesh,
                                   sharding_rules=FIVE_RULES)
        self.layers = nnx.List([Block(mesh, rngs) for _ in range(LAYERS)])
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = pin(self.embedding[...][tokens], self.mesh)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def model(devices=None) -> Llama:
    """For `remat-kit --model tests/zoo/axes_nnx.py:model`; over the first 4 of `devices`
    (default this machine's)."""
    with nnx.use_eager_sharding(False):
        return Llama(own_mesh(FIVE, PERMUTED, devices), nnx.Rngs(0))


def plain() -> Llama:
    """The same model over no mesh: the one-device program."""
    with nnx.use_eager_sharding(False):
        return Llama(None, nnx.Rngs(0))
