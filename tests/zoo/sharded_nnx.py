"""A flax.nnx model built abstractly as a training codebase builds its train state: every
parameter's abstract array carries its `NamedSharding` (`jax.ShapeDtypeStruct(...,
sharding=NamedSharding(mesh, P('fsdp', None)))`, as MaxText's `create_nnx_abstract_model`
leaves them), the logical names stay in the nnx metadata (`out_sharding`), and the rules live
on the model's config (`config.logical_axis_rules`), never on the parameters. Its
activations are constrained by logical names through the rules in effect
(`nn.with_logical_constraint`), as its training loop sets them.

`model()`: a 12-axis mesh named as MaxText names it, fsdp:4, over this machine's first 4
devices (or `devices`); the batch over data x fsdp x fsdp_transpose x expert.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

# Every shard a whole number of TPU tiles (8 x 128), so per-chip bytes are a quarter there too.
VOCAB, DIM, HEADS, HIDDEN, LAYERS = 256, 512, 4, 1024, 2
AXES = {"diloco": 1, "data": 1, "stage": 1, "fsdp": 4, "fsdp_transpose": 1, "context": 1,
        "context_autoregressive": 1, "tensor": 1, "tensor_transpose": 1, "tensor_sequence": 1,
        "expert": 1, "autoregressive": 1}
RULES = (("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
         ("activation_length", None), ("activation_embed", None),
         ("embed", ("fsdp", "fsdp_transpose", "expert")), ("mlp", "tensor"),
         ("heads", "tensor"), ("vocab", "tensor"))


@dataclasses.dataclass(frozen=True)
class Config:
    logical_axis_rules: tuple = RULES


def _param(rngs, shape, names):
    return nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape),
                     out_sharding=names)


class Dense(nnx.Module):
    def __init__(self, rngs, shape, names):
        self.kernel = _param(rngs, shape, names)

    def __call__(self, x):
        return x @ self.kernel[...]


def _act(x):
    return nn.with_logical_constraint(x, ("activation_batch", "activation_length",
                                          "activation_embed"))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.qkv = Dense(rngs, (DIM, 3 * DIM), ("embed", "heads"))
        self.out = Dense(rngs, (DIM, DIM), ("heads", "embed"))
        self.up = Dense(rngs, (DIM, 2 * HIDDEN), ("embed", "mlp"))
        self.down = Dense(rngs, (HIDDEN, DIM), ("mlp", "embed"))

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, HEADS, d // HEADS)
                   for a in jnp.split(self.qkv(x), 3, -1))
        att = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        x = _act(x + jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(att, -1), v)
                 .reshape(b, t, d) @ self.out.kernel[...])
        gate, up = jnp.split(self.up(x), 2, -1)
        return _act(x + self.down(nnx.silu(gate) * up))


class Llama(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.config = Config()
        self.embedding = _param(rngs, (VOCAB, DIM), ("vocab", "embed"))
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.lm_head = _param(rngs, (DIM, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        x = _act(self.embedding[...][tokens])
        for layer in self.layers:
            x = layer(x)
        return x @ self.lm_head[...]


class Checked(Llama):
    """`Llama` whose code asserts that its batch splits over its mesh's fsdp axis, as
    MaxText's flash attention asserts it (`attention_op.tpu_flash_attention`): one chip's
    share of the batch alone fails there."""

    def __call__(self, tokens):
        assert tokens.shape[0] % AXES["fsdp"] == 0, (
            f"Batch dimension should be shardable among the devices in data and fsdp axis got "
            f"{tokens.shape[0]}/{AXES['fsdp']}")
        return super().__call__(tokens)


def mesh(devices=None) -> Mesh:
    """`AXES` over the first 4 of `devices` (default this machine's)."""
    grid = np.array(list(devices or jax.devices())[:4]).reshape(tuple(AXES.values()))
    return Mesh(grid, tuple(AXES))


def abstract(over: Mesh | None, cls: type = Llama) -> Llama:
    """The model (`cls`) with abstract parameters; each with its NamedSharding on `over`
    (its logical names mapped by `RULES`), none where `over` is None."""
    with nnx.use_eager_sharding(False):
        shaped = nnx.eval_shape(lambda: cls(nnx.Rngs(0)))
    graphdef, state = nnx.split(shaped)

    def placed(var):
        value = var.get_value()
        if over is None or not isinstance(var, nnx.Param):
            return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype))
        spec = nn.logical_to_mesh_axes(var.get_metadata()["out_sharding"], RULES)
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=NamedSharding(over, spec)))

    state = jax.tree.map(placed, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def model(devices=None) -> Llama:
    """For `remat-kit --model tests/zoo/sharded_nnx.py:model`: over `mesh(devices)`."""
    return abstract(mesh(devices))


def checked() -> Checked:
    """`model()` whose code asserts its batch splits over its mesh (`Checked`)."""
    return abstract(mesh(), Checked)


def plain() -> Llama:
    """The same model over no mesh: the one-device program."""
    return abstract(None)
