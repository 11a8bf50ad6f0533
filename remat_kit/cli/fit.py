"""`remat-kit fit`: the longest sequence (or largest batch) whose whole train step fits
a per-device memory budget under each policy (`remat_kit.decide.fit`), with what holds
the floor and its remedy."""

from __future__ import annotations

import json
import sys

from remat_kit import files as outputs
from remat_kit import mesh as rk_mesh
from remat_kit.cli.common import map_context, print_map, targets_of
from remat_kit.cli.inputs import (BadInput, check_output_file, check_schedules, check_seq,
                                  device_mesh, split_policies)
from remat_kit.cli.sources import load_source, rechunked
from remat_kit.units import fmt_bytes


def run(args) -> int:
    """`remat-kit fit` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from rich.console import Console

    from remat_kit.cli import fit_report
    from remat_kit.decide.fit import DEFAULT_MAX_SIZE, DEFAULT_MULTIPLE, FIT_POLICIES, _is_auto
    from remat_kit.errors import BudgetError
    from remat_kit.models.program import config_map
    from remat_kit.models.shortcuts import fit
    from remat_kit.policy.budget import parse_budget

    src = load_source(args)
    cfg, label, defaults = src.cfg, src.label, src.defaults
    try:
        budget = parse_budget(args.budget).bytes
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    if budget is None:
        raise BadInput(f"--budget must be a size such as 16GiB, not a fraction: got "
                       f"{args.budget!r}")
    searched = {"seq": args.seq, "batch": args.batch}[args.vary]
    if searched is not None:
        other = "batch" if args.vary == "seq" else "seq"
        raise BadInput(f"--{args.vary} {searched} is what --vary {args.vary} searches; fix "
                       f"the --{other} instead, or search the {other} with --vary {other}")
    target_list = targets_of(args.target)
    if len(target_list) > 1:
        raise BadInput(f"fit takes one --target, got {args.target!r}")
    try:  # the global batch splits over data x fsdp: its default and unit follow the mesh
        split = rk_mesh.axis_size(rk_mesh.parse_spec(args.mesh), "batch") if args.mesh else 1
    except rk_mesh.MeshError as e:
        raise BadInput(f"--mesh: {e}") from None
    batch = args.batch or (split if args.vary == "seq" else defaults.get("batch", 8))
    seq = args.seq or defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    per_example = seq is None  # a --model batch without a sequence axis: images, latents
    seq = seq or 1  # so fit's FLOPs per token are FLOPs per example there
    if args.vary == "batch" and cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    multiple = args.multiple or DEFAULT_MULTIPLE[args.vary] * (split if args.vary == "batch"
                                                               else 1)
    if args.vary == "batch" and multiple % split:
        raise BadInput(f"--multiple {multiple} does not split over the {split} data-parallel "
                       f"devices of --mesh {args.mesh} (data x fsdp); the batch is global: "
                       f"use a multiple of {split}")
    # "auto" is fit's planner row; its budget is the fit budget.
    text = (",".join(f"auto:budget={args.budget}" if p.strip() == "auto" else p
                     for p in args.policies.split(",")) if args.policies is not None else None)
    specs = split_policies(text) if text is not None else list(FIT_POLICIES)
    check_schedules(cfg, specs, "--policies")
    if args.multiple and args.multiple > DEFAULT_MAX_SIZE[args.vary]:
        raise BadInput(f"--multiple {args.multiple} is above the largest {args.vary} fit "
                       f"searches, {DEFAULT_MAX_SIZE[args.vary]}")
    for spec in specs:
        try:
            _is_auto(spec, budget)
        except BudgetError as e:
            raise BadInput(f"--policies: {e}") from None
    for path, flag, suffix in ((args.json, "--json", None), (args.plot, "--plot", ".png")):
        if path is not None:
            check_output_file(path, flag, suffix=suffix)
    # Without --mesh the step runs on one device, of an AOT target's slice too.
    mesh = (device_mesh(args.mesh, batch if args.vary == "seq" else multiple, cfg,
                        target_list[0]) if args.mesh else None)

    def progress(i, n, row):
        status = row.error or (f"{args.vary} {row.size}, {row.compiles} compiles"
                               + (f", picked {row.picked}" if row.picked else "")
                               + (f"; the model stops below {row.limit.splitlines()[0]}"
                                  if row.limit else ""))
        print(f"[{i}/{n}] {row.policy}: {status}", file=sys.stderr, flush=True)

    model, dtype, first = cfg, cfg and src.dtype(), None
    # The model with its loss over n vocabulary chunks, should the logits hold fit's floor.
    rechunk = None if cfg is not None else (
        lambda n, built=mesh: lambda b, s: rechunked(args, n).workload(b, s, built))
    if cfg is None:  # traced once at the smallest size: bad models fail before compiling
        first = src.workload(*((batch, multiple) if args.vary == "seq" else (multiple, seq)),
                             mesh)
        check_schedules(first, specs, "--policies")
        model, dtype = (lambda b, s: src.workload(b, s, mesh)), src.dtype(first)
        mesh = None  # the workloads carry it
    try:
        result = fit(model, args.budget, vary=args.vary, policies=specs, batch=batch, seq=seq,
                     multiple=multiple, target=target_list[0], mesh=mesh, progress=progress,
                     rechunk=rechunk)
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    fixed = (f"batch {batch}" if args.vary == "seq" else "no sequence axis (FLOPs/token: per "
             "example)" if per_example else f"seq {seq}")
    step = rk_mesh.compiled_step("train step", result.mesh)
    where = (f"per device of mesh {result.mesh} ({result.devices} devices; sizes global)"
             if result.mesh else "per device")
    title = (f"{label}: longest {args.vary} within {fmt_bytes(budget)} {where}, {fixed}, "
             f"{dtype}, multiple {multiple} ({result.platform})")
    console = Console() if sys.stdout.isatty() else Console(width=180)
    the_map = config_map(cfg) if first is None else first
    print_map(the_map)
    console.print(fit_report.fit_table(result, title))
    console.print(f"compiled: {step}", markup=False, soft_wrap=True)
    if result.below_minimum:
        console.print(f"below the minimum: {result.below_minimum}", markup=False, soft_wrap=True)
    if args.json is not None:
        with outputs.atomic_write(args.json) as f:
            json.dump(fit_report.fit_to_dict(result) | {"config": label, "step": step}
                      | map_context(the_map), f, indent=2)
            f.write("\n")
    if args.plot is not None:
        fit_report.plot_fit(args.plot, result, f"{label}, {fixed}, {dtype}")
    return 0


__all__ = ["run"]
