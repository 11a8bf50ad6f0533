"""Device meshes, logical-axis sharding rules and multi-process start.

`make("data:2,fsdp:2,tensor:2")` builds a mesh; inside `use(mesh)` the models' activation
constraints (`constrain`) apply, before their `checkpoint_name` tags. `RULES` maps the logical
axes (`LOGICAL_AXES`, MaxText's names) to the mesh `AXES`; `shardings`, `batch_sharding`,
`replicated` give NamedShardings; `initialize` starts JAX's distributed runtime.
Axes (data, FSDP/ZeRO-3, Megatron tensor: Shoeybi et al. 2019): docs/meshes.md ("Sharded").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from remat_kit.errors import MeshError, closest_choice

AXES = ("data", "fsdp", "tensor")
LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers")

# Logical axis -> mesh axes, in Flax's priority order (first free rule wins).
# MaxText's base.yml rules, cut down to the three mesh axes above; `kv` is
# the per-head dimension and `layers` the stacked axis of a scanned layer
# stack, both whole on every device.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("length", None),
    ("kv", None),
    ("layers", None),
)

# Creating more host devices than this takes minutes (8192: about a minute).
MAX_DEVICES = 1024

_TERM = re.compile(r"^([A-Za-z_]\w*):(\d+)$", re.ASCII)


def spec_text(mesh: "Mesh | Mapping[str, int] | None") -> str | None:
    """The spec string of a mesh or {axis: size}, axes in order ("data:2,fsdp:2",
    the inverse of `parse_spec`); None for None."""
    if mesh is None:
        return None
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return ",".join(f"{k}:{v}" for k, v in shape.items())


def parse_spec(spec: "str | Mapping[str, int]") -> dict[str, int]:
    """'data:2,fsdp:2,tensor:2' -> {"data": 2, "fsdp": 2, "tensor": 2}, in spec order.

    A {axis: size} mapping goes through the same checks and comes back as a
    dict, so both forms of `make` accept and refuse the same meshes.

    Any axis name (a Python identifier) is a mesh axis: `AXES` are the ones the
    reference models and `RULES` shard over (`check_fits` refuses others for
    them), and a model's own logical-axis rules may map to any other.

    Raises:
      MeshError: empty spec, a term not AXIS:N, an axis that is not an
        identifier, an axis given twice, a size that is not an int >= 1, a
        product of sizes above `MAX_DEVICES`, or a spec that is neither a
        string nor a mapping.
    """
    if isinstance(spec, Mapping):
        shown, terms = repr(dict(spec)), list(spec.items())
    elif isinstance(spec, str) and spec.strip():
        shown, terms = repr(spec), []
        for term in spec.replace(" ", "").split(","):
            m = _TERM.match(term)
            if not m:
                raise MeshError(f"mesh spec {spec!r}: term {term!r} is not AXIS:N with AXIS a "
                                f"name (e.g. {', '.join(AXES)}) and N a positive int")
            terms.append((m.group(1), int(m.group(2))))
    else:
        raise MeshError(f"mesh spec must be AXIS:N[,AXIS:N...] or {{AXIS: N}} with AXIS a "
                        f"name (e.g. {', '.join(AXES)}), got {spec!r}")
    if not terms:
        raise MeshError(f"mesh spec {shown} names no axis; give AXIS:N, e.g. data:2")
    sizes: dict[str, int] = {}
    for axis, n in terms:
        if not isinstance(axis, str) or not axis.isidentifier():
            raise MeshError(f"mesh spec {shown}: unknown axis {axis!r}; an axis is a name "
                            f"such as {', '.join(AXES)}")
        if axis in sizes:
            raise MeshError(f"mesh spec {shown}: axis {axis!r} is given twice")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise MeshError(f"mesh spec {shown}: axis {axis!r} has size {n!r}; sizes are ints "
                            ">= 1")
        sizes[axis] = int(n)
    if math.prod(sizes.values()) > MAX_DEVICES:
        raise MeshError(f"mesh spec {shown} needs {math.prod(sizes.values())} devices, more "
                        f"than the {MAX_DEVICES} supported")
    return sizes


def _product_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a} {n}" for a, n in sizes.items())


def make(spec: "str | Mapping[str, int]", devices: Sequence | None = None) -> Mesh:
    """A `jax.sharding.Mesh` for a spec such as "data:2,fsdp:2,tensor:2".

    Built with `jax.make_mesh` (a device order that suits the hardware) with
    Auto axis types, so XLA's SPMD partitioner propagates shardings from the
    arguments and `with_sharding_constraint`s.

    Args:
      spec: a spec string or {axis: size}, both checked by `parse_spec`.
      devices: the devices to use, default all of `jax.devices()` (every
        process's, under `jax.distributed`).
    Raises:
      MeshError: a bad spec (`parse_spec`), or a product of sizes other than
        the number of devices; the message names both numbers and, on CPU,
        the XLA flag that creates host devices; a device given twice.
      TypeError: `devices` is not a list of jax devices.
    """
    sizes = parse_spec(spec)
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (Iterable, type(None))):
        raise TypeError(f"rk.mesh.make: devices must be a list of jax devices (e.g. "
                        f"jax.devices()[:4]), got {devices!r}")
    devices = list(jax.devices() if devices is None else devices)
    bad = next((d for d in devices if not hasattr(d, "platform")), None)
    if bad is not None:
        raise TypeError(f"rk.mesh.make: devices must be jax devices (jax.devices()), got {bad!r}")
    need = math.prod(sizes.values())
    repeated = next((d for i, d in enumerate(devices) if d in devices[:i]), None)
    if repeated is not None:
        raise MeshError(f"rk.mesh.make: device {repeated} is given twice; a mesh takes "
                        "distinct devices")
    if need != len(devices):
        hint = (f"; on CPU start with XLA_FLAGS=--xla_force_host_platform_device_count={need}"
                if devices and devices[0].platform == "cpu" and need > len(devices) else "")
        kind = f" {devices[0].platform}" if devices else ""
        raise MeshError(f"mesh {_product_text(sizes)} needs {need} devices, but "
                        f"{len(devices)}{kind} devices are given{hint}")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices,
                         axis_types=(AxisType.Auto,) * len(sizes))


def _shape(mesh: "Mesh | Mapping[str, int]") -> Mapping[str, int]:
    return mesh.shape if isinstance(mesh, Mesh) else parse_spec(mesh)


def _mesh(mesh, where: str) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where} takes a jax.sharding.Mesh, e.g. "
                        f"rk.mesh.make('data:2,tensor:4'), got {mesh!r}")
    return mesh


def rules(mesh: "Mesh | Mapping[str, int]") -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """`RULES` restricted to the axes of `mesh` (a Mesh or {axis: size}); a
    rule's missing axes are dropped."""
    out = []
    for logical, axes in RULES:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ())
                     if a in _shape(mesh))
        out.append((logical, kept[0] if len(kept) == 1 else (kept or None)))
    return tuple(out)


def host_devices(n: int) -> None:
    """At least `n` CPU devices, if JAX has not started yet: sets the
    `jax_num_cpu_devices` option to n unless it, or XLA_FLAGS'
    --xla_force_host_platform_device_count, asks for as many already (a
    smaller count would take devices from a process that set more). Once
    JAX has started, nothing changes: `make` checks the devices there are."""
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                     os.environ.get("XLA_FLAGS", ""))
    if max(int(flag.group(1)) if flag else 1, jax.config.jax_num_cpu_devices) >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX already started


@dataclasses.dataclass(frozen=True)
class Fallback:
    """The mesh of a step where none is asked for: a TPU target's chips, data parallel
    (the CLI's default without --mesh). A model that builds a mesh of its own is measured
    on its own instead, without a word; a plain `Mesh` is an ask (--mesh) that a model's
    own mesh must equal (`remat_kit.flax.placement.resolve`)."""

    mesh: Mesh


def plain(mesh: "Mesh | Fallback | None") -> "Mesh | None":
    """The `Mesh` of a Mesh or `Fallback`; None for None."""
    return mesh.mesh if isinstance(mesh, Fallback) else mesh


def spanning(mesh: "Mesh | None") -> "Mesh | None":
    """`mesh` if it spans more than one device, else None: a program on one
    device has nothing to shard, and is itself the program each device runs
    (a one-chip target's data:1 mesh traces and measures as no mesh, same figures)."""
    return mesh if mesh is not None and mesh.size > 1 else None


def axis_size(mesh: "Mesh | Mapping[str, int] | None", logical: str) -> int:
    """How many ways `mesh` (a Mesh or {axis: size}) splits a logical axis
    ("batch" -> data x fsdp, "heads" -> tensor)."""
    if logical not in LOGICAL_AXES:
        raise MeshError(f"unknown logical axis {logical!r}; valid: {list(LOGICAL_AXES)}")
    if mesh is None:
        return 1
    axes = dict(rules(mesh))[logical]
    return math.prod(_shape(mesh)[a]
                     for a in ((axes,) if isinstance(axes, str) else axes or ()))


# The mesh `constrain` applies to. Not `jax.set_mesh`: under a global mesh Flax
# also constrains DenseGeneral's flattened kernel inside its initializer with
# the unflattened names, which fails (flax 0.12.12).
_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("remat_kit_mesh",
                                                                        default=None)


@contextlib.contextmanager
def use(mesh: Mesh | None) -> Iterator[None]:
    """Context in which the models' logical constraints (`constrain`) apply on
    `mesh`, with Flax's `nn.logical_axis_rules(rules(mesh))` set too. Enter it
    while tracing (jit, lower). A no-op for None. Raises TypeError for
    anything else that is not a Mesh (a spec string: build it with `make`)."""
    if mesh is None:
        yield
        return
    token = _CURRENT.set(_mesh(mesh, "rk.mesh.use"))
    try:
        with nn.logical_axis_rules(rules(mesh)):
            yield
    finally:
        _CURRENT.reset(token)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """`x` under the sharding its logical axis `names` get on the mesh of the
    enclosing `use` (`jax.lax.with_sharding_constraint` through
    `nn.with_logical_constraint`); `x` itself outside `use`."""
    mesh = _CURRENT.get()
    if mesh is None:
        return x
    return nn.with_logical_constraint(x, names, rules=rules(mesh), mesh=mesh)


def check_fits(mesh: "Mesh | Mapping[str, int] | None", cfg, batch: int | None) -> None:
    """Raises MeshError unless `mesh` (a Mesh or {axis: size}) can split a
    `TransformerConfig` (None: no model checks) and a global batch: batch by data x
    fsdp, query and key/value heads and mlp_dim by tensor; for a config, an axis of
    size > 1 other than `AXES` splits nothing and is refused. batch None (a --model's
    batch whose leaves share no leading axis) only a mesh without data-parallel devices
    takes. The message names the numbers.
    Dimensions that rules split but that need not divide (vocab, embed) are
    replicated instead (`shardings`)."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        mesh = parse_spec(mesh)
    n = axis_size(mesh, "batch")
    if batch is None and n > 1:
        raise MeshError(f"the batch's leaves share no leading (batch) axis, so it does not "
                        f"split over the {n} data-parallel devices of mesh "
                        f"{_product_text(_shape(mesh))} (data x fsdp = {n}); make every leaf "
                        "[batch, ...] or use a mesh without data and fsdp axes")
    if batch is not None and batch % n:
        raise MeshError(f"batch {batch} does not split over the {n} data-parallel devices of "
                        f"mesh {_product_text(_shape(mesh))} (data x fsdp = {n})")
    t = axis_size(mesh, "heads")
    if cfg is None:  # a model that is not ours: only the batch is ours to split
        return
    shape = _shape(mesh)
    other = next((a for a, size in shape.items() if a not in AXES and size > 1), None)
    if other is not None:
        hint = closest_choice(other, AXES)
        raise MeshError(f"mesh {spec_text(shape)}: unknown axis {other!r} for the reference "
                        f"models, which shard over {list(AXES)}"
                        + (f"; did you mean {hint!r}?" if hint else "")
                        + " (a --model's own logical-axis rules may name other axes)")
    for name, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads),
                        ("mlp_dim", cfg.mlp_dim)):
        if value % t:
            raise MeshError(f"{name}={value} is not divisible by the tensor axis of size {t} "
                            f"(mesh {_product_text(_shape(mesh))}): tensor parallelism splits "
                            f"the heads and the MLP")


def divisible_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with every mesh axis that does not divide its dimension dropped."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        out.append(axes if dim % math.prod(mesh.shape[a] for a in names) == 0 else None)
    return PartitionSpec(*out)


def shardings(boxed, mesh: Mesh):
    """NamedShardings for a tree with Flax logical-partitioning boxes.

    boxed: `model.init(...)["params"]`, a train state built from boxed
    parameters (optax keeps the boxes on its moments), or their
    `jax.eval_shape`; leaves are `nn.LogicallyPartitioned` or plain arrays
    (replicated). Returns a tree shaped like `nn.unbox(boxed)`. A dimension
    the rules split but its size does not divide (e.g. GPT-2's 50257-token
    vocabulary over tensor:2) stays whole.
    """
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed),
                               rules(_mesh(mesh, "rk.mesh.shardings")))
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, divisible_spec(spec, x.shape, mesh)),
                        specs, nn.unbox(boxed), is_leaf=lambda s: isinstance(s, PartitionSpec))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, ...] arrays split along batch over data x fsdp (the `batch` rule)."""
    return NamedSharding(mesh, PartitionSpec(dict(rules(_mesh(mesh, "rk.mesh.batch_sharding")))
                                             ["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device (PRNG keys, scalars)."""
    return NamedSharding(_mesh(mesh, "rk.mesh.replicated"), PartitionSpec())


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from host data that every process holds alike: each
    process transfers only the slices its own devices hold."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def per_device_config(cfg, mesh: "Mesh | Mapping[str, int] | None"):
    """The `TransformerConfig` one device computes under tensor parallelism:
    num_heads, num_kv_heads and mlp_dim divided by the tensor size, head_dim
    kept. Its activations at batch / (data x fsdp) are the per-device ones
    (embed-width activations are whole on every tensor rank: no sequence
    parallelism). Raises MeshError as `check_fits`."""
    t = axis_size(mesh, "heads")
    if t == 1:
        return cfg
    check_fits(mesh, cfg, axis_size(mesh, "batch"))
    return cfg.replace(num_heads=cfg.num_heads // t, num_kv_heads=cfg.kv_heads // t,
                       head_dim=cfg.heads_dim, mlp_dim=cfg.mlp_dim // t)


def origin(mesh: Mesh, label: str) -> str:
    """Where a step's mesh came from, for a caption: "the model's own mesh (5 axes
    stage:1,replica:1,shard:2,model:2,expert:1; device order [0, 2, 1, 3])" for label
    "the model's own mesh"; the device order (ids) only where it is not ascending, its
    first four and last where there are more than 8."""
    ids = [d.id for d in mesh.devices.flat]
    shown = ids if len(ids) <= 8 else f"[{', '.join(map(str, ids[:4]))}, ... {ids[-1]}]"
    order = "" if ids == sorted(ids) else f"; device order {shown}"
    count = f"{len(mesh.shape)} ax{'e' if len(mesh.shape) > 1 else 'i'}s "
    return f"{label} ({count}{spec_text(mesh)}{order})"


def compiled_step(step: str, mesh: "Mesh | Mapping[str, int] | str | None",
                  where: str | None = None, sharded: bool = True) -> str:
    """What a report says was compiled, e.g. 'value-and-grad; gradients sharded like the
    parameters over fsdp:4', and with `where` (`origin`) where the mesh came from: '...
    over fsdp:4; on the model's own mesh (1 axis fsdp:4)'.

    step: "value-and-grad" (`measure`: the loss and its gradients) or "train step"
    (`decide.step`: with the optimizer update). mesh: a Mesh, {axis: size} or spec
    string; None or one device: the step alone (on `where`, if given). sharded
    False (the compiled program takes every parameter whole): "...; parameters and
    gradients whole on every device of fsdp:4".
    """
    spec = mesh if isinstance(mesh, str) else spec_text(mesh)
    on = f"; on {where}" if where else ""
    if spec is None or all(n == "1" for n in re.findall(r":(\d+)", spec)):
        return step + on
    held = ("gradients and optimizer state" if step == "train step" else "gradients")
    if not sharded:
        return f"{step}; parameters and {held} whole on every device of {spec}{on}"
    return f"{step}; {held} sharded like the parameters over {spec}{on}"


def _wait_for(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to HOST:PORT opens within timeout_s seconds."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 300) -> None:
    """Starts JAX's distributed runtime (`jax.distributed.initialize`) for
    multi-process training; on CPU with gloo collectives
    (`jax_cpu_collectives_implementation`).

    Args:
      coordinator: "HOST:PORT" where process 0 serves the coordinator; None
        reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID,
        as `jax.distributed.initialize` does.
      num_processes, process_id: this run's size and this process's rank.
      timeout_s: seconds to wait for the coordinator, and then for every
        process to join.
    Raises:
      MeshError: a malformed address or rank, or (processes other than 0) no
        coordinator listening at the address within timeout_s seconds. JAX's
        runtime aborts the process rather than raising, so the coordinator is
        probed over TCP first. A process 0 whose peers never join is aborted
        by JAX after timeout_s with DEADLINE_EXCEEDED.
    Call it before any other JAX call.
    """
    address = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if address is None or not re.match(r"^[^:\s]+:\d+$", address):
        raise MeshError(f"the coordinator must be HOST:PORT (or JAX_COORDINATOR_ADDRESS), "
                        f"got {address!r}")
    if num_processes is None or process_id is None or not 0 <= process_id < num_processes:
        raise MeshError(f"process_id must be in [0, num_processes); got process_id "
                        f"{process_id}, num_processes {num_processes}")
    if process_id > 0 and not _wait_for(address, timeout_s):
        raise MeshError(f"timed out after {timeout_s} s: process {process_id} of "
                        f"{num_processes} found no coordinator at {address}; start process 0 "
                        f"with the same coordinator address first")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes, process_id,
                               initialization_timeout=timeout_s)


def local_shape(leaf) -> jax.ShapeDtypeStruct:
    """A leaf (array or ShapeDtypeStruct) at its per-device shape: the shard shape
    of its sharding, or its own shape without one."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return jax.ShapeDtypeStruct(shape, leaf.dtype)


def is_sharded(leaf) -> bool:
    """Whether a leaf's sharding spans more than one device."""
    sharding = getattr(leaf, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1

__all__ = ["AXES", "Fallback", "LOGICAL_AXES", "MAX_DEVICES", "RULES", "axis_size",
           "batch_sharding", "check_fits", "compiled_step", "constrain", "divisible_spec",
           "host_devices", "initialize", "is_sharded", "local_shape", "make", "origin",
           "parse_spec", "per_device_config", "plain", "put", "replicated", "rules", "shardings",
           "spanning", "spec_text", "use"]
