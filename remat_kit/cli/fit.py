"""`remat-kit fit`: the longest sequence (or largest batch) whose whole train step fits
a per-device memory budget under each policy (`remat_kit.decide.fit`), with what holds
the floor and its remedy.
Docs: docs/fit.md.
"""

from __future__ import annotations

import json
import sys

from remat_kit import files as outputs
from remat_kit import mesh as rk_mesh
from remat_kit.measure import pool
from remat_kit.cli.common import (budget_bytes, map_context, mesh_origin, print_map,
                                  step_caption, targets_of)
from remat_kit.ui.inputs import (BadInput, check_json_and_plot, check_schedules, check_seq,
                                  device_mesh, split_policies)
from remat_kit.ui.sources import load_source, rechunked
from remat_kit.units import fmt_bytes


def run(args) -> int:
    """`remat-kit fit` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from remat_kit.decide.fit import DEFAULT_MAX_SIZE
    from remat_kit.errors import BudgetError
    from remat_kit.api.configs import fit

    src = load_source(args)
    _check_not_fixed(args)
    target_list = targets_of(args.target)
    if len(target_list) > 1:
        raise BadInput(f"fit takes one --target, got {args.target!r}")
    budget = default_budget(args, target_list[0])
    if (line := over_the_chip(budget, target_list[0])) is not None:
        print(line, file=sys.stderr, flush=True)
    batch, seq, multiple = _sizes(args, src, target_list[0])
    per_example = seq is None  # a --model batch without a sequence axis: images, latents
    seq = seq or 1  # so fit's FLOPs per token are FLOPs per example there
    specs = _policies(args, src.cfg)
    if args.multiple and args.multiple > DEFAULT_MAX_SIZE[args.vary]:
        raise BadInput(f"--multiple {args.multiple} is above the largest {args.vary} fit "
                       f"searches, {DEFAULT_MAX_SIZE[args.vary]}")
    _check_autos(specs, budget)
    check_json_and_plot(args)
    # Without --mesh the step runs on one device, of an AOT target's slice too.
    mesh = (device_mesh(args.mesh, batch if args.vary == "seq" else multiple, src.cfg,
                        target_list[0]) if args.mesh else None)
    model, dtype, first, mesh, rechunk = _model(args, src, specs, (batch, seq, multiple), mesh)
    try:
        result = fit(model, args.budget, vary=args.vary, policies=specs, batch=batch, seq=seq,
                     multiple=multiple, target=target_list[0], mesh=mesh,
                     progress=_progress(args.vary), rechunk=rechunk)
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    fixed = (f"batch {batch}" if args.vary == "seq" else "no sequence axis (FLOPs/token: per "
             "example)" if per_example else f"seq {seq}")
    origin = mesh_origin(first, mesh, target_list[0])
    # The parameters whole, for the caption's check against the compiled steps (a config's
    # traced here only on a mesh: on one device the caption claims no sharding).
    params = (first or src.workload(batch if args.vary == "seq" else multiple,
                                    multiple if args.vary == "seq" else seq, mesh)).args[0] \
        if result.mesh else None
    _report(args, src.label, result, (fixed, budget, f"{dtype}, loss: {src.loss}", multiple,
                                      origin), src.cfg, first,
            target_list[0], params)
    return 0


def default_budget(args, target) -> int:
    """--budget in bytes; where it is not given, what one device of `target` holds for a
    program (`Target.memory`: a GPU's share JAX's allocator takes, a TPU chip's HBM), said
    on stderr with how to change it, and set in `args.budget` (an auto row's budget).
    BadInput where it is not given and the target's memory is unknown (the CPU)."""
    if args.budget is not None:
        return budget_bytes(args.budget)
    memory = target.memory
    if memory is None:
        raise BadInput(f"fit needs --budget on target {target} (its memory is not known "
                       "here): device memory per device, e.g. --budget 16GiB")
    how = ("set XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. .9) or --budget to change it"
           if target.platform == "gpu" else "--budget to change it")
    print(f"budget: {fmt_bytes(memory.usable)} per device, what {target} holds for a program "
          f"({memory.source}); {how}", file=sys.stderr, flush=True)
    args.budget = f"{memory.usable}B"
    return memory.usable


def over_the_chip(budget: int, target) -> str | None:
    """The line saying that `budget` bytes is more than one device of `target` holds for
    a program (`Target.memory`: on a GPU the share JAX's allocator takes, 75% by default);
    None where it is not, or the memory is unknown."""
    memory = target.memory
    if memory is None or budget <= memory.usable:
        return None
    fix = ("; set XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. .95) to let JAX take more"
           if target.platform == "gpu" else "")
    return (f"note: --budget {fmt_bytes(budget)} is more than {target} holds for a program, "
            f"{fmt_bytes(memory.usable)} ({memory.source}){fix}")


def _check_not_fixed(args) -> None:
    """BadInput for --seq (or --batch) given where --vary searches it."""
    searched = {"seq": args.seq, "batch": args.batch}[args.vary]
    if searched is not None:
        other = "batch" if args.vary == "seq" else "seq"
        raise BadInput(f"--{args.vary} {searched} is what --vary {args.vary} searches; fix "
                       f"the --{other} instead, or search the {other} with --vary {other}")


def _sizes(args, src, target) -> tuple[int, int | None, int]:
    """(global batch, seq, the multiple searched): the flags, else the config file's or
    the model's, else the defaults; on a --mesh the batch's default and unit are its
    data x fsdp split (times the slices of a multi-slice `target`, data parallel). seq
    None where a --model's batch has no sequence axis. BadInput for a bad --mesh, a seq
    a config cannot take, or a multiple the mesh cannot split."""
    from remat_kit.decide.fit import DEFAULT_MULTIPLE
    cfg, defaults = src.cfg, src.defaults
    try:  # the global batch splits over data x fsdp: its default and unit follow the mesh
        split = (rk_mesh.axis_size(rk_mesh.parse_spec(args.mesh), "batch") * target.slices
                 if args.mesh else 1)
    except rk_mesh.MeshError as e:
        raise BadInput(f"--mesh: {e}") from None
    batch = args.batch or (split if args.vary == "seq" else defaults.get("batch", 8))
    seq = args.seq or defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    if args.vary == "batch" and cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    multiple = args.multiple or DEFAULT_MULTIPLE[args.vary] * (split if args.vary == "batch"
                                                               else 1)
    if args.vary == "batch" and multiple % split:
        raise BadInput(f"--multiple {multiple} does not split over the {split} data-parallel "
                       f"devices of --mesh {args.mesh} (data x fsdp); the batch is global: "
                       f"use a multiple of {split}")
    return batch, seq, multiple


def _policies(args, cfg) -> list[str]:
    """--policies as specs ("auto" as the planner's row at the fit budget), else
    `FIT_POLICIES`; BadInput for a spec that does not parse or a config cannot take."""
    from remat_kit.decide.fit import FIT_POLICIES
    # "auto" is fit's planner row; its budget is the fit budget.
    text = (",".join(f"auto:budget={args.budget}" if p.strip() == "auto" else p
                     for p in args.policies.split(",")) if args.policies is not None else None)
    specs = split_policies(text) if text is not None else list(FIT_POLICIES)
    check_schedules(cfg, specs, "--policies")
    return specs


def _check_autos(specs, budget: int) -> None:
    """BadInput for an auto spec whose budget is not the fit budget (`decide.fit.is_auto_spec`)."""
    from remat_kit.api.configs import fit_rows
    from remat_kit.decide.fit import is_auto_spec
    from remat_kit.errors import BudgetError
    for spec, policy in fit_rows(specs, budget).items():
        try:
            is_auto_spec(policy, budget, spec)
        except BudgetError as e:
            raise BadInput(f"--policies: {e}") from None


def _model(args, src, specs, sizes, mesh):
    """(what fit searches, the dtype for the title, a --model's first workload or None,
    the mesh to pass fit, the rechunked model for the floor's remedy
    or None). A --model is traced once at the smallest size, so a bad model fails before
    compiling."""
    batch, seq, multiple = sizes
    cfg = src.cfg
    if cfg is not None:
        return cfg, src.dtype(), None, mesh, None

    # The model with its loss over n vocabulary chunks, should the logits hold fit's floor.
    def rechunk(n):
        return lambda b, s: rechunked(args, n).workload(b, s, mesh)

    first = src.workload(*((batch, multiple) if args.vary == "seq" else (multiple, seq)), mesh)
    check_schedules(first, specs, "--policies")
    # Each searched workload carries --mesh; fit is given it too, for the sizes it splits.
    return (lambda b, s: src.workload(b, s, mesh)), src.dtype(first), first, mesh, rechunk


def _progress(vary: str):
    """fit's progress callback: a line per policy on stderr, its size and compiles."""
    def progress(i, n, row):
        status = row.error or (f"{vary} {row.size}, {row.compiles} compiles"
                               + (f", picked {row.picked}" if row.picked else "")
                               + (f"; the model stops below {row.limit.splitlines()[0]}"
                                  if row.limit else ""))
        print(f"[{i}/{n}] {row.policy}: {status} ({pool.current().status()})",
              file=sys.stderr, flush=True)
    return progress


def _report(args, label, result, words, cfg, first, target, params) -> None:
    """The model map, fit's table, the compiled step, what holds the floor, and --json and
    --plot. `words`: (what is fixed, the budget in bytes, the dtype, the multiple, where
    the mesh came from: `common.mesh_origin`); `params`: the parameters' tree, global shapes
    (None on one device), against which the compiled steps' shardings are checked
    (`common.step_caption`)."""
    from remat_kit.cli import fit_report, verdict
    from remat_kit.ui.report import print_title, terminal_console
    from remat_kit.models.program import config_map
    fixed, budget, dtype, multiple, origin = words
    step = step_caption("train step", result.mesh, params,
                        [r.memory for r in result.rows if r.memory is not None], origin)
    where = (f"per device of mesh {result.mesh} ({result.devices} devices; sizes global)"
             if result.mesh else "per device")
    longest = "longest seq" if args.vary == "seq" else "largest batch"
    title = (f"{label}: {longest} within {fmt_bytes(budget)} {where}, {fixed}, "
             f"{dtype}, multiple {multiple} ({result.platform})")
    console = terminal_console()
    the_map = config_map(cfg) if first is None else first
    print_map(the_map)  # the map's line first, as in every report, then the verdict
    choice = fit_report.pick_fit(result)
    why = ("see below" if result.below_minimum else
           f"none compiled: at {args.vary} {multiple} the largest buffer alone (one layer's "
           "attention scores, or the logits) needs more than the budget less the parameters "
           "and optimizer state"
           if not any(r.compiles for r in result.rows) else "")
    for line in (verdict.verdict(choice, target, asked_target=args.target is not None)
                 if choice else [f"{target}: no policy fits {fmt_bytes(budget)} at any "
                                 f"{args.vary}" + (f" ({why})" if why else "")]):
        console.print(line, markup=False, emoji=False, soft_wrap=True)
    print_title(console, title)
    console.print(fit_report.fit_table(result, "", args.wide))
    console.print(f"compiled: {step}", markup=False, soft_wrap=True)
    for r in result.rows:  # XLA:GPU's own remat past its limit, held off in fit's compiles
        if r.xla_remat:
            console.print(f"{r.policy}: {r.xla_remat}", markup=False, soft_wrap=True)
    pipe = getattr(getattr(first, "model_map", None), "pipeline", None)
    if pipe is not None:
        from remat_kit.decide.stages import fit_line
        console.print(fit_line(pipe, result.rows, args.vary), markup=False, soft_wrap=True)
    if result.below_minimum:
        console.print(f"below the minimum: {result.below_minimum}", markup=False, soft_wrap=True)
    if args.json is not None:
        with outputs.atomic_write(args.json) as f:
            json.dump(fit_report.fit_to_dict(result) | {"config": label, "step": step}
                      | {"verdict": verdict.to_json(choice, target)}
                      | map_context(the_map), f, indent=2)
            f.write("\n")
    if args.plot is not None:
        fit_report.plot_fit(args.plot, result, f"{label}, {fixed}, {dtype}")


__all__ = ["default_budget", "over_the_chip", "run"]
