"""A model's own partitioning: where its parameters and its batch go on a mesh.

`annotations` reads it wherever the model keeps it, in this order of trust: a `NamedSharding`
on a parameter's own array, logical names with the rules of the boxes, the model or its
`config`, `nn.logical_axis_rules` in effect or the user's, then mesh axes named directly.
`resolve` puts it together with a `--mesh` for the axes it leaves open.
The rules it follows: docs/meshes.md ("A model's own partitioning").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
from collections.abc import Iterator

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit import mesh as rk_mesh
from remat_kit.errors import MeshError
from remat_kit.trace import retarget

# Mesh axis names that split the batch where the rules name no batch axis: `expert` too, as
# MaxText's rules put it in `activation_batch` (outside the expert layers, expert parallelism
# is data parallelism).
DATA_AXES = ("data", "fsdp", "expert")

_BOXES = (nn.LogicallyPartitioned, nn.Partitioned, nnx.Variable)

# How a parameter was placed (`Annotations.sources`), as a caption says it.
SOURCES = {"sharding": "their own NamedShardings", "logical": "their logical names",
           "axes": "the mesh axes they name"}


def _is_box(x) -> bool:
    return isinstance(x, _BOXES)


def own_sharding(x) -> NamedSharding | None:
    """The `NamedSharding` an array or ShapeDtypeStruct carries over a mesh of
    several devices, else None (one device, no sharding, an abstract mesh)."""
    found = getattr(x, "sharding", None)
    if isinstance(found, NamedSharding) and isinstance(found.mesh, Mesh) \
            and found.mesh.size > 1:
        return found
    return None


@dataclasses.dataclass(frozen=True)
class Annotations:
    """What a model says of its own partitioning.

    Attributes:
      names: a tree like the parameters of per-dimension names (a tuple, None
        per unnamed dimension) or None (the parameter names nothing); logical
        names where `logical`, else mesh axes.
      logical: per leaf (same tree), whether its names are logical ones.
      rules: the model's logical-axis rules, or None where it sets none.
      mesh: the model's own mesh (on its boxes or its arrays' shardings), or None.
      sources: per leaf (same tree), a `SOURCES` key or None (nothing said).
      rules_from: where `rules` came from ("the parameters' metadata", "the
        model's config", "nn.logical_axis_rules", "the given rules"), or None.
      paths: per leaf (same tree), its path in the parameters ("layers/mlp/wi").
    """

    names: object
    logical: object
    rules: tuple | None
    mesh: Mesh | None
    sources: object = None
    rules_from: str | None = None
    paths: object = None

    @property
    def any(self) -> bool:
        return any(n is not None for n in jax.tree.leaves(
            self.names, is_leaf=lambda x: x is None or isinstance(x, tuple)))


@dataclasses.dataclass(frozen=True)
class _Found:
    """What one parameter leaf says (`_leaf`); logical None: logical where rules are
    found (NNX metadata names either)."""

    names: tuple | None
    logical: bool | None
    rules: tuple | None
    mesh: Mesh | None
    source: str | None


def _leaf(box) -> _Found:
    """What one parameter leaf says of its placement: its array's own
    `NamedSharding` first, else its box's names."""
    value = box.get_value() if isinstance(box, nnx.Variable) else getattr(box, "value", box)
    own = own_sharding(value)
    if own is not None:
        spec = tuple(own.spec) + (None,) * (len(value.shape) - len(own.spec))
        return _Found(spec, False, None, own.mesh, "sharding")
    if isinstance(box, nn.LogicallyPartitioned):
        return _Found(tuple(box.names), True, box.rules, box.mesh, "logical")
    if isinstance(box, nn.Partitioned):
        return _Found(tuple(box.names), False, None, box.mesh, "axes")
    if isinstance(box, nnx.Variable):
        meta = box.get_metadata()
        names = meta.get("out_sharding") or meta.get("sharding")
        rules = meta.get("sharding_rules") or None
        mesh = meta.get("mesh") if isinstance(meta.get("mesh"), Mesh) else None
        return _Found(tuple(names) if names else None, True if rules else None, rules, mesh,
                      None if not names else "logical" if rules else "axes")
    return _Found(None, False, None, None, None)


def model_rules(model) -> tuple | None:
    """The logical-axis rules a model keeps on itself: a `logical_axis_rules`
    attribute of the model or of its `config` (MaxText's `Transformer.config`), or
    of the first NNX submodule that has one; None where none does."""
    nodes = [model] + ([n for _, n in nnx.iter_graph(model)]
                       if isinstance(model, nnx.Module) else [])
    for node in nodes:
        for owner in (node, getattr(node, "config", None)):
            rules = getattr(owner, "logical_axis_rules", None)
            if rules and not callable(rules):
                return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                             for name, axes in rules)
    return None


def check_rules(rules, where: str) -> tuple:
    """`rules` as a tuple of (logical name, mesh axes) pairs.

    Raises:
      MeshError: an entry that is not such a pair, or a logical name mapped twice
        (one line naming it and `where`)."""
    seen: dict[str, object] = {}
    for entry in rules:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2
                and isinstance(entry[0], str)):
            raise MeshError(f"{where}: a rule must be (logical name, mesh axes), "
                            f"got {entry!r:.60}")
        name, axes = entry
        if name in seen:
            raise MeshError(f"{where}: logical axis {name!r} is mapped twice ({seen[name]!r} "
                            f"and {axes!r}); map each logical name once")
        seen[name] = axes
    return tuple((n, tuple(a) if isinstance(a, list) else a) for n, a in rules)


def read_rules(path: str) -> tuple:
    """The logical-axis rules of a JSON file (`--rules`): a list of [logical name, mesh
    axes] pairs (axes a name, a list of names, or null), or {"logical_axis_rules": that
    list}, as MaxText's configs write them.

    Raises:
      MeshError: the file is missing or not JSON, or as `check_rules`."""
    where = f"rules file {path!r}"
    try:
        with open(path) as f:
            loaded = json.load(f)
    except OSError as e:
        raise MeshError(f"{where}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise MeshError(f"{where} is not JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(loaded, dict):
        loaded = loaded.get("logical_axis_rules")
    if not isinstance(loaded, list):
        raise MeshError(f"{where}: expected a list of [logical name, mesh axes] pairs, or "
                        "{\"logical_axis_rules\": [...]}")
    return check_rules(loaded, where)


# Rules and batch axes the user gave (--rules, --batch-axes) to models built inside `given`.
_GIVEN: contextvars.ContextVar[tuple] = contextvars.ContextVar("remat_kit_given",
                                                               default=(None, None))


@contextlib.contextmanager
def given(rules: tuple | None = None, batch_axes: tuple[str, ...] | None = None
          ) -> Iterator[None]:
    """Inside: `remat_kit.flax.from_model.workload` takes `rules` and `batch_axes` where
    its call gives none (the CLI's --rules and --batch-axes)."""
    token = _GIVEN.set((rules, batch_axes))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def given_now() -> tuple:
    """(rules, batch_axes) of the enclosing `given`, else (None, None)."""
    return _GIVEN.get()


def _path_text(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def annotations(params, own_rules=None, given_rules=None) -> Annotations:
    """The `Annotations` of a model's parameters: linen's boxed ones (`init`'s
    "params", boxes kept), NNX's `nnx.Param` state (`nnx.split`), or arrays /
    ShapeDtypeStructs that carry a `NamedSharding`. The rules are the boxes'
    own, else `own_rules` (`model_rules`), else `nn.get_logical_axis_rules()`
    (the enclosing `nn.logical_axis_rules`), else `given_rules` (the user's).

    Raises:
      MeshError: the parameters carry different meshes.
    """
    found = jax.tree_util.tree_map_with_path(lambda p, x: (_path_text(p), _leaf(x)), params,
                                             is_leaf=_is_box)
    is_found = lambda x: (isinstance(x, tuple) and len(x) == 2  # noqa: E731
                          and isinstance(x[1], _Found))
    leaves = [f for _, f in jax.tree.leaves(found, is_leaf=is_found)]
    boxes = next((tuple(f.rules) for f in leaves if f.rules), None)
    rules, rules_from = next(((tuple(r), label) for r, label in (
        (boxes, "the parameters' metadata"), (own_rules, "the model's config"),
        (tuple(nn.get_logical_axis_rules()), "nn.logical_axis_rules"),
        (given_rules, "the given rules")) if r), (None, None))

    def logical(f: _Found) -> bool:
        return bool(rules) if f.logical is None else f.logical

    def source(f: _Found) -> str | None:
        return "logical" if f.logical is None and rules and f.names else f.source

    meshes = {f.mesh: None for f in leaves if f.mesh is not None}
    if len(meshes) > 1:
        raise MeshError("the model's parameters name "
                        f"{len(meshes)} different meshes "
                        f"({'; '.join(retarget.describe(m) for m in meshes)}); "
                        "build them all over one mesh")
    pick = lambda fn: jax.tree.map(lambda x: fn(x[1]), found, is_leaf=is_found)  # noqa: E731
    return Annotations(pick(lambda f: f.names), pick(logical), rules, next(iter(meshes), None),
                       pick(source), rules_from, jax.tree.map(lambda x: x[0], found,
                                                             is_leaf=is_found))


def described(found: Annotations, mesh: Mesh) -> tuple[str, tuple[str, ...]]:
    """(how the parameters were placed, for a caption: "parameters by their own
    NamedShardings"; notes naming the parameters nothing placed, where others are)."""
    sources = jax.tree.leaves(found.sources, is_leaf=lambda x: x is None)
    paths = jax.tree.leaves(found.paths)
    counts = {k: sources.count(k) for k in SOURCES if k in sources}
    if not counts:
        return "parameters whole on every device (the model names no sharding)", ()
    parts = [SOURCES[k] + (f" and the rules of {found.rules_from}" if k == "logical"
                           and found.rules_from else "")
             + (f" ({n} of {len(sources)})" if len(counts) > 1 or n < len(sources) else "")
             for k, n in counts.items()]
    bare = [p for p, s in zip(paths, sources) if s is None]
    notes = (f"{len(bare)} parameter{'s' if len(bare) > 1 else ''} the model gives no "
             f"sharding, whole on every device of {rk_mesh.spec_text(mesh)}: "
             f"{', '.join(bare[:4])}{', ...' if len(bare) > 4 else ''}",) if bare else ()
    return "parameters by " + "; ".join(parts), notes


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
    batch_from: str = ""

    def batch_size(self) -> int:
        """How many ways the batch is split."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def batch_text(self, batch: int) -> str:
        """The batch's placement for a caption: "batch 8 over data,fsdp (the model's
        rules): 2 per device", or "batch 8 whole on every device"."""
        split = self.batch_size()
        if split == 1:
            return f"batch {batch} whole on every device"
        axes = ",".join(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        return (f"batch {batch} over {axes} ({self.batch_from}): {batch // split} "
                f"per device")


def _restrict(rules, mesh: Mesh) -> tuple:
    """`rules` with the mesh axes `mesh` lacks dropped (MaxText's rules name more
    axes than one mesh has)."""
    out = []
    for logical, axes in rules:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                     if a in mesh.shape)
        out.append((logical, kept[0] if len(kept) == 1 else (kept or None)))
    return tuple(out)


def _batch_axes(rules, mesh: Mesh, asked: tuple[str, ...] | None) -> tuple[tuple, str]:
    """(the mesh axes that split the batch, where they came from): the axes the rules
    give the logical axis `batch` (or the first with "batch" in its name, MaxText's
    `activation_embed_and_logits_batch`, as its input sharding splits it), else
    `asked` (`--batch-axes`), else `DATA_AXES`."""
    entry = next((axes for logical, axes in rules if logical == "batch"), None) or next(
        (axes for logical, axes in rules if "batch" in logical and axes), None)
    if entry:
        return ((entry,) if isinstance(entry, str) else tuple(entry)), "the model's rules"
    if asked:
        return tuple(asked), "--batch-axes"
    return tuple(a for a in mesh.axis_names if a in DATA_AXES), "the data axes"


def check_batch_axes(asked, mesh: Mesh) -> None:
    """Raises MeshError, in one line, where `asked` (`--batch-axes`) names an axis
    `mesh` lacks, naming it and the mesh's axes."""
    for axis in asked or ():
        if axis not in mesh.shape:
            raise MeshError(f"--batch-axes names mesh axis {axis!r}, which mesh "
                            f"{rk_mesh.spec_text(mesh)} lacks; its axes: "
                            f"{list(mesh.axis_names)}")


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
            batch: int, batch_axes: tuple[str, ...] | None = None) -> Placement | None:
    """The `Placement` of a model on its own mesh or `mesh` (`--mesh`); None
    where neither spans several devices.

    Args:
      found: the model's `annotations`.
      own_mesh: a mesh the model's code names (`retarget.meshes` of its trace),
        or None; its boxes' mesh comes first.
      mesh: the mesh asked for (`--mesh`), a `rk_mesh.Fallback` (a TPU target's
        chips where nothing is asked: the model's own mesh replaces it), or None.
      batch: the global batch size.
      batch_axes: the mesh axes to split the batch over where the model's rules
        name none (`--batch-axes`), or None (`DATA_AXES`).
    Raises:
      MeshError: in one line, saying how to build the model for the mesh: a
        `mesh` other than the model's own (both named); a mesh axis the model's
        rules do not know (it would split nothing); a batch the batch axes of
        `mesh` do not split (on the model's own mesh such a batch stays whole,
        with a note); `batch_axes` naming an axis the mesh lacks.
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
    check_batch_axes(batch_axes, use)
    batch_axes, batch_from = _batch_axes(rules if found.rules else (), use, batch_axes)
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
        return Placement(use, rules, batch_axes, batch_from=batch_from)
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


__all__ = ["Annotations", "Placement", "SOURCES", "annotations", "check_batch_axes",
           "check_rules", "described", "given", "given_now", "model_rules", "own_sharding", "place",
           "read_rules", "reshaped_kernels", "resolve", "tracing", "unboxed"]
