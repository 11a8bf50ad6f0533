"""Lowering and compiling a program for a target, with its memory and FLOPs.

`compile_for(fn, *args, target=...)` is the one compile site of the reports' figures: it places
the arguments on the target's devices (`place`), lowers for its platform (ahead of time where
this machine lacks it), reads memory and FLOPs (while loops per trip; fused kernels priced), and
keeps the figures of a program that will not run (`figure_cache`). Returns a `Compiled`.
Docs: docs/targets.md (the example at the end of its first part).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit.measure import cluster, figure_cache, kernels, pool
from remat_kit._jax_private import without_compilation_cache
from remat_kit.measure.costs import loop_scaled_costs, memory_fields
from remat_kit.measure.peak import dump_options
from remat_kit.measure.targets import Target, TargetError, parse_target
from remat_kit.trace import retarget, stand_in
from remat_kit.mesh import local_shape as _local

# XLA CPU: LLVM optimization only changes the speed of the generated code,
# not buffer assignment or cost analysis (checked on every gpt2_small preset),
# and skipping it makes CPU compiles several times faster.
_CPU_COMPILE_ONLY_OPTIONS = {"xla_backend_optimization_level": 0}
# XLA:GPU holds a program to (its memory figure - arguments and outputs) x this slop factor
# / 100 (default 95), rematerializing on its own past it (`chip_memory.gpu_remat_limit`);
# 100x the memory puts that limit out of reach: the program is the policy's as asked.
_GPU_NO_OWN_REMAT = {"xla_gpu_memory_limit_slop_factor": 10_000}


def place(args, target: Target):
    """`args` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs on `target`'s devices.

    Leaves that carry a sharding keep it; a `NamedSharding` over other devices
    (this machine's, a model's own mesh) is rebuilt over the target's first
    devices with the same axis names and shape. The others are replicated on
    the target's first device. For JAX's default backend with no sharding
    given, `args` come back as they are.

    Raises:
      TargetError: a leaf sharded over other devices, not by a NamedSharding.
      MeshError: a mesh with more devices than the target has.
    """
    if not target.aot and target.platform == jax.default_backend():
        return args
    found = target.devices
    ids = {(d.platform, d.id) for d in found}
    single = NamedSharding(Mesh(found[:1], ("data",)), PartitionSpec())

    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=single)
        if not {(d.platform, d.id) for d in sharding.device_set} <= ids:
            if not isinstance(sharding, NamedSharding):
                raise TargetError(f"an argument is sharded over {sorted(sharding.device_set)[:2]}"
                                  f"..., not over the devices of target {target}; build the "
                                  f"mesh with remat_kit.measure.targets.make_mesh")
            sharding = retarget.rebuild(sharding, found, str(target))  # same axes, shape
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(one, args)


def lower(fn: Callable, leaves: Sequence, target: Target,
          donate_argnums: tuple[int, ...] = ()):
    """`jax.jit(fn, donate_argnums=...)` lowered for `target` at `leaves` (already
    `place`d): a `Lowered`."""
    jitted = jax.jit(fn, donate_argnums=donate_argnums)
    if target.aot:
        platform = "cuda" if target.platform == "gpu" else target.platform
        with retarget.retargeting(target.devices, str(target)):  # a model's own mesh
            traced = jitted.trace(*leaves)
        if _off_target(traced.jaxpr, target):  # a step's own constraint on the model's mesh
            rebuilt = retarget.rebuild(traced.jaxpr, target.devices, str(target))
            traced = jax.jit(jaxpr_as_fun(rebuilt), donate_argnums=donate_argnums).trace(
                *leaves)
        return traced.lower(lowering_platforms=(platform,))
    return jitted.lower(*leaves)


def _off_target(closed, target: Target) -> bool:
    """Whether a traced program names a mesh over devices `target` has not: one the
    step built around the model (the train step's gradient constraints on the model's
    own mesh), outside the regions `retarget.retargeting` rebuilds as they are bound."""
    found = set(target.devices)
    return any(not set(m.devices.flat) <= found for m in retarget.meshes(closed.jaxpr))


def on_target(closed, target: Target):
    """A staged ClosedJaxpr for `target`: a mesh of the model's own over other
    devices rebuilt on the target's (`trace.retarget`); as it is for JAX's backend.

    Raises:
      MeshError: the model's mesh has more devices than the target.
    """
    return retarget.rebuild(closed, target.devices, str(target)) if target.aot else closed


def compile_options(target: Target, compile_only: bool, xla_remat: bool = True) -> dict | None:
    """XLA options for compiling on `target`; compile_only: the program will not run,
    so skip code-generation work that changes neither memory nor FLOPs; xla_remat False:
    on a GPU, XLA's own rematerialization held off (its memory limit out of reach,
    `_GPU_NO_OWN_REMAT`), so the program is the policy's as asked."""
    if compile_only and target.platform == "cpu":
        return dict(_CPU_COMPILE_ONLY_OPTIONS)
    return dict(_GPU_NO_OWN_REMAT) if not xla_remat and target.platform == "gpu" else None


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled for one target, with what the report needs.

    Attributes:
      compiled: JAX's `Compiled` executable (not runnable for an AOT target);
        None where the program will not run (compile_only, or an AOT
        target) and its figures were kept from an earlier compile of the
        same program (`figure_cache`).
      target: the `Target`.
      memory: `measure.memory_fields(compiled)`: bytes per device.
      flops, transcendentals: per device, while loops counted per trip
        (`measure.loop_scaled_costs`); None if no compiler reports them.
      seconds: lowering and compiling, seconds.
      notes: where a figure came from, if not the target's compiler.
      kernel_seconds: the time model's seconds of the fused kernels priced from
        shapes (`kernels.seconds`), which `time_model.compiled_seconds` leaves out;
        0.0 where there are none.
      argument_bytes: bytes one device takes of each of the program's arguments, by
        the shardings the compiled program takes them with (`argument_bytes`); None
        where it keeps none.
    """

    compiled: object
    target: Target
    memory: dict
    flops: float | None
    transcendentals: float | None
    seconds: float
    notes: tuple[str, ...] = ()
    kernel_seconds: float = 0.0
    argument_bytes: tuple[int, ...] | None = None


def argument_bytes(compiled, args: Sequence) -> tuple[int, ...] | None:
    """Bytes one device of `compiled` takes of each of `args` (its arguments, in order,
    their leaves its input leaves), by the shardings the compiled program takes them with
    (`compiled.input_shardings`); None where it does not say."""
    try:
        shardings = jax.tree.leaves(compiled.input_shardings[0])
    except Exception:  # noqa: BLE001 - an executable that keeps no shardings
        return None
    found, at = [], 0
    for arg in args:
        leaves = jax.tree.leaves(arg)
        if at + len(leaves) > len(shardings):
            return None
        found.append(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize  # keys too
                         for s, x in zip(shardings[at:], leaves)))
        at += len(leaves)
    return tuple(found)


def costs(compiled, target: Target, fn: Callable, local_leaves: Sequence):
    """FLOPs and transcendentals of `compiled`, loops counted per trip, with notes.

    If the target's compiler leaves a while loop whose trip count cannot be
    read (`loops.trip_count`) or gives no cost analysis (the deviceless GPU
    compiler does not), the figures come from
    the XLA CPU compile of the same program at the per-device shapes
    `local_leaves`, and a note says so.

    Returns:
      ({"flops": float, "transcendentals": float} or {}, notes).
    """
    found, notes = loop_scaled_costs(compiled)
    if target.platform == "cpu" or (found and not notes):
        return found, notes
    cpu = jax.devices("cpu")[0]
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=jax.sharding.SingleDeviceSharding(cpu))
               for x in local_leaves]
    on_cpu = jax.jit(fn).lower(*structs).compile(_CPU_COMPILE_ONLY_OPTIONS)
    found, cpu_notes = loop_scaled_costs(on_cpu)
    why = ("has while loops without a known trip count" if found
           else "gives no cost analysis")
    return found, cpu_notes + (f"FLOPs from the XLA CPU compile of the same program (the "
                               f"{target} compile {why})",)


def costs_with_kernels(compiled, target: Target, fn: Callable, local_leaves: Sequence,
                       program) -> tuple[dict, tuple[str, ...], kernels.Priced]:
    """(`costs` of `compiled` with its fused kernels' FLOPs, notes, the kernels): the
    one place a program's kernels priced from shapes (`kernels.price` of `program`,
    its ClosedJaxpr; None where it holds no custom call) join its count, where the
    compiler left them out (`kernels.added`). `measure`'s records and `compile_for`
    both count here."""
    priced = kernels.price(program, target.platform) if program is not None \
        else kernels.Priced()
    found, notes = kernels.added(costs(compiled, target, fn, local_leaves), priced)
    return found, notes, priced


def _kernel_program(lowered, fn: Callable, local_leaves: Sequence):
    """The jaxpr of a lowered program, traced again only where it holds a custom call
    that is not an annotation (`kernels.has_kernels`); else None."""
    if not kernels.has_kernels(lowered.as_text()):
        return None
    return jax.make_jaxpr(fn)(*local_leaves)


def compile_for(fn: Callable, *args, target: "str | Target | None" = None,
                compile_only: bool = True, donate: tuple[int, ...] = (),
                count_flops: bool = True, dump: str | None = None,
                xla_remat: bool = True) -> Compiled:
    """Compiles `jax.jit(fn)` at `args` for `target`; nothing is allocated.

    Args:
      fn: any jittable function of `args`.
      args: arrays or ShapeDtypeStructs; leaves with a `NamedSharding` over
        a `make_mesh(target, ...)` mesh give a sharded program, whose
        figures are per device.
      target: a target string or `Target`, parsed here once (`parse_target`: this
        is an entry point); default JAX's default backend.
      compile_only: the program will not be run (faster CPU compiles).
      donate: indices of `args` whose buffers the program may reuse
        (`jax.jit`'s donate_argnums), e.g. the parameters of a train step.
      count_flops: also count FLOPs (`costs`); False skips it, and with it
        the XLA CPU compile that a compiler without cost analysis needs
        (flops and transcendentals are then None).
      dump: a folder for XLA's dump (`peak.dump_options`, read by
        `peak.breakdown`): the program is then compiled, never read back from
        the figure cache or JAX's compilation cache (which would write none).
      xla_remat: False holds off XLA's own rematerialization on a GPU (`compile_options`).
    Returns:
      A `Compiled`; cuDNN attention traced as its stand-in where `target` cannot build
      it here (`remat_kit.trace.stand_in`), its kernels' FLOPs in `flops`
      (`costs_with_kernels`).
    Raises:
      TargetError: a bad target, or libtpu missing.
      Exception: whatever tracing or the compiler raises (e.g.
        `jax.errors.JaxRuntimeError` for a program the compiler rejects).
    """
    target = parse_target(target)
    with stand_in.for_target(target):  # cuDNN attention where it cannot be built
        return _compile_for(fn, args, target, compile_only, donate, count_flops, dump,
                            xla_remat)


def compile_lowered(lowered, options: dict | None, target: Target, runs: bool = False):
    """`lowered.compile(options)`; for an ahead-of-time target, past JAX's persistent
    compilation cache: this machine cannot load such an executable back (a read warns and
    compiles anyway), and `figure_cache` keeps what is read from it. Inside
    `cluster.using`, a program that will not run (not `runs`) compiles on the Ray
    cluster and comes back as its `cluster.Figures` (what the reports read of it)."""
    if not runs and cluster.active():
        figures = cluster.compile_figures_remote(lowered, options, target)
        if figures is not None:
            return figures
    if not target.aot:
        return lowered.compile(options)
    with without_compilation_cache():
        return lowered.compile(options)


def _compile_dumped(lowered, options: dict, target: Target):
    """`lowered.compile(options)` past JAX's persistent cache, whose read would write no dump."""
    del target
    with without_compilation_cache():
        return lowered.compile(options)


def _compile_for(fn: Callable, args: tuple, target: Target, compile_only: bool,
                 donate: tuple[int, ...], count_flops: bool, dump: str | None,
                 xla_remat: bool = True) -> Compiled:
    placed = place(args, target)
    leaves, tree = jax.tree.flatten(placed)

    def flat(*xs):
        return fn(*jax.tree.unflatten(tree, xs))

    counts = [len(jax.tree.leaves(a)) for a in placed]
    first = [sum(counts[:i]) for i in range(len(counts))]
    donated = tuple(j for i in donate for j in range(first[i], first[i] + counts[i]))
    start = time.perf_counter()
    lowered = lower(flat, leaves, target, donated)
    options = compile_options(target, compile_only, xla_remat)
    local = [_local(x) for x in leaves]
    program = _kernel_program(lowered, flat, local) if count_flops else None
    program_key, kept = figure_cache.lookup(lowered.as_text(), target, options,
                                            f"compile_for count_flops={count_flops}",
                                            runs=not compile_only, schema=figure_cache.COMPILED,
                                            program=program)
    if kept is not None and dump is None:  # a program that will not run: kept figures
        return Compiled(None, target, kept["memory"], kept["flops"], kept["transcendentals"],
                        time.perf_counter() - start, tuple(kept["notes"]),
                        kept["kernel_seconds"], kept["argument_bytes"]
                        and tuple(kept["argument_bytes"]))
    compiled = (pool.current().run(_compile_dumped, lowered, dump_options(options, dump),
                                   target) if dump else
                pool.current().run(compile_lowered, lowered, options, target, not compile_only))
    seconds = time.perf_counter() - start
    found, notes, priced = (costs_with_kernels(compiled, target, flat, local, program)
                            if count_flops else ({}, (), kernels.Priced()))
    memory = memory_fields(compiled)
    kernel_seconds = kernels.seconds(priced, target.roofline) if priced.kernels else 0.0
    shards = argument_bytes(compiled, placed)
    figure_cache.store(program_key, {"memory": memory, "flops": found.get("flops"),
                                     "transcendentals": found.get("transcendentals"),
                                     "notes": list(notes), "kernel_seconds": kernel_seconds,
                                     "argument_bytes": shards and list(shards)})
    return Compiled(compiled, target, memory, found.get("flops"),
                    found.get("transcendentals"), seconds, notes, kernel_seconds, shards)


__all__ = ["Compiled", "argument_bytes", "compile_for", "compile_lowered", "compile_options", "costs",
           "costs_with_kernels", "lower", "on_target", "place"]
