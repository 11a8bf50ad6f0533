"""A linen model whose blocks run inside `jax.shard_map` over the batch, on a 4-device mesh it
builds from `jax.devices()`, the way a codebase runs a kernel per data shard: its batch must
divide by 4, so it cannot be initialised at batch 1."""

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from tests.zoo.mesh_linen import Block

MESH = Mesh(np.array(jax.devices()[:4]), ("data",))


def _per_shard(x):  # runs on each data shard: [batch / 4, seq, width]
    return x * jax.nn.sigmoid(x)


class Model(nn.Module):
    vocab: int = 64
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(2):
            x = Block()(x)
            x = jax.shard_map(_per_shard, mesh=MESH, in_specs=P("data"), out_specs=P("data"))(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def model() -> Model:
    return Model()
