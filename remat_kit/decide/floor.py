"""What a memory budget cannot go below, known before anything compiles.

No policy saves the parameters or the optimizer state, so a budget below them fits nothing; a
`jax.eval_shape` says so where compiles would. `step_floor`: the whole train step's (parameters +
optimizer state); `planner_floor`: the planner's figure on TPU and GPU (parameters and their
gradients; none on XLA CPU, whose figure is temp); `check` raises `BudgetError`. Per device.
The rule and the figures: docs/plan.md ("A floor known before compiling").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from remat_kit import mesh as rk_mesh
from remat_kit.errors import BudgetError
from remat_kit.measure.record import PEAK, memory_kind
from remat_kit.units import fmt_bytes_exact
from remat_kit.trace.workload import Workload


def tree_bytes(tree) -> int:
    """Bytes one device holds of a tree of (possibly sharded) ShapeDtypeStructs."""
    return sum(math.prod(rk_mesh.local_shape(x).shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def train_state(workload: Workload, optimizer: optax.GradientTransformation):
    """One train step's arguments as `jax.ShapeDtypeStruct`s: (params, opt_state, rest).

    The optimizer state is sharded like the parameters each of its leaves
    mirrors (`optax.tree_map_params`), its other leaves (AdamW's step count)
    replicated on the workload's mesh.
    """
    params, rest = workload.args[0], workload.args[1:]
    opt_state = jax.eval_shape(optimizer.init, params)
    mesh = workload.mesh
    if mesh is not None:
        replicated = rk_mesh.replicated(mesh)
        opt_state = optax.tree_map_params(
            optimizer, lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
            opt_state, params,
            transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                sharding=replicated))
    return params, opt_state, rest


def _params(model: Workload):
    """The parameters of a workload."""
    if isinstance(model, Workload):
        return model.params
    raise TypeError(f"expected a Workload, got {type(model).__name__}")


def step_floor(model: Workload, optimizer: optax.GradientTransformation) -> int:
    """Parameters plus optimizer state, bytes per device: the least a train
    step under any policy holds, per device of the workload's mesh. Traced with `jax.eval_shape`; nothing compiles.

    Raises:
      MeshError: the mesh does not split the heads (or a batch of its
        data x fsdp size).
    """
    params = _params(model)
    return tree_bytes(params) + tree_bytes(jax.eval_shape(optimizer.init, params))


def planner_floor(model: Workload, platform: str) -> int | None:
    """The least the planner's figure (`record.memory_kind(platform)`) can be
    for the value-and-grad of the workload `model`:
    parameters plus gradients, bytes per device, where that figure is the
    compiler's peak (TPU, GPU); None on CPU, whose temp figure holds neither."""
    if memory_kind(platform) != PEAK:
        return None
    return 2 * tree_bytes(_params(model))


def check(budget_bytes: int, floor: int | None, what: str, *, budget=None) -> None:
    """Raises BudgetError, in one line naming the floor, when budget_bytes < floor.

    Args:
      budget_bytes: the budget, bytes per device.
      floor: `step_floor` or `planner_floor` (None: nothing to check).
      what: what the floor is, e.g. "the parameters plus optimizer state".
      budget: the budget as given, for the error.
    """
    if floor is not None and budget_bytes < floor:
        raise BudgetError(
            f"budget {fmt_bytes_exact(budget_bytes)} is below {what}, "
            f"{fmt_bytes_exact(floor, 'per device')}, which no policy frees: no "
            f"policy fits",
            budget=budget if budget is not None else budget_bytes, minimum_bytes=floor)


__all__ = ["check", "planner_floor", "step_floor", "train_state", "tree_bytes"]
