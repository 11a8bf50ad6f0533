"""Peak figures of each chip, for the time model: a `Roofline`.

An accelerator's peaks come from its vendor's pages (`PEAKS`, each entry
naming its source); the CPU's are measured once on this machine
(`calibrate_cpu`) and kept in a small JSON file. `of_chip` picks one for a
chip as `remat_kit.measure.targets.Target.chip` names it; a `Target` keeps
its own (`Target.roofline`), so a report reads the figures once.
Docs: docs/targets.md ("The time model").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp

from remat_kit.measure import sealed

_PCIE5_X16 = 64e9  # PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b coding, ~63 GB/s each way
_PCIE4_X16 = 32e9  # PCIe Gen4 x16: 16 GT/s x 16 lanes, ~31.5 GB/s each way
# TPU host <-> HBM (PCIe DMA): Google publishes no per-chip figure; "How to Scale Your
# Model" (Austin et al. 2025, jax-ml.github.io/scaling-book/tpus, "PCIe" in its bandwidth
# table, 16-32 GB/s by generation; its worked example takes 1.5e10 bytes/s) gives the
# order of magnitude; we take the low end, 1.5e10 bytes/s each way, for v5e and v5p.
_TPU_HOST_DMA = 1.5e10
# TPU chip <-> the data-center network (DCN) that joins slices, bytes/s per chip each way:
# the same book's "DCN bandwidth" per chip (its hardware table: 6.25e9 for v5p, 3.125e9
# for v5e), what a multi-slice job's cross-slice all-reduce runs at.
_DCN = {"tpu:v5e": 3.125e9, "tpu:v5p": 6.25e9}
# TPU chip -> a neighbour over one ICI link, bytes/s one way: the same book's "ICI
# bandwidth" per link, one direction (4.5e10 for v5e, 9e10 for v5p), what a pipeline's
# `ppermute` to the next stage and every other collective (all-to-all, all-gather, ...) run at.
_ICI = {"tpu:v5e": 4.5e10, "tpu:v5p": 9e10}
# TPU on-chip vector memory (VMEM, memory space S(1) in the optimized HLO) <-> the vector and
# matrix units, bytes/s: Google publishes no figure; the same book ("VMEM" in its TPU chapter)
# puts VMEM's bandwidth at about 22x HBM's. An assumption, then: 22 x the chip's HBM figure.
_VMEM_OVER_HBM = 22
# Dense (no sparsity) peaks. bf16_flops: 16-bit matmul; f32_flops: what an f32
# matmul runs at under JAX's default precision (TPU: one bf16 pass; NVIDIA: TF32).
PEAKS = {
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s HBM2.
    "tpu:v5e": {"bf16_flops": 197e12, "f32_flops": 197e12, "bandwidth": 819e9,
                "host_bandwidth": _TPU_HOST_DMA, "dcn_bandwidth": _DCN["tpu:v5e"],
                "ici_bandwidth": _ICI["tpu:v5e"], "vmem_bandwidth": _VMEM_OVER_HBM * 819e9,
                "source": "cloud.google.com/tpu/docs/v5e; host DMA, DCN, ICI and VMEM "
                          "(22x HBM, assumed): jax-ml.github.io/scaling-book"},
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 2,765 GB/s HBM2e.
    "tpu:v5p": {"bf16_flops": 459e12, "f32_flops": 459e12, "bandwidth": 2765e9,
                "host_bandwidth": _TPU_HOST_DMA, "dcn_bandwidth": _DCN["tpu:v5p"],
                "ici_bandwidth": _ICI["tpu:v5p"], "vmem_bandwidth": _VMEM_OVER_HBM * 2765e9,
                "source": "cloud.google.com/tpu/docs/v5p; host DMA, DCN, ICI and VMEM "
                          "(22x HBM, assumed): jax-ml.github.io/scaling-book"},
    # https://www.nvidia.com/en-us/data-center/a100/ (A100 SXM4 80GB datasheet): BF16
    # 624 TFLOP/s with sparsity (312 dense), TF32 312 with sparsity (156 dense),
    # 2,039 GB/s HBM2e; host link PCIe Gen4 x16.
    "gpu:a100": {"bf16_flops": 312e12, "f32_flops": 156e12, "bandwidth": 2.039e12,
                 "host_bandwidth": _PCIE4_X16, "source": "nvidia.com/en-us/data-center/a100"},
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM): BF16 1,979 TFLOP/s
    # with sparsity (989 dense), TF32 989 with sparsity (494.5 dense), 3.35 TB/s HBM3;
    # host link PCIe Gen5 x16.
    "gpu:h100": {"bf16_flops": 989e12, "f32_flops": 494.5e12, "bandwidth": 3.35e12,
                 "host_bandwidth": _PCIE5_X16, "source": "nvidia.com/en-us/data-center/h100"},
    # H200 SXM: the ceilings measured on one (2026-10 and 11, driver 580.159): an
    # 8192^3 bf16 matrix product at 769-798 TFLOP/s (the datasheet's dense 989), a
    # device-to-device copy at 4.3 TB/s counting bytes read and written (the
    # datasheet's 4.8); TF32 half of bf16, as the datasheet has it. With them the
    # time model's steps came within 13% of the measured ones (docs/gpu.md).
    # Host link PCIe Gen5 x16.
    "gpu:h200": {"bf16_flops": 790e12, "f32_flops": 395e12, "bandwidth": 4.3e12,
                 "host_bandwidth": _PCIE5_X16,
                 "source": "measured on an H200 SXM (datasheet: nvidia.com/en-us/data-center/h200)"},
}


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A target's peaks, for `seconds`.

    Attributes:
      bf16_flops, f32_flops: peak FLOP/s of 16-bit and 32-bit math.
      bandwidth: device memory bandwidth, bytes/s.
      host_bandwidth: device <-> host bytes/s per direction (None: no host memory).
      source: where the figures come from (a vendor page, or "measured on this machine").
      dcn_bandwidth: chip <-> data-center network bytes/s per direction, what joins the
        slices of a multi-slice target (None: not listed).
      slices: on a multi-slice target, how many slices (None: one); the time model
        prices what the program sends across them at `dcn_bandwidth`
        (`remat_kit.measure.dcn`).
      ici_bandwidth: chip -> neighbouring chip bytes/s over one ICI link, one way
        (None: not listed); the time model prices what every collective sends at it
        (`collectives.ici_bytes`: a pipeline's `ppermute`, an expert layer's all-to-alls).
      vmem_bandwidth: on-chip vector memory (TPU VMEM) bytes/s (None: no such memory
        space; bytes found there are priced at `bandwidth`).
    """

    bf16_flops: float
    f32_flops: float
    bandwidth: float
    host_bandwidth: float | None = None
    source: str = ""
    # Not in the repr, which keys the figure cache: the target's name (slices=N) does.
    dcn_bandwidth: float | None = dataclasses.field(default=None, repr=False)
    slices: int | None = dataclasses.field(default=None, repr=False)
    # Not in the repr either: a chip's `source` names where its ICI figure comes from.
    ici_bandwidth: float | None = dataclasses.field(default=None, repr=False)
    # Not in the repr either: the figure cache keys on this module's source.
    vmem_bandwidth: float | None = dataclasses.field(default=None, repr=False)

    def seconds(self, flops: float, nbytes: float, dtype=None, vmem_bytes: float = 0.0) -> float:
        """max(flops / peak of `dtype`, nbytes / bandwidth + vmem_bytes / vmem_bandwidth):
        16-bit dtypes take bf16's peak; bytes in on-chip memory cost time too (an op
        whose buffers all sit in VMEM is not free), added to its HBM bytes' time."""
        peak = self.bf16_flops if getattr(dtype, "itemsize", 4) <= 2 else self.f32_flops
        return max(flops / peak, self.memory_seconds(nbytes, vmem_bytes))

    def memory_seconds(self, nbytes: float, vmem_bytes: float = 0.0) -> float:
        """Seconds to move `nbytes` of device memory (HBM) and `vmem_bytes` of on-chip
        memory at their bandwidths (`vmem_bandwidth`, else `bandwidth`)."""
        return nbytes / self.bandwidth + (
            vmem_bytes / (self.vmem_bandwidth or self.bandwidth) if vmem_bytes else 0.0)


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remat_kit", "cpu_roofline.json")


# Bump when the calibration changes: a cached figure from another version is measured again.
_CALIBRATION = 3
_RUNS = 15


# What a kept calibration holds (`sealed.unseal` checks it when read back).
_KEPT: sealed.Schema = {"version": lambda v: v == _CALIBRATION, "f32_flops": sealed.positive,
                        "bandwidth": sealed.positive, "source": sealed.text}
_MEASURED: dict[str, Roofline] = {}  # path -> this process's calibration


def calibrate_cpu(path: str | None = None) -> Roofline:
    """This machine's CPU peaks, measured once and cached at `path` (default
    $XDG_CACHE_HOME/remat_kit/cpu_roofline.json).

    A 256x256 f32 matmul (2 * 256**3 FLOPs) and an element-wise pass over 4 MiB
    (read and written: 8 MiB accessed), each the best of 15 runs after a
    warm-up, with XLA CPU. The sizes are those of a small model's matmuls and
    activations, what the CPU target is used for: a 64 MiB pass measures page
    faults on fresh output buffers more than bandwidth (about 2 GB/s against
    12-16 GB/s at 1-16 MiB on the machine this was written on), and a large
    matmul runs nearer peak than a small model's do. bf16 math on XLA CPU runs
    no faster than f32: both peaks are the matmul's. The best of many runs
    keeps most of other processes' load out; a figure measured under load is
    low, and the cache keeps it: delete the file to measure again.

    The file is sealed (`remat_kit.measure.sealed`): a changed figure, or a
    peak that is not a positive finite number, is measured again and
    rewritten. A process measures once per path, so one report never mixes
    rooflines; where the file cannot be written (a read-only folder) a
    warning says so once, and the next process measures again.
    """
    path = path or _cache_path()
    if path in _MEASURED:
        return _MEASURED[path]
    try:
        with open(path) as f:
            d = sealed.unseal(json.load(f), _KEPT)
    except (OSError, ValueError):
        d = None
    if d is None:
        d = _measure_cpu()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.{os.getpid()}.tmp", "w") as f:
                json.dump(sealed.seal(d), f)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(f"{path}.{os.getpid()}.tmp")
            warnings.warn(f"the CPU roofline cannot be kept at {path!r} ({e.strerror or e}): "
                          "measured once for this run, so another run may predict other "
                          "times", stacklevel=2)
    _MEASURED[path] = Roofline(d["f32_flops"], d["f32_flops"], d["bandwidth"], None, d["source"])
    return _MEASURED[path]


def _measure_cpu() -> dict:
    """{"version", "f32_flops", "bandwidth", "source"} measured now (`calibrate_cpu`)."""
    cpu = jax.devices("cpu")[0]

    def best(f, *xs):
        jax.block_until_ready(f(*xs))
        times = []
        for _ in range(_RUNS):
            start = time.perf_counter()
            jax.block_until_ready(f(*xs))
            times.append(time.perf_counter() - start)
        return min(times)

    n = 256
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    flops = 2 * n**3 / best(jax.jit(lambda x: x @ x), a)
    x = jax.device_put(jnp.ones((2**20,), jnp.float32), cpu)  # 4 MiB
    bandwidth = 2 * x.nbytes / best(jax.jit(lambda v: v * 1.0001), x)
    source = (f"measured on this machine ({os.cpu_count()} CPUs): a {n}x{n} f32 matmul and a "
              f"{x.nbytes >> 20} MiB element-wise pass, best of {_RUNS}")
    return {"version": _CALIBRATION, "f32_flops": flops, "bandwidth": bandwidth,
            "source": source}


def of_chip(chip: str) -> Roofline:
    """The `Roofline` of `chip` ("tpu:v5e", "gpu:a100", ..., as `PEAKS` names it):
    its listed peaks, or for the CPU (and a chip with no listed figures) a
    measurement of this CPU (`calibrate_cpu`)."""
    found = PEAKS.get(chip)
    if found is None:
        return calibrate_cpu()
    return Roofline(found["bf16_flops"], found["f32_flops"], found["bandwidth"],
                    found.get("host_bandwidth"), found["source"], found.get("dcn_bandwidth"),
                    ici_bandwidth=found.get("ici_bandwidth"),
                    vmem_bandwidth=found.get("vmem_bandwidth"))


__all__ = ["PEAKS", "Roofline", "calibrate_cpu", "of_chip"]
