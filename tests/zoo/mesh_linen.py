"""A linen model that carries its own mesh: it builds a `Mesh` over this machine's devices
at import and constrains its activations to it (`with_sharding_constraint`), the way a
training codebase pins its data-parallel layout inside the model."""

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH = Mesh(np.array(jax.devices()), ("data",))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class Model(nn.Module):
    vocab: int = 64
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = jax.lax.with_sharding_constraint(x, NamedSharding(MESH, PartitionSpec("data")))
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def model() -> Model:
    return Model()
