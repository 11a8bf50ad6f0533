"""How far each target's time model was checked against measured step times, and
the floor no predicted step may beat.

`time_check` says whether a target's predictions came within `REACH` of measured step-time
ratios (`benchmarks/time_model_cpu.py`; `benchmarks/published_ratios.py`: Korthikanti et al.
2022, Table 4, and torchtitan's performance.md), so the planner may minimize time there.
`check_floor` raises `BelowFloor` for a step below max(FLOPs / peak, bytes written / bandwidth).
The checks, tabled: docs/plan.md; the floor: docs/targets.md ("Physics").
"""

from __future__ import annotations

import math

import jax

from remat_kit.measure import targets
from remat_kit.units import fmt_bytes

# A prediction is within reach of a measured ratio (a policy's step time over no
# remat's) when it is within this much of it: 0.05 is a third of the gap between
# the selective (1.07) and full (1.39) recompute Korthikanti et al. measured.
REACH = 0.05

# chip (`Target.chip`) -> (within reach of every measurement checked, how far checked)
CHECKS = {
    "cpu": (True, "the cpu time model was checked on this machine: 16 presets' predicted "
                  "step times within 10% of measured (benchmarks/time_model_cpu.py)"),
    "gpu:a100": (False, "the gpu:a100 time model is not within 0.05 of published A100 step "
                        "times: selective 1.045 against 1.07 (Korthikanti et al. 2022) and "
                        "1.165 against 1.136 (torchtitan, Llama 2 13B) are, full recompute "
                        "1.22 against 1.39 is not (benchmarks/published_ratios.py)"),
    "tpu:v5e": (False, "the tpu:v5e time model is checked against no measured TPU step time; "
                       "at the A100 papers' shapes it predicts full 1.22 and selective 1.07 "
                       "against 1.39 and 1.07 measured on A100 (benchmarks/published_ratios.py)"),
}


def time_check(target: "targets.Target") -> tuple[bool, str]:
    """(whether `target`'s predicted step times were checked within `REACH` of
    measured ones, one line saying how far they were checked), by its chip
    (`Target.chip`)."""
    name = target.chip
    return CHECKS.get(name, (False, f"the {name} time model is checked against no measured "
                                    f"step time: predicted times are an unchecked roofline"))


# The time model's FLOPs (`time_model.compiled_ops`) and XLA's cost analysis count
# element-wise ops apart by up to 0.7% (tiny_llama on TPU v5e, every preset): a
# prediction may sit this far below a floor of XLA's FLOPs before it is a bug.
FLOOR_SLACK = 0.02


class BelowFloor(AssertionError):
    """A predicted step faster than the target's peaks allow: a time-model bug."""


def floor_seconds(line, flops: float, nbytes: float) -> float:
    """max(flops / peak FLOP/s, nbytes / bandwidth): the least time a step can take.

    Args:
      line: the target's `Roofline` (`Target.roofline`); its faster peak (bf16's) is used,
        so the floor holds whatever the dtypes.
      flops: the step's FLOPs per device (every loop trip counted).
      nbytes: bytes the step must move per device at least once, e.g. its
        outputs written (`written_bytes`).
    Returns:
      Seconds.
    """
    return max(flops / max(line.bf16_flops, line.f32_flops), nbytes / line.bandwidth)


def written_bytes(compiled) -> int:
    """Bytes of a compiled program's outputs on one device, each element once (its
    shard's shape; no tile padding, which the time model does not price either):
    what the program writes at least once.

    Args: compiled: a JAX `Compiled`.
    """
    return sum(math.prod(o.sharding.shard_shape(o.shape)) * o.dtype.itemsize
               for o in jax.tree.leaves(compiled.out_info))


def check_floor(seconds: float, line, flops: float, nbytes: float) -> float:
    """`seconds`, checked against `floor_seconds(line, flops, nbytes)`.

    Raises:
      BelowFloor: seconds below the floor by more than `FLOOR_SLACK`, naming
        both and the FLOPs, bytes and peaks behind the floor.
    """
    floor = floor_seconds(line, flops, nbytes)
    if seconds < floor * (1 - FLOOR_SLACK):
        peak = max(line.bf16_flops, line.f32_flops)
        raise BelowFloor(
            f"predicted step {seconds * 1e3:.4g} ms is below the physical floor "
            f"{floor * 1e3:.4g} ms: {flops:.4g} FLOPs at {peak / 1e12:.4g} TFLOP/s, "
            f"{fmt_bytes(nbytes)} at {line.bandwidth / 1e9:.4g} GB/s ({line.source}); "
            "the time model has priced part of the program too low")
    return seconds


__all__ = ["BelowFloor", "CHECKS", "FLOOR_SLACK", "REACH", "check_floor", "floor_seconds",
           "time_check", "written_bytes"]
