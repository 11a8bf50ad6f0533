"""`remat-kit plan`: the budget planner (`remat_kit.decide.plan`) for each budget, set
against the best fixed preset that fits, with what holds a budget below the minimum,
the offload probe's figure, --json (for `rk.remat_model` and training) and --plot.
Docs: docs/plan.md.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time

from remat_kit import files as outputs
from remat_kit import mesh as rk_mesh
from remat_kit.measure import pool
from remat_kit.cli.common import (map_context, mesh_origin, print_map, sizes_text, step_caption,
                                  source_and_sizes, targets_of)
from remat_kit.ui.inputs import (BadInput, check_json_and_plot, check_planner_floor,
                                  check_schedules, device_mesh, plan_groups, preset_policies,
                                  split_budgets, split_policies)
from remat_kit.ui.sources import rechunked
from remat_kit.cli.plan_table import (LEGEND, extras, near_budgets, report_lines, rows, same_preset,
                                      split, table)
from remat_kit.policy.spec import parse
from remat_kit.units import fmt_bytes


def run(args) -> int:
    """`remat-kit plan` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from remat_kit.decide.plan import offload_bandwidth
    from remat_kit.measure.time_model import OBJECTIVES

    src, batch, seq = source_and_sizes(args)
    cfg = src.cfg
    budgets = split_budgets(args.budgets)
    check_json_and_plot(args)
    _check_cache(args.cache)
    target_list = targets_of(args.target)
    if len(target_list) > 1:
        raise BadInput(f"plan takes one --target, got {args.target!r}")
    step, emit_to = checked_step_and_emit(args, target_list[0], budgets)
    presets = _presets(args, cfg, step, emit_to)
    if args.offload:
        offload_bandwidth(target_list[0], True)  # no host memory: one line, before any work
    mesh = device_mesh(args.mesh, batch, cfg, target_list[0])
    if args.uniform and args.groups is not None and args.groups.strip() != "1":
        raise BadInput(f"--uniform and --groups {args.groups} conflict: --uniform is one "
                       "decision per tag for every layer (--groups 1); give one of them")
    if args.objective is not None and args.objective not in OBJECTIVES:
        raise BadInput(f"--objective {args.objective!r}: use one of {', '.join(OBJECTIVES)}")
    work = src.workload(batch, seq, mesh)
    check_planner_floor(work, budgets, target_list[0], mesh, "--budgets")
    if cfg is None:
        check_schedules(work, presets, "--presets")
    groups = plan_groups(args.groups, work.num_layers or 1)
    planner = _planner(args, work, target_list[0], 1 if args.uniform else groups, step,
                       emit_to)
    compiled, predicted = split(planner, presets, args.presets is not None)
    records = _preset_records(planner, compiled)
    found = _frontier(args, planner, budgets, target_list[0],
                      lambda n: rechunked(args, n).workload(batch, seq, mesh))
    preset_rows = rows(planner, records, predicted)  # after planning: predicts from its compiles
    near = near_budgets(planner, found, preset_rows[0])
    if near:  # predictions near a budget that would beat its plan: compiled, then planned again
        records += _preset_records(planner, near)
        again = _frontier(args, planner, budgets, target_list[0],
                          lambda n: rechunked(args, n).workload(batch, seq, mesh))
        found = dataclasses.replace(again, seconds=found.seconds + again.seconds)
        preset_rows = rows(planner, records, [p for p in predicted if p not in near])
    used = (work.mesh if work.mesh is not None or work.own_mesh is not None  # the model's own
            else rk_mesh.plain(mesh))
    shown = _Shown(src.label, batch, seq, src.dtype(work), src.loss,
                   1 if used is None else used.size,
                   step_caption("train step" if planner.step == "train"
                                else "value-and-grad", work.mesh, work.args[0],
                                [planner.measure(parse("full")), *records],
                                mesh_origin(work, mesh, target_list[0])), emit_to,
                   _own_tags(src, batch, seq) if emit_to == "jax" else None)
    return _report(args, planner, work, found, records, preset_rows, shown)


# What a train-step plan for a training run (--step train --emit ...) is set against by
# default: each preset is a train-step compile at full size, and the run needs the plan.
EMIT_PRESETS = ("none", "full")


def _presets(args, cfg, step: str, emit_to: str | None) -> list[str]:
    """The presets to set against the plans (--presets; none with --no-presets; by
    default every preset, compiled or predicted as `plan_table.split` says, or
    `EMIT_PRESETS` only with --step train and --emit);
    BadInput for a spec the model cannot take or an auto spec."""
    default = (list(EMIT_PRESETS) if step == "train" and emit_to is not None
               else preset_policies())
    presets = ([] if args.no_presets else split_policies(args.presets, "--presets")
               if args.presets is not None else default)
    check_schedules(cfg, presets, "--presets")
    auto = [p for p in presets if p.strip().startswith("auto")]
    if auto:
        raise BadInput(f"--presets: {auto[0]!r} is a budget for the planner, not a preset; "
                       "give its budget in --budgets")
    return presets


def _check_cache(path: str | None) -> None:
    """BadInput for a --cache that cannot be written, or holds something other than a
    plan cache; '' and None pass (none, the default)."""
    from remat_kit.decide.plan import read_cache
    from remat_kit.decide.plan_cache import CACHE_LIMIT
    # A cache in a folder not made yet is fine: the first plan makes it.
    if path and os.path.isdir(os.path.dirname(os.path.abspath(path))) \
            and (why := outputs.problem(path)):
        raise BadInput(f"--cache: {why}; give a plan cache file, or '' for none")
    if path and read_cache(path) is None:
        raise BadInput(f"--cache {path!r} is not a plan cache (a JSON object of plans "
                       f"written by remat-kit plan, not its --json report; at most "
                       f"{CACHE_LIMIT >> 20} MiB); give a new file, or '' for none")


def _planner(args, work, target, groups, step, emit_to):
    """The `Planner` for the flags, its progress on stderr; BadInput for --groups the
    program cannot take. Prints how far the target's time model was checked where the
    objective is time."""
    from remat_kit.decide.cost_model import PLANNED_BASES
    from remat_kit.decide.emit import maxtext_taggable
    from remat_kit.decide.plan import Planner

    def progress(message):
        print(f"{message} ({pool.current().status()})", file=sys.stderr, flush=True)

    planner = Planner(work, progress=progress,
                      cache=args.cache if args.cache is not None else True,
                      target=target, groups=groups, objective=args.objective,
                      offload=args.offload, step=step,
                      bases=("nothing",) if emit_to == "maxtext" else PLANNED_BASES,
                      no_remat=emit_to != "maxtext")  # MaxText cannot run no remat
    if isinstance(groups, int) and groups > 1 and planner.program.per_layer:
        raise BadInput(f"--groups {groups}: not possible, {planner.program.per_layer}; "
                       "give --groups 1 or leave it out")
    if emit_to == "maxtext":  # the plan keeps to the tensors MaxText's custom policy names
        planner.decide = maxtext_taggable(planner.program.planned_names())
    if planner.objective == "time":  # how far this target's time model was checked
        print(planner.time_check, file=sys.stderr, flush=True)
    return planner


def _preset_records(planner, presets) -> list:
    """The presets' records, measured by `planner`, one per distinct program with every
    spec that compiled to it in `names`. Presets first: the planner takes any compiled
    policy that beats its own plan."""
    named: dict[int, tuple] = {}
    with planner.in_phase("presets"):  # the progress line's phase
        measured = planner.measure_all([parse(p) for p in presets], names=presets)
    for spec, r in zip(presets, measured):
        named[id(r)] = (r, named.get(id(r), (r, ()))[1] + (spec,))
    return [dataclasses.replace(r, names=names) for r, names in named.values()]


@dataclasses.dataclass(frozen=True)
class _Frontier:
    """What the planner found for the budgets.

    Attributes:
      budgets: the budgets asked for, as given (--budgets).
      full: the least compiled memory, bytes. none: no remat's, None where it runs out.
      fits: the budgets at or above `full`. plans: {budget: Plan} for them.
      seconds: the planning's wall time. per_layer: {budget: per-layer Plan} (--uniform).
      held, held_parts: what holds the minimum (`search.what_holds`), where a budget is
        below it; else ("", None).
    """

    budgets: list
    full: int
    none: int | None
    fits: list
    plans: dict
    seconds: float
    per_layer: dict
    held: str
    held_parts: dict | None
    stages: dict = dataclasses.field(default_factory=dict)


def _frontier(args, planner, budgets, target, rechunk) -> _Frontier:
    """The plans for the budgets that fit, and what holds the minimum for those that
    do not (`rechunk(n)`: the workload with its loss over n vocabulary chunks).
    BadInput for a fraction where no remat runs out of `target`'s memory."""
    from remat_kit.decide.search import what_holds
    from remat_kit.decide.stages import per_stage
    from remat_kit.policy.budget import parse_budget
    start = time.perf_counter()
    full, none = planner.minimum()
    if none is None and any(parse_budget(b).bytes is None for b in budgets):
        raise BadInput(f"--budgets: no remat runs out of {target}'s memory at these "
                       "shapes, so a fraction of it means nothing; give budgets in bytes")
    fits = [b for b in budgets if parse_budget(b).resolve(none) >= full]
    plans = dict(zip(fits, planner.frontier(fits)))
    seconds = time.perf_counter() - start
    per_layer = dict(zip(fits, layered(planner).frontier(fits))) if args.uniform else {}
    held, held_parts = (what_holds(planner, rechunk) if len(fits) < len(budgets)
                        else ("", None))
    pipe = getattr(planner.compiles.workload.model_map, "pipeline", None)
    stages = {b: per_stage(planner, pipe, parse_budget(b).resolve(none)) for b in fits
              } if pipe is not None else {}
    return _Frontier(budgets, full, none, fits, plans, seconds, per_layer, held, held_parts,
                     stages)


@dataclasses.dataclass(frozen=True)
class _Shown:
    """What the report names beside the planner's figures: the model's label, the global
    batch and seq, the dtype, the loss measured (`Source.loss`), the devices, the compiled step's words, and --emit's
    framework (None without) and the names the model emits itself (None: not known)."""

    label: str
    batch: int | None
    seq: int | None
    dtype: str
    loss: str
    devices: int
    compiled: str
    emit_to: str | None
    own_tags: frozenset | None = None  # the names the model emits itself (--emit jax)


def _report(args, planner, work, found: _Frontier, records, preset_rows: tuple,
            shown: _Shown) -> int:
    """The model map, the table, the lines under it (the legend of predicted figures,
    the presets the cost model cannot predict), --json and --plot (`preset_rows`:
    `plan_table.rows`); 1 where no budget can be met, else 0."""
    import json

    from remat_kit.ui import plots, report
    from remat_kit.cli import verdict
    from remat_kit.measure.record import MEMORY_LABELS

    memory = MEMORY_LABELS[planner.memory_kind]
    title = _title(planner, found, shown, memory)
    presets, unpriced = preset_rows
    shown_table, out, marked = table("", planner, found, records, presets, shown.emit_to,
                                     memory, args.wide, shown.own_tags)
    console = report.terminal_console(200)
    print_map(work)  # the map's line first, as in every report, then the verdict
    choice = plan_choice(planner, found, records, args)
    for line in verdict_lines(choice, planner, found, args):
        console.print(line, markup=False, emoji=False, soft_wrap=True)
    report.print_title(console, title)
    console.print(shown_table)
    if marked:
        console.print(LEGEND, markup=False)
    if unpriced and args.wide:
        console.print(f"not compared (the cost model cannot predict them; --presets compiles "
                      f"them): {', '.join(unpriced)}", markup=False, soft_wrap=True)
    _print_notes(console, planner, found, shown.emit_to, shown.own_tags)
    # The presets' notes (a preset that compiles as its base rule on this model), as compare
    # prints them: never in the JSON only.
    for note in dict.fromkeys(n for r in records for n in r.notes):
        print(f"note: {note}", file=sys.stderr)
    fits = found.fits
    console.print(f"planned {len(fits)} budget{'' if len(fits) == 1 else 's'} in "
                  f"{found.seconds:.1f} s"
                  + (" (the presets compiled before, not counted)" if records else ""))
    if args.json is not None:
        from remat_kit.flax.measured import PLAN_SCHEMA_VERSION
        with outputs.atomic_write(args.json) as f:
            json.dump({"schema_version": PLAN_SCHEMA_VERSION,
                       "context": _context(planner, work, found, shown),
                       "verdict": verdict.to_json(choice, planner.target),
                       "budgets": out,
                       "stages": {b: [sp.to_dict() for sp in v]
                                  for b, v in found.stages.items()},
                       "presets": [r.to_dict(planner.memory_kind) for r in presets]}, f,
                      indent=2)
            f.write("\n")
    if args.plot is not None:
        planned = [dataclasses.replace(planner.records[p.spec], names=(f"auto:budget={b}",))
                   for b, p in found.plans.items()]
        plots.plot(args.plot, report.rows(records + planned), title)
    if not fits:
        print(f"error: no budget can be met: each is below the least compiled memory, "
              f"{fmt_bytes(found.full)} {memory}", file=sys.stderr)
        return 1
    return 0


def plan_choice(planner, found: _Frontier, records, args):
    """The `verdict.Choice` for the first budget that can be met: its plan, named by the
    preset it compiles alike to where there is one, else with --json the file to paste,
    else its spec; None where no budget can be met."""
    from remat_kit.cli import verdict
    from remat_kit.measure.record import MEMORY_LABELS
    if not found.plans:
        return None
    b, p = next(iter(found.plans.items()))
    preset = same_preset(p, records)
    ratio = "" if p.memory_fraction is None else f" ({p.memory_fraction:.3f} x none)"
    fewest = "pred. step" if planner.objective == "time" else "FLOPs"
    why = (f"plan for {b}: fewest {fewest} within {fmt_bytes(found_limit(b, found))}"
           + (f"; preset {preset}'s program" if preset and preset != p.spec else ""))
    file = args.json if preset is None and args.json is not None else None
    return verdict.Choice(name=file or preset or p.spec,
                          gives=f"{MEMORY_LABELS[p.memory_kind]} {fmt_bytes(p.measured_bytes)}"
                                f"{ratio}",
                          cost=verdict.cost_text(p.flops_overhead, p.time_overhead), why=why,
                          budget=b if file else None, spec=p.spec if file else None)


def verdict_lines(choice, planner, found: _Frontier, args) -> list[str]:
    """The verdict's lines (`verdict.verdict`) of `plan_choice`; with --emit, a pointer to
    the text below. One line where no budget can be met."""
    from remat_kit.cli import verdict
    from remat_kit.measure.record import MEMORY_LABELS
    if choice is None:
        return [f"{planner.target}: no budget can be met: the least compiled memory is "
                f"{fmt_bytes(found.full)} {MEMORY_LABELS[planner.memory_kind]} (see below)"]
    lines = verdict.verdict(choice, planner.target, asked_target=args.target is not None)
    if args.emit is not None:
        lines.insert(2, f"--emit {args.emit}: the text under the table")
    return lines


def found_limit(budget, found: _Frontier) -> int:
    """`budget` in bytes (a fraction of no remat's memory resolved)."""
    from remat_kit.policy.budget import parse_budget
    return parse_budget(budget).resolve(found.none)


def _title(planner, found: _Frontier, shown: _Shown, memory: str) -> str:
    """The table's title: the model, sizes, dtype, platform, devices, and no remat's and
    the least compiled memory."""
    full, none, devices = found.full, found.none, shown.devices
    return (f"{shown.label}: {sizes_text(shown.batch, shown.seq)}, {shown.dtype}, "
            f"loss: {shown.loss} "
            f"({planner.measure(parse('full')).platform}"
            f"{f', per device of {devices}; {shown.compiled}' if devices > 1 else ''}); "
            f"no remat: {fmt_bytes(none) + ' ' + memory if none else 'out of device memory'}, "
            f"least compiled: {fmt_bytes(full)}{f' ({full / none:.3f})' if none else ''}")


def _print_notes(console, planner, found: _Frontier, emit_to, own=None) -> None:
    """The lines under the table: offload's bandwidth, probe and notes, the step the
    budgets cover, each budget's uniformity cost and --emit text, and what holds the
    minimum."""
    from remat_kit.decide.plan import CPU_OFFLOAD_NOTE
    from remat_kit.decide.step_records import STEP_WORDS
    on_cpu = planner.target.platform == "cpu"
    if planner.host_bandwidth is not None:
        console.print(f"offload asked for: host transfers at "
                      f"{planner.host_bandwidth / 1e9:.1f} GB/s each way ({'this CPU' if on_cpu else planner.roofline.source}),"
                      " hidden behind each layer's predicted compute, the excess charged",
                      markup=False)
        console.print(planner.offload_probe.note, markup=False)
        if on_cpu:
            console.print(CPU_OFFLOAD_NOTE, markup=False)
    for b, p in found.plans.items():
        for note in p.offload_notes:
            if note not in (CPU_OFFLOAD_NOTE, planner.offload_probe.note):
                console.print(f"budget {b}: {note}", markup=False)
    console.print(f"budgets cover {STEP_WORDS[planner.step]}", markup=False)
    for b, p in found.plans.items():
        for line in report_lines(b, p, found.per_layer.get(b), emit_to, own):
            console.print(line, markup=False, soft_wrap=True)
    for line in _stage_lines(planner, found, emit_to):
        console.print(line, markup=False, soft_wrap=True)
    if found.held:
        console.print(f"below the minimum: {found.held}", markup=False, soft_wrap=True)


def _stage_lines(planner, found: _Frontier, emit_to) -> list[str]:
    """A pipelined model's lines: per budget, each stage's plan (`stages.per_stage`), and
    with --emit maxtext the pipeline's settings beside the first stage's policy."""
    from remat_kit.decide.stages import lines as stage_lines, maxtext_settings
    pipe = getattr(planner.compiles.workload.model_map, "pipeline", None)
    if pipe is None:
        return []
    lines = []
    for b, stage_plans in found.stages.items():
        lines.append(f"budget {b}, a plan per stage ({pipe.schedule}; each stage's figure is "
                     f"the compiled program's, its residuals scaled to the passes it holds):")
        lines += [f"  {line}" for line in stage_lines(stage_plans)]
    if emit_to == "maxtext":
        lines.append(f"--emit maxtext, the pipeline: {maxtext_settings(pipe)} (MaxText runs "
                     "one remat_policy on every stage: the first stage's plan, the tightest)")
    return lines


def _context(planner, work, found: _Frontier, shown: _Shown) -> dict:
    """--json's `context`: the model, sizes, devices, step, platform, memory figures, the
    planning's seconds, what holds the minimum, and the offload probe."""
    return {**map_context(work), "config": shown.label, "batch": shown.batch, "seq": shown.seq,
            "dtype": shown.dtype, "devices": shown.devices, "step": shown.compiled,
            "platform": planner.measure(parse("full")).platform,
            "memory_kind": planner.memory_kind, "none_bytes": found.none,
            "minimum_bytes": found.full, "minimum_peak": found.held_parts,
            "below_minimum": found.held, "plan_seconds": found.seconds,
            "block": work.block_name, "num_layers": work.num_layers,
            "parameters": work.parameter_count,
            "offload_probe": (probe := planner.offload_probe) and {
                **dataclasses.asdict(probe), "figure": probe.figure}}


def _own_tags(src, batch, seq) -> frozenset | None:
    """The names a --model emits itself (`user_model.own_tags`); None for --config (the
    reference transformer tags its own values) and a Workload FUNCTION (not known)."""
    from remat_kit.flax.user_model import own_tags
    return None if src.cfg is not None else own_tags(src.make, batch, seq)


def checked_step_and_emit(args, target, budgets) -> tuple[str, str | None]:
    """(the step the budgets cover, the --emit framework or None), checked before any
    work: --step one of grad|train (default `step_records.default_step`), --emit one of
    `emit.FRAMEWORKS`, and maxtext or jax only with --uniform (or --groups 1): they take
    one setting per tensor for every layer."""
    from remat_kit.decide.emit import FRAMEWORKS
    from remat_kit.decide.step_records import STEPS, default_step
    if args.step is not None and args.step not in STEPS:
        raise BadInput(f"--step {args.step!r}: use one of {', '.join(STEPS)}")
    if args.emit is not None and args.emit not in FRAMEWORKS:
        raise BadInput(f"--emit {args.emit!r}: use one of {', '.join(FRAMEWORKS)}")
    if args.emit in ("maxtext", "jax") and not (args.uniform or args.groups == "1"):
        raise BadInput(f"--emit {args.emit} takes one setting per tensor for every layer; "
                       "add --uniform (one decision per tag for every layer)")
    return args.step or default_step(target, budgets), args.emit


def layered(planner):
    """`planner` deciding each tag per layer (its default groups), sharing its compiles:
    the per-layer plan `--uniform` is set against."""
    other = copy.copy(planner)
    other.costs = copy.copy(planner.costs)  # its cost models shared, keyed by groups
    other.costs.groups = "layers"
    return other


__all__ = ["run"]
