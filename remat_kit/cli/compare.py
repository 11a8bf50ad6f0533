"""`remat-kit compare`: every policy measured compile-only (`remat_kit.api.answers.measure`),
one table per target sorted by memory (`remat_kit.ui.report`), with --json, --csv and
--plot.
Docs: docs/compare.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax

from remat_kit import mesh as rk_mesh
from remat_kit.trace import retarget
from remat_kit.measure import pool
from remat_kit.cli.common import (budget_bytes, map_context, mesh_origin, step_caption,
                                  plot_path, print_map, sizes_text, source_and_sizes, targets_of)
from remat_kit.ui.inputs import (BadInput, check_json_and_plot, check_memory, check_planner_floor,
                                  check_schedules, device_mesh, preset_policies, split_policies)
from remat_kit.policy.spec import AutoSpec, parse


def run(args) -> int:
    """`remat-kit compare` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from remat_kit.ui import plots, report
    from remat_kit.cli import verdict

    # Every check comes before JAX starts measuring, so bad input costs nothing.
    src, batch, seq = source_and_sizes(args)
    cfg, label = src.cfg, src.label
    target_list = targets_of(args.target)
    try:
        specs = default_policies(args.policies, target_list)
    except BadInput as e:  # a model's module outside its layers is no unknown tag
        outside = cfg is None and _outside_line(args.policies, src.workload(batch, seq))
        raise BadInput(outside or str(e)) from None
    check_schedules(cfg, specs, "--policies")
    check_json_and_plot(args)
    budget = None if args.budget is None else budget_bytes(args.budget)
    if args.time and any(t.aot for t in target_list):
        raise BadInput("--time runs steps, which needs the devices: a target compiled ahead "
                       "of time (tpu:<topology>) cannot be timed")
    meshes = [device_mesh(args.mesh, batch, cfg, t) for t in target_list]
    works = [src.workload(batch, seq, mesh) for mesh in meshes]  # traced, not compiled
    specs += with_fused_attention(args.policies, target_list, works[0], specs)
    if cfg is None:
        check_schedules(works[0], specs, "--policies")
    auto = [p.budget for p in map(parse, specs) if isinstance(p, AutoSpec)]
    for target, mesh, work in zip(target_list, meshes, works):
        check_planner_floor(work, auto, target, mesh, "--policies auto:budget=")

    spent: list[float] = []

    def progress(i, n, record):
        spent.append(record.compile_seconds or 0.0)
        print(f"{progress_line(i, n, record, spent)} ({pool.current().status()})",
              file=sys.stderr, flush=True)

    _check_own_meshes(target_list, works)
    print(estimate_line(specs, target_list), file=sys.stderr, flush=True)
    sections, contexts = [], []
    dtype = src.dtype(works[0])
    for target, asked, work in zip(target_list, meshes, works):
        section, context = _on_target(args, src, (batch, seq, dtype), specs, progress,
                                      (target, asked, work))
        sections.append(section)
        contexts.append(context)
    print_map(works[0])  # the map's line first, as in every report, then the verdict
    for line in _verdict_lines(sections, args.target is not None, budget):
        print(line, flush=True)
    if len(sections) == 1:
        report.print_table(sections[0][2], sections[0][1], wide=args.wide)
    else:
        report.print_side_by_side(
            [(str(t), rows) for t, _, rows in sections],
            f"{label}: {sizes_text(batch, seq)}, {dtype}, loss: {src.loss}, per device",
            wide=args.wide)
    for target, _, rows in sections:
        if len(sections) > 1 and args.peak:
            print(f"{target}:")
        report.print_peaks(rows)
    for line in (policy_notes([d for _, _, rows in sections for d in rows])
                 if cfg is None else []):
        print(line, file=sys.stderr)
    if args.json is not None:
        # The first target's fields stay at the top level (schema 1); "targets" has them all.
        context = {"config": label, "batch": batch, "seq": seq, "dtype": dtype,
                   **contexts[0], "targets": contexts, **map_context(works[0])}
        report.write_json(args.json, [d for _, _, rows in sections for d in rows], context,
                          [v for t, _, rows in sections
                           if (v := verdict.to_json(verdict.pick_compare(rows, t.memory, budget),
                                                   t))])
    if args.plot is not None:
        for target, title, rows in sections:
            plots.plot(plot_path(args.plot, target, len(sections) > 1), rows, title)
    # No row with a figure on any target: a failure that scripts and CI must see.
    return 1 if all(verdict.pick_compare(rows) is None for _, _, rows in sections) else 0


def _check_own_meshes(target_list, works) -> None:
    """Refuse, before the first compile, a model's own mesh that does not fit a target's
    devices (a pipeline's must stay on them); print a line for each target's unused chips.
    Raises BadInput from `retarget`."""
    for target, work in zip(target_list, works):
        own = work.own_mesh
        if own is not None and not set(own.devices.flat) <= set(target.devices):
            retarget.check_fits(own, target.devices, str(target))
            if getattr(work.model_map, "pipeline", None) is not None:
                retarget.check_stays(own, target.devices, str(target))
        if (line := unused_chips(own, target)) is not None:
            print(line, file=sys.stderr, flush=True)


def _on_target(args, src, sizes, specs, progress, where) -> tuple:
    """((target, title, rows), the JSON context) of compare's policies measured on one
    target: `where` = (the target, the --mesh asked, the workload); a model's own mesh
    first."""
    from remat_kit.ui import report
    from remat_kit.api.answers import measure
    (target, asked, work), (batch, seq, dtype), cfg = where, sizes, src.cfg
    mesh = (work.mesh if work.mesh is not None or work.own_mesh is not None
            else rk_mesh.plain(asked))
    devices = 1 if mesh is None else mesh.size
    batch_split = 1 if mesh is None else rk_mesh.axis_size(mesh, "batch")
    if getattr(work, "placement", None):  # a model's own batch axes: as its tokens are split
        first = jax.tree.leaves(work.args[1])[0]
        batch_split = first.shape[0] // rk_mesh.local_shape(first).shape[0]
    tensor = 1 if mesh is None else rk_mesh.axis_size(mesh, "heads")
    if args.time and cfg is not None:
        check_memory(cfg, batch // batch_split, seq, f"--batch {batch} and --seq {seq}")
    records = measure(work, policies=specs, names=specs, time_steps=args.time,
                      progress=progress, target=target, per_layer=True, peak=args.peak)
    found = target.versions
    mesh_text = rk_mesh.spec_text(mesh)
    step, origin = (step_caption("value-and-grad", work.mesh, work.args[0], records),
                    mesh_origin(work, asked, target))
    how = getattr(work, "placement", None)
    per_device = (f", per device of {devices} ({mesh_text}); "
                  f"{step_caption('value-and-grad', work.mesh, work.args[0], records, origin)}"
                  f"{'; ' + how if how else ''}" if devices > 1 else "")
    title = (f"{src.label}: {sizes_text(batch, seq)}, {dtype}, loss: {src.loss} "
             f"({target.label}{per_device})")
    share = None if batch is None else batch // batch_split  # None: leaves as declared
    context = {"target": str(target), "platform": target.label, "devices": devices,
               "mesh": mesh_text if devices > 1 else args.mesh, "step": step,
               "mesh_origin": origin, "placement": getattr(work, "placement", None),
               "jax_version": found["jax"], "compiler_version": found["compiler"]}
    return (target, title, report.rows(records, cfg, share, seq, tensor=tensor)), context


def _outside_line(text: str, work) -> str | None:
    """Where a --policies name the vocabulary lacks is a module the model runs outside
    every layer (its map's `outside`), one line saying so; else None."""
    from remat_kit.errors import RematSpecError
    outside = set(work.model_map.outside) if work.model_map is not None else set()
    for piece in text.split(","):
        try:
            parse(piece.strip())
        except RematSpecError as e:
            if e.token in outside:
                return (f"--policies {piece.strip()!r}: `{e.token}` is emitted only outside the "
                        f"layers (the model map: outside: {', '.join(work.model_map.outside)}): "
                        "no remat policy saves or recomputes it, it is kept as with no remat")
    return None


# compare's default on a TPU or GPU target, whose compiles take up to a minute or more
# each on a long sequence: the policies that answer "which one" (`--policies all` for
# every preset).
ACCELERATOR_POLICIES = ("none", "full", "minimal", "dots", "selective")


def default_policies(text: str | None, target_list) -> list[str]:
    """--policies as specs; without it, every preset on the CPU and
    `ACCELERATOR_POLICIES` where any target is a TPU or GPU; 'all' for every preset
    anywhere."""
    if text is not None and text.strip() != "all":
        return split_policies(text)
    if text is None and any(t.platform != "cpu" for t in target_list):
        return list(ACCELERATOR_POLICIES)
    return preset_policies()


# The preset a fused attention kernel (splash, cuDNN) adds to the accelerator default: it
# keeps the kernel's output, which spares its forward's rerun where the kernel's
# residuals are named `context` (splash's residual_checkpoint_name).
FUSED_ATTENTION_POLICY = "minimal_with_context"


def with_fused_attention(text: str | None, target_list, work, specs) -> list[str]:
    """[`FUSED_ATTENTION_POLICY`] to add to the accelerator default (no --policies, a TPU
    or GPU target) where `work` (a `Workload`) has fused attention (its notes say no
    scores exist); [] otherwise."""
    fused = any("fused attention" in n for n in work.notes)
    default = text is None and any(t.platform != "cpu" for t in target_list)
    return [FUSED_ATTENTION_POLICY] if (fused and default
                                        and FUSED_ATTENTION_POLICY not in specs) else []


def policy_notes(report_rows) -> list[str]:
    """The rows' notes, each once, prefixed by the policies whose rows have it ("note
    (full, minimal): ..."), or "every policy" where every compiled row has it; a note
    that opens with its policy's name ("dots: none of the tags ...") loses it there."""
    policies: dict[str, list[str]] = {}
    for d in report_rows:
        for n in d["notes"]:
            name = next((m for m in d["names"] if n.startswith(f"{m}: ")), d["names"][0])
            policies.setdefault(n.removeprefix(f"{name}: "), []).append(name)
    every = {d["names"][0] for d in report_rows if d["error"] is None}

    def who(names):
        return ("every policy" if set(names) >= every and len(every) > 1
                else ", ".join(dict.fromkeys(names)))
    return [f"note ({who(names)}): {n}" for n, names in policies.items()]


def unused_chips(own, target) -> str | None:
    """The line naming the chips of `target` that the model's own mesh `own` (a Mesh,
    or None) leaves unused, e.g. a 4-chip mesh on `tpu:v5p:2x2x1:slices=2`; None where
    it uses them all, or there is no own mesh or topology."""
    chips = target.chip_count
    if own is None or chips is None or own.size >= chips:
        return None
    return (f"note: the model's own mesh ({rk_mesh.spec_text(own)}) uses {own.size} of "
            f"{target}'s {chips} chips; the other {chips - own.size} are unused, and the "
            f"figures are those of its {own.size}; build the mesh over all of them (or "
            "name a smaller --target) to measure the slice")


def progress_line(i: int, n: int, record, spent: Sequence[float]) -> str:
    """'[2/5] tpu:v5p:1x1x1: minimal: 152.8 s; about 8 min left': compile `i` of `n`, and
    where the rest would take a minute or more at the mean of the compiles so far
    (`spent`, seconds: this model's own compile time, not a guess of its size)."""
    status = "error" if record.error else f"{record.compile_seconds:.1f} s"
    left = (n - i) * sum(spent) / max(len(spent), 1)
    rest = f"; about {round(left / 60)} min left" if left >= 60 else ""
    return f"[{i}/{n}] {record.target}: {', '.join(record.names)}: {status}{rest}"


def estimate_line(specs, target_list) -> str:
    """The line before the compiles: how many, for which targets, and on an accelerator
    target what their time depends on, with no figure that is not this model's own: the
    progress lines give the time left from its compiles (`progress_line`, docs/speed.md)."""
    n = len(specs) * len(target_list)
    where = ", ".join(map(str, target_list))
    slow = [t for t in target_list if t.platform != "cpu"]
    return (f"compiling {n} program{'s' * (n != 1)} for {where} (policies that compile "
            "alike are compiled once)"
            + ("; a TPU or GPU compile takes seconds for a small model, a minute or more for "
               "a large one at a long sequence: after the first, each line gives the time "
               "left at this model's own pace (a repeat is read from the compile cache)"
               if slow else ""))


def _verdict_lines(sections, asked_target: bool, budget: int | None) -> list[str]:
    """The verdict (`verdict.verdict`) of each target's table, within `budget` bytes
    (--budget) or the target's memory (`verdict.pick_compare`); the CPU note once."""
    from remat_kit.cli import verdict
    lines = []
    for target, _, rows in sections:
        choice = verdict.pick_compare(rows, target.memory, budget)
        if choice is None:
            lines.append(f"{target}: no policy compiled; each row below says why")
            continue
        lines += [line for line in verdict.verdict(choice, target, asked_target=asked_target)
                  if line not in lines]
    return lines


__all__ = ["ACCELERATOR_POLICIES", "FUSED_ATTENTION_POLICY", "policy_notes", "unused_chips",
           "with_fused_attention", "default_policies", "estimate_line", "progress_line", "run"]
