"""What each remat policy costs, measured compile-only: residuals by tag, memory, FLOPs, time.

`measure(workload, policies=...)` traces each policy's forward and backward pass once: the trace
gives the residuals by tag (`measure.residuals`) and the program compiled for the target
(`measure.targets`), whose memory, FLOPs and predicted time fill one `Record` per distinct
program. A plain loss is wrapped whole in one remat region per policy.
How a workload walks through here: docs/architecture.md ("The data flow"); figures: docs/compare.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
from jax.extend.core import jaxpr_as_fun

from remat_kit import mesh as rk_mesh
from remat_kit._jax_private import without_compilation_cache
from remat_kit.measure import audit as audit_of
from remat_kit.measure import figure_cache
from remat_kit.measure import targets
from remat_kit.measure import kernels, lowering, pool
from remat_kit.measure import peak as peak_of
from remat_kit.measure import step_times, time_checks, time_model
from remat_kit.measure.explain import blocks_differ, stack_stored_bytes
from remat_kit.policy.policy import Policy
from remat_kit.policy.names import known_tags
from remat_kit.measure.record import Record, memory_kind
from remat_kit.measure.costs import memory_fields, xla_remat_note
from remat_kit.measure.residuals import stage, split
from remat_kit.errors import RematSpecError
from remat_kit.policy.spec import AutoSpec, parsed_only
from remat_kit.trace import model_map, stand_in
from remat_kit.trace.marked import tags_in_regions
from remat_kit.trace.validate import emitted_tags, policy_notes
from remat_kit.trace.workload import Workload, from_loss


def _group(policies: Sequence[Policy], names: Sequence[str],
           emitted: Sequence[str]) -> list[tuple[Policy, list[str]]]:
    """Policies that decide every emitted tag alike (and share base, memory
    kinds and layer schedule) compile to the same program; measure each such
    group once."""
    if len(names) != len(policies):
        raise ValueError(f"{len(names)} names for {len(policies)} policies")
    groups: dict[tuple, tuple[Policy, list[str]]] = {}
    for p, name in zip(policies, names):
        kinds = (p.offload_src, p.offload_dst) if p.offload else None
        key = (p.remat, p.base, kinds, p.schedule, tuple(p.decide(t) for t in emitted))
        groups.setdefault(key, (p, []))[1].append(name)
    return list(groups.values())


def measure(workload: "Workload | Callable", *args, policies: Sequence, names=None,
            time_steps: int = 0, sample_args: Callable | None = None,
            progress: Callable[[int, int, Record], None] | None = None,
            per_device: tuple | None = None, target: targets.Target,
            per_layer: bool = False, peak: bool = False,
            jobs: int | None = None) -> list[Record]:
    """Measures a workload under each policy, compile-only (optionally also timed).

    Args:
      workload: a `Workload` (`rk.models.workload(cfg, ...)`,
        `rk.from_model.workload(model, ...)`, or the user's own); or a loss
        factory, policy -> loss(*args) returning a scalar (the model decides
        where the policy applies, e.g. per layer); or a plain loss(*args),
        which is then wrapped whole in one remat region per policy
        (`checkpointed`). It is a factory when calling it with a Policy
        returns a callable. The loss is differentiated with respect to
        `args[0]` (the parameters).
      args: with a loss, its arguments: arrays or `jax.ShapeDtypeStruct`s (with `sharding=` to measure a
        sharded program; figures are then per device, and residuals are
        traced at the per-device shard shapes).
      policies: `Policy`s, parsed and resolved: `rk.measure` takes spec strings, parses
        them and plans an "auto:budget=..." spec first (`remat_kit.decide.resolve`).
        Policies that decide every tag
        the loss emits alike, or that lower to the same program (their
        decisions differ only on values the backward pass never reads), are
        measured once, as one record listing all their names.
      names: what to call each policy in the report; default its spec string.
      time_steps: if > 0, also run one warm-up step and `time_steps` timed
        steps of value-and-grad per policy on `sample_args` data, after every
        policy is compiled, in rounds of one step per policy (`step_times`),
        so a shared machine's load falls on every policy alike.
      sample_args: key -> concrete args for timed mode; default random data
        shaped like `args` (normal floats, zero ints).
      progress: called as progress(i, n, record) after the i-th of the n
        distinct programs is compiled and measured (policies that lower to
        one program count once; one that fails to lower counts as one).
      per_device: (factory, args) of the program one device runs, whose
        residuals are reported instead of tracing `args` at their shard
        shapes; needed where a shard is not a valid input (parameters split
        over fsdp or tensor). A workload brings its own.
      target: the `targets.Target` whose compiler to measure with, parsed at
        the edge (`targets.parse_target("tpu:v5e:1x1")`: ahead of time, no TPU
        needed; `rk.measure` takes the text). Sharded `args` must be sharded
        over the target's devices (`targets.make_mesh`); unsharded ones go to
        its first device.
      per_layer: also measure one block at a time (`Record.layer_residual_bytes`,
        `layers_residual_bytes`, for the Korthikanti comparison), where the
        workload has blocks.
      peak: also say what holds each program's peak (`Record.peak`,
        `remat_kit.measure.peak.breakdown`): the compile then writes XLA's
        buffer assignment to a temporary folder and reads it back.
      jobs: compiles run at once, 1..the cores (`pool.using`); default the process's
        compile pool (`pool.current`: one a core, as the free memory allows). The
        records do not depend on it.
    cuDNN attention is traced as a stand-in where `target` cannot build it here
    (`remat_kit.trace.stand_in`; the records' notes say so).
    Returns:
      One `Record` per distinct policy, in first-seen order. A policy that
      fails to trace, compile or run gives a record with `error` set (for
      an AOT target, the compiler's message); the other records still come
      out.
    Raises:
      TypeError: a spec string among `policies`. RematSpecError: an auto:budget= spec.
      TargetError: target not a `Target`, libtpu missing, args sharded over
        other devices, or `time_steps` > 0 for a target compiled ahead of time.
      ValueError: `names` and `policies` differ in length, or a bad `jobs`. TypeError: a
        workload and args both given.
    """
    with pool.using(jobs):
        return _measure(workload, args, policies, names, time_steps, sample_args, progress,
                        per_device, target, per_layer, peak)


def _measure(workload, args, policies, names, time_steps, sample_args, progress, per_device,
             target, per_layer, peak) -> list[Record]:
    """`measure`, on the compile pool it set."""
    workload = _as_workload(workload, args)
    parsed = parsed_only(policies, "measure")
    names = names if names is not None else [str(p) for p in policies]
    with stand_in.for_target(target):  # cuDNN attention where it cannot be built
        run, groups, data = _prepare(workload, parsed, names, target, time_steps,
                                     sample_args, per_device, per_layer, peak)
        programs = _lowered(run, groups, time_steps)
        records, timed = [], {}  # timed: index in records -> compiled, run after compiles
        for i, program in enumerate(programs):
            record, compiled = _measured(run, *program)
            if compiled is not None and data is not None:
                timed[len(records)] = compiled
            records.append(record)
            if progress is not None:
                progress(i + 1, len(programs), record)
    records = audit_of.faster_than_none(records)
    return step_times.with_step_times(records, timed, data, time_steps) if timed else records


def _as_workload(workload: "Workload | Callable", args: tuple) -> Workload:
    """`workload` itself, or a loss and its `args` as one (`from_loss`).

    Raises:
      TypeError: a workload and args both given.
    """
    if isinstance(workload, Workload):
        if args:
            raise TypeError("measure takes a Workload or a loss and its args, not both")
        return workload
    return from_loss(workload, *args)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every program of one `measure` call shares.

    Attributes:
      args: the workload's args placed on the target (`lowering.place`).
      local_args: their per-device shapes where any is sharded, else None.
      per_device: (factory, args) of one device's program, or None (`measure`).
      emitted: the tags the loss emits. by_name: each name's Policy.
      differ: the note that the workload's blocks differ ("" if alike, or no per_layer).
      outside: the emitted tags no remat region holds (`_outside`).
    """

    workload: Workload
    target: targets.Target
    args: tuple
    local_args: tuple | None
    per_device: tuple | None
    emitted: tuple[str, ...]
    by_name: dict
    differ: str
    per_layer: bool
    peak: bool
    outside: frozenset = frozenset()


def _prepare(workload: Workload, parsed: list, names: list, target, time_steps: int,
             sample_args, per_device, per_layer: bool, peak: bool) -> tuple:
    """(`_Run`, the policy groups `_group` makes, the timed steps' data or None).

    Raises:
      TargetError: target not a `Target`, args sharded over other devices, or
        timed steps on a target compiled ahead of time.
      RematSpecError: an auto:budget= spec. ValueError: names and policies differ
        in length.
    """
    if not isinstance(target, targets.Target):
        raise targets.TargetError(f"measure takes a targets.Target, got {type(target).__name__} "
                                  f"{target!r}: parse it (targets.parse_target({target!r})), "
                                  "or call rk.measure, which takes text")
    if time_steps > 0 and target.aot:
        raise targets.TargetError(f"cannot time steps on target {target}: it is compiled "
                                  "ahead of time, for devices this machine does not have")
    args = lowering.place(workload.args, target)
    for p in parsed:
        if isinstance(p, AutoSpec):  # planning is decide's, above this part
            raise RematSpecError(f"{p} is planned, not measured: give it to rk.measure, which "
                                 "plans it first (remat_kit.decide.resolve)", token=str(p))
    emitted = tuple(emitted_tags(workload.loss_for_policy(Policy(remat=False)), *args))  # "none"
    local_args = (jax.tree.map(rk_mesh.local_shape, args)
                  if any(rk_mesh.is_sharded(x) for x in jax.tree.leaves(args)) else None)
    data = (step_times.sample_data(args, sample_args or workload.sample_args)
            if time_steps > 0 else None)
    groups = _group(parsed, names, emitted)
    run = _Run(workload, target, args, local_args,
               per_device if per_device is not None else workload.per_device, emitted,
               dict(zip(names, parsed)), blocks_differ(workload) if per_layer else "",
               per_layer, peak, _outside(workload, parsed, emitted, args))
    return run, groups, data


def _outside(workload: Workload, parsed: list, emitted, args) -> frozenset:
    """The emitted tags the loss holds in no remat region under full remat (one forward
    trace, only where some policy keeps a tag by name): a policy's decision on them
    changes nothing. None found where full remat does not trace."""
    if not any(p.remat and (p.save or p.offload) for p in parsed):
        return frozenset()
    try:
        full = jax.make_jaxpr(workload.loss_for_policy(Policy()))(*args).jaxpr
    except Exception:  # noqa: BLE001 - full remat's own row reports why it fails
        return frozenset()
    return frozenset(emitted) - tags_in_regions(full)


def _lowered(run: _Run, groups: list, time_steps: int) -> list[tuple]:
    """`_lower_programs` of `groups`, each distinct program's compile started as it is
    lowered (`_Compiles`: on the compile pool, or one at a time when asked for where
    steps are timed, so that no step runs beside a compile)."""
    compiles = _Compiles(lowering.compile_options(run.target, not time_steps),
                         target=run.target, runs=time_steps > 0, peak=run.peak)
    return _lower_programs(groups, run.workload.loss_for_policy, run.args, run.target,
                           compiles.start, marked=True)


def _measured(run: _Run, policy: Policy, group_names: list[str], loss, staged, compiling,
              seconds: float) -> tuple[Record, object]:
    """(the record of one distinct program, from `_lower_programs`' entry, and its
    executable to time; None where it failed). A failure is the record's error."""
    versions = run.target.versions
    record = Record(str(policy), tuple(group_names), run.target.label, str(run.target),
                    versions["jax"], versions["compiler"])
    try:
        if isinstance(compiling, Exception):
            raise compiling
        local, layers = _traced(run, policy, loss, staged)  # while the compile runs
        compiled, compile_seconds, program_key, dump = compiling()
        figures = _compiled_figures(run, compiled, local, program_key, dump)
        found = split(local.residuals)
        return dataclasses.replace(
            record, **found, **figures["memory"], flops=figures["flops"],
            transcendentals=figures["transcendentals"],
            compile_seconds=seconds + compile_seconds,
            predicted_seconds=figures["predicted_seconds"],
            kernel_flops=figures["kernel_flops"],
            parameter_bytes_per_device=figures.get("parameter_bytes"),
            peak=figures.get("peak") if run.peak else None,
            audit=audit_of.audit(policy, local.residuals, audit_of.recomputed(local.program.jaxpr),
                                 figures["compiled_audit"], run.outside, _argument_names(run)),
            notes=_notes(run, policy, group_names, figures, found), **layers), compiled
    except Exception as e:  # noqa: BLE001 - one failing policy must not hide the others
        detail = str(e) or "no message; JAX_TRACEBACK_FILTERING=off shows where"
        return dataclasses.replace(record, error=f"{type(e).__name__}: {detail}"), None


def _argument_names(run: _Run) -> dict[str, str]:
    """{"args[i]": the path of the workload's i-th argument leaf, e.g. "[0]['params']['wi']"},
    as the compiled program's parameters name them in their op metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(run.args)[0]
    return {f"args[{i}]": jax.tree_util.keystr(path) for i, (path, _) in enumerate(leaves)}


def _traced(run: _Run, policy: Policy, loss, staged) -> tuple:
    """(the per-device program whose residuals a record reports, the per-layer
    figures); where tracing fails, (the exception, {}), raised once the compile
    is known, so that a compile error is reported before a tracing one."""
    try:
        local = (stage(run.per_device[0](policy), run.per_device[1])
                 if run.per_device is not None
                 else stage(loss, run.local_args) if run.local_args is not None else staged)
        return local, (stack_stored_bytes(run.workload, policy, not run.differ)
                       if run.per_layer else {})
    except Exception as e:  # noqa: BLE001 - raised once the compile is known
        return e, {}


def _compiled_figures(run: _Run, compiled, local, program_key, dump) -> dict:
    """What the record reads of a compile (`_figures`, with its peak's breakdown
    where `dump` holds XLA's dump), kept under `program_key`; figures read back
    (`compiled` a dict) as they are. Removes `dump`. Raises `local` if it is the
    exception tracing raised."""
    try:
        if isinstance(local, Exception):
            raise local
        if isinstance(compiled, dict):  # read back (`figure_cache`): nothing compiled
            return compiled
        figures = _figures(compiled, run.target, local)
        figures["parameter_bytes"] = parameter_bytes(compiled, run.args[0])
        if dump is not None:
            figures["peak"] = peak_of.breakdown(
                dump, figures["memory"], figure=memory_kind(run.target.platform),
                arg_groups=(("parameters", len(jax.tree.leaves(run.args[0]))),),
                logits_shape=peak_of.logits_shape(local.program),
                residuals=local.residuals,
                code_bytes=getattr(compiled.memory_analysis(),
                                   "generated_code_size_in_bytes", 0) or 0)
        figure_cache.store(program_key, figures)
        return figures
    finally:
        if dump is not None:
            shutil.rmtree(dump, ignore_errors=True)


def _notes(run: _Run, policy: Policy, group_names, figures: dict, found: dict) -> tuple:
    """A record's notes: where its FLOPs came from, host memory on the CPU, names that
    select nothing, blocks that differ, the model map's, the time model's."""
    keeps_context = policy.remat and any(fnmatch.fnmatchcase("context", p)
                                         for p in (*policy.save, *policy.offload))
    # A fused kernel's rerun forward says its residuals were not kept only where the
    # policy asked to keep them (under `full` the rerun is the policy's own).
    notes = tuple(n for n in figures["cost_notes"]
                  if keeps_context or not n.endswith(kernels.CONTEXT_NOT_KEPT))
    if found["offloaded_bytes"] and run.target.platform == "cpu":
        notes += ("on CPU, host memory is device memory: temp_size_in_bytes "
                  "includes the offloaded residuals",)
    for name in group_names:  # merged policies may each select nothing
        notes += tuple(f"{name}: {line}" for line in policy_notes(
            run.by_name.get(name, policy), run.emitted, run.workload.notes))
    notes += (run.differ,) if run.differ else ()
    if run.workload.model_map is not None:  # kept own remat, no layers: on every row
        notes += model_map.notes(run.workload.model_map)
    # The workload's notes on the model as a whole (a batch its own mesh cannot split,
    # blocks left out), on every row; those on a tag are the policy's own (above).
    tags = set(known_tags())
    notes += tuple(line for line in run.workload.notes
                   if line.split(":", 1)[0] not in tags and line not in notes)
    return notes + tuple(figures["time_notes"])


def parameter_bytes(compiled, params) -> int | None:
    """Bytes of the parameter arguments one device of `compiled` holds, by the shardings
    the compiled program takes them with (`lowering.argument_bytes`, its first arguments
    being `params`' leaves); None where it does not say."""
    found = lowering.argument_bytes(compiled, (params,))
    return found and found[0]


def _figures(compiled, target, local) -> dict:
    """What a record reads from a compile, JSON-ready (`figure_cache` keeps it):
    {"memory": `memory_fields`, "flops", "transcendentals" (`lowering.costs`, at
    the per-device program `local`, with its kernels priced from shapes:
    `lowering.costs_with_kernels`), "kernel_flops" (theirs, in "flops"), "predicted_seconds",
    "cost_notes", "time_notes"}.

    Raises:
      time_checks.BelowFloor: a predicted step faster than the target's peaks.
    """
    costs, cost_notes, priced = lowering.costs_with_kernels(
        compiled, target, jaxpr_as_fun(local.program), local.leaves, local.program)
    predicted, time_notes, terms = _predicted_seconds(compiled, target, priced)
    if predicted is not None and costs.get("flops") is not None:
        time_checks.check_floor(predicted, target.roofline, costs["flops"],
                                time_checks.written_bytes(compiled))
    memory = memory_fields(compiled)
    return {"memory": memory, "flops": costs.get("flops"),
            "kernel_flops": priced.kernel_flops,
            "transcendentals": costs.get("transcendentals"), "predicted_seconds": predicted,
            "cost_notes": [*cost_notes, *xla_remat_note(compiled, target.platform)],
            "time_notes": list(time_notes),
            "compiled_audit": {**audit_of.compiled_facts(compiled, memory, target.platform),
                               "step_terms": terms}}


def _predicted_seconds(compiled, target, priced: kernels.Priced
                       ) -> tuple[float | None, tuple[str, ...], dict | None]:
    """(the time model's step seconds of `compiled` on `target`, notes, the terms it sums:
    `time_model.step_terms`, the kernels' time as "kernel_seconds"): None, a note and None
    where its HLO cannot be read; the kernels `priced` from shapes add their FLOPs' time
    (`kernels.seconds`)."""
    try:
        terms = time_model.step_terms(compiled, target.roofline)
        terms["kernel_seconds"] = kernels.seconds(priced, target.roofline)
        return terms["seconds"] + terms["kernel_seconds"], (), terms
    except Exception as e:  # noqa: BLE001 - a prediction must not lose the measurement
        return None, (f"no predicted step time: {type(e).__name__}: {e}",), None


class _Compiles:
    """Starts each lowered program's compile on the compile pool (`pool.current()`) as
    soon as it is lowered, so the next policy's tracing and lowering (Python, holding the
    GIL) overlap it; where steps will run (`runs`), only when asked for, so a timed step
    never runs beside a compile.

    `start(lowered, text, program)` returns a zero-argument callable giving (compiled,
    seconds, key, dump), raising what the compile raised; for a program whose
    figures were kept (`figure_cache`: a program that will not run),
    compiled is those figures (a dict) and nothing compiles. With `peak`,
    kept figures count only if they hold a breakdown ("peak"), and a compile
    writes XLA's dump (`peak.dump_options`) into the new folder `dump`, which
    the caller reads and removes; else dump is None. seconds is the compile's own
    wall time.
    """

    def __init__(self, options: dict | None, target, runs: bool, peak: bool = False):
        self._options, self._target, self._runs, self._peak = options, target, runs, peak

    def _compile(self, lowered, program_key) -> tuple:
        dump = tempfile.mkdtemp(prefix="remat_kit_peak_") if self._peak else None
        start = time.perf_counter()
        try:
            if dump is None:
                compiled = lowering.compile_lowered(lowered, self._options, self._target,
                                                   self._runs)
            else:  # a compile read back from JAX's cache would write no dump
                with without_compilation_cache():
                    compiled = lowered.compile(peak_of.dump_options(self._options, dump))
        except BaseException:
            if dump is not None:
                shutil.rmtree(dump, ignore_errors=True)
            raise
        return compiled, time.perf_counter() - start, program_key, dump

    def start(self, lowered, text: str, program) -> Callable[[], tuple]:
        # The dump option is left out of the key: it changes no figure.
        program_key, kept = figure_cache.lookup(text, self._target, self._options, "measure",
                                                self._runs, program=program)
        if kept is not None and (not self._peak or "peak" in kept):
            return lambda: (kept, 0.0, program_key, None)
        if self._runs:
            return lambda: pool.current().run(self._compile, lowered, program_key)
        return pool.current().submit(self._compile, lowered, program_key).result


def _lower_programs(groups, loss_for_policy: Callable, args, target,
                    start: Callable[[object, str, object], Callable[[], tuple]],
                    marked: bool = False) -> list[tuple]:
    """(policy, names, loss, staged, compiling, seconds) per distinct program,
    in first-seen order: `compiling` is `start(lowered, its text, its jaxpr)` (once per
    distinct program, as soon as it is lowered), or the exception where
    tracing or lowering failed. Groups whose decisions differ only on values
    the backward pass never reads lower to the same program: they become one
    entry with all their names, so `measure` compiles, and counts, each
    program once. marked: lower each program with its residuals named in its op
    metadata (`peak.marked`; the same text, so the same key)."""
    out, seen = [], {}  # lowered program text -> its index in out
    for policy, group_names in groups:
        begin = time.perf_counter()
        try:
            loss = loss_for_policy(policy)
            staged = stage(loss, args)
            program = (peak_of.marked(staged.program, staged.residual_vars, staged.residuals)
                       if marked else staged.program)
            lowered = lowering.lower(jaxpr_as_fun(lowering.on_target(program, target)),
                                     staged.leaves, target)
        except Exception as e:  # noqa: BLE001 - reported in the policy's record
            out.append((policy, list(group_names), None, None, e, 0.0))
            continue
        text = lowered.as_text()
        same = seen.setdefault(text, len(out))
        if same != len(out):
            out[same][1].extend(group_names)
            continue
        seconds = time.perf_counter() - begin
        out.append((policy, list(group_names), loss, staged, start(lowered, text, program),
                    seconds))
    return out


__all__ = ["measure"]
