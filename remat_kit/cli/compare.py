"""`remat-kit compare`: every policy measured compile-only (`remat_kit.decide.resolve.measure`),
one table per target sorted by memory (`remat_kit.cli.report`), with --json, --csv and
--plot."""

from __future__ import annotations

import sys

from remat_kit import mesh as rk_mesh
from remat_kit.cli.common import (map_context, mesh_origin, plot_path, print_map, sizes_text,
                                  source_and_sizes, targets_of)
from remat_kit.cli.inputs import (BadInput, check_json_and_plot, check_memory, check_planner_floor,
                                  check_schedules, device_mesh, preset_policies, split_policies)
from remat_kit.policy.spec import AutoSpec, parse


def run(args) -> int:
    """`remat-kit compare` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from remat_kit.cli import report
    from remat_kit.decide.resolve import measure

    # Every check comes before JAX starts measuring, so bad input costs nothing.
    src, batch, seq = source_and_sizes(args)
    cfg, label = src.cfg, src.label
    specs = split_policies(args.policies) if args.policies is not None else preset_policies()
    check_schedules(cfg, specs, "--policies")
    check_json_and_plot(args)
    target_list = targets_of(args.target)
    if args.time and any(t.aot for t in target_list):
        raise BadInput("--time runs steps, which needs the devices: a target compiled ahead "
                       "of time (tpu:<topology>) cannot be timed")
    meshes = [device_mesh(args.mesh, batch, cfg, t) for t in target_list]
    works = [src.workload(batch, seq, mesh) for mesh in meshes]  # traced, not compiled
    if cfg is None:
        check_schedules(works[0], specs, "--policies")
    auto = [p.budget for p in map(parse, specs) if isinstance(p, AutoSpec)]
    for target, mesh, work in zip(target_list, meshes, works):
        check_planner_floor(work, auto, target, mesh, "--policies auto:budget=")

    def progress(i, n, record):
        status = "error" if record.error else f"{record.compile_seconds:.1f} s"
        print(f"[{i}/{n}] {record.target}: {', '.join(record.names)}: {status}",
              file=sys.stderr, flush=True)

    sections, contexts = [], []
    dtype = src.dtype(works[0])
    for target, asked, work in zip(target_list, meshes, works):
        # a model's own mesh first
        mesh = (work.mesh if work.mesh is not None or work.own_mesh is not None
                else rk_mesh.plain(asked))
        devices = 1 if mesh is None else mesh.size
        batch_split = 1 if mesh is None else rk_mesh.axis_size(mesh, "batch")
        tensor = 1 if mesh is None else rk_mesh.axis_size(mesh, "heads")
        if args.time and cfg is not None:
            check_memory(cfg, batch // batch_split, seq, f"--batch {batch} and --seq {seq}")
        records = measure(work, policies=specs, names=specs, time_steps=args.time,
                          progress=progress, target=target, per_layer=True, peak=args.peak)
        found = target.versions
        mesh_text = rk_mesh.spec_text(mesh)
        step, origin = (rk_mesh.compiled_step("value-and-grad", work.mesh),
                        mesh_origin(work, asked, target))
        per_device = (f", per device of {devices} ({mesh_text}); "
                      f"{rk_mesh.compiled_step('value-and-grad', work.mesh, origin)}"
                      if devices > 1 else "")
        title = f"{label}: {sizes_text(batch, seq)}, {dtype} ({target.label}{per_device})"
        share = None if batch is None else batch // batch_split  # None: leaves as declared
        sections.append((target, title, report.rows(records, cfg, share, seq,
                                                    tensor=tensor)))
        contexts.append({"target": str(target), "platform": target.label, "devices": devices,
                         "mesh": mesh_text if devices > 1 else args.mesh, "step": step,
                         "mesh_origin": origin,
                         "jax_version": found["jax"], "compiler_version": found["compiler"]})
    print_map(works[0])
    if len(sections) == 1:
        report.print_table(sections[0][2], sections[0][1])
    else:
        report.print_side_by_side(
            [(str(t), rows) for t, _, rows in sections],
            f"{label}: {sizes_text(batch, seq)}, {dtype}, per device")
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
                   **contexts[0], "targets": contexts, **map_context(works[0])}
        report.write_json(args.json, [d for _, _, rows in sections for d in rows], context)
    if args.plot is not None:
        for target, title, rows in sections:
            report.plot(plot_path(args.plot, target, len(sections) > 1), rows, title)
    return 0


__all__ = ["run"]
