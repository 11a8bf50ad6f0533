"""`remat-kit plan`'s table: a row per budget, its plan, and the best preset that fits,
set against presets that are compiled where asked (--presets) or where the planner
compiles them anyway (its starting points: none, full, its base rules), and otherwise
predicted by the cost model (`search.predict`), marked `PREDICTED`.
Docs: docs/plan.md ("Presets the cost model predicts").
"""

from __future__ import annotations

import dataclasses

from remat_kit.measure.audit import column as audit_column
from remat_kit.measure.record import Record
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parse
from remat_kit.units import fmt_bytes

# Marks a figure the cost model predicted; the legend says so under the table.
PREDICTED = "~"
LEGEND = f"{PREDICTED}: predicted by the cost model, not compiled"


@dataclasses.dataclass(frozen=True)
class PresetRow:
    """A preset set against the plans: compiled (`record`) or predicted (record None).

    Attributes:
      names: the preset names of one program. policy: its canonical spec.
      memory_bytes: bytes of the planner's `memory_kind`, per device. flops: per step.
      seconds: predicted step seconds (None where not predicted).
      record: the compile, None where the figures are the cost model's.
    """

    names: tuple
    policy: str
    memory_bytes: int
    flops: float
    seconds: float | None
    record: Record | None = None

    def to_dict(self, memory_kind: str) -> dict:
        """--json's entry: the compiled record's fields, or the predicted figures; with
        "compiled" saying which."""
        if self.record is not None:
            return self.record.to_dict() | {"compiled": True}
        return {"policy": self.policy, "names": list(self.names), "compiled": False,
                "memory_kind": memory_kind, "memory_bytes": self.memory_bytes,
                "flops": self.flops, "predicted_seconds": self.seconds}


def starting_points(planner) -> set[str]:
    """The canonical specs the planner compiles whatever the presets: none, full and each
    base rule it plans above."""
    return {"none", "full"} | {str(Policy(base=b)) for b in planner.bases}


def split(planner, presets: list[str], asked: bool) -> tuple[list[str], list[str]]:
    """(the presets to compile, those to predict): every one where the user named them
    (`asked`, --presets), else only the planner's `starting_points`."""
    if asked:
        return presets, []
    starts = starting_points(planner)
    compiled = [p for p in presets if str(parse(p)) in starts]
    return compiled, [p for p in presets if str(parse(p)) not in starts]


def rows(planner, records: list, predict: list[str]) -> tuple[list[PresetRow], list[str]]:
    """(the rows of the compiled `records` and of the presets in `predict`, one per
    program; the names of those the cost model cannot predict, `search.predict`).
    A preset the planner compiled anyway (a plan it verified) is a compiled row. Call
    after planning: predictions read the planner's compiles and compile nothing."""
    from remat_kit.decide.search import predict as predicted
    kind = planner.memory_kind
    out = [PresetRow(r.names, r.policy, r.memory_bytes, r.flops,
                     planner.seconds(parse(r.policy)), r) for r in records
           if r.error is None and r.memory_bytes is not None and r.memory_kind == kind]
    named: dict[str, tuple] = {}
    for spec in predict:
        key = str(parse(spec))
        named[key] = named.get(key, ()) + (spec,)
    unpriced = []
    for key, names in named.items():
        record = planner.records.get(key)
        if record is not None and record.error is None and record.memory_bytes is not None:
            out.append(PresetRow(names, key, record.memory_bytes, record.flops,
                                 planner.seconds(parse(key)), record))
        elif (figures := predicted(planner, parse(key))) is not None:
            out.append(PresetRow(names, key, *figures))
        else:
            unpriced += names
    return out, unpriced


# How far over a budget a predicted preset may be and still fit once compiled: the cost
# model's memory ran up to 41% over the compiled figure on the CPU (benchmarks/
# preset_predictions.py, tiny) and 3-9% over on a TPU v5e, so those predicted within
# this margin are compiled.
PREDICTION_MARGIN = 0.45


def near_budgets(planner, found, presets: list[PresetRow]) -> list[str]:
    """The names of the predicted presets to compile: those predicted within
    `PREDICTION_MARGIN` of a budget's limit whose predicted score beats that budget's
    plan (compiled, they may fit and beat it; the planner takes a compiled preset that
    does)."""
    from remat_kit.policy.budget import parse_budget
    out = []
    for row in presets:
        if row.record is not None:
            continue
        for b, p in found.plans.items():
            limit = parse_budget(b).resolve(found.none)
            plan_row = PresetRow((), p.spec, p.measured_bytes, p.measured_flops,
                                 p.predicted_seconds)
            if (row.memory_bytes <= limit * (1 + PREDICTION_MARGIN)
                    and _score(planner, row)[:-1] < _score(planner, plan_row)[:-1]):
                out += [n for n in row.names if n not in out]
                break
    return out


def _score(planner, row: PresetRow) -> tuple:
    """`Planner.score` of a compiled row; the same ranking of a predicted row's figures."""
    if row.record is not None:
        return planner.score(row.record)
    if planner.objective == "time" and row.seconds is not None:
        from remat_kit.decide.plan import TIME_RESOLUTION
        step = TIME_RESOLUTION * planner.seconds(Policy(remat=False))
        return (round(row.seconds / step), row.flops, row.memory_bytes)
    return (row.flops, row.memory_bytes)


# plan's default columns, which fit 100 columns; --wide adds the budget's bytes, the
# tries and the best preset that fits.
_NARROW = (0, 2, 3, 4, 5, 6)  # of `table`'s columns: budget, plan, memory, x none, FLOPs, time


def table(title, planner, found, records, presets: list[PresetRow], emit_to, memory,
          wide=False, own=None):
    """(the table, --json's budget entries, whether a shown figure is predicted): a row
    per budget, its plan (named by the compiled preset it compiles alike to, where there
    is one), and with `wide` the budget's bytes, the tries and the best preset that fits
    by the planner's objective (`PREDICTED` before a predicted figure)."""
    from rich.table import Table
    from rich.text import Text
    kind = planner.memory_kind
    t = Table(title=Text(title), caption=f"memory: compiled {kind}, budgets and x none of it; "
              f"FLOPs: over no remat; time: predicted step time over no remat"
              + (f" ({planner.roofline.source}); objective: {planner.objective}" if wide else
                 f"; objective: {planner.objective}; --wide: bytes, tries, best preset; "
                 "docs/plan.md"), caption_justify="left")
    names = ("budget", "bytes", "planned policy", memory, f"{memory} x none", "FLOPs +",
             "time +", "tries", "best preset that fits", memory, "FLOPs +", "time +", "as asked")
    keep = range(len(names)) if wide else _NARROW
    for i in keep:
        words = "polic" in names[i] or "preset" in names[i]  # a long spec folds, not cut
        t.add_column(names[i] if wide or i != 4 else "x none",
                     justify="left" if words else "right", overflow="fold" if words else
                     "ellipsis", max_width=None if wide or not words else 30)
    none_seconds = planner.seconds(parse("none"))
    out, marked = [], False
    for b in found.budgets:
        cells, entry = _budget_row(b, planner, found, presets, none_seconds, emit_to, own)
        p = found.plans.get(b)
        preset = None if wide or p is None else same_preset(p, records)
        if preset is not None and preset != p.spec:
            cells[2] = f"{preset} (same program)"
        marked |= wide and PREDICTED in cells[9]
        t.add_row(*(cells[i] for i in keep))
        out.append(entry)
    return t, out, marked


def _preset_cells(planner, best: PresetRow | None, shown: bool, none_seconds) -> tuple:
    """(the best preset's four cells, its --json entry or None)."""
    if best is None:
        return ["no preset fits" if shown else "not compared", "-", "-", "-"], None
    mark = "" if best.record is not None else PREDICTED
    over = None if best.seconds is None else best.seconds / none_seconds - 1
    cells = [", ".join(best.names), mark + fmt_bytes(best.memory_bytes),
             f"{mark}{best.flops / planner.none_flops() - 1:+.2%}",
             "-" if over is None else f"{mark}{over:+.2%}"]
    return cells, best.to_dict(planner.memory_kind) | {"predicted_seconds": best.seconds,
                                                      "time_overhead": over}


def _budget_row(b, planner, found, presets: list[PresetRow], none_seconds, emit_to,
                own=None):
    """(a budget's table cells, its --json entry): its plan, or below the minimum, and the
    best preset that fits (fewest FLOPs or least predicted time, the planner's objective)."""
    from remat_kit.policy.budget import parse_budget
    full, none = found.full, found.none
    limit = parse_budget(b).resolve(none)
    best = min((r for r in presets if r.memory_bytes <= limit),
               key=lambda r: _score(planner, r), default=None)
    preset_cells, best_entry = _preset_cells(planner, best, bool(presets), none_seconds)
    p = found.plans.get(b)
    if p is None:
        cells = [b, fmt_bytes(limit), "below the minimum"
                 + (f" ({full / none:.3f})" if none else f" ({fmt_bytes(full)})"),
                 "-", "-", "-", "-", "-", *preset_cells, "-"]
    else:
        cells = [b, fmt_bytes(limit), p.spec, fmt_bytes(p.measured_bytes),
                 "-" if p.memory_fraction is None else f"{p.memory_fraction:.3f}",
                 f"{p.flops_overhead:+.2%}",
                 "-" if p.time_overhead is None else f"{p.time_overhead:+.2%}",
                 "cached" if p.cached else str(p.iterations), *preset_cells,
                 audit_column(p.audit)]
        if p.audit and not p.audit["as_asked"]:  # not reported as the plan it compiles otherwise
            cells[2] = f"{p.spec} (compiled otherwise: {p.audit['findings'][0]})"
    entry = ({"budget": b, "budget_bytes": limit, "plan": p and p.to_dict(),
              "best_preset": best_entry} | extras(p, found.per_layer.get(b), emit_to, own))
    return cells, entry


def same_preset(p, records) -> str | None:
    """The name of the compiled preset whose program plan `p` is (the same canonical
    spec, or the same compiled memory and FLOPs), None where none is."""
    return next((r.names[0] for r in records if r.error is None and (
        r.policy == p.spec or (r.memory_bytes == p.measured_bytes
                               and r.flops == p.measured_flops))), None)


def _uniformity(p, per_layer) -> dict:
    """What one decision per tag costs against the per-layer plan: FLOPs (over no
    remat's) and bytes more."""
    return {"flops": p.flops_overhead - per_layer.flops_overhead,
            "bytes": p.measured_bytes - per_layer.measured_bytes}


def extras(p, per_layer, emit_to: str | None, own=None) -> dict:
    """A budget's --json entries for --uniform ("per_layer", "uniformity_cost") and
    --emit ("emit": `emit.emit_entry`, `own` the names the model emits itself)."""
    from remat_kit.decide.emit import emit_entry
    out = {}
    if per_layer is not None and p is not None:
        out |= {"per_layer": per_layer.to_dict(), "uniformity_cost": _uniformity(p, per_layer)}
    if emit_to is not None:
        out["emit"] = p and emit_entry(p, emit_to, own)
    return out


def report_lines(budget, p, per_layer, emit_to: str | None, own=None) -> list[str]:
    """The lines under the table for one budget: what uniformity costs, and the plan
    written out for --emit (or the one line saying why it cannot be; `own` as `extras`)."""
    from remat_kit.decide.emit import emit_entry
    lines = []
    if per_layer is not None:
        cost = _uniformity(p, per_layer)
        lines.append(f"budget {budget}: one decision per tag costs {cost['flops']:+.2%} of no "
                     f"remat's FLOPs and {fmt_bytes(cost['bytes'])} against the per-layer plan "
                     f"({per_layer.spec}: {per_layer.flops_overhead:+.2%}, "
                     f"{fmt_bytes(per_layer.measured_bytes)})")
    if emit_to is not None:
        entry = emit_entry(p, emit_to, own)
        lines.append(f"budget {budget}, --emit {emit_to}:")
        lines.append(entry["text"] if entry["refused"] is None else f"refused: {entry['refused']}")
    return lines


__all__ = ["LEGEND", "PREDICTED", "PresetRow", "extras", "report_lines", "rows", "same_preset",
           "split", "starting_points", "table"]
