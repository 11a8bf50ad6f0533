"""Targets: whose compiler the figures come from, and for which devices.

A target (`cpu`, `tpu`, `tpu:v5e:2x2[:slices=N]`, `gpu`, `gpu:h100[:N]`) names the compiler and
the devices a program is compiled for, ahead of time where the machine lacks them.
Main names: `parse_target` (text to `Target`, at the edge only), `Target`, `TargetError`,
`make_mesh`, `devices`, `chip`, `peaks`, `roofline`, `versions`.
The targets, the AOT compile and what each needs: docs/targets.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import types

import jax
import numpy as np
from jax.sharding import Mesh

from remat_kit._jax_private import has_nvidia_gpu, num_tpu_chips
from remat_kit.errors import closest_choice, install_command
# PEAKS re-exported: the table is read as targets.PEAKS beside the targets it lists.
from remat_kit.measure import chip_memory
from remat_kit.measure.chip_peaks import PEAKS, Roofline, of_chip
from remat_kit.measure.cloud_tpu import cloud_topology
from remat_kit.mesh import spec_text

# TPU generations libtpu knows by topology name (checked with libtpu 0.0.52).
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x")
_TPU_SHAPE = re.compile(r"\d+x\d+(x\d+)?", re.ASCII)
_SLICES = re.compile(r"slices=(\d+)", re.ASCII)
# The most slices libtpu compiles for (its kMaxNumSlices; more aborts the process).
MAX_SLICES = 512
# The mesh axis across the slices of a multi-slice target: data parallel, as MaxText's
# create_hybrid_device_mesh folds dcn_data_parallelism into its `data` axis.
SLICE_AXIS = "data"
# GPU name -> GpuTargetConfigProto text file in remat_kit/measure/gpu_targets/. Only
# GPUs with a sourced description are listed: h100_sxm.txtpb describes an
# NVIDIA H100 SXM 80 GB HBM3 (132 SMs, 50 MiB L2, compute capability 9.0),
# in the format of XLA's xla/tools/hlo_opt/gpu_specs; it comes with the
# project's design notes (DESIGN.md, "Measuring: what counts").
# h200_sxm.txtpb: an NVIDIA H200 SXM 141 GB HBM3e, the same chip with 4.8 TB/s
# and 139.9 GiB (NVIDIA's H200 datasheet; the file's comment derives the size).
# a100_sxm.txtpb: an NVIDIA A100 SXM4 80 GB, the GPU of the published remat step
# times the time model is checked against (its comment gives the datasheet figures).
GPU_TARGET_CONFIGS = {"a100": "a100_sxm.txtpb", "h100": "h100_sxm.txtpb",
                      "h200": "h200_sxm.txtpb"}
KINDS = ("cpu", "tpu", "tpu:<topology>[:slices=N]", "tpu:<Cloud TPU type>", "gpu",
         "gpu:<name>[:N]")
EXAMPLES = ("cpu", "tpu:v5e:1x1", "tpu:v5e:2x2", "tpu:v5p:2x2x1", "tpu:v4:2x2x1",
            "tpu:v5p:4x4x4:slices=2", "gpu",
            "gpu:a100", "gpu:h100", "gpu:h100:8", "gpu:h200", "gpu:/path/to/spec.txtpb")

class TargetError(ValueError):
    """A target string names no compiler or device set this machine can compile for.

    The message names the bad value and the valid choices (and the closest
    one), or says what to install.
    """


def _plugin_environment() -> None:
    """Environment the accelerator plugins read when they load, on a machine
    without that accelerator.

    With libtpu installed, JAX tries the TPU backend at start-up and libtpu,
    finding no Cloud TPU metadata, prints a page of warnings about the
    accelerator type and worker hostnames, and holds a lockfile that makes a
    second JAX process fail to load it. With the CUDA plugin installed and no
    GPU, its start-up version check fails and the plugin is not registered,
    so no GPU topology can be made. A compile-only client needs none of
    this, so say so before the plugins load. Values the user set are kept; on
    a machine with the accelerator nothing is set.
    """
    if importlib.util.find_spec("libtpu") is not None and num_tpu_chips() == 0:
        for key, value in (("TPU_SKIP_MDS_QUERY", "1"),
                           ("TPU_ACCELERATOR_TYPE", "v5litepod-1"),
                           ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                           ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
            os.environ.setdefault(key, value)
    if _cuda_plugin_installed() and not has_nvidia_gpu():
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


_plugin_environment()  # must run before JAX starts its backends


@dataclasses.dataclass(frozen=True)
class Target:
    """A compiler and the devices it compiles for. Build with `parse_target`.

    A target is parsed once, where it comes in (the CLI's --target, the target=
    of a public function such as `rk.measure`), and handed down as this value.
    What the later stops need of it is derived on first use and kept on the
    value (`functools.cached_property`): its devices, chip, peaks, `Roofline`
    and versions. Equality and hashing are by platform and topology only.

    Attributes:
      platform: "cpu", "tpu" or "gpu".
      topology: for an ahead-of-time target, the topology: a TPU topology
        name (e.g. "v5e:2x2", "v5p:4x4x4:slices=2" for two such slices), or a
        GPU name or target config path with an optional device count ("h100",
        "h100:8"); None for this machine's devices.
    """

    platform: str
    topology: str | None = None

    def __str__(self) -> str:
        return self.platform if self.topology is None else f"{self.platform}:{self.topology}"

    @property
    def aot(self) -> bool:
        """True if compiled ahead of time for devices this machine need not have."""
        return self.topology is not None

    @property
    def label(self) -> str:
        """Whose figures these are, e.g. "XLA CPU compile", "XLA TPU compile (v5e:2x2, AOT)"."""
        where = f" ({self.topology}, AOT)" if self.aot else ""
        return f"XLA {self.platform.upper()} compile{where}"

    @functools.cached_property
    def devices(self) -> tuple:
        """The devices this target compiles for: a topology's compile-only devices,
        or this machine's devices of the platform.

        Raises:
          TargetError: libtpu or the CUDA plugin missing or rejecting the
            topology, or this machine has no device of the platform.
        """
        return _devices_of(self)

    @property
    def slices(self) -> int:
        """How many slices of the topology (`tpu:v5p:4x4x4:slices=2`: 2); 1 otherwise."""
        found = _SLICES.search(self.topology or "") if self.platform == "tpu" else None
        return int(found.group(1)) if found else 1

    @functools.cached_property
    def chip(self) -> str:
        """The chip compiled for, as `PEAKS` names it: "cpu", "tpu:v5e", "gpu:a100",
        ...; this machine's devices are matched by their device kind ("NVIDIA
        A100-SXM4-80GB", "TPU v5 lite"); "tpu:?" / "gpu:?" where the kind names
        no listed chip or there is no such device."""
        return _chip_of(self)

    @property
    def peaks(self) -> dict | None:
        """`PEAKS` of the chip: {"bf16_flops", "f32_flops" (FLOP/s), "bandwidth",
        "host_bandwidth" (bytes/s), "source"}; None for the CPU and for chips
        not listed (the time model then measures this CPU, `chip_peaks.calibrate_cpu`)."""
        return PEAKS.get(self.chip)

    @property
    def chip_count(self) -> int | None:
        """How many chips (GPUs) the topology names, read from its text, before JAX or
        libtpu starts: `tpu:v5p:2x2x1:slices=2` 8, `gpu:h100:8` 8; None for this
        machine's devices."""
        if not self.aot:
            return None
        if self.platform == "gpu":
            return _split_count(self.topology)[1]
        shape = self.topology.split(":")[1]
        return math.prod(int(n) for n in shape.split("x")) * self.slices

    @functools.cached_property
    def roofline(self) -> Roofline:
        """The time model's peaks of the chip (`chip_peaks.of_chip`); on several slices
        with their count, which the DCN joins (`Roofline.slices`)."""
        line = of_chip(self.chip)
        return line if self.slices == 1 else dataclasses.replace(line, slices=self.slices)

    @functools.cached_property
    def memory(self) -> chip_memory.ChipMemory | None:
        """What one device of the target holds for a program: a TPU chip's HBM
        (`chip_memory.TPU_HBM_BYTES`); a GPU's memory times the share JAX's allocator takes
        (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75); this machine's accelerator's
        own `bytes_limit`. None for the CPU and for chips of no known size."""
        description = gpu_description(self) if self.platform == "gpu" and self.aot else {}
        return chip_memory.of_target(self, description.get("device_memory_size"))

    @functools.cached_property
    def versions(self) -> "types.MappingProxyType[str, str]":
        """{"jax": "0.12.0.1", "compiler": "libtpu 0.0.52"}: the versions the
        figures depend on. The compiler is libtpu for TPU targets, the CUDA
        plugin for GPU ones (jax-cuda12-plugin or jax-cuda13-plugin, whichever
        is installed) and jaxlib (XLA CPU) otherwise."""
        return types.MappingProxyType(_versions_of(self))


def parse_target(text: "str | Target | None") -> Target:
    """'tpu:v5e:2x2' -> Target("tpu", "v5e:2x2"); None -> JAX's default backend.

    Raises:
      TargetError: an unknown kind or TPU generation, or a topology shape
        that is not NxM or NxMxK; the message lists the valid ones.
    """
    if isinstance(text, Target):
        return text
    if text is None:
        return Target(jax.default_backend())
    if not isinstance(text, str):
        raise TargetError(f"a target is a string such as 'cpu' or 'tpu:v5e:2x2', got "
                          f"{type(text).__name__} {text!r}")
    word = text.strip()
    if word.endswith(":"):  # 'cpu:', 'tpu:v5e:1x1:': a part left out, never a default
        raise TargetError(f"target {text!r} ends in ':'; valid: {', '.join(KINDS)} "
                          f"(e.g. {', '.join(EXAMPLES)})")
    kind, _, topology = word.partition(":")
    kind = kind.lower()
    if kind != "gpu":
        topology = topology.lower()
    if kind == "cpu" and not topology:
        return Target("cpu")
    if kind == "gpu":
        return Target("gpu", _gpu_topology(text.strip()[4:], text) if topology else None)
    if kind != "tpu":
        closest = closest_choice(kind, ("cpu", "tpu", "gpu"))
        hint = f"; did you mean {closest!r}?" if closest else ""
        raise TargetError(f"unknown target {text!r}{hint}; valid: {', '.join(KINDS)} "
                          f"(e.g. {', '.join(EXAMPLES)})")
    if not topology:
        return Target("tpu")
    try:
        topology = cloud_topology(topology)
    except ValueError as e:
        raise TargetError(str(e)) from None
    generation, _, shape = topology.partition(":")
    if generation not in TPU_GENERATIONS:
        closest = closest_choice(generation, TPU_GENERATIONS)
        hint = f"; did you mean {closest!r}?" if closest else ""
        raise TargetError(f"unknown TPU generation {generation!r} in target {text!r}{hint}; "
                          f"valid: {', '.join(TPU_GENERATIONS)}")
    shape, colon, extra = shape.partition(":")
    if not _TPU_SHAPE.fullmatch(shape) or any(int(n) < 1 for n in shape.split("x")):
        raise TargetError(f"bad TPU topology {topology!r} in target {text!r}: give "
                          f"<generation>:<chips per axis>, e.g. v5e:2x2, v5p:2x2x1")
    slices = _SLICES.fullmatch(extra) if colon else None
    if colon and (slices is None or not 1 <= int(slices.group(1)) <= MAX_SLICES):
        raise TargetError(f"bad TPU topology {topology!r} in target {text!r}: after the "
                          f"shape give slices=N with N a number of slices from 1 to "
                          f"{MAX_SLICES} (libtpu's most), e.g. tpu:v5p:4x4x4:slices=2")
    n = int(slices.group(1)) if slices else 1
    return Target("tpu", f"{generation}:{shape}" + (f":slices={n}" if n > 1 else ""))


def _split_count(topology: str) -> tuple[str, int]:
    """'h100:8' -> ('h100', 8); 'h100' -> ('h100', 1)."""
    head, sep, tail = topology.rpartition(":")
    return (head, int(tail)) if sep and tail.isdigit() else (topology, 1)


def _gpu_topology(topology: str, text: str) -> str:
    """'h100' / 'H100:8' / '/path/x.txtpb:8' checked (a known name or an existing file,
    and a positive device count) and normalized: 'h100', 'h100:8', ..."""
    name, count = _split_count(topology)
    if count <= 0 or ":" in name:
        raise TargetError(f"bad GPU target {text!r}: give gpu:<name> or gpu:<name>:N with N "
                          "a positive number of GPUs, e.g. gpu:h100:8")
    if name.endswith(".txtpb"):
        if not os.path.isfile(name):
            raise TargetError(f"GPU target config file {name!r} in target {text!r} not found")
    elif name.lower() not in GPU_TARGET_CONFIGS:
        closest = closest_choice(name, tuple(GPU_TARGET_CONFIGS))
        hint = f"; did you mean {closest!r}?" if closest else ""
        raise TargetError(f"unknown GPU {name!r} in target {text!r}{hint}; valid: "
                          f"{', '.join(GPU_TARGET_CONFIGS)}, or a GpuTargetConfigProto "
                          f"file: gpu:/path/to/spec.txtpb")
    else:
        name = name.lower()
    return name if count == 1 else f"{name}:{count}"


def parse_targets(text: str) -> list[Target]:
    """'cpu,tpu:v5e:1x1' -> [Target("cpu"), Target("tpu", "v5e:1x1")], without repeats.

    Raises:
      TargetError: empty text or item, or a bad target (`parse_target`).
    """
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise TargetError(f"--target needs comma-separated targets, e.g. cpu,tpu:v5e:1x1; "
                          f"got {text!r}")
    return list(dict.fromkeys(parse_target(t) for t in items))


def is_out_of_memory(error: "BaseException | str") -> bool:
    """Whether a compile failed for lack of device memory: XLA's RESOURCE_EXHAUSTED
    (e.g. XLA:TPU's CompileTimeHbmOom). `error`: the exception or its text
    (`Record.error`)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


# ---------------------------------------------------------------------------
# What a Target derives: devices, chip, versions
# ---------------------------------------------------------------------------

def _need_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(f"TPU targets need libtpu: {install_command('tpu')} "
                          "(or pip install libtpu)")


@functools.cache
def _topology_devices(topology: str) -> tuple:
    """The compile-only devices of a topology, slice by slice for "...:slices=N" (JAX's
    multi-slice topology: each device's `slice_index` says its slice)."""
    _need_libtpu()
    from jax.experimental import topologies
    name, _, extra = topology.rpartition(":") if "slices=" in topology else (topology, "", "")
    slices = int(_SLICES.fullmatch(extra).group(1)) if extra else 1
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            **({"num_slices": slices} if slices > 1 else {}))
    except Exception as e:  # noqa: BLE001 - libtpu's own message is the useful one
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TargetError(f"libtpu rejects TPU topology {topology!r}: {detail}; valid: "
                          f"<generation>:<shape> with generation one of "
                          f"{', '.join(TPU_GENERATIONS)}, e.g. v5e:2x2, v5p:2x2x1") from None
    return tuple(desc.devices)


def _need_cuda_plugin() -> None:
    if not _cuda_plugin_installed():
        raise TargetError(f"GPU targets compiled ahead of time need the CUDA plugin: "
                          f"{install_command('cuda')} (jax-cuda12-plugin and jax-cuda12-pjrt, "
                          "about 200 MB)")


def _gpu_config_text(name: str) -> str:
    path = (name if name.endswith(".txtpb") else
            os.path.join(os.path.dirname(__file__), "gpu_targets", GPU_TARGET_CONFIGS[name]))
    with open(path) as f:
        return f.read()


# The GpuTargetConfigProto fields `gpu_description` reads (each occurs once).
_GPU_FIELDS = re.compile(r"^\s*(device_description_str|core_count|clock_rate_ghz|"
                         r'memory_bandwidth|l2_cache_size|device_memory_size):\s*("[^"]*"|\S+)\s*$',
                         re.MULTILINE)


@functools.cache
def _gpu_devices(topology: str) -> tuple:
    _need_cuda_plugin()
    from jax.experimental import topologies
    name, count = _split_count(topology)
    config = _gpu_config_text(name)
    try:
        desc = topologies.get_topology_desc(
            topology_name=os.path.splitext(os.path.basename(name))[0], platform="cuda",
            target_config=config, topology=f"1x1x{count}")
    except Exception as e:  # noqa: BLE001 - the plugin's own message is the useful one
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TargetError(f"the CUDA plugin rejects GPU target {topology!r}: {detail}") from None
    return tuple(desc.devices)


def _devices_of(target: Target) -> tuple:
    if target.aot:
        return (_topology_devices if target.platform == "tpu" else _gpu_devices)(
            target.topology)
    if target.platform == "tpu":
        _need_libtpu()
    try:
        return tuple(jax.devices(target.platform))
    except RuntimeError:
        hint = {"tpu": "; to compile for a TPU without one, name a topology, e.g. tpu:v5e:1x1",
                "gpu": "; jax[cuda12] and an NVIDIA GPU are needed"}.get(target.platform, "")
        raise TargetError(f"target {str(target)!r}: this machine has no {target.platform} "
                          f"device{hint}") from None


def _chip_of(target: Target) -> str:
    if target.platform == "cpu":
        return "cpu"
    if target.aot:
        return f"{target.platform}:{target.topology.split(':')[0].lower()}"
    try:
        kind = jax.devices(target.platform)[0].device_kind.lower()
    except RuntimeError:
        return f"{target.platform}:?"
    names = (("a100", ("a100",)), ("h200", ("h200",)), ("h100", ("h100",)),
             ("v5e", ("v5 lite", "v5e")), ("v5p", ("v5p",)))
    name = next((n for n, words in names if any(w in kind for w in words)), "?")
    return f"{target.platform}:{name}"


def _versions_of(target: Target) -> dict[str, str]:
    packages = {"tpu": ("libtpu",), "gpu": ("jax-cuda12-plugin", "jax-cuda13-plugin")}.get(
        target.platform, ("jaxlib",))
    compiler = packages[0]
    for package in packages:  # the first installed one
        try:
            compiler = f"{package} {importlib.metadata.version(package)}"
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"jax": jax.__version__, "compiler": compiler}


# ---------------------------------------------------------------------------
# The same, for a target given as text: `rk.targets`' helpers for scripts and
# notebooks, each parsing its argument once (`parse_target`).
# ---------------------------------------------------------------------------

def devices(target: "str | Target") -> list:
    """`Target.devices` of `target`, as a list. Raises: TargetError: a bad target,
    or as `Target.devices`."""
    return list(parse_target(target).devices)


def chip(target: "str | Target") -> str:
    """`Target.chip` of `target`: "cpu", "tpu:v5e", "gpu:a100", ..."""
    return parse_target(target).chip


def peaks(target: "str | Target") -> dict | None:
    """`Target.peaks` of `target`; None for the CPU and for chips not listed."""
    return parse_target(target).peaks


def roofline(target: "str | Target | None" = None) -> Roofline:
    """`Target.roofline` of `target` (default JAX's default backend)."""
    return parse_target(target).roofline


def versions(target: "str | Target") -> dict[str, str]:
    """`Target.versions` of `target`, as a dict: {"jax": ..., "compiler": ...}."""
    return dict(parse_target(target).versions)


def gpu_description(target: "str | Target") -> dict:
    """The main figures of a GPU target's description, read from its text proto.

    No CUDA plugin is needed. Args: target: a GPU target compiled ahead of
    time, e.g. "gpu:h200". Returns: {"device_description_str": "NVIDIA H200",
    "core_count": 132 (SMs), "clock_rate_ghz": 1.98, "memory_bandwidth"
    (bytes/s), "l2_cache_size" (bytes), "device_memory_size" (bytes)}, the
    fields the file has. Raises: TargetError: not a GPU target with a
    description (`parse_target`).
    """
    target = parse_target(target)
    if target.platform != "gpu" or not target.aot:
        raise TargetError(f"target {str(target)!r} has no GPU description; give a GPU "
                          f"compiled ahead of time, e.g. gpu:{next(iter(GPU_TARGET_CONFIGS))}")
    found = {}
    for key, value in _GPU_FIELDS.findall(_gpu_config_text(_split_count(target.topology)[0])):
        found[key] = (value.strip('"') if value.startswith('"') else
                      float(value) if "." in value else int(value))
    return found


def make_mesh(target: "str | Target", shape: dict[str, int]) -> Mesh:
    """A `Mesh` of the first prod(shape) devices of `target`, axes named by `shape`
    ({"data": 4}). On several slices `shape` is within each slice (its first chips), and
    the slices add to `SLICE_AXIS` (`data`, slices outermost, as MaxText's
    `create_hybrid_device_mesh` builds dcn_data_parallelism), or prepend it.

    Raises:
      TargetError: the mesh needs more devices than the target (or one of its
        slices) has (the message names both numbers), or `Target.devices` fails.
    """
    target = parse_target(target)
    found, slices = target.devices, target.slices
    n, per = math.prod(shape.values()), len(found) // slices
    if n > per:
        where = f"each slice of target {target}" if slices > 1 else f"target {target}"
        raise TargetError(f"mesh {spec_text(shape)} needs {n} devices; {where} has {per}")
    grid = np.array([found[s * per:s * per + n] for s in range(slices)], dtype=object)
    grid = grid.reshape((slices, *shape.values()))
    if slices == 1:
        return Mesh(grid[0], tuple(shape))
    if SLICE_AXIS not in shape:
        return Mesh(grid, (SLICE_AXIS, *shape))
    at = list(shape).index(SLICE_AXIS)
    merged = np.moveaxis(grid, 0, at)  # the slices just outside the data axis, then one axis
    sizes = [slices * size if a == SLICE_AXIS else size for a, size in shape.items()]
    return Mesh(merged.reshape(sizes), tuple(shape))


__all__ = ["chip", "EXAMPLES", "KINDS", "PEAKS", "TPU_GENERATIONS", "Target", "TargetError",
           "devices", "gpu_description", "is_out_of_memory", "make_mesh", "parse_target",
           "parse_targets", "peaks", "roofline", "SLICE_AXIS", "versions"]
