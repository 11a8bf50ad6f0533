"""A model's own mesh, rebuilt on the devices of the target it is compiled for.

A model may build a mesh over this machine's devices and use it in its own sharding constraints;
compiled for another target those name devices the target has not. Inside `retargeting(devices)`
every equation `trace.regions` binds has each such mesh rebuilt (same axis names, shape, types,
device order) over the target's devices; a mesh larger than the target is refused (`check_fits`).
Docs: docs/meshes.md ("A model that carries its own mesh").
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding

from remat_kit.errors import MeshError

# (target devices, the target's name, {id(mesh): rebuilt}) while compiling for a target.
_TARGET: contextvars.ContextVar = contextvars.ContextVar("remat_kit_retarget", default=None)


@contextlib.contextmanager
def retargeting(devices: Sequence, label: str) -> Iterator[None]:
    """Context in which `params` rebuilds meshes not over `devices` (those of the
    target named `label`) on them."""
    token = _TARGET.set((tuple(devices), label, {}))
    try:
        yield
    finally:
        _TARGET.reset(token)


def describe(mesh: Mesh) -> str:
    """'data: 8 over 8 cpu devices'."""
    axes = ", ".join(f"{a}: {n}" for a, n in mesh.shape.items())
    return f"{axes} over {mesh.size} {mesh.devices.flat[0].platform} devices"


def check_fits(mesh: Mesh, devices: Sequence, label: str) -> None:
    """Raises MeshError where the model's own `mesh` has more devices than target
    `label`'s `devices` (so the CLI refuses before it starts compiling)."""
    if mesh.size > len(devices):
        raise MeshError(
            f"the model builds its own mesh ({describe(mesh)}) and target {label} has "
            f"{len(devices)} device{'s' if len(devices) != 1 else ''}: name a target with "
            f"at least {mesh.size}, or build the model's mesh over at most {len(devices)}")


def check_stays(mesh: Mesh, devices: Sequence, label: str) -> None:
    """Raises MeshError where a `shard_map` (a pipeline's stages, say) runs over the
    model's own `mesh` and that mesh is not over target `label`'s `devices`: its body,
    typed on this machine's devices, is not rebuilt on another's."""
    if not set(mesh.devices.flat) <= set(devices):
        raise MeshError(
            f"the model runs a shard_map over its own mesh ({describe(mesh)}), which is not "
            f"rebuilt for target {label}: build that mesh over the target's chips "
            f"(remat_kit.measure.targets.devices({label!r})), as MaxText builds its own for "
            "an ahead-of-time compile")


def shard_map_mesh(mesh: Mesh) -> Mesh:
    """A `shard_map`'s mesh, checked (`check_stays`) while compiling for a target."""
    state = _TARGET.get()
    if state is not None:
        check_stays(mesh, state[0], state[1])
    return mesh


def _mesh(mesh: Mesh, devices: tuple, label: str, memo: dict) -> Mesh:
    if not mesh.axis_names or set(mesh.devices.flat) <= set(devices):
        return mesh  # the empty context mesh, or already the target's
    if id(mesh) not in memo:
        check_fits(mesh, devices, label)
        ids = [d.id for d in mesh.devices.flat]
        # The model's own device order ([0, 2, 1, 3]) kept on the target's devices.
        chosen = ([devices[i] for i in ids] if max(ids) < len(devices)
                  else list(devices[:mesh.size]))
        grid = np.array(chosen, dtype=object).reshape(mesh.devices.shape)
        memo[id(mesh)] = (mesh, Mesh(grid, mesh.axis_names, axis_types=mesh.axis_types))
    return memo[id(mesh)][1]


def _value(v, devices, label, memo):
    if isinstance(v, Mesh):
        return _mesh(v, devices, label, memo)
    if isinstance(v, NamedSharding):
        mesh = _mesh(v.mesh, devices, label, memo) if isinstance(v.mesh, Mesh) else v.mesh
        return v if mesh is v.mesh else NamedSharding(mesh, v.spec, memory_kind=v.memory_kind)
    if isinstance(v, ClosedJaxpr):
        inner = _jaxpr(v.jaxpr, devices, label, memo)
        return v if inner is v.jaxpr else ClosedJaxpr(inner, v.consts)
    if isinstance(v, Jaxpr):
        return _jaxpr(v, devices, label, memo)
    if isinstance(v, (tuple, list)):
        out = [_value(x, devices, label, memo) for x in v]
        if all(a is b for a, b in zip(out, v)):
            return v
        return type(v)(*out) if hasattr(v, "_fields") else type(v)(out)  # namedtuples too
    return v


def _jaxpr(jaxpr: Jaxpr, devices, label, memo) -> Jaxpr:
    if ("jaxpr", id(jaxpr)) not in memo:
        eqns = [e if (p := _params(e.params, devices, label, memo)) is e.params
                else e.replace(params=p) for e in jaxpr.eqns]
        new = jaxpr if all(a is b for a, b in zip(eqns, jaxpr.eqns)) else jaxpr.replace(eqns=eqns)
        memo[("jaxpr", id(jaxpr))] = (jaxpr, new)  # the jaxpr kept alive: ids stay its own
    return memo[("jaxpr", id(jaxpr))][1]


def _params(params: dict, devices, label, memo) -> dict:
    out = {k: _value(v, devices, label, memo) for k, v in params.items()}
    return params if all(out[k] is params[k] for k in params) else out


def rebuild(value, devices: Sequence, label: str):
    """`value` (a Mesh, a NamedSharding, a jaxpr, tuples of them) with each mesh not over
    `devices` (those of the target named `label`) rebuilt on them.

    Raises:
      MeshError: a mesh with more devices than `devices`.
    """
    return _value(value, tuple(devices), label, {})


def params(params: dict) -> dict:
    """An equation's bind params with every mesh over devices not the target's rebuilt
    on the target's (outside `retargeting`: unchanged).

    Raises:
      MeshError: a mesh with more devices than the target has.
    """
    state = _TARGET.get()
    return params if state is None else _params(params, *state)


def meshes(value) -> list[Mesh]:
    """The concrete meshes `value` (a jaxpr, or one equation's params: a dict) names,
    inner jaxprs included, largest first."""
    found: dict[int, Mesh] = {}

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, Mesh):
            found.setdefault(id(v), v)
        elif isinstance(v, NamedSharding) and isinstance(v.mesh, Mesh):
            found.setdefault(id(v.mesh), v.mesh)
        elif isinstance(v, (ClosedJaxpr, Jaxpr)):
            for e in (v.jaxpr if isinstance(v, ClosedJaxpr) else v).eqns:
                for x in e.params.values():
                    walk(x)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)

    walk(value)
    return sorted((m for m in found.values() if m.axis_names), key=lambda m: -m.size)


__all__ = ["check_stays", "describe", "meshes", "params", "rebuild", "retargeting",
           "shard_map_mesh"]
