"""The verdict: the first lines of every compare, plan and fit.

One line says which policy to use on which chip, what it gives and what it costs against no
remat; the next says what to paste; on the CPU without --target a third says the figures are the
CPU's. Each command picks its `Choice` (compare: `pick_compare`; plan: the first budget's plan;
fit: `fit_report.pick_fit`), and `verdict` words it alike. Docs: docs/compare.md ("What it prints").
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence

# The targets named where the figures are the CPU's: a TPU slice compiled ahead of
# time and a GPU compiled without one (docs/targets.md).
ACCELERATOR_EXAMPLES = "--target tpu:v5p:1x1x1 or gpu:h100"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a command recommends.

    Attributes:
      name: what to paste: a preset name ("dots"), a spec, or a plan file's path.
      gives: what it gives, e.g. "peak 1.14 GiB (0.452 x none)" or "seq 4096 in 16 GiB".
      cost: what it costs against no remat, e.g. "+0.56% FLOPs, +1.2% pred. step".
      why: the rule that picked it, e.g. "fewest FLOPs within 0.5".
      budget: for a plan file, the budget whose plan to take (`rk.remat_model`'s
        `budget=`); None otherwise.
      spec: where `name` is a plan file, the spec it holds, for the flag form;
        None otherwise.
    """

    name: str
    gives: str
    cost: str
    why: str
    budget: str | None = None
    spec: str | None = None


def _pct(x: float | None, what: str) -> str | None:
    return None if x is None else f"{x:+.2%} {what}"


def cost_text(flops_overhead: float | None, time_overhead: float | None) -> str:
    """'+0.56% FLOPs, +1.20% pred. step': the overheads over no remat (fractions:
    0.05 is 5% more), the missing ones left out; 'cost unknown' where both are."""
    parts = [p for p in (_pct(flops_overhead, "FLOPs"), _pct(time_overhead, "pred. step"))
             if p]
    return ", ".join(parts) or "cost unknown"


def where_words(target) -> str:
    """The chip the figures are for, first in every verdict: "tpu:v5p:1x1x1",
    "gpu:h100", "cpu"."""
    return str(target)


def verdict(choice: Choice, target, *, asked_target: bool) -> list[str]:
    """The verdict's lines for `choice` on `target` (a `measure.targets.Target`).

    Returns:
      ["tpu:v5e:1x1: use dots: peak 1.14 GiB (0.452 x none), +0.56% FLOPs (why)",
       "paste: rk.remat_model(model, \"dots\")  or  --config.remat=dots"]
      and, where the figures are the CPU's and no --target was given
      (`asked_target` False), a note naming the accelerator targets: policies
      rank differently there.
    """
    lines = [f"{where_words(target)}: use {choice.name}: {choice.gives}, {choice.cost} "
             f"({choice.why})", "paste: " + snippet(choice)]
    if target.platform == "cpu" and not asked_target:
        lines.append(cpu_note())
    return lines


def to_json(choice: Choice | None, target) -> dict | None:
    """--json's "verdict": the fields of the verdict's line and the snippet, on `target`;
    None where nothing was recommended."""
    return None if choice is None else {
        "target": str(target), **dataclasses.asdict(choice), "paste": snippet(choice)}


def snippet(choice: Choice) -> str:
    """What to paste for `choice`: the `rk.remat_model` call for your own Flax model,
    and the flag of `experiments.train` (quoted for a shell where a spec needs it)."""
    budget = "" if choice.budget is None else f", budget={json.dumps(str(choice.budget))}"
    call = f"rk.remat_model(model, {json.dumps(choice.name)}{budget})"
    flag = shlex.quote(f"--config.remat={choice.spec or choice.name}")
    return f"{call}  or  {flag}"


def cpu_note() -> str:
    """The line under a verdict made from CPU figures without --target."""
    return ("note: CPU figures (no --target); TPU and GPU compilers rank policies "
            f"differently: {ACCELERATOR_EXAMPLES}")


def pick_compare(report_rows: Sequence[dict]) -> Choice | None:
    """The Pareto row to recommend of one target's `report.rows`: among the
    Pareto-optimal rows that compiled, the one with the least memory x cost product
    (cost: predicted step over no remat's where every candidate has one, else FLOPs
    over no remat's), i.e. the most memory saved per unit of recompute; `none` only
    where it is the only row. None where no row compiled."""
    ok = [d for d in report_rows if d["error"] is None and d["memory_bytes"] is not None]
    front = [d for d in ok if d["pareto"]] or ok
    if not front:
        return None
    timed = all(d.get("predicted_ratio_to_none") is not None for d in front)
    key = "predicted_ratio_to_none" if timed else "flops_ratio_to_none"

    def score(d):
        return (d["memory_ratio_to_none"] or 1.0) * (d[key] or 1.0)

    best = min(front, key=score)
    return Choice(name=best["names"][0], gives=memory_text(best),
                  cost=cost_text(_over(best["flops_ratio_to_none"]),
                                 _over(best.get("predicted_ratio_to_none"))),
                  why="Pareto: least memory x " + ("pred. step" if timed else "FLOPs"))


def memory_text(d: dict) -> str:
    """'peak 1.14 GiB (0.452 x none)' of a `report.rows` row."""
    from remat_kit.measure.record import MEMORY_LABELS
    from remat_kit.units import fmt_bytes
    ratio = d["memory_ratio_to_none"]
    return (f"{MEMORY_LABELS[d['memory_kind']]} {fmt_bytes(d['memory_bytes'])}"
            + ("" if ratio is None else f" ({ratio:.3f} x none)"))


def _over(ratio: float | None) -> float | None:
    return None if ratio is None else ratio - 1


__all__ = ["ACCELERATOR_EXAMPLES", "Choice", "cost_text", "cpu_note", "memory_text",
           "pick_compare", "snippet", "to_json", "verdict", "where_words"]
