"""What one device of a target holds for a program: a `ChipMemory`.

A TPU chip's HBM (`TPU_HBM_BYTES`, from Google's pages); a GPU's memory (its description's
`device_memory_size`) times the share JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION,
default `GPU_MEM_FRACTION_DEFAULT`); this machine's accelerator's own `bytes_limit`. The
verdict picks the fastest policy that fits it (`remat_kit.cli.verdict`); fit names a budget
over it. Main names: `ChipMemory`, `of_target`. Docs: docs/compare.md ("What it prints").
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import jax

from remat_kit.units import fmt_bytes

# HBM per TPU chip, each chip one JAX device on these generations (Google's pages:
# cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e). A generation not listed has no known
# size: the verdict then ranks by memory x cost (docs/compare.md, "What it prints").
TPU_HBM_BYTES = {"tpu:v4": 32 * 2**30, "tpu:v5e": 16 * 2**30, "tpu:v5p": 95 * 2**30,
                 "tpu:v6e": 32 * 2**30}
# The share of a GPU's memory JAX's allocator takes by default (JAX's "GPU memory
# allocation" page: XLA_PYTHON_CLIENT_MEM_FRACTION, default .75); the rest is not JAX's.
GPU_MEM_FRACTION_DEFAULT = 0.75
# XLA:GPU's memory limit for its scheduler and its own rematerialization (gpu_hlo_schedule.cc,
# GetSchedulerMemoryLimit): (the memory it is given - arguments and outputs) x this / 100,
# XLA_FLAGS --xla_gpu_memory_limit_slop_factor (default 95). The memory given: on a GPU, the
# limit of JAX's allocator (its share, above); ahead of time, 80% of the device's memory.
GPU_SLOP_DEFAULT = 95
_SLOP = re.compile(r"--xla_gpu_memory_limit_slop_factor=(\d+)")


class ChipMemory(NamedTuple):
    """What a program may use on one device of a target: `usable` bytes, and `source`,
    the words saying where the figure comes from ("95.00 GiB HBM per chip")."""

    usable: int
    source: str


def gpu_fraction() -> tuple[float, str]:
    """(the share of a GPU's memory JAX takes, the words saying whose it is); a value of
    XLA_PYTHON_CLIENT_MEM_FRACTION that is no share in (0, 1] is JAX's default here."""
    try:
        share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
    except ValueError:
        share = 0.0
    if 0 < share <= 1:
        return share, "XLA_PYTHON_CLIENT_MEM_FRACTION as set"
    return GPU_MEM_FRACTION_DEFAULT, "JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION"


def gpu_remat_limit(given: int, io_bytes: int) -> int:
    """Bytes XLA:GPU holds a program to, rematerializing on its own past them (see
    `GPU_SLOP_DEFAULT`): (`given` - `io_bytes`) x the slop factor (XLA_FLAGS' or 95) / 100.
    given: the memory XLA is given (a GPU's `ChipMemory.usable`); io_bytes: the program's
    arguments and outputs less what they alias, bytes per device."""
    return max(0, given - io_bytes) * gpu_slop() // 100


def gpu_slop() -> int:
    """XLA:GPU's memory limit slop factor, percent: XLA_FLAGS' last
    --xla_gpu_memory_limit_slop_factor, else `GPU_SLOP_DEFAULT`."""
    found = _SLOP.findall(os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else GPU_SLOP_DEFAULT


def of_target(target, gpu_memory_size: int | None = None) -> ChipMemory | None:
    """`ChipMemory` of one device of `target` (a `targets.Target`); `gpu_memory_size`: an
    ahead-of-time GPU's `device_memory_size` (bytes, from its description). None for the
    CPU, a chip of no known size, and a device that reports no limit."""
    if target.platform == "cpu":
        return None
    if not target.aot:
        try:
            stats = jax.devices(target.platform)[0].memory_stats() or {}
        except RuntimeError:
            return None
        limit = stats.get("bytes_limit")
        return ChipMemory(int(limit), f"{fmt_bytes(limit)} JAX may use") if limit else None
    if target.platform == "tpu":
        hbm = TPU_HBM_BYTES.get(target.chip)
        return None if hbm is None else ChipMemory(hbm, f"{fmt_bytes(hbm)} HBM per chip")
    if not gpu_memory_size:
        return None
    share, how = gpu_fraction()
    return ChipMemory(int(gpu_memory_size * share),
                      f"{share:.0%} of {fmt_bytes(gpu_memory_size)}, {how}")


__all__ = ["ChipMemory", "GPU_MEM_FRACTION_DEFAULT", "GPU_SLOP_DEFAULT", "TPU_HBM_BYTES",
           "gpu_fraction", "gpu_remat_limit", "gpu_slop", "of_target"]
