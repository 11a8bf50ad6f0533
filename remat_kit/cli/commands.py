"""remat-kit: what each remat policy costs on your model before you launch (compare,
explain), the cheapest policy for a memory budget (plan), the longest sequence that fits (fit).

    remat-kit compare --config gpt2_small --batch 8 --seq 1024 --dtype bfloat16 \\
        [--policies a,b,c] [--mesh data:2,fsdp:2,tensor:2] [--target cpu,tpu:v5e:1x1] \\
        [--time N] [--json out.json] [--plot pareto.png]
    remat-kit explain --config tiny --policy selective [--batch B] [--seq S] [--target T]
    remat-kit plan --config gpt2_small --batch 8 --seq 1024 --budgets 0.2,0.4,6GiB \\
        [--presets a,b | --no-presets] [--json plan.json] [--plot plan.png]
    remat-kit fit --config llama_1b --budget 16GiB --vary seq [--batch 1] [--multiple 128] \\
        [--target T] [--mesh data:2,fsdp:2] [--policies a,b,auto] [--json out.json] \\
        [--plot fit.png]

`compare` measures every policy compile-only (`remat_kit.measure.measure`) and prints
a table sorted by memory (`remat_kit.cli.report`). `explain` lists what one
decoder layer saves, offloads and recomputes under one policy. `plan` runs
the budget planner (`remat_kit.decide.plan`) for each budget and sets its frontier
against the best fixed preset that fits. `fit` finds the longest sequence
(or largest batch) whose whole train step fits a per-device memory budget
under each policy (`remat_kit.decide.fit`). `--target` names the compiler
(`remat_kit.measure.targets`): `tpu:v5e:2x2` compiles for a TPU slice ahead of time,
on a machine without one.

Bad input (unknown config or policy, a config file that does not load, a
batch or sequence length that is not a positive int or too long for the
model, a mesh that does not fit the batch or the devices, an unknown target or
topology, libtpu missing, an output path that cannot be written) prints one
line on stderr and exits with status 2, before anything is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence

from remat_kit import mesh as rk_mesh
from remat_kit import files as outputs
from remat_kit.units import fmt_bytes
from remat_kit.cli import stops
from remat_kit.errors import RematSpecError
from remat_kit.cli.inputs import (BadInput, Source, _non_negative_int, _positive_int, check_memory,
                              check_output_file, check_planner_floor, check_schedules,
                              check_seq, device_mesh, load_source, plan_groups,
                              preset_policies, rechunked, split_budgets, split_policies)
from remat_kit.models import CONFIGS
from remat_kit.models.config import DTYPES
from remat_kit.policy.spec import AutoSpec, parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------

def _sizes(args, src: Source) -> tuple[int, int]:
    """(batch, seq) from the flags, else the config file's, else the defaults (8,
    min(max_len, 1024)); BadInput if a config's model cannot take seq (`check_seq`)."""
    cfg = src.cfg
    batch = args.batch or src.defaults.get("batch", 8)
    seq = args.seq or src.defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    if cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    return batch, seq


def _targets(text: str | None) -> list:
    """The --target list, [None] (JAX's default backend) if not given. Checks that
    libtpu is there and accepts each TPU topology, before anything is measured."""
    from remat_kit.measure import targets
    if text is None:
        return [None]
    found = targets.parse_targets(text)
    for target in found:
        if target.aot:
            targets.devices(target)
    return found


def _plot_path(path: str, target, several: bool) -> str:
    """`path`, or with several targets one file per target: pareto_tpu_v5e_1x1.png."""
    if not several:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{str(target).replace(':', '_')}{ext}"


def _compare(args) -> int:
    from remat_kit.cli import report
    from remat_kit.measure import targets
    from remat_kit.decide.resolve import measure

    # Every check comes before JAX starts measuring, so bad input costs nothing.
    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    specs = split_policies(args.policies) if args.policies is not None else preset_policies()
    check_schedules(cfg, specs, "--policies")
    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.plot is not None:
        check_output_file(args.plot, "--plot", suffix=".png")
    target_list = _targets(args.target)
    if args.time and any(t is not None and t.aot for t in target_list):
        raise BadInput("--time runs steps, which needs the devices: a target compiled ahead "
                       "of time (tpu:<topology>) cannot be timed")
    meshes = [device_mesh(args.mesh, batch, cfg, t) for t in target_list]
    works = [src.workload(batch, seq, mesh) for mesh in meshes]  # traced, not compiled
    if cfg is None:
        check_schedules(works[0].num_layers, specs, "--policies")
    auto = [p.budget for p in map(parse, specs) if isinstance(p, AutoSpec)]
    for target, mesh, work in zip(target_list, meshes, works):
        check_planner_floor(work, auto, target, mesh, "--policies auto:budget=")

    def progress(i, n, record):
        status = "error" if record.error else f"{record.compile_seconds:.1f} s"
        print(f"[{i}/{n}] {record.target}: {', '.join(record.names)}: {status}",
              file=sys.stderr, flush=True)

    sections, contexts = [], []
    dtype = src.dtype(works[0])
    for target, mesh, work in zip(target_list, meshes, works):
        devices = 1 if mesh is None else mesh.size
        batch_split = 1 if mesh is None else rk_mesh.axis_size(mesh, "batch")
        tensor = 1 if mesh is None else rk_mesh.axis_size(mesh, "heads")
        if args.time and cfg is not None:
            check_memory(cfg, batch // batch_split, seq, f"--batch {batch} and --seq {seq}")
        records = measure(work, policies=specs, names=specs, time_steps=args.time,
                          progress=progress, target=target, per_layer=True, peak=args.peak)
        target = targets.parse_target(target)
        found = targets.versions(target)
        mesh_text = rk_mesh.spec_text(mesh)
        per_device = f", per device of {devices} ({mesh_text})" if devices > 1 else ""
        title = f"{label}: batch {batch}, seq {seq}, {dtype} ({target.label}{per_device})"
        sections.append((target, title, report.rows(records, cfg, batch // batch_split, seq,
                                                    tensor=tensor)))
        contexts.append({"target": str(target), "platform": target.label, "devices": devices,
                         "mesh": mesh_text if devices > 1 else args.mesh,
                         "jax_version": found["jax"], "compiler_version": found["compiler"]})
    if len(sections) == 1:
        report.print_table(sections[0][2], sections[0][1])
    else:
        report.print_side_by_side(
            [(str(t), rows) for t, _, rows in sections],
            f"{label}: batch {batch}, seq {seq}, {dtype}, per device")
    for target, _, rows in sections:
        if len(sections) > 1 and args.peak:
            print(f"{target}:")
        report.print_peaks(rows)
    for note in dict.fromkeys(n for _, _, rows in sections for d in rows for n in d["notes"]
                              if cfg is None):
        print(f"note: {note}", file=sys.stderr)
    if args.json is not None:
        # The first target's fields stay at the top level (schema 1); "targets" has them all.
        context = {"config": label, "batch": batch, "seq": seq, "dtype": dtype,
                   **contexts[0], "targets": contexts}
        report.write_json(args.json, [d for _, _, rows in sections for d in rows], context)
    if args.plot is not None:
        for target, title, rows in sections:
            report.plot(_plot_path(args.plot, target, len(sections) > 1), rows, title)
    return 0


def _parses(spec: str) -> bool:
    try:
        parse(spec)
    except RematSpecError:
        return False
    return True


def _explain(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from remat_kit.measure import targets
    from remat_kit.models.shortcuts import layer_residuals

    from remat_kit.decide.resolve import measure
    from remat_kit.measure import peak
    from remat_kit.measure.explain import explain
    from remat_kit.measure.record import MEMORY_LABELS

    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    if args.policy is None and cfg is None:
        raise BadInput("explain --model needs --policy (a --model has no default policy)")
    if args.policy is not None and "," in args.policy and all(
            _parses(p) for p in args.policy.split(",")):
        raise BadInput(f"explain shows one policy, got {args.policy!r}; compare takes several "
                       f"(remat-kit compare --policies {args.policy})")
    policy = parse(args.policy if args.policy is not None else cfg.remat)
    if isinstance(policy, AutoSpec):
        raise BadInput(f"explain shows one policy; {policy} is planned per model: run "
                       f"remat-kit plan --budgets {policy.budget} to see what it chooses")
    if policy.schedule.kind != "uniform":
        raise BadInput(f"explain shows one layer under one policy; {policy} runs its layers "
                       f"under different policies (schedule {policy.schedule}): explain the "
                       f"policy without '@{policy.schedule}', or compare the whole model")
    if args.peak and args.mesh is not None:
        raise BadInput("explain --peak compiles the whole model on one device; drop --mesh "
                       "(compare --mesh ... --peak measures it sharded)")
    where = ""
    if args.mesh is not None and cfg is None:  # the block one device runs: its batch share
        try:
            sizes = rk_mesh.parse_spec(args.mesh)
            rk_mesh.check_fits(sizes, None, batch)
        except rk_mesh.MeshError as e:
            raise BadInput(f"--mesh: {e}") from None
        if rk_mesh.axis_size(sizes, "heads") > 1:
            raise BadInput(f"--mesh {args.mesh}: a tensor axis splits a --model's own layers, "
                           "which remat_kit cannot do; use data and fsdp axes")
        batch //= rk_mesh.axis_size(sizes, "batch")
        where = f", per device of mesh {args.mesh}"
    elif args.mesh is not None:  # the layer one device runs; no devices needed
        try:
            sizes = rk_mesh.parse_spec(args.mesh)
            rk_mesh.check_fits(sizes, cfg, batch)
            cfg = rk_mesh.per_device_config(cfg, sizes)
        except rk_mesh.MeshError as e:
            raise BadInput(f"--mesh: {e}") from None
        batch //= rk_mesh.axis_size(sizes, "batch")
        where = f", per device of mesh {args.mesh} (heads {cfg.num_heads}, mlp {cfg.mlp_dim})"
    target = None
    if args.target is not None:
        found = _targets(args.target)
        if len(found) > 1:
            raise BadInput(f"explain takes one --target, got {args.target!r}")
        target = found[0]
    if cfg is not None:
        layer, what, dtype = layer_residuals(cfg, batch, seq, policy, target=target), \
            "one decoder layer", cfg.dtype
    else:
        work = src.workload(batch, seq)
        layer, what, dtype = explain(policy, work, target=target), "one block", src.dtype(work)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(f"{label}, {what} under {args.policy or str(policy)!r} "
                  f"({policy}): batch {batch}, seq {seq}, {dtype}{where}")
    t = Table()
    for name, justify in (("value", "left"), ("kind", "left"), ("shape", "left"),
                          ("dtype", "left"), ("bytes", "right"), ("decision", "left")):
        t.add_column(name, justify=justify)
    for r in layer.rows:
        t.add_row(r.name + (f" ({', '.join(r.aliases)})" if r.aliases else ""), r.kind, str(list(r.shape)), r.dtype, fmt_bytes(r.nbytes),
                  r.decision)
    console.print(t)
    n = layer.num_layers
    totals = Table(title="totals")
    for name in ("", "saved", "offloaded", "recomputed (not stored)"):
        totals.add_column(name, justify="right" if name else "left")
    totals.add_row("per layer", fmt_bytes(layer.saved_bytes),
                   fmt_bytes(layer.offloaded_bytes), fmt_bytes(layer.recomputed_bytes))
    if not layer.blocks_differ:  # else n x the first block is no figure
        totals.add_row(f"model ({n} layer{'' if n == 1 else 's'})",
                       fmt_bytes(n * layer.saved_bytes), fmt_bytes(n * layer.offloaded_bytes),
                       fmt_bytes(n * layer.recomputed_bytes))
    console.print(totals)
    if layer.constants:
        console.print(_constants_line(layer.constants), markup=False)
    if layer.blocks_differ:
        console.print(layer.blocks_differ)
    for note in layer.notes:  # a name that selects nothing: compare's note, never silence
        console.print(f"note: {args.policy or policy}: {note}", markup=False, soft_wrap=True)
    console.print(f"parameters read by the backward pass (not extra memory): "
                  f"{fmt_bytes(layer.parameter_bytes)} per layer")
    if layer.compiled is not None:
        c, found = layer.compiled, targets.versions(layer.compiled.target)
        flops = "-" if c.flops is None else f"{c.flops / 1e9:.3g} GFLOP"
        temp = fmt_bytes(c.memory.get("temp_size_in_bytes"))
        console.print(f"one layer's value-and-grad, {c.target.label} (jax {found['jax']}, "
                      f"{found['compiler']}): temp {temp}, {flops}, compiled in "
                      f"{c.seconds:.1f} s", markup=False)
        for note in c.notes:
            console.print(note, style="dim", markup=False)
    if args.peak:
        [record] = measure(src.workload(batch, seq), policies=[policy], target=target,
                           peak=True)
        if record.error:
            raise BadInput(f"--peak: the whole model under {policy} did not compile: "
                           f"{record.error.splitlines()[0]}")
        console.print(f"the whole model's {MEMORY_LABELS[record.peak['figure']]} under {policy} "
                      f"({record.platform}): {peak.summary(record.peak)}", markup=False)
    return 0


def _constants_line(constants) -> str:
    """explain's line for `LayerBreakdown.constants`, equal values counted once each:
    'constants, the same in every layer (not per-layer residuals, in no sum above):
    broadcast_in_dim [1, 16, 1, 8] float32 512 B x4, ...; 12.50 KiB'."""
    counts = Counter((r.name, r.shape, r.dtype, r.nbytes) for r in constants)
    shown = ", ".join(f"{name} {list(shape)} {dtype} {fmt_bytes(nbytes)}"
                      + (f" x{n}" if n > 1 else "") for (name, shape, dtype, nbytes), n
                      in counts.items())
    return (f"constants, the same in every layer (not per-layer residuals, in no sum above): "
            f"{shown}; {fmt_bytes(sum(r.nbytes for r in constants))}")


def _plan(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from remat_kit.cli import report
    from remat_kit.policy.budget import parse_budget
    from remat_kit.decide.plan import CPU_OFFLOAD_NOTE, Planner, offload_bandwidth, read_cache
    from remat_kit.decide.plan_cache import CACHE_LIMIT
    from remat_kit.decide.search import what_holds
    from remat_kit.measure.record import MEMORY_LABELS
    from remat_kit.measure.time_model import OBJECTIVES

    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    budgets = split_budgets(args.budgets)
    presets = ([] if args.no_presets else split_policies(args.presets, "--presets")
               if args.presets is not None else preset_policies())
    check_schedules(cfg, presets, "--presets")
    auto = [p for p in presets if p.strip().startswith("auto")]
    if auto:
        raise BadInput(f"--presets: {auto[0]!r} is a budget for the planner, not a preset; "
                       "give its budget in --budgets")
    for path, flag, suffix in ((args.json, "--json", None), (args.plot, "--plot", ".png")):
        if path is not None:
            check_output_file(path, flag, suffix=suffix)
    # A cache in a folder not made yet is fine: the first plan makes it.
    if args.cache and os.path.isdir(os.path.dirname(os.path.abspath(args.cache))) \
            and (why := outputs.problem(args.cache)):
        raise BadInput(f"--cache: {why}; give a plan cache file, or '' for none")
    if args.cache and read_cache(args.cache) is None:
        raise BadInput(f"--cache {args.cache!r} is not a plan cache (a JSON object written by "
                       f"remat-kit plan, at most {CACHE_LIMIT >> 20} MiB); give a new file, "
                       "or '' for none")
    target_list = _targets(args.target)
    if len(target_list) > 1:
        raise BadInput(f"plan takes one --target, got {args.target!r}")
    if args.offload:
        offload_bandwidth(target_list[0], True)  # no host memory: one line, before any work
    mesh = device_mesh(args.mesh, batch, cfg, target_list[0])
    devices = 1 if mesh is None else mesh.size
    if args.objective is not None and args.objective not in OBJECTIVES:
        raise BadInput(f"--objective {args.objective!r}: use one of {', '.join(OBJECTIVES)}")
    work = src.workload(batch, seq, mesh)
    check_planner_floor(work, budgets, target_list[0], mesh, "--budgets")
    if cfg is None:
        check_schedules(work.num_layers, presets, "--presets")
    groups = plan_groups(args.groups, work.num_layers or 1)
    dtype = src.dtype(work)

    def progress(message):
        print(message, file=sys.stderr, flush=True)

    planner = Planner(work, progress=progress,
                      cache=args.cache if args.cache is not None else True,
                      target=target_list[0], groups=groups, objective=args.objective,
                      offload=args.offload)
    if planner.objective == "time":  # how far this target's time model was checked
        print(planner.time_check, file=sys.stderr, flush=True)
    # Presets first: the planner takes any compiled policy that beats its own plan.
    named: dict[int, tuple] = {}
    for spec, r in zip(presets, planner.measure_all(presets)):
        named[id(r)] = (r, named.get(id(r), (r, ()))[1] + (spec,))
    records = [dataclasses.replace(r, names=names) for r, names in named.values()]
    start = time.perf_counter()
    full, none = planner.minimum()
    if none is None and any(parse_budget(b).bytes is None for b in budgets):
        raise BadInput(f"--budgets: no remat runs out of {target_list[0]}'s memory at these "
                       "shapes, so a fraction of it means nothing; give budgets in bytes")
    fits = [b for b in budgets if parse_budget(b).resolve(none) >= full]
    plans = dict(zip(fits, planner.frontier(fits)))
    plan_seconds = time.perf_counter() - start
    held, held_parts = (what_holds(planner, lambda n: rechunked(args, n).workload(batch, seq, mesh))
                        if len(fits) < len(budgets) else ("", None))
    kind = planner.memory_kind
    memory = MEMORY_LABELS[kind]
    ok = [r for r in records if r.error is None and r.memory_bytes is not None
          and r.memory_kind == kind]
    title = (f"{label}: batch {batch}, seq {seq}, {dtype} ({planner.measure('full').platform}"
             f"{f', per device of {devices}' if devices > 1 else ''}); no remat: "
             f"{fmt_bytes(none) + ' ' + memory if none else 'out of device memory'}, "
             f"least compiled: {fmt_bytes(full)}{f' ({full / none:.3f})' if none else ''}")
    t = Table(title=Text(title), caption=f"memory: compiled {kind}, budgets and x none of it; "
              f"FLOPs: over no remat; time: predicted step time over no remat "
              f"({planner.roofline.source}); objective: {planner.objective}",
              caption_justify="left")
    for name in ("budget", "bytes", "planned policy", memory, f"{memory} x none", "FLOPs +",
                 "time +", "tries", "best preset that fits", memory, "FLOPs +", "time +"):
        words = "polic" in name or "preset" in name  # a long spec folds, it is not cut
        t.add_column(name, justify="left" if words else "right",
                     overflow="fold" if words else "ellipsis")
    out = []
    none_seconds = planner.seconds(parse("none"))
    for b in budgets:
        limit = parse_budget(b).resolve(none)
        fitting = [r for r in ok if r.memory_bytes <= limit]
        # The best preset by the planner's objective: fewest FLOPs or least predicted time.
        best = min(fitting, key=planner.score, default=None)
        best_time = best and planner.seconds(parse(best.policy)) / none_seconds - 1
        p = plans.get(b)
        preset_cells = ([", ".join(best.names), fmt_bytes(best.memory_bytes),
                         f"{best.flops / planner.none_flops() - 1:+.2%}", f"{best_time:+.2%}"]
                        if best else ["no preset fits" if presets else "not compared", "-", "-",
                                      "-"])
        if p is None:
            t.add_row(b, fmt_bytes(limit), "below the minimum"
                      + (f" ({full / none:.3f})" if none else f" ({fmt_bytes(full)})"),
                      "-", "-", "-", "-", "-", *preset_cells)
        else:
            t.add_row(b, fmt_bytes(limit), p.spec, fmt_bytes(p.measured_bytes),
                      "-" if p.memory_fraction is None else f"{p.memory_fraction:.3f}",
                      f"{p.flops_overhead:+.2%}",
                      "-" if p.time_overhead is None else f"{p.time_overhead:+.2%}",
                      "cached" if p.cached else str(p.iterations), *preset_cells)
        out.append({"budget": b, "budget_bytes": limit, "plan": p and p.to_dict(),
                    "best_preset": best and (best.to_dict() | {
                        "predicted_seconds": planner.seconds(parse(best.policy)),
                        "time_overhead": best_time})})
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(t)
    on_cpu = planner.target.platform == "cpu"
    if planner.host_bandwidth is not None:
        console.print(f"offload asked for: host transfers at {planner.host_bandwidth / 1e9:.1f} GB/s "
                      f"each way ({'this CPU' if on_cpu else planner.roofline.source}),"
                      " hidden behind each layer's predicted compute, the excess charged",
                      markup=False)
        console.print(planner.offload_probe.note, markup=False)
        if on_cpu:
            console.print(CPU_OFFLOAD_NOTE, markup=False)
    for b, p in plans.items():
        for note in p.offload_notes:
            if note not in (CPU_OFFLOAD_NOTE, planner.offload_probe.note):
                console.print(f"budget {b}: {note}", markup=False)
    if held:
        console.print(f"below the minimum: {held}", markup=False, soft_wrap=True)
    # The presets' notes (a preset that compiles as its base rule on this model), as compare
    # prints them: never in the JSON only.
    for note in dict.fromkeys(n for r in records for n in r.notes):
        print(f"note: {note}", file=sys.stderr)
    console.print(f"planned {len(fits)} budget{'' if len(fits) == 1 else 's'} in "
                  f"{plan_seconds:.1f} s"
                  + (" (the presets compiled before, not counted)" if presets else ""))
    context = {"config": label, "batch": batch, "seq": seq, "dtype": dtype,
               "devices": devices, "platform": planner.measure("full").platform,
               "memory_kind": kind, "none_bytes": none, "minimum_bytes": full,
               "minimum_peak": held_parts, "below_minimum": held, "plan_seconds": plan_seconds,
               "block": work.block_name, "num_layers": work.num_layers,
               "parameters": work.parameter_count,
               "offload_probe": (probe := planner.offload_probe) and {
                   **dataclasses.asdict(probe), "figure": probe.figure}}
    if args.json is not None:
        with outputs.atomic_write(args.json) as f:
            json.dump({"schema_version": 1, "context": context, "budgets": out,
                       "presets": [r.to_dict() for r in records]}, f, indent=2)
            f.write("\n")
    if args.plot is not None:
        planned = [dataclasses.replace(planner.records[p.spec], names=(f"auto:budget={b}",))
                   for b, p in plans.items()]
        report.plot(args.plot, report.rows(records + planned), title)
    if not fits:
        print(f"error: no budget can be met: each is below the least compiled memory, "
              f"{fmt_bytes(full)} {memory}", file=sys.stderr)
        return 1
    return 0


def _fit(args) -> int:
    from rich.console import Console

    from remat_kit.cli import report
    from remat_kit.errors import BudgetError
    from remat_kit.decide.fit import DEFAULT_MAX_SIZE, DEFAULT_MULTIPLE, FIT_POLICIES, _is_auto
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
    target_list = _targets(args.target)
    if len(target_list) > 1:
        raise BadInput(f"fit takes one --target, got {args.target!r}")
    try:  # the global batch splits over data x fsdp: its default and unit follow the mesh
        split = rk_mesh.axis_size(rk_mesh.parse_spec(args.mesh), "batch") if args.mesh else 1
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

    model, dtype = cfg, cfg and cfg.dtype
    # The model with its loss over n vocabulary chunks, should the logits hold fit's floor.
    rechunk = None if cfg is not None else (
        lambda n, built=mesh: lambda b, s: rechunked(args, n).workload(b, s, built))
    if cfg is None:  # traced once at the smallest size: bad models fail before compiling
        first = src.workload(*((batch, multiple) if args.vary == "seq" else (multiple, seq)),
                             mesh)
        check_schedules(first.num_layers, specs, "--policies")
        model, dtype = (lambda b, s: src.workload(b, s, mesh)), src.dtype(first)
        mesh = None  # the workloads carry it
    try:
        result = fit(model, args.budget, vary=args.vary, policies=specs, batch=batch, seq=seq,
                     multiple=multiple, target=target_list[0], mesh=mesh, progress=progress,
                     rechunk=rechunk)
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    fixed = f"batch {batch}" if args.vary == "seq" else f"seq {seq}"
    where = (f"per device of mesh {result.mesh} ({result.devices} devices; sizes global)"
             if result.mesh else "per device")
    title = (f"{label}: longest {args.vary} within {fmt_bytes(budget)} {where}, {fixed}, "
             f"{dtype}, multiple {multiple} ({result.platform})")
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(report.fit_table(result, title))
    if result.below_minimum:
        console.print(f"below the minimum: {result.below_minimum}", markup=False, soft_wrap=True)
    if args.json is not None:
        with outputs.atomic_write(args.json) as f:
            json.dump(report.fit_to_dict(result) | {"config": label}, f, indent=2)
            f.write("\n")
    if args.plot is not None:
        report.plot_fit(args.plot, result, f"{label}, {fixed}, {dtype}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat-kit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="{compare,explain,plan,fit}")

    def common(p):
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--config",
                            help=f"a model name ({', '.join(CONFIGS)}) or a .py config file "
                                 "with get_config()")
        source.add_argument("--model", metavar="FILE.py:FUNCTION",
                            help="your own model: FUNCTION() returns a linen or NNX model "
                                 "(int32 tokens [batch, seq] -> logits), or FUNCTION(batch, "
                                 "seq) returns a remat_kit.Workload; also package.module:FUNCTION")
        p.add_argument("--block", default=None, metavar="NAME[,NAME]",
                       help="with --model: the repeated block class(es) to remat (default: the "
                            "class whose instances hold the most parameters, and any other "
                            "repeated one apart from it, e.g. an encoder's layers)")
        p.add_argument("--batch", type=_positive_int, default=None,
                       help="global batch size (default: the config file's batch_size, or 8)")
        p.add_argument("--seq", type=_positive_int, default=None,
                       help="sequence length (default: the config file's seq_len, or "
                            "min(max_len, 1024))")
        p.add_argument("--vocab-chunks", type=_positive_int, default=None, metavar="N",
                       help="compute the loss over N vocabulary slices, each recomputed in "
                            "the backward pass, so the float32 logits and their gradient "
                            "never exist whole (N must divide the vocabulary; default 1)")
        p.add_argument("--dtype", choices=DTYPES, default=None,
                       help="activation dtype (default: the config's)")

    compare = sub.add_parser("compare", help="measure every policy: memory, FLOPs, time")
    common(compare)
    compare.add_argument("--policies", default=None,
                         help="comma-separated policy specs (default: every preset)")
    compare.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: measure sharded, per device")
    compare.add_argument("--target", default=None,
                         help="whose compiler: cpu, tpu:<topology> (ahead of time via libtpu, "
                              "e.g. tpu:v5e:2x2), tpu or gpu (this machine's); comma-separated "
                              "targets go side by side (default: JAX's default backend)")
    compare.add_argument("--time", type=_non_negative_int, default=0, metavar="N",
                         help="also time N steps per policy on random data")
    compare.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    compare.add_argument("--plot", default=None, metavar="PATH",
                         help="write a memory vs FLOPs PNG here")
    compare.add_argument("--peak", action="store_true",
                         help="also say what holds each policy's peak (XLA's buffer "
                              "assignment, grouped): a line per policy, and in --json")
    compare.set_defaults(run=_compare)

    explain = sub.add_parser("explain", help="what one layer saves under one policy")
    common(explain)
    explain.add_argument("--policy", default=None, help="a policy spec (default: the config's)")
    explain.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: the layer one device runs")
    explain.add_argument("--target", default=None,
                         help="also compile the layer for this target (cpu, tpu:v5e:1x1, "
                              "gpu:h100, ...) and print its temp memory and FLOPs")
    explain.add_argument("--peak", action="store_true",
                         help="also compile the whole model under the policy and say what "
                              "holds its peak (XLA's buffer assignment, grouped)")
    explain.set_defaults(run=_explain)

    plan = sub.add_parser("plan", help="the cheapest policy for each memory budget")
    common(plan)
    plan.add_argument("--budgets", required=True,
                      help="comma-separated budgets: sizes (6GiB, 512MiB, 8e9B for bytes) or fractions "
                           "0 < f <= 1 of no remat's memory (temp on CPU, the compiler's "
                           "peak on TPU and GPU)")
    presets = plan.add_mutually_exclusive_group()
    presets.add_argument("--presets", default=None,
                         help="comma-separated specs to set against the plans (default: every "
                              "preset)")
    presets.add_argument("--no-presets", action="store_true", help="compare with no preset")
    plan.add_argument("--mesh", default=None,
                      help="e.g. data:2,fsdp:2,tensor:2: plan the per-device program")
    plan.add_argument("--target", default=None,
                      help="plan against this target's compiled memory (cpu, tpu:v5e:1x1, "
                           "gpu:h100, ...; default JAX's default backend)")
    plan.add_argument("--cache", default=None, metavar="PATH",
                      help="plan cache file (default: $REMAT_KIT_CACHE or "
                           "~/.cache/remat_kit/plans.json); '' for none")
    plan.add_argument("--json", default=None, metavar="PATH", help="write plans and presets here")
    plan.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of the plans over the presets' points")
    plan.add_argument("--groups", default=None, metavar="G",
                      help="decide each tag in G groups of consecutive layers (default: one "
                           "group per layer, up to 64; 1: one decision for every layer)")
    plan.add_argument("--objective", default=None, metavar="flops|time",
                      help="minimize FLOPs or predicted step time (default: time only on a "
                           "target whose time model was checked within reach of measured "
                           "step times, flops elsewhere; time prints how far it was checked)")
    offload = plan.add_mutually_exclusive_group()
    offload.add_argument("--offload", dest="offload", action="store_const", const=True,
                         default=None, help="also plan offload to host memory, at the target's "
                         "host bandwidth (tpu:v5e, tpu:v5p, gpu:h100, gpu:h200; cpu: its memory "
                         "bandwidth), where a probe compile of this model shows offload lowers "
                         "device memory (docs/plan.md)")
    offload.add_argument("--no-offload", dest="offload", action="store_const", const=False,
                         help="plan save and recompute only")
    plan.set_defaults(run=_plan)

    fit = sub.add_parser("fit", help="the longest seq (or largest batch) each policy fits "
                                     "in a memory budget")
    common(fit)
    fit.add_argument("--budget", required=True,
                     help="device memory per device, e.g. 16GiB, 512MiB, 8e9B for bytes (also the "
                          "budget of an auto row)")
    fit.add_argument("--vary", choices=("seq", "batch"), default="seq",
                     help="search the sequence length (global batch fixed, default 1, or "
                          "data x fsdp on a mesh) or the global batch (seq fixed)")
    fit.add_argument("--multiple", type=_positive_int, default=None,
                     help="search in multiples of this (default 128 for seq; 1 for batch, or "
                          "data x fsdp on a mesh)")
    fit.add_argument("--policies", default=None,
                     help="comma-separated policy specs, and auto for the planner's pick at "
                          "each size (default: none,full,minimal,selective,dots)")
    fit.add_argument("--mesh", default=None,
                     help="e.g. data:2,fsdp:2,tensor:2: the step sharded over a mesh; the "
                          "budget is per device, the batch global (default: one device)")
    fit.add_argument("--target", default=None,
                     help="whose compiler: cpu, tpu:<topology> (ahead of time), gpu:h100, ... "
                          "(default: JAX's default backend); the budget is per chip")
    fit.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    fit.add_argument("--plot", default=None, metavar="PATH",
                     help="write a bar chart of the sizes (PNG) here")
    fit.set_defaults(run=_fit)
    return parser


def use_compile_cache() -> None:
    """Keeps the commands' compiled programs in JAX's persistent compilation cache,
    so a repeated run loads them instead of compiling (the same memory and FLOP
    figures; only the compile seconds shrink). The folder is $REMAT_KIT_COMPILE_CACHE,
    default ~/.cache/remat_kit/jax ($XDG_CACHE_HOME if set); an empty value
    turns it off, and JAX_COMPILATION_CACHE_DIR, if set, is used as JAX uses it.

    Raises:
      BadInput: $REMAT_KIT_COMPILE_CACHE names something that is not a folder
        (/dev/null, a file): the figures would go to "/dev/null-figures".
    """
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.environ.get("REMAT_KIT_COMPILE_CACHE", os.path.join(home, "remat_kit", "jax"))
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"REMAT_KIT_COMPILE_CACHE={path!r} is not a folder; give a folder for "
                       "the compile cache, or an empty value for none")
    if path:
        import jax
        jax.config.update("jax_compilation_cache_dir", path)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(_joined_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    with warnings.catch_warnings(), stops.catching():
        warnings.showwarning = _one_line_warning
        try:
            use_compile_cache()
            return args.run(args)
        except stops.Stopped as e:  # Ctrl-C or SIGTERM: one line, never a traceback
            print(f"remat-kit {args.command}: stopped by {e.name}; {stops.kept(args)}",
                  file=sys.stderr)
            return e.exit_code
        except (BadInput, RematSpecError, ValueError) as e:
            # RematSpecError is a ValueError; other ValueErrors here come from
            # validating sizes and dtypes before anything is measured.
            print(f"remat-kit {args.command}: error: {' '.join(str(e).split())}",
                  file=sys.stderr)  # as argparse names the command in its own errors
            return 2
        except outputs.OutputError as e:  # at the end, after the work: a disk fills up
            print(f"remat-kit {args.command}: error: {' '.join(str(e).split())}",
                  file=sys.stderr)
            return 1


def _joined_values(argv: list[str]) -> list[str]:
    """`--budget -1GiB` (or -inf) as `--budget=-1GiB`: argparse takes a value that starts with
    '-' and is not a plain number for an option, and would say only "expected one
    argument"; joined, the budget's own check names the bad value."""
    out = []
    for arg in argv:
        if (out and out[-1] in ("--budget", "--budgets") and arg[:1] == "-"
                and arg[1:2] != "-" and arg != "-h"):  # -1GiB, -inf, -nan, -.5
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"remat-kit: warning: {' '.join(str(message).split())}", file=file or sys.stderr)
