"""One equation of a traced loss bound again, where `trace.regions` evaluates the loss afresh.

`bind` runs an equation under the context it was traced in, the model's own mesh rebuilt on the
target's devices (`trace.retarget`); `literal` retypes a literal traced inside a `shard_map` that
runs outside one. How the loss is run again: docs/models.md ("A Flax model, no glue").
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.core import ShapedArray

from remat_kit.trace import retarget


def bind(eqn, invals) -> list:
    """`eqn`'s primitive bound again on `invals` under the context it was traced in (its
    outputs, a list): the model's own mesh in its parameters on the target's devices
    (`retarget.params`), a shard_map's manual mesh left where it runs outside one."""
    got = eqn.primitive.get_bind_params(eqn.params)
    # jax 0.12 returns the params; older releases (subfuns, params).
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    params = retarget.params(params)  # the model's own mesh, on a target's devices
    outside = _out_of_shard_map(eqn.ctx.cur_abstract_mesh)  # before eqn.ctx sets its mesh
    with eqn.ctx.manager, outside:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def literal(val):
    """A literal's value; one typed inside a `shard_map` (jax's host array typed on its
    manual mesh) typed afresh, on no mesh, where it runs outside one."""
    mesh = getattr(getattr(getattr(val, "aval", None), "sharding", None), "mesh", None)
    if (mesh is None or not mesh.manual_axes
            or jax.sharding.get_abstract_mesh().manual_axes):
        return val
    return type(val)(np.asarray(val), ShapedArray(val.shape, val.dtype,
                                                  weak_type=val.aval.weak_type))


def _out_of_shard_map(traced):
    """Where an equation traced inside a `shard_map` (its context mesh has manual axes)
    runs outside one (`explain`'s block taken out of a pipeline's stage), a context
    that keeps the mesh it runs under; else none."""
    here = jax.sharding.get_abstract_mesh()
    if traced.manual_axes and not here.manual_axes:
        return jax.sharding.use_abstract_mesh(here)
    return contextlib.nullcontext()
