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

from remat_kit.units import fmt_bytes

# The targets named where the figures are the CPU's: a TPU slice compiled ahead of
# time and a GPU compiled without one (docs/targets.md).
ACCELERATOR_EXAMPLES = "--target tpu:v5p:1x1x1 or gpu:h100"

# Under a CPU verdict ranked by predicted step: those steps come from this machine's
# measured peaks (`chip_peaks.calibrate_cpu`), which another machine, or this one under
# load, measures otherwise, and a close pick can flip with them.
ROOFLINE_NOTE = ("note: CPU steps predicted from this machine's measured roofline; "
                 "another machine may pick otherwise")


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
      rank differently there. On the CPU, where the rule ranked by predicted step,
      `ROOFLINE_NOTE` before it.
    """
    lines = [f"{where_words(target)}: use {choice.name}: {choice.gives}, {choice.cost} "
             f"({choice.why})", "paste: " + snippet(choice)]
    if target.platform == "cpu" and "pred. step" in choice.why:
        lines.append(ROOFLINE_NOTE)
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


# The share of a chip's memory kept free when the verdict asks what fits it: the compiled
# value-and-grad leaves out the optimizer's state and update, the runtime's own buffers and
# fragmentation, so a peak that fits is one at most 90% of what the chip holds.
MARGIN = 0.10


def pick_compare(report_rows: Sequence[dict], memory=None, budget: int | None = None
                 ) -> Choice | None:
    """The row to recommend of one target's `report.rows`.

    Where a limit is known (`budget` in bytes, from --budget; else `memory`, the
    target's `chip_memory.ChipMemory`, less `MARGIN`), the fastest row whose memory fits
    it (`fastest_within`). Where neither is (the CPU, a chip of unknown size), the
    Pareto pick (`pareto_pick`). None where no row compiled.
    """
    ok = [d for d in report_rows if d["error"] is None and d["memory_bytes"] is not None]
    if not ok:
        return None
    if budget is not None:
        return fastest_within(ok, budget, f"--budget {fmt_bytes(budget)}")
    if memory is not None:
        limit = int(memory.usable * (1 - MARGIN))
        return fastest_within(ok, limit, f"{fmt_bytes(limit)}: {memory.source}, less "
                                         f"{MARGIN:.0%}")
    return pareto_pick(ok)


def _cost_key(rows: Sequence[dict]) -> tuple[str, str]:
    """(the row field to rank cost by, its words): the predicted step over none's where
    every row has one, else FLOPs over none's."""
    timed = all(d.get("predicted_ratio_to_none") is not None for d in rows)
    return ("predicted_ratio_to_none", "pred. step") if timed else ("flops_ratio_to_none",
                                                                    "FLOPs")


def _choice(d: dict, why: str) -> Choice:
    return Choice(name=d["names"][0], gives=memory_text(d),
                  cost=cost_text(_over(d["flops_ratio_to_none"]),
                                 _over(d.get("predicted_ratio_to_none"))), why=why)


def fastest_within(ok: Sequence[dict], limit: int, limit_words: str) -> Choice:
    """Of compiled rows `ok`: `none`, "no remat needed", where its memory is at most
    `limit` bytes (a policy the time model predicts faster than no remat is a modelling
    artefact, not a reason to remat); else the one with the least cost (`_cost_key`)
    whose memory fits. Where no row fits, the row with the least memory, saying so."""
    key, words = _cost_key(ok)
    fits = [d for d in ok if d["memory_bytes"] <= limit]
    if not fits:
        least = min(ok, key=lambda d: d["memory_bytes"])
        return _choice(least, f"no policy fits {limit_words}; this one needs the least")
    best = next((d for d in fits if d["policy"] == "none"), None) or min(
        fits, key=lambda d: (d[key] or 1.0, d["memory_bytes"]))
    if best["policy"] == "none":
        return dataclasses.replace(_choice(best, f"fits {limit_words}"),
                                   cost="no remat needed")
    return _choice(best, f"the least {words} of the policies that fit {limit_words}")


def pareto_pick(ok: Sequence[dict]) -> Choice:
    """Of compiled rows `ok`, among the Pareto-optimal ones, the one with the least
    memory x cost product (cost: `_cost_key`), i.e. the most memory saved per unit of
    recompute; `none` only where it is the only row."""
    front = [d for d in ok if d["pareto"]] or ok
    key, words = _cost_key(front)
    best = min(front, key=lambda d: (d["memory_ratio_to_none"] or 1.0) * (d[key] or 1.0))
    return _choice(best, "Pareto: least memory x " + words)


def memory_text(d: dict) -> str:
    """'peak 1.14 GiB (0.452 x none)' of a `report.rows` row."""
    from remat_kit.measure.record import MEMORY_LABELS
    ratio = d["memory_ratio_to_none"]
    return (f"{MEMORY_LABELS[d['memory_kind']]} {fmt_bytes(d['memory_bytes'])}"
            + ("" if ratio is None else f" ({ratio:.3f} x none)"))


def _over(ratio: float | None) -> float | None:
    return None if ratio is None else ratio - 1


__all__ = ["ACCELERATOR_EXAMPLES", "Choice", "MARGIN", "ROOFLINE_NOTE", "cost_text", "cpu_note",
           "fastest_within", "memory_text", "pareto_pick", "pick_compare", "snippet", "to_json",
           "verdict", "where_words"]
