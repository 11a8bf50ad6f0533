"""Models built over meshes of their own, with axis names of their own, as a training
codebase builds its decoder: `tests/zoo/logical_linen.py`'s Llama with its own logical-axis
rules on every box and constraint, over

* `five()`: stage:1, replica:2, shard:2, model:1, expert:1 on 4 devices (batch over
  replica x shard, embed over shard, heads and mlp over model);
* `five_permuted()`: the same in device order [0, 2, 1, 3];
* `five_scanned()`: the same, its layers one `nn.scan`;
* `twelve()`: 12 axes named as a large training codebase names them (diloco, data,
  stage, fsdp, fsdp_transpose, context, ...), fsdp:2 x tensor:2 in device order
  [0, 2, 1, 3], the others of size 1.

Each mesh is over the first 4 of this machine's devices (`jax.devices()`); compiled for
a TPU target it is rebuilt on the target's chips (`remat_kit.trace.retarget`).
"""

import jax
import numpy as np
from jax.sharding import Mesh

from tests.zoo.logical_linen import Config, Llama

FIVE = {"stage": 1, "replica": 2, "shard": 2, "model": 1, "expert": 1}
FIVE_RULES = (("activation_batch", ("replica", "shard")), ("embed", "shard"),
              ("heads", "model"), ("mlp", "model"), ("vocab", "model"), ("layers", "stage"),
              ("length", None), ("kv", None))
TWELVE = {"diloco": 1, "data": 1, "stage": 1, "fsdp": 2, "fsdp_transpose": 1, "context": 1,
          "context_autoregressive": 1, "tensor": 2, "tensor_transpose": 1,
          "tensor_sequence": 1, "expert": 1, "autoregressive": 1}
TWELVE_RULES = (("activation_batch", ("diloco", "data", "fsdp", "fsdp_transpose", "expert")),
                ("embed", ("fsdp", "fsdp_transpose", "context", "expert")),
                ("heads", ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive")),
                ("mlp", ("tensor", "tensor_transpose", "tensor_sequence")),
                ("vocab", ("tensor", "tensor_transpose")), ("layers", "stage"),
                ("length", None), ("kv", None))
PERMUTED = (0, 2, 1, 3)


def own_mesh(shape: dict, order=(0, 1, 2, 3), devices=None) -> Mesh:
    """`shape`'s axes over the first 4 of `devices` (default this machine's), in device
    order `order`."""
    grid = np.array(list(devices or jax.devices())[:4])[list(order)]
    return Mesh(grid.reshape(tuple(shape.values())), tuple(shape))


def _llama(shape, rules, order=(0, 1, 2, 3), scan=False, devices=None) -> Llama:
    return Llama(Config(batch_name="activation_batch", mesh=own_mesh(shape, order, devices),
                        rules=rules, scan=scan))


def five() -> Llama:
    return _llama(FIVE, FIVE_RULES)


def five_permuted() -> Llama:
    return _llama(FIVE, FIVE_RULES, PERMUTED)


def five_scanned() -> Llama:
    return _llama(FIVE, FIVE_RULES, scan=True)


def twelve(devices=None) -> Llama:
    """Over the first 4 of `devices` (default this machine's): a training script builds it
    over a TPU topology's devices to compile its own step ahead of time."""
    return _llama(TWELVE, TWELVE_RULES, PERMUTED, devices=devices)


def plain(scan=False) -> Llama:
    """The same Llama over no mesh: the one-device program."""
    return Llama(Config(scan=scan))
