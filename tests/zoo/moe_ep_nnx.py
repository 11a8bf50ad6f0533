"""The NNX MoE decoder of `moe_nnx.py` with its experts split over a mesh axis (expert
parallelism, as MaxText's `ici_expert_parallelism` splits them).

Each chip holds `experts / n` experts' weights (their `out_sharding` names the axis) and
`batch / n` of the tokens. Per layer, inside `jax.shard_map` over the axis: the chip routes
its tokens, sorts them by expert, and sends each chip the rows for its experts in one
`jax.lax.all_to_all` (the dispatch: `moe_dispatch`, padded to the static bound, every row to
one chip); the receiver sorts them by its local expert, runs the grouped matmuls over its own
experts, and a second all-to-all returns the outputs (the combine: `moe_combine`), which
are unsorted and weighted as on one chip. `ragged_all_to_all` (MaxText's) has no CPU lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.zoo import moe_nnx
from tests.zoo.moe_nnx import _name


AXIS = "expert"


def mesh(n: int, devices=None) -> Mesh:
    """One axis `expert` over the first `n` of `devices` (this machine's where None; a
    target's chips, `remat_kit.measure.targets.devices("tpu:v5p:2x2x1")`, as MaxText builds
    its mesh for an ahead-of-time compile)."""
    return Mesh(np.array(list(devices or jax.devices())[:n]), (AXIS,))


def _send(c, ids, sorted_x, n: int):
    """Rows sorted by expert [R, d] and their expert ids [R] -> (a buffer [n, R, d] whose
    row block j holds the rows for chip j's experts, zero past their count; their local
    expert ids [n, R], `experts / n` past the count; each chip's count [n])."""
    local = c.experts // n
    r = jnp.arange(ids.shape[0])
    count = jnp.bincount(ids // local, length=n)
    start = jnp.cumsum(count) - count
    valid = r[None, :] < count[:, None]
    at = jnp.clip(start[:, None] + r[None, :], 0, ids.shape[0] - 1)
    rows = jnp.where(valid[..., None], sorted_x[at], 0)
    local_ids = jnp.where(valid, ids[at] - jnp.arange(n)[:, None] * local, local)
    return rows, local_ids.astype(jnp.int32), start


class ExpertParallelMoE(moe_nnx.MoE):
    mesh: Mesh | None = None  # set by `make`: the mesh the experts are split over

    def __call__(self, x):
        spec = P(AXIS)
        body = jax.shard_map(self._per_chip, mesh=self.mesh,
                             in_specs=(spec,) * 4, out_specs=spec, check_vma=False)
        return body(x, self.wi_0[...], self.wi_1[...], self.wo[...]) + self.dense(x)

    def _per_chip(self, x, wi_0, wi_1, wo):
        """x [b/n, s, d], the chip's experts' weights [experts/n, ...] -> [b/n, s, d]."""
        c, local = self.c, wi_0.shape[0]
        n, d = c.experts // local, x.shape[-1]
        flat, order, weights = self.route(x)
        ids = flat[order]
        sorted_x = _name(c, jnp.take(x.reshape(-1, d), order // c.top_k, axis=0),
                         "moe_x_sorted")
        rows, local_ids, start = _send(c, ids, sorted_x, n)
        got = _name(c, jax.lax.all_to_all(rows, AXIS, 0, 0, tiled=True),
                    "moe_dispatch").reshape(-1, d)
        got_ids = _name(c, jax.lax.all_to_all(local_ids, AXIS, 0, 0, tiled=True),
                        "moe_routing_maps").reshape(-1)
        mine = _name(c, jnp.argsort(got_ids), "moe_routing_maps")
        sizes = jnp.bincount(got_ids, length=local + 1)[:local].astype(jnp.int32)
        out = self.experts(got[mine], sizes, wi_0.astype(x.dtype), wi_1.astype(x.dtype),
                           wo.astype(x.dtype))
        out = jnp.where((got_ids[mine] < local)[:, None], out, 0)[jnp.argsort(mine)]
        back = _name(c, jax.lax.all_to_all(out.reshape(n, -1, d), AXIS, 0, 0,
                                           tiled=True), "moe_combine")
        shard = ids // local
        mine_sorted = back[shard, jnp.arange(ids.shape[0]) - start[shard]]
        return self.combine(mine_sorted, order, weights, x.shape)


class Block(moe_nnx.Block):
    MOE = ExpertParallelMoE


class MoELM(moe_nnx.MoELM):
    BLOCK = Block


def make(batch: int, seq: int, abstract: bool = False, chips: int = 4, devices=None,
         **config):
    """(model, params, forward) as `moe_nnx.make`, the experts split over `chips` devices
    of the axis `expert` (`mesh(chips, devices)`): each expert weight carries its NamedSharding
    (abstract: on its ShapeDtypeStruct, as a codebase's abstract train state does), the
    rest whole on every device. The batch must divide by `chips`."""
    del batch, seq
    c = moe_nnx.MoEConfig(expert_parallel=chips, **config)
    over = mesh(chips, devices)
    build = lambda: MoELM(c, rngs=nnx.Rngs(0))  # noqa: E731
    with nnx.use_eager_sharding(False):  # placed below, on the mesh
        graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else nnx.jit(build)())

    def placed(var):
        value = var.get_value()
        names = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Param) else None
        at = NamedSharding(over, P(*names) if names else P())
        if abstract:
            return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=at))
        return var.replace(jax.device_put(value, at))

    state = jax.tree.map(placed, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    model = nnx.merge(graphdef, state)
    for _, layer in nnx.iter_modules(model):
        if isinstance(layer, ExpertParallelMoE):
            layer.mesh = over
    graphdef, params = nnx.split(model, nnx.Param)
    return model, params, lambda p, tok: nnx.merge(graphdef, p)(tok)
