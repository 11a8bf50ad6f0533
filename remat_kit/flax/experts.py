"""The expert axis: a mesh axis a mixture of experts' weights are split over (MaxText's
`expert`, `ici_expert_parallelism`), checked against the number of experts before the model
is traced (a `shard_map` over it would fail deep in JAX). How its all-to-alls are priced:
docs/policies.md ("Expert parallelism").
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from remat_kit.errors import MeshError
from remat_kit.flax.placement import own_sharding

EXPERT_AXIS = "expert"


def check_axis(path: str, names, shape: tuple, mesh: Mesh | None) -> None:
    """Raises MeshError, in one line naming both, where parameter `path` (of `shape`, its
    per-dimension mesh-axis `names` on `mesh`) splits a dimension over `EXPERT_AXIS` and
    that axis is larger than the dimension (its experts) or does not divide it. Nothing
    where the parameter names no mesh or no expert axis."""
    if mesh is None or not names or EXPERT_AXIS not in mesh.shape:
        return
    for n, dim in zip(names, shape):
        if EXPERT_AXIS not in ((n,) if isinstance(n, str) else tuple(n or ())):
            continue
        size = mesh.shape[EXPERT_AXIS]
        if size > dim or dim % size:
            fits = [k for k in range(1, dim + 1) if dim % k == 0]
            raise MeshError(f"expert axis {EXPERT_AXIS!r} of {size} devices splits the {dim} "
                            f"experts of parameter {path} {list(shape)}: {size} "
                            f"{'is larger than' if size > dim else 'does not divide'} {dim}; "
                            f"give an expert axis of {fits}")


def check(params) -> None:
    """`check_axis` on every leaf of `params` (arrays, ShapeDtypeStructs, or NNX
    Variables holding them) that carries its own `NamedSharding`.

    Raises:
      MeshError: as `check_axis`.
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in leaves:
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf
        if (found := own_sharding(value)) is not None:
            where = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                             for k in path if getattr(k, "name", None) != "value")
            check_axis(where, tuple(found.spec), tuple(value.shape), found.mesh)


__all__ = ["EXPERT_AXIS", "check", "check_axis"]
