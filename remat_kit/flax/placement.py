"""A model's own partitioning: where its parameters and its batch go on a mesh.

`resolve` reads a model's partitioning (linen `nn.with_logical_partitioning` / `with_partitioning`,
NNX `nnx.with_partitioning`, its own mesh and logical-axis rules) and puts it together with a
`--mesh` for the axes it leaves open: the mesh, the rules, each parameter's sharding and the
batch's, as a training codebase places a step it compiles ahead of time.
The rules it follows: docs/meshes.md ("A model's own partitioning").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit import mesh as rk_mesh
from remat_kit.errors import MeshError
from remat_kit.trace import retarget

# Mesh axis names that split the batch where the rules name no batch axis.
DATA_AXES = ("data", "fsdp")

_BOXES = (nn.LogicallyPartitioned, nn.Partitioned, nnx.Variable)


def _is_box(x) -> bool:
    return isinstance(x, _BOXES)


@dataclasses.dataclass(frozen=True)
class Annotations:
    """What a model says of its own partitioning.

    Attributes:
      names: a tree like the parameters of per-dimension names (a tuple, None
        per unnamed dimension) or None (the parameter names nothing); logical
        names where `logical`, else mesh axes.
      logical: per leaf (same tree), whether its names are logical ones.
      rules: the model's logical-axis rules, or None where it sets none.
      mesh: the model's own mesh (on its boxes), or None.
    """

    names: object
    logical: object
    rules: tuple | None
    mesh: Mesh | None

    @property
    def any(self) -> bool:
        return any(n is not None for n in jax.tree.leaves(
            self.names, is_leaf=lambda x: x is None or isinstance(x, tuple)))


def _leaf(box) -> tuple:
    """(names, logical, rules, mesh) of one parameter leaf."""
    if isinstance(box, nn.LogicallyPartitioned):
        return tuple(box.names), True, box.rules, box.mesh
    if isinstance(box, nn.Partitioned):
        return tuple(box.names), False, None, box.mesh
    if isinstance(box, nnx.Variable):
        meta = box.get_metadata()
        names = meta.get("out_sharding") or meta.get("sharding")
        rules = meta.get("sharding_rules") or None
        logical = bool(rules) or bool(nn.get_logical_axis_rules())
        return (tuple(names) if names else None), logical, rules, meta.get("mesh")
    return None, False, None, None


def annotations(params) -> Annotations:
    """The `Annotations` of a model's parameters: linen's boxed ones (`init`'s
    "params", boxes kept) or NNX's `nnx.Param` state (`nnx.split`). Rules on no
    box are read from `nn.get_logical_axis_rules()` (the enclosing
    `nn.logical_axis_rules`, or `nn.set_logical_axis_rules`'s).

    Raises:
      MeshError: the boxes carry different meshes.
    """
    found = jax.tree.map(_leaf, params, is_leaf=_is_box)
    is_found = lambda x: (isinstance(x, tuple) and len(x) == 4  # noqa: E731
                          and isinstance(x[1], bool))
    leaves = jax.tree.leaves(found, is_leaf=is_found)
    names = jax.tree.map(lambda f: f[0], found, is_leaf=is_found)
    logical = jax.tree.map(lambda f: f[1], found, is_leaf=is_found)
    rules = next((tuple(f[2]) for f in leaves if f[2]), None) or (
        tuple(nn.get_logical_axis_rules()) or None)
    meshes = {id(f[3]): f[3] for f in leaves if isinstance(f[3], Mesh)}
    if len(meshes) > 1:
        raise MeshError("the model's parameters name "
                        f"{len(meshes)} different meshes "
                        f"({'; '.join(retarget.describe(m) for m in meshes.values())}); "
                        "build them all over one mesh")
    return Annotations(names, logical, rules, next(iter(meshes.values()), None))


def unboxed(tree):
    """`nn.unbox(tree)` without the sharding constraint a box over a mesh of its own
    applies (abstract values outside a trace take none)."""
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False)
                        if isinstance(x, (nn.LogicallyPartitioned, nn.Partitioned)) else x,
                        tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model's arguments go: `mesh`, `rules` (restricted to the mesh's
    axes), the mesh axes that split the batch, and a note for the report where
    the batch stays whole."""

    mesh: Mesh
    rules: tuple
    batch_axes: tuple[str, ...]
    note: str = ""

    def batch_size(self) -> int:
        """How many ways the batch is split."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)


def _restrict(rules, mesh: Mesh) -> tuple:
    """`rules` with the mesh axes `mesh` lacks dropped (MaxText's rules name more
    axes than one mesh has)."""
    out = []
    for logical, axes in rules:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                     if a in mesh.shape)
        out.append((logical, kept[0] if len(kept) == 1 else (kept or None)))
    return tuple(out)


def _batch_axes(rules, mesh: Mesh) -> tuple[str, ...]:
    entry = next((axes for logical, axes in rules if logical == "batch"), None) or next(
        (axes for logical, axes in rules if "batch" in logical and axes), None)
    if entry:
        return (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in mesh.axis_names if a in DATA_AXES)


def _named_axes(found: Annotations) -> set[str]:
    """The mesh axes the parameters name directly (`nn.with_partitioning`, NNX's mesh-axis
    `sharding=`), not through logical-axis rules."""
    is_names = lambda x: x is None or isinstance(x, tuple)  # noqa: E731
    return {a for names, logical in zip(jax.tree.leaves(found.names, is_leaf=is_names),
                                        jax.tree.leaves(found.logical))
            if names and not logical
            for n in names for a in ((n,) if isinstance(n, str) else n or ())}


def _model_text(mesh: Mesh) -> str:
    return f"the model builds its own mesh ({retarget.describe(mesh)})"


def resolve(found: Annotations, own_mesh: Mesh | None, mesh: "Mesh | rk_mesh.Fallback | None",
            batch: int) -> Placement | None:
    """The `Placement` of a model on its own mesh or `mesh` (`--mesh`); None
    where neither spans several devices.

    Args:
      found: the model's `annotations`.
      own_mesh: a mesh the model's code names (`retarget.meshes` of its trace),
        or None; its boxes' mesh comes first.
      mesh: the mesh asked for (`--mesh`), a `rk_mesh.Fallback` (a TPU target's
        chips where nothing is asked: the model's own mesh replaces it), or None.
      batch: the global batch size.
    Raises:
      MeshError: in one line, saying how to build the model for the mesh: a
        `mesh` other than the model's own (both named); a mesh axis the model's
        rules do not know (it would split nothing); a batch the batch axes of
        `mesh` do not split (on the model's own mesh such a batch stays whole,
        with a note).
    """
    own = found.mesh or own_mesh
    if isinstance(mesh, rk_mesh.Fallback):
        mesh = None if own is not None else mesh.mesh
    mesh = rk_mesh.spanning(mesh)  # data:1: nothing asked
    if own is not None and mesh is not None and dict(mesh.shape) != dict(own.shape):
        raise MeshError(f"{_model_text(own)} and --mesh asks for {rk_mesh.spec_text(mesh)}: "
                        f"drop --mesh to measure on the model's own, or give --mesh "
                        f"{rk_mesh.spec_text(own)}; or build the model over "
                        f"{rk_mesh.spec_text(mesh)}")
    use = rk_mesh.spanning(own or mesh)
    if use is None:
        return None
    rules = _restrict(found.rules, use) if found.rules else rk_mesh.rules(use.shape)
    batch_axes = _batch_axes(rules, use)
    known = set(batch_axes) | _named_axes(found) | {
        a for _, axes in rules for a in ((axes,) if isinstance(axes, str) else axes or ())}
    unknown = [a for a, n in use.shape.items() if n > 1 and a not in known]
    if unknown and not found.rules and own is None:  # --mesh names an axis nothing uses
        usable = sorted(_named_axes(found) | set(rk_mesh.AXES))
        raise MeshError(f"mesh {rk_mesh.spec_text(use)}: mesh axis {unknown[0]!r} is named by "
                        f"no parameter of the model and no logical-axis rule, so it would split "
                        f"nothing; the axes it can use: {usable}")
    if unknown and found.rules:
        names = sorted({a for _, axes in found.rules
                        for a in ((axes,) if isinstance(axes, str) else axes or ())})
        where = _model_text(use) if own is not None else f"mesh {rk_mesh.spec_text(use)}"
        raise MeshError(f"{where}: mesh axis {unknown[0]!r} is not in the model's "
                        f"logical-axis rules, which map to mesh axes {names}; build the mesh "
                        f"from those axes (e.g. --mesh {names[0]}:{use.size})")
    split = Placement(use, rules, batch_axes).batch_size()
    if batch % split == 0:
        return Placement(use, rules, batch_axes)
    text = (f"batch {batch} does not split over the {split} devices of mesh axes "
            f"{list(batch_axes)} ({rk_mesh.spec_text(use)})")
    if own is None:
        raise MeshError(f"{text}; give a batch that is a multiple of {split}")
    # The model's own mesh is as it built it: the tokens go whole, as its code takes them.
    return Placement(use, rules, (),
                     note=f"{text}: the tokens are whole on every device of the model's mesh")


def _spec(names, logical: bool, rules, shape, mesh: Mesh) -> PartitionSpec:
    if names is None:
        return PartitionSpec()
    if logical:
        axes = list(nn.logical_to_mesh_axes(names, rules))  # a name no rule maps: whole
    else:
        axes = [a if a is None or all(x in mesh.shape for x in ((a,) if isinstance(a, str)
                                                                 else a)) else None
                for a in names]
    return rk_mesh.divisible_spec(PartitionSpec(*axes), shape, mesh)


def place(found: Annotations, placement: Placement, args):
    """(params, batch, rest) as ShapeDtypeStructs on `placement.mesh`: each
    parameter as its names map, every leaf of the batch (the tokens, or a model's
    images and labels) split over the batch axes along its first dimension, the
    rest whole."""
    params, tokens, rest = args
    mesh, is_names = placement.mesh, (lambda x: x is None or isinstance(x, tuple))

    def one(names, logical, x):
        spec = _spec(names, logical, placement.rules, x.shape, mesh)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    leaves, tree = jax.tree.flatten(params)  # NNX's Variables kept around their values
    placed = tree.unflatten(one(n, lg, x) for n, lg, x in zip(
        jax.tree.leaves(found.names, is_leaf=is_names), jax.tree.leaves(found.logical), leaves))
    axes = placement.batch_axes
    batch = PartitionSpec(axes[0] if len(axes) == 1 else (tuple(axes) or None))
    whole = NamedSharding(mesh, PartitionSpec())
    at = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    split = NamedSharding(mesh, batch)
    return (placed, jax.tree.map(lambda x: at(x, split), tokens),  # a batch of several inputs too
            jax.tree.map(lambda x: at(x, whole), rest))


@contextlib.contextmanager
def reshaped_kernels() -> Iterator[None]:
    """Inside: a partitioning box (`nn.LogicallyPartitioned`, `nn.Partitioned`)
    applies no sharding constraint to a value of another rank than its names.

    Flax's `nn.DenseGeneral` builds its kernel flat (2-D) with the model's
    boxed initializer and reshapes it after, so a kernel named by 3 logical
    axes (MaxText's attention: ("embed", "heads", "kv")) is first constrained
    by 3 names as a 2-D array, which fails under a mesh (google/flax#3676).
    `Module.param` runs that initializer in `apply` too, under `jax.eval_shape`
    only to check the parameter's shape, so the constraint is none of the
    step's program: skipping it leaves the kernel 3-D, placed by its 3 names
    (`place`), as the model says.
    """
    # Flax has no hook into DenseGeneral's initializer: the boxes' classes are
    # patched only while the model is traced.
    originals = {cls: cls.unbox for cls in (nn.LogicallyPartitioned, nn.Partitioned)}

    def patched(cls):
        def unbox(self, apply_constraint=True):
            fits = len(self.names) == len(getattr(self.value, "shape", self.names))
            return originals[cls](self, apply_constraint=apply_constraint and fits)
        return unbox

    try:
        for cls in originals:
            cls.unbox = patched(cls)
        yield
    finally:
        for cls, unbox in originals.items():
            cls.unbox = unbox


@contextlib.contextmanager
def tracing(placement: Placement | None) -> Iterator[None]:
    """Context in which a model is traced as its training step traces it: its
    logical-axis rules set and its mesh the context mesh (`jax.set_mesh`), so
    its own `nn.with_logical_constraint`s apply, and its `reshaped_kernels`
    taken as their names say. A no-op for None."""
    if placement is None:
        yield
        return
    with jax.set_mesh(placement.mesh), nn.logical_axis_rules(placement.rules), \
            reshaped_kernels():
        yield


__all__ = ["Annotations", "Placement", "annotations", "place", "reshaped_kernels", "resolve",
           "tracing", "unboxed"]
