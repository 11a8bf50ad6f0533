"""How far each target's time model was checked against measured step times.

The planner minimizes predicted step time by default only on a target whose
predictions came within `REACH` of measured step-time ratios (`time_check`);
elsewhere its default is FLOPs, and asking for time (`--objective time`)
prints the line saying how far that target's model was checked. The figures
come from `benchmarks/time_model_cpu.py` (the CPU, measured here) and
`benchmarks/published_ratios.py` (deviceless compiles at the shapes of
published A100 measurements: Korthikanti et al. 2022, Table 4; torchtitan's
docs/performance.md), tabled in docs/plan.md.
"""

from __future__ import annotations

from remat_kit.measure import targets

# A prediction is within reach of a measured ratio (a policy's step time over no
# remat's) when it is within this much of it: 0.05 is a third of the gap between
# the selective (1.07) and full (1.39) recompute Korthikanti et al. measured.
REACH = 0.05

# chip (`targets.chip`) -> (within reach of every measurement checked, how far checked)
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


def time_check(target) -> tuple[bool, str]:
    """(whether `target`'s predicted step times were checked within `REACH` of
    measured ones, one line saying how far they were checked).

    Args: target: a target string or `targets.Target`.
    Raises: TargetError: a bad target (`targets.parse_target`).
    """
    name = targets.chip(target)
    return CHECKS.get(name, (False, f"the {name} time model is checked against no measured "
                                    f"step time: predicted times are an unchecked roofline"))


__all__ = ["CHECKS", "REACH", "time_check"]
