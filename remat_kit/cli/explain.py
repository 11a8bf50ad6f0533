"""`remat-kit explain`: what one decoder layer saves, offloads and recomputes under one
policy (`rk.explain`, `remat_kit.api.answers`), its constants on one line apart, and the whole
step's peak where asked.
Docs: docs/compare.md ("`remat-kit explain`: what one layer keeps").
"""

from __future__ import annotations

import sys
from collections import Counter

from remat_kit import mesh as rk_mesh
from remat_kit.cli.common import print_map, sizes_text, source_and_sizes, targets_of
from remat_kit.ui.inputs import BadInput
from remat_kit.errors import RematSpecError
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.units import fmt_bytes


def _parses(spec: str) -> bool:
    try:
        parse(spec)
    except RematSpecError:
        return False
    return True


def run(args) -> int:
    """`remat-kit explain` on the parsed flags; returns the exit status (`commands.main`
    turns bad input into one line and 2)."""
    from rich.console import Console

    src, batch, seq = source_and_sizes(args)
    if args.map:  # the map alone: the one trace, no compile
        first, *layers = src.workload(batch, seq).model_map.lines()
        print("\n".join([f"model map: {first}", *layers]))  # as every report's first line
        return 0
    policy = _checked_policy(args, src.cfg)
    cfg, batch, where = _per_device(args, src.cfg, batch)
    target = _one_target(args)
    layer, what, dtype = _breakdown(src, cfg, batch, seq, policy, target)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(f"{src.label}, {what} under {args.policy or str(policy)!r} "
                  f"({policy}): {sizes_text(batch, seq)}, {dtype}{where}")
    _print_layer(console, layer, args.policy or policy)
    if layer.compiled is not None:
        _print_compiled(console, layer.compiled)
    if args.peak or args.audit:
        record = _whole(src.workload(batch, seq), policy, target, args.peak)
        if args.peak:
            _print_peak(console, record, policy)
        if args.audit:
            _print_audit(console, record, args.policy or policy)
    return 0


def _checked_policy(args, cfg):
    """The one policy explain shows (--policy, else the config's), parsed; BadInput for
    none (a --model), several, an auto spec, a schedule over layers, or --peak with
    --mesh."""
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
    return policy


def _per_device(args, cfg, batch):
    """(config, batch, title words) of the layer one device runs on --mesh: the batch's
    share, and a config's heads and mlp split over tensor; no devices needed. As given,
    with no words, without --mesh."""
    if args.mesh is None:
        return cfg, batch, ""
    try:
        sizes = rk_mesh.parse_spec(args.mesh)
        rk_mesh.check_fits(sizes, cfg, batch)
        if cfg is not None:
            cfg = rk_mesh.per_device_config(cfg, sizes)
    except rk_mesh.MeshError as e:
        raise BadInput(f"--mesh: {e}") from None
    if cfg is None and rk_mesh.axis_size(sizes, "heads") > 1:
        raise BadInput(f"--mesh {args.mesh}: a tensor axis splits a --model's own layers, "
                       "which remat_kit cannot do; use data and fsdp axes")
    if batch is not None:  # None: a --model's leaves as declared, on a mesh with no data axes
        batch //= rk_mesh.axis_size(sizes, "batch")
    if cfg is None:  # the block one device runs: its batch share
        return cfg, batch, f", per device of mesh {args.mesh}"
    return cfg, batch, (f", per device of mesh {args.mesh} (heads {cfg.num_heads}, "
                        f"mlp {cfg.mlp_dim})")


def _one_target(args):
    """The --target to compile the layer for, None without one; BadInput for several."""
    target = None
    if args.target is not None:
        found = targets_of(args.target)
        if len(found) > 1:
            raise BadInput(f"explain takes one --target, got {args.target!r}")
        target = found[0]
    return target


def _breakdown(src, cfg, batch, seq, policy, target):
    """(the `LayerBreakdown` of one layer under `policy`, what the layer is called, the
    dtype for the title), after printing the model map: a config's decoder layer
    (`layer_residuals`), or a --model's first block (`rk.explain`); BadInput for a
    model with no block."""
    from remat_kit.api.answers import explain
    from remat_kit.models.program import config_map
    from remat_kit.api.configs import layer_residuals
    if cfg is not None:
        print_map(config_map(cfg))
        return (layer_residuals(cfg, batch, seq, policy, target=target), "one decoder layer",
                src.dtype())
    work = src.workload(batch, seq)
    print_map(work)
    if work.block is None:
        raise BadInput(f"explain shows one layer; {src.label} has none: "
                       f"{work.model_map.line()}")
    return explain(policy, work, target=target), "one block", src.dtype(work)


def _print_layer(console, layer, policy) -> None:
    """The layer's values table, its totals per layer and over the model, its constants,
    notes (`policy` names the policy as given), and the parameters the backward reads."""
    from rich.table import Table
    t = Table()
    for name, justify in (("value", "left"), ("kind", "left"), ("shape", "left"),
                          ("dtype", "left"), ("bytes", "right"), ("decision", "left")):
        t.add_column(name, justify=justify)
    for r in layer.rows:
        t.add_row(r.name + (f" ({', '.join(r.aliases)})" if r.aliases else ""), r.kind,
                  str(list(r.shape)), r.dtype, fmt_bytes(r.nbytes), r.decision)
    console.print(t)
    console.print(_totals(layer))
    if layer.constants:
        console.print(_constants_line(layer.constants), markup=False)
    if layer.blocks_differ:
        console.print(layer.blocks_differ)
    for note in layer.notes:  # a name that selects nothing: compare's note, never silence
        console.print(f"note: {policy}: {note}", markup=False, soft_wrap=True)
    console.print(f"parameters read by the backward pass (not extra memory): "
                  f"{fmt_bytes(layer.parameter_bytes)} per layer")


def _totals(layer):
    """The totals table: saved, offloaded and recomputed bytes per layer, and over the
    model's layers where its blocks are alike."""
    from rich.table import Table
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
    return totals


def _print_compiled(console, c) -> None:
    """The line for the layer compiled for --target: temp memory, FLOPs, compile seconds,
    and the compiler's notes."""
    found = c.target.versions
    flops = "-" if c.flops is None else f"{c.flops / 1e9:.3g} GFLOP"
    temp = fmt_bytes(c.memory.get("temp_size_in_bytes"))
    console.print(f"one layer's value-and-grad, {c.target.label} (jax {found['jax']}, "
                  f"{found['compiler']}): temp {temp}, {flops}, compiled in "
                  f"{c.seconds:.1f} s", markup=False)
    for note in c.notes:
        console.print(note, style="dim", markup=False)


def _whole(work, policy, target, peak: bool):
    """The whole model compiled under `policy` (with its peak's breakdown where `peak`);
    BadInput where it does not compile."""
    from remat_kit.api.answers import measure
    [record] = measure(work, policies=[policy], target=target, peak=peak)
    if record.error:
        raise BadInput(f"--{'peak' if peak else 'audit'}: the whole model under {policy} did "
                       f"not compile: {record.error.splitlines()[0]}")
    return record


def _print_audit(console, record, policy) -> None:
    """--audit: per tag, what `policy` asks against what the compiled program does
    (`measure.audit.audit`), each difference in one line, and what was not checked."""
    from rich.table import Table
    found = record.audit
    t = Table(title=f"the whole model under {policy}, as asked and as compiled "
                    f"({record.platform})")
    for header in ("tag", "asked", "bytes asked", "compiled", "bytes compiled"):
        t.add_column(header, justify="right" if "bytes" in header else "left")
    for row in found["tags"]:
        t.add_row(row["tag"], row["asked"], fmt_bytes(row["asked_bytes"]), row["compiled"],
                  fmt_bytes(row["compiled_bytes"]))
    console.print(t)
    console.print("as asked" if found["as_asked"] else "not as asked:", markup=False)
    for line in found["findings"] + ([found["step"]] if found.get("step") else []):
        console.print(f"  {line}", markup=False, soft_wrap=True)
    for line in found["unchecked"]:
        console.print(f"  not checked: {line}", style="dim", markup=False, soft_wrap=True)


def _print_peak(console, record, policy) -> None:
    """--peak: what holds the whole model's peak under `policy` (`measure.peak.summary`,
    and `scores_note` where the attention scores hold the most)."""
    from remat_kit.measure import peak
    from remat_kit.measure.record import MEMORY_LABELS
    console.print(f"the whole model's {MEMORY_LABELS[record.peak['figure']]} under {policy} "
                  f"({record.platform}): {peak.summary(record.peak)}", markup=False,
                  soft_wrap=True)
    if note := peak.scores_note(record.peak):
        console.print(f"  {note}", markup=False, soft_wrap=True)


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


__all__ = ["run"]
