"""One train step of a workload: its device memory per device, compiled, or run.

The step is forward, backward and the optimizer update (optax AdamW unless given), parameters and
optimizer state donated, compiled on `jax.ShapeDtypeStruct`s. Its memory (`in_use_bytes`) is
argument + temp + output - alias on XLA CPU (whose peak leaves out temp), the compiler's peak on
TPU and GPU; `StepMemory.source` says which. Main names: `step_memory`, `train_step`, `StepMemory`.
What is counted and why: docs/fit.md (the paragraph after the flags).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable

import jax
import optax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from remat_kit.measure import targets
from remat_kit.measure import lowering, peak
from remat_kit.measure.residuals import stage
from remat_kit.measure.step_times import random_like  # measure's random data, for timed runs
from remat_kit.errors import RematSpecError, check_positive
from remat_kit.decide.floor import train_state, tree_bytes
from remat_kit.policy.policy import Policy
from remat_kit.measure.record import PEAK, memory_kind
from remat_kit.policy.spec import AutoSpec, parsed_only
from remat_kit.trace.workload import Workload


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Device memory and FLOPs of one compiled train step, per device.

    Attributes:
      total_bytes: device memory in use at the step's peak, bytes; see
        `source`.
      source: how total_bytes was obtained: "peak_memory_in_bytes" (the
        compiler's own figure) or "argument + temp + output - alias" (XLA CPU,
        whose peak figure leaves out temp buffers).
      params_bytes: the parameters (donated, updated in place), bytes.
      grads_bytes: the gradients, one per parameter in its dtype, bytes.
      opt_state_bytes: the optimizer state (donated), bytes.
      other_bytes: the rest, activations saved for the backward pass and the
        compiler's workspace: total - params - grads - optimizer state, at
        least 0. Gradients and activations need not peak together, so this
        split is by size, not by a timeline.
      temp_size_in_bytes, argument_size_in_bytes, output_size_in_bytes,
        alias_size_in_bytes, peak_memory_in_bytes: `memory_analysis()`
        figures, None where the backend gives none.
      flops: FLOPs of the step (`loop_scaled_costs`), None where the backend
        gives none.
      compile_seconds: lowering and compiling, seconds.
      parameter_bytes_per_device: bytes of the parameters one device takes, by the
        shardings the compiled program takes them with (`lowering.argument_bytes`,
        kept in the figure cache too); None where it does not say.
    """

    total_bytes: int
    source: str
    params_bytes: int
    grads_bytes: int
    opt_state_bytes: int
    other_bytes: int
    temp_size_in_bytes: int | None
    argument_size_in_bytes: int | None
    output_size_in_bytes: int | None
    alias_size_in_bytes: int | None
    peak_memory_in_bytes: int | None
    flops: float | None
    compile_seconds: float
    parameter_bytes_per_device: int | None = None


def resizer(model, mesh: Mesh | None) -> tuple[Callable[[int, int], Workload], Workload]:
    """(batch, seq) -> the workload at those sizes, and the workload as given.

    model: a `Workload` (resized by `Workload.at`; its own mesh), or a function
    (batch, seq) -> Workload. A reference config becomes one of these above this
    part (`remat_kit.api.configs`).
    """
    if isinstance(model, Workload):
        if mesh is not None:
            raise TypeError("mesh= is for a TransformerConfig; a Workload brings its own "
                            "mesh (Workload.mesh)")
        return (lambda batch, seq: model.at(batch, seq)), model
    if callable(model):
        return model, None
    raise TypeError(f"fit and step_memory take a TransformerConfig (get_config('tiny')), a "
                    f"remat_kit Workload or a function (batch, seq) -> Workload, got "
                    f"{type(model).__name__} {model!r:.80}")


def check_args(optimizer, **sizes) -> None:
    """TypeError / ValueError naming the argument, before anything compiles."""
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}")
    for name, value in sizes.items():
        check_positive(name, value)


def one_policy(policy: "Policy | AutoSpec") -> Policy:
    """`policy`, parsed (`rk.step_memory` parses a spec), refusing an auto:budget= spec: a
    step compiles one policy. Raises TypeError for a spec string."""
    [policy] = parsed_only([policy], "a train step")
    if not isinstance(policy, Policy):
        raise RematSpecError(f"step_memory compiles one policy, not {policy}: fit's auto row "
                             "plans it for each size, remat-kit plan for one", token=str(policy))
    return policy


def default_optimizer() -> optax.GradientTransformation:
    """optax AdamW (Loshchilov & Hutter 2019): two float32-like moments per parameter."""
    return optax.adamw(1e-4)


def in_use_bytes(memory: dict, platform: str) -> tuple[int, str]:
    """Device memory a compiled step holds at its peak, and how it was found.

    Args:
      memory: `measure.memory_fields(compiled)`.
      platform: the compiler's platform ("cpu", "tpu", "gpu").
    Returns:
      (bytes, source): `peak_memory_in_bytes` where the platform's policies
      are ranked by the compiler's peak (`measure.memory_kind`: TPU, GPU) and
      it reports one; else argument + temp + output - alias bytes (the XLA
      CPU peak figure leaves out temp buffers).
    """
    if memory_kind(platform) == PEAK and memory.get(PEAK):
        return memory[PEAK], PEAK
    return (memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]
            + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"],
            "argument + temp + output - alias")


def check_mesh(mesh) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (remat_kit.mesh.make(\"fsdp:2\") or "
                        f"remat_kit.measure.targets.make_mesh), got {type(mesh).__name__} {mesh!r}")


def step_memory(model, batch: int, seq: int, policy: "str | Policy", *,
                optimizer: optax.GradientTransformation | None = None,
                target: "str | targets.Target | None" = None,
                mesh: Mesh | None = None) -> StepMemory:
    """Compiles one train step of a workload and returns its memory per device.

    The step is `jax.value_and_grad` of the workload's loss (e.g. the
    language-model loss on int32 tokens [batch, seq]), then
    `optimizer.update` and `optax.apply_updates`; it is jitted with the
    parameters and the optimizer state donated. For a GPT-2 config and
    seq > max_len, the position table is made seq long.

    On a mesh the program is SPMD-partitioned: parameters are sharded by
    their logical axes (`remat_kit.mesh.RULES`), each optimizer-state leaf
    like the parameter it mirrors, the tokens split over the batch axes
    (data x fsdp); the updated parameters and state keep their input
    shardings, so the donated buffers are reused. XLA's memory and cost
    analysis of such a program are per device, and so is every figure
    returned (the parameter bytes are those of one device's shards).

    Args:
      model: a `TransformerConfig` (its dtype, param_dtype, dropout; its
        remat is replaced by `policy`), a `Workload` (`remat_kit.trace.workload`:
        e.g. `rk.from_model.workload(model, batch, seq)`), or a function
        (batch, seq) -> Workload.
      batch, seq: the global batch size (split over the mesh's data x fsdp
        axes) and the sequence length, positive ints.
      policy: a spec string or `Policy`.
      optimizer: an optax transformation; default `default_optimizer()`.
      target: whose compiler (`remat_kit.measure.targets`): "cpu", "tpu:v5e:1x1"
        (ahead of time), "gpu:h100", ...; default JAX's default backend.
        Without a mesh the step runs on one device of the target.
      mesh: a `jax.sharding.Mesh` (`remat_kit.mesh.make`, or
        `targets.make_mesh` for a target compiled ahead of time); default
        none, one device.
    Returns:
      A `StepMemory` (bytes per device, FLOPs per device, seconds).
    Raises:
      TypeError, ValueError: model, batch, seq, optimizer or mesh of the wrong
        type, or sizes not positive.
      MeshError: the mesh does not split the batch or the heads
        (`remat_kit.mesh.check_fits`).
      RematSpecError: an auto:budget= spec. TypeError: a spec string (`rk.step_memory`
        parses it).
      TargetError: a bad target, or libtpu missing.
      Any compiler error, e.g. an out-of-memory error from an accelerator's
      compiler (see `is_out_of_memory`).
    """
    check_args(optimizer, batch=batch, seq=seq)
    check_mesh(mesh)
    policy = one_policy(policy)
    optimizer = optimizer or default_optimizer()
    workload = resizer(model, mesh)[0](batch, seq)
    return compile_step(workload, policy, optimizer, targets.parse_target(target))


def compile_step(workload: Workload, policy: Policy, optimizer,
                 target: targets.Target, xla_remat: bool = True) -> StepMemory:
    """`step_memory` of a workload at its sizes, for a parsed `target`; xla_remat False
    holds off XLA's own rematerialization on a GPU (`lowering.compile_options`)."""
    made = workload_step(workload, policy, optimizer)
    c = lowering.compile_for(made.step, *made.args, target=target, donate=TrainStep.DONATED,
                             xla_remat=xla_remat)
    return step_figures(c, made.args)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One train step of a workload, to compile or to run.

    Attributes:
      step: step(params, opt_state, *rest) -> (params, opt_state, loss):
        value-and-grad of the workload's loss, then the optimizer update;
        params and opt_state are meant to be donated (`DONATED`).
      args: (params, opt_state, *rest) as `jax.ShapeDtypeStruct`s (sharded on
        the mesh, if any); rest are the loss's other arguments (e.g. int32
        tokens [batch, seq]).
      make_args: key -> concrete args of those shapes (the workload's
        `sample_args`, else random normal floats and zero ints; the
        optimizer state by the optimizer), on JAX's default device.
    """

    step: Callable
    args: tuple
    make_args: Callable

    DONATED = (0, 1)  # params and opt_state: updated in place


def train_step(model, batch: int, seq: int, policy: "str | Policy", *,
               optimizer: optax.GradientTransformation | None = None,
               mesh: Mesh | None = None) -> TrainStep:
    """The train step `step_memory` compiles, as a function with its arguments.

    Args and errors as `step_memory` (without `target`), less the compiler's.
    Returns:
      A `TrainStep`.
    """
    check_args(optimizer, batch=batch, seq=seq)
    check_mesh(mesh)
    policy = one_policy(policy)
    optimizer = optimizer or default_optimizer()
    return workload_step(resizer(model, mesh)[0](batch, seq), policy, optimizer)


def workload_step(workload: Workload, policy: Policy, optimizer,
                  value_grad: Callable | None = None) -> TrainStep:
    """The `TrainStep` of `workload` under `policy`; value_grad(params, *rest) ->
    (loss, grads), default `jax.value_and_grad` of the policy's loss."""
    params, opt_state, rest = train_state(workload, optimizer)
    value_grad = value_grad or jax.value_and_grad(workload.loss_for_policy(policy))
    mesh = workload.mesh
    # A leaf given no placement (a --model's parameters on an AOT target's mesh) is
    # replicated: with_sharding_constraint takes no None.
    state_shardings = jax.tree.map(
        lambda x: x.sharding if x.sharding is not None or mesh is None
        else NamedSharding(mesh, PartitionSpec()), (params, opt_state))

    def step(params, opt_state, *rest):
        loss, grads = value_grad(params, *rest)
        if mesh is not None:  # reduce-scattered (FSDP) or all-reduced (data) to the params'
            grads = jax.lax.with_sharding_constraint(grads, state_shardings[0])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        state = optax.apply_updates(params, updates), opt_state
        if mesh is not None:  # where the donated inputs live, so their buffers are reused
            state = jax.lax.with_sharding_constraint(state, state_shardings)
        return *state, loss

    sample = workload.sample_args or (lambda k: random_like(workload.args, k))

    def make_args(k):
        params, *rest = sample(k)
        return params, optimizer.init(params), *rest

    return TrainStep(step, (params, opt_state, *rest), make_args)


def step_peak(workload: Workload, policy: Policy, optimizer, target) -> dict:
    """What holds a train step's memory (`StepMemory.total_bytes`): the
    `remat_kit.measure.peak.breakdown` of one compile of the step that writes
    XLA's dump, with "parameters" and "optimizer state" as groups of their own
    and each saved residual by its tag. "figure" is `StepMemory.source`.

    Raises: whatever tracing or compiling the step raises.
    """
    params, _, rest = train_state(workload, optimizer)
    staged = stage(workload.loss_for_policy(policy), (params, *rest))
    # The value-and-grad program with its residuals named, so the dump says which is which.
    marked = jaxpr_as_fun(peak.marked(staged.program, staged.residual_vars, staged.residuals))
    tree = jax.tree.structure(params)

    def value_grad(params, *rest):
        loss, *grads = marked(*jax.tree.leaves((params, *rest)))
        return loss, jax.tree.unflatten(tree, grads)

    made = workload_step(workload, policy, optimizer, value_grad)
    folder = tempfile.mkdtemp(prefix="remat_kit_peak_")
    try:
        c = lowering.compile_for(made.step, *made.args, target=target,
                                 donate=TrainStep.DONATED, count_flops=False, dump=folder)
        total, source = in_use_bytes(c.memory, c.target.platform)
        code = getattr(c.compiled.memory_analysis(), "generated_code_size_in_bytes", 0) or 0
        return peak.breakdown(
            folder, c.memory, figure=source, total=None if source == PEAK else total,
            arg_groups=(("parameters", tree.num_leaves),
                        ("optimizer state", len(jax.tree.leaves(made.args[1])))),
            logits_shape=peak.logits_shape(staged.program), residuals=staged.residuals,
            code_bytes=code)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def step_figures(c: "lowering.Compiled", args: tuple) -> StepMemory:
    """The `StepMemory` of a compiled train step: `c` from `lowering.compile_for` of a
    `TrainStep`'s step at its `args` (params, opt_state, ...)."""
    mem = c.memory
    total, source = in_use_bytes(mem, c.target.platform)
    p_bytes, o_bytes = tree_bytes(args[0]), tree_bytes(args[1])
    return StepMemory(total, source, p_bytes, p_bytes, o_bytes,
                      max(0, total - 2 * p_bytes - o_bytes), mem.get("temp_size_in_bytes"),
                      mem.get("argument_size_in_bytes"), mem.get("output_size_in_bytes"),
                      mem.get("alias_size_in_bytes"), mem.get("peak_memory_in_bytes"),
                      c.flops, c.seconds, c.argument_bytes and c.argument_bytes[0])


__all__ = ["StepMemory", "TrainStep", "compile_step", "default_optimizer", "in_use_bytes",
           "step_figures", "step_memory", "step_peak", "train_step"]
