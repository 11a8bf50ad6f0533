"""Fit: the longest sequence or the largest batch each policy allows within a device-memory budget.

The question remat answers for most users is not "how many bytes does
`minimal` use" but "with 16 GiB per chip, how long a context can I train
with each policy, and what does each cost in FLOPs?". MaxText's memory
estimator answers a narrower version for its own models: it binary-searches
the batch size against an out-of-memory compile. `fit` answers it for the
reference transformers under any policy, compile-only.

What is measured is the whole train step (`step_memory`): forward, backward
and the optimizer update (optax AdamW unless another optimizer is given),
jitted with the parameters and optimizer state donated, lowered on
`jax.ShapeDtypeStruct`s and compiled; nothing is allocated. Its device memory
in use at the step's peak is

* on the XLA CPU backend: argument + temp + output - alias bytes
  (`memory_analysis()`), because CPU's `peak_memory_in_bytes` leaves out temp
  buffers;
* on backends whose compiler reports a peak (TPU, GPU):
  `peak_memory_in_bytes`.

`StepMemory.source` says which one a figure is.

The search (`fit`) works in units of `multiple` (sequence lengths: 128 by
default; batch sizes: 1). It brackets the boundary by growing the size,
then narrows the bracket; each step compiles the size that a quadratic fit
of the memory measured so far predicts to be the boundary, or bisects when
that prediction does not shrink the bracket enough (a safeguarded
regula falsi). Step memory grows about quadratically with the sequence
length (attention scores are [batch, heads, seq, seq]) and linearly with the
batch, so the prediction is usually right within one unit and a policy costs
a handful of compiles. The size found is exact: it fits and size + multiple
does not, both compiled.

On a mesh (`mesh=`, `remat-kit fit --mesh`) the step is the SPMD program of
`measure.config_program`'s loss plus the update; the budget and every byte
figure are per device, the sizes global (the batch is split over data x
fsdp). The auto row ("auto") asks the budget planner (`remat_kit.plan`) for
a policy at each size, with the step budget translated into its
value-and-grad budget, and verifies the plan on the whole step (`fit`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import Mesh

from remat_kit import mesh as rk_mesh
from remat_kit import targets
from remat_kit.errors import BudgetError, MeshError, RematSpecError
from remat_kit.models import TransformerConfig
from remat_kit.models.program import check_positive, sized
from remat_kit.models.program import workload as config_workload
from remat_kit.plan import Planner, parse_budget
from remat_kit.policy import Policy
from remat_kit.record import PEAK, memory_kind
from remat_kit.report import fmt_bytes
from remat_kit.spec import AutoSpec, parse
from remat_kit.targets import is_out_of_memory
from remat_kit.workload import Workload

VARY = ("seq", "batch")
FIT_POLICIES = ("none", "full", "minimal", "selective", "dots")  # the default rows
DEFAULT_MULTIPLE = {"seq": 128, "batch": 1}
# Sizes beyond these are not searched, and a policy that still fits there is
# reported as capped: XLA's CPU compiler aborts the process (SIGFPE) compiling
# tiny at seq 2**20, while 655360 compiles.
DEFAULT_MAX_SIZE = {"seq": 1 << 19, "batch": 1 << 16}


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


def _tree_bytes(tree) -> int:
    """Bytes one device holds of a tree of (possibly sharded) ShapeDtypeStructs."""
    return sum(math.prod(rk_mesh.local_shape(x).shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _resizer(model, mesh: Mesh | None) -> tuple[Callable[[int, int], Workload], Workload]:
    """(batch, seq) -> the workload at those sizes, and the workload as given.

    model: a TransformerConfig (built on `mesh`), a `Workload` (resized by
    `Workload.at`; its own mesh), or a function (batch, seq) -> Workload.
    """
    if isinstance(model, TransformerConfig):
        def make(batch: int, seq: int) -> Workload:
            return config_workload(sized(model, seq), batch, seq, mesh=mesh)
        return make, None
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


def _check_args(optimizer, **sizes) -> None:
    """TypeError / ValueError naming the argument, before anything compiles."""
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}")
    for name, value in sizes.items():
        check_positive(name, value)


def _policy(spec) -> Policy:
    """parse(spec), refusing an auto:budget= spec: a step compiles one policy."""
    policy = parse(spec)
    if not isinstance(policy, Policy):
        raise RematSpecError(f"step_memory compiles one policy, not {policy}: fit's auto row "
                             "plans it for each size, remat-kit plan for one", token=str(policy))
    return policy


def _is_auto(spec: str, budget_bytes: int) -> bool:
    """Whether `spec` is fit's auto row: "auto", or auto:budget= the fit budget.

    Raises:
      RematSpecError: a spec that does not parse. BudgetError: an auto spec
        with another budget (in fit, auto's budget is the step budget).
    """
    if spec == "auto":
        return True
    policy = parse(spec)
    if not isinstance(policy, AutoSpec):
        return False
    if parse_budget(policy.budget).bytes != budget_bytes:
        raise BudgetError(
            f"in fit, auto's budget is the fit budget ({fmt_bytes(budget_bytes)}, "
            f"{budget_bytes} bytes per device, of the whole step); write 'auto' or "
            f"'auto:budget={budget_bytes}', not {spec!r}", budget=policy.budget)
    return True


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


def _train_state(workload: Workload, optimizer: optax.GradientTransformation):
    """One train step's arguments as `jax.ShapeDtypeStruct`s: (params, opt_state, rest).

    The optimizer state is sharded like the parameters each of its leaves
    mirrors (`optax.tree_map_params`), its other leaves (AdamW's step count)
    replicated on the workload's mesh.
    """
    params, rest = workload.args[0], workload.args[1:]
    opt_state = jax.eval_shape(optimizer.init, params)
    mesh = workload.mesh
    if mesh is not None:
        replicated = rk_mesh.replicated(mesh)
        opt_state = optax.tree_map_params(
            optimizer, lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
            opt_state, params,
            transform_non_params=lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                sharding=replicated))
    return params, opt_state, rest


def _check_mesh(mesh) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (remat_kit.mesh.make(\"fsdp:2\") or "
                        f"remat_kit.targets.make_mesh), got {type(mesh).__name__} {mesh!r}")


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
        remat is replaced by `policy`), a `Workload` (`remat_kit.workload`:
        e.g. `rk.from_model.workload(model, batch, seq)`), or a function
        (batch, seq) -> Workload.
      batch, seq: the global batch size (split over the mesh's data x fsdp
        axes) and the sequence length, positive ints.
      policy: a spec string or `Policy`.
      optimizer: an optax transformation; default `default_optimizer()`.
      target: whose compiler (`remat_kit.targets`): "cpu", "tpu:v5e:1x1"
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
      RematSpecError: the policy does not parse, or is an auto:budget= spec.
      TargetError: a bad target, or libtpu missing.
      Any compiler error, e.g. an out-of-memory error from an accelerator's
      compiler (see `is_out_of_memory`).
    """
    _check_args(optimizer, batch=batch, seq=seq)
    _check_mesh(mesh)
    policy = _policy(policy)
    optimizer = optimizer or default_optimizer()
    workload = _resizer(model, mesh)[0](batch, seq)
    return _step_memory(workload, policy, optimizer, targets.parse_target(target))


def _step_memory(workload: Workload, policy: Policy, optimizer, target) -> StepMemory:
    params, opt_state, rest = _train_state(workload, optimizer)
    loss_fn = workload.loss_for_policy(policy)
    mesh = workload.mesh
    state_shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))

    def step(params, opt_state, *rest):
        loss, grads = jax.value_and_grad(loss_fn)(params, *rest)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        state = optax.apply_updates(params, updates), opt_state
        if mesh is not None:  # where the donated inputs live, so their buffers are reused
            state = jax.lax.with_sharding_constraint(state, state_shardings)
        return *state, loss

    c = targets.compile_for(step, params, opt_state, *rest, target=target, donate=(0, 1))
    mem = c.memory
    total, source = in_use_bytes(mem, target.platform)
    p_bytes, o_bytes = _tree_bytes(params), _tree_bytes(opt_state)
    return StepMemory(total, source, p_bytes, p_bytes, o_bytes,
                      max(0, total - 2 * p_bytes - o_bytes), mem.get("temp_size_in_bytes"),
                      mem.get("argument_size_in_bytes"), mem.get("output_size_in_bytes"),
                      mem.get("alias_size_in_bytes"), mem.get("peak_memory_in_bytes"),
                      c.flops, c.seconds)


@dataclasses.dataclass(frozen=True)
class FitRow:
    """The largest size one policy allows within the budget.

    Attributes:
      policy: the spec as given.
      size: the largest fitting sequence length or global batch size (a
        multiple of `multiple`); 0 if not even one multiple fits.
      memory: the step at `size` (`StepMemory`, per device); None if size is
        0 or on error.
      flops_per_token: FLOPs of the whole step over all devices per token:
        per-device step FLOPs x devices / (global batch * seq), at `size`.
      flop_overhead: step FLOPs / no remat's step FLOPs at the same size.
      none_fits: whether no remat fits the budget at `size`.
      none_flops: how no remat's FLOPs at `size` were found: "compiled", or
        "extrapolated" (its compile failed for memory; FLOPs are a
        polynomial in the size, degree 2 in seq and 1 in batch, fitted
        exactly through compiled smaller sizes).
      capped: `size` is the search's upper limit and still fits.
      compiles: train-step compiles this row needed (cached ones not
        counted); for an auto row, plus the planner's value-and-grad compiles.
      probes: (size, total bytes or None on an out-of-memory compile) for
        every size compiled for this policy, in search order.
      error: why the search stopped ("TypeName: message"), for a compile that
        failed for a reason other than memory; the other fields are then
        what was found before it.
      picked: for an auto row, the policy it picked at `size` (canonical
        spec string); None for a fixed policy.
    """

    policy: str
    size: int
    memory: StepMemory | None = None
    flops_per_token: float | None = None
    flop_overhead: float | None = None
    none_fits: bool | None = None
    none_flops: str | None = None
    capped: bool = False
    compiles: int = 0
    probes: tuple[tuple[int, int | None], ...] = ()
    error: str | None = None
    picked: str | None = None


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` found, with its context.

    Attributes:
      rows: one `FitRow` per policy, in the order given.
      vary: "seq" or "batch".
      fixed: the other size (the global batch when varying seq, the
        sequence length when varying the batch).
      multiple: the search unit.
      budget_bytes: the per-device budget, bytes.
      floor_bytes: parameters plus optimizer state, bytes per device.
      platform: whose compiler the figures come from, e.g. "XLA CPU compile".
      seconds: wall time of the whole search.
      mesh: the mesh, e.g. "data:2,fsdp:2,tensor:2"; None for one device.
      devices: devices the step runs on (the mesh's size, else 1).
    """

    rows: tuple[FitRow, ...]
    vary: str
    fixed: int
    multiple: int
    budget_bytes: int
    floor_bytes: int
    platform: str
    seconds: float
    mesh: str | None = None
    devices: int = 1


class _Steps:
    """Compiled step figures by (canonical policy spec, size), so no policy is
    compiled twice at a size, whichever name (or planner) asked for it."""

    def __init__(self, measure: Callable[[str, int], StepMemory]):
        self._measure, self._cache, self.total = measure, {}, 0

    def get(self, policy: str, size: int) -> StepMemory | None:
        """The step at `size`, or None if its compile ran out of memory."""
        key = (str(parse(policy)), size)
        if key not in self._cache:
            self.total += 1
            try:
                self._cache[key] = self._measure(policy, size)
            except Exception as e:  # noqa: BLE001 - only memory errors mean "does not fit"
                if not is_out_of_memory(e):
                    raise
                self._cache[key] = None
        return self._cache[key]

    def known(self, policy: str) -> dict[int, StepMemory]:
        policy = str(parse(policy))
        return {s: m for (p, s), m in self._cache.items() if p == policy and m is not None}

    def at(self, size: int) -> dict[str, StepMemory]:
        """Every policy compiled at `size` that did not run out of memory."""
        return {p: m for (p, s), m in self._cache.items() if s == size and m is not None}


def _predict(points: dict[int, int], budget: int, lo: int, hi: int | None) -> int | None:
    """The largest unit k whose memory a quadratic through the three points
    nearest the bracket predicts to fit; None if no prediction can be made."""
    near = sorted(points, key=lambda k: min(abs(k - lo), abs(k - (hi or lo))))[:3]
    if len(near) < 2:
        return None
    xs = np.array(near, float)
    coef = np.polyfit(xs, np.array([points[k] for k in near], float), len(near) - 1)
    roots = [r.real for r in np.roots(coef - np.eye(len(coef))[-1] * budget)
             if abs(r.imag) < 1e-9 and r.real > 0]
    return int(math.floor(max(roots))) if roots else None


def _search(fits: Callable[[int], bool], bytes_at: Callable[[int], int | None],
            budget: int, max_units: int, start: int = 1) -> tuple[int, bool]:
    """The largest k in [0, max_units] with fits(k), assuming fits is monotone.

    Returns (k, capped). `bytes_at(k)` is the memory measured at a unit
    already probed (None if not probed or out of memory), for prediction;
    bytes_at(0) may give the memory the step holds at no size at all (its
    parameters, gradients and optimizer state), which is never compiled.
    `start`: the first unit probed, e.g. another policy's answer.
    """
    start = min(max(start, 1), max_units)
    if fits(start):
        lo, hi = start, None  # fits(lo); not fits(hi)
        if lo == max_units:
            return lo, True
    elif start == 1:
        return 0, False
    else:
        lo, hi = 0, start  # size 0 fits trivially; the prediction picks the next probe
    stalls = 0
    while hi is None or hi - lo > 1:
        points = {k: b for k in range(0, (hi or lo) + 1) if (b := bytes_at(k)) is not None}
        guess = _predict(points, budget, lo, hi)
        if guess == lo or (guess is None and hi is None and lo == start > 1):
            # The boundary is predicted at lo, or lo is another policy's boundary:
            # confirm that lo + 1 fails.
            k = lo + 1
        elif hi is None:
            # Grow: to the predicted boundary, at most 8x a step; 2x without one.
            k = 2 * lo if guess is None or guess < lo else min(guess, 8 * lo)
        elif guess is None or not lo < guess < hi or stalls >= 2:
            k, stalls = (lo + hi) // 2, 0
        else:
            k = guess
        k = min(k, max_units)
        width = None if hi is None else hi - lo
        if fits(k):
            lo = k
            if k == max_units:
                return lo, True
        else:
            hi = k
        # A prediction that does not halve the bracket twice in a row gives way to bisection.
        stalls = stalls + 1 if width is not None and hi - lo > width / 2 else 0
    return lo, False


def _extrapolated_flops(known: dict[int, StepMemory], size: int, degree: int) -> float | None:
    pts = sorted((s, m.flops) for s, m in known.items() if m.flops is not None)
    if len(pts) < degree + 1:
        return None
    pts = pts[-(degree + 1):]
    coef = np.polyfit([s for s, _ in pts], [f for _, f in pts], degree)
    return float(np.polyval(coef, size))


def fit(model, budget: "int | str", *, vary: str = "seq",
        policies: Sequence["str | Policy"] = FIT_POLICIES,
        batch: int | None = None, seq: int | None = None, multiple: int | None = None,
        max_size: int | None = None, optimizer: optax.GradientTransformation | None = None,
        target: "str | targets.Target | None" = None, mesh: Mesh | None = None,
        cache: "str | bool | None" = None,
        progress: Callable[[int, int, FitRow], None] | None = None) -> FitResult:
    """For each policy, the largest sequence length or batch whose train step fits `budget`.

    Sizes are global (the whole mesh's batch, the sequence length); memory
    is per device, and the budget is per device: on a mesh each device's
    step (its parameter, gradient and optimizer-state shards, its part of
    the batch) must fit it.

    The auto row ("auto", or "auto:budget=" the same budget) is the
    planner's choice at each size (`remat_kit.plan`): the whole-step budget
    is translated into the planner's value-and-grad budget (its temp memory
    on CPU) by taking off what the step holds besides (full remat's step
    memory minus the planner's figure for full remat at that size,
    `Planner.minimum`), the planned policy's whole step is
    compiled, and an over-budget plan is planned again with the overshoot
    taken off (3 tries). Of it and every policy already compiled at that
    size (the other rows', `full`), the one with the fewest FLOPs whose step
    fits is picked (`FitRow.picked`). The auto row is searched last, from
    the largest size the other rows found.

    Args:
      model: a `TransformerConfig` (dtype, dropout, family, sizes), a
        `Workload` that can be resized (`Workload.at`; e.g.
        `rk.from_model.workload(model, batch, seq)`), or a function
        (batch, seq) -> Workload.
      budget: device memory per device: bytes as an int, or a size string
        ("16GiB", "512MiB", "8e9"; `remat_kit.plan.parse_budget`, but not a
        fraction: there is no fixed no-remat figure to take it of).
      vary: "seq" (find the longest sequence at a fixed batch) or "batch"
        (the largest global batch at a fixed sequence length).
      policies: spec strings or `Policy`s, and "auto" for the planner's row;
        "none" is compiled as well when absent, for the FLOP overhead.
      batch: the fixed global batch when vary="seq" (default: the mesh's
        data x fsdp size, 1 without a mesh).
      seq: the fixed sequence length when vary="batch" (default: a config's
        min(max_len, 1024), a workload's own seq).
      multiple: the search unit, a positive int (default 128 for seq; for
        batch the mesh's data x fsdp size, 1 without a mesh); every size
        searched is a multiple of it.
      max_size: the largest size searched (default 2**20 tokens for seq,
        2**16 for batch); a policy that fits there is `capped`.
      optimizer, target, mesh: see `step_memory`.
      cache: the plan cache of the auto row's planner (`remat_kit.plan.Planner`);
        default none.
      progress: called as progress(i, n, row) after the i-th of n policies.
    Returns:
      A `FitResult`; its rows follow `policies`' order.
    Raises:
      TypeError: model not one of the above, optimizer not an optax
        transformation, mesh not a `jax.sharding.Mesh`.
      ValueError: vary not in VARY; batch, seq, multiple or max_size not a
        positive int; a layer schedule that does not fit the model.
      MeshError: the mesh does not split the batch or the heads, or (vary
        "batch") a multiple that its data x fsdp size does not divide.
      BudgetError: a budget that is not a size in bytes, one below the
        parameters plus the optimizer state per device (the floor, stated
        in bytes), so no size can fit, or an auto spec with another budget.
      TargetError: a bad target, or libtpu missing.
      RematSpecError: a policy does not parse (before anything compiles).
    """
    if vary not in VARY:
        raise ValueError(f"vary must be one of {list(VARY)}, got {vary!r}")
    _check_mesh(mesh)
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    make, given = _resizer(model, mesh)
    mesh = mesh if given is None else given.mesh
    split = rk_mesh.axis_size(mesh, "batch")
    multiple = (DEFAULT_MULTIPLE[vary] * (split if vary == "batch" else 1) if multiple is None
                else multiple)
    batch = split if batch is None else batch
    if seq is None:
        seq = (min(model.max_len, 1024) if isinstance(model, TransformerConfig)
               else given.seq if given is not None and given.seq else 1024)
    max_size = DEFAULT_MAX_SIZE[vary] if max_size is None else max_size
    _check_args(optimizer, batch=batch, seq=seq, multiple=multiple, max_size=max_size)
    if max_size < multiple:
        raise ValueError(f"multiple {multiple} is above the largest {vary} searched, "
                         f"max_size {max_size}")
    if vary == "batch" and multiple % split:
        raise MeshError(f"multiple {multiple} does not split over the {split} data-parallel "
                        f"devices of mesh {rk_mesh.spec_text(mesh)} (data x fsdp = {split}): the "
                        f"batch is global; use a multiple of {split}")
    if isinstance(model, TransformerConfig):
        rk_mesh.check_fits(mesh, model, batch if vary == "seq" else multiple)
    budget_bytes = parse_budget(budget).bytes
    if budget_bytes is None:
        raise BudgetError(f"fit needs a budget in bytes, such as 16GiB; {budget!r} is a "
                          "fraction of no-remat memory, which changes with the size searched",
                          budget=budget)
    target = targets.parse_target(target)
    specs = list(dict.fromkeys(p if isinstance(p, str) else str(p) for p in policies))
    if not specs:
        raise ValueError("policies is empty; give at least one spec, e.g. ['none', 'full']")
    auto = [_is_auto(p, budget_bytes) for p in specs]

    def sizes(size: int) -> tuple[int, int]:
        return (batch, size) if vary == "seq" else (size, seq)

    at_size = functools.lru_cache(maxsize=None)(lambda size: make(*sizes(size)))
    smallest = at_size(multiple)
    for p, is_auto in zip(specs, auto):
        if not is_auto and smallest.num_layers:  # bad specs fail before anything compiles
            _policy(p).schedule.check(smallest.num_layers)
    optimizer = optimizer or default_optimizer()

    params, opt_state, _ = _train_state(smallest, optimizer)
    floor = _tree_bytes(params) + _tree_bytes(opt_state)
    at_zero = floor + _tree_bytes(params)  # and the gradients: the step's memory at size 0
    if budget_bytes < floor:
        where = f"per device of mesh {rk_mesh.spec_text(mesh)}" if mesh is not None else "per device"
        raise BudgetError(
            f"budget {fmt_bytes(budget_bytes)} ({budget_bytes} bytes) is below the parameters "
            f"plus optimizer state alone, {fmt_bytes(floor)} ({floor} bytes {where}): no "
            f"{vary} fits", budget=budget, minimum_bytes=floor)

    steps = _Steps(lambda p, size: _step_memory(at_size(size), _policy(p), optimizer,
                                                target))
    devices = 1 if mesh is None else mesh.size
    start = time.perf_counter()
    rows: list[FitRow | None] = [None] * len(specs)
    # Fixed policies first (the auto row picks among what they compiled), each
    # starting at the largest size found so far: policies land near each other.
    order = [i for i in range(len(specs)) if not auto[i]] + [i for i in range(len(specs))
                                                            if auto[i]]
    for n, i in enumerate(order):
        start_units = max((r.size for r in rows if r is not None), default=0) // multiple
        if auto[i]:
            # On the step's devices: without a mesh, one device of the target.
            chooser = _Auto(steps, budget_bytes, lambda size: Planner(
                at_size(size), cache=cache, target=target))
            at, extra, seen = chooser.at, lambda: chooser.planner_compiles, {}
        else:
            # A policy's sizes compiled before (no remat's, for the overhead) help predict.
            at, extra, seen = ((lambda size, spec=specs[i]: (None, steps.get(spec, size))),
                               lambda: 0, steps.known(specs[i]))
        rows[i] = _fit_one(specs[i], at, extra, steps, budget_bytes, multiple,
                           max_size // multiple, vary, sizes, devices, start_units, seen, at_zero)
        if progress is not None:
            progress(n + 1, len(specs), rows[i])
    return FitResult(tuple(rows), vary, batch if vary == "seq" else seq, multiple, budget_bytes,
                     floor, target.label, time.perf_counter() - start, rk_mesh.spec_text(mesh), devices)


class _Auto:
    """The auto row's choice at each size: the fewest-FLOP policy whose whole
    step fits, among the planner's verified plan and every policy already
    compiled at that size (see `fit`)."""

    TRIES = 3

    def __init__(self, steps: _Steps, budget: int, planner_at: Callable[[int], object]):
        self.steps, self.budget, self.planner_at = steps, budget, planner_at
        self.planner_compiles = 0
        self._chosen: dict[int, tuple[str | None, StepMemory | None]] = {}

    def at(self, size: int) -> tuple[str | None, StepMemory | None]:
        """(picked spec, its step) at `size`; (None, None) if nothing fits."""
        if size not in self._chosen:
            self._chosen[size] = self._choose(size)
        return self._chosen[size]

    def _choose(self, size: int) -> tuple[str | None, StepMemory | None]:
        full = self.steps.get("full", size)
        if full is not None:
            planner = self.planner_at(size)
            # Take off what the step holds besides the value-and-grad memory the planner
            # budgets (parameters, gradients, optimizer state, the update): full remat's step
            # minus the planner's own figure for it (`minimum`: full's, in its memory kind).
            try:
                limit = self.budget - (full.total_bytes - planner.minimum()[0])
                for _ in range(self.TRIES):
                    plan = planner.plan(limit)
                    step = self.steps.get(plan.spec, size)
                    if step is not None and step.total_bytes <= self.budget:
                        break
                    # Over: take the overshoot off the planner's budget (an out-of-memory
                    # compile: plan below what this plan measured).
                    limit = (limit - (step.total_bytes - self.budget) if step is not None
                             else plan.measured_bytes - 1)
            except BudgetError:
                pass  # below what the planner can reach: full (compiled) is the fallback
            self.planner_compiles += len({id(r) for r in planner.records.values()})
        fitting = [(m.flops, m.total_bytes, spec) for spec, m in self.steps.at(size).items()
                   if m.total_bytes <= self.budget and m.flops is not None]
        if not fitting:
            return None, None
        spec = min(fitting)[2]
        return spec, self.steps.get(spec, size)


def _fit_one(spec: str, at: Callable[[int], tuple[str | None, StepMemory | None]],
             extra_compiles: Callable[[], int], steps: _Steps, budget: int, multiple: int,
             max_units: int, vary: str, sizes: Callable[[int], tuple[int, int]], devices: int,
             start: int, seen: dict[int, StepMemory], at_zero: int) -> FitRow:
    """One row: search the largest size where `at(size)` gives a fitting step.

    at(size) -> (picked spec or None for a fixed policy, step or None if out of memory).
    seen: steps of this row compiled before, by size, for the search's prediction.
    at_zero: the step's bytes at size 0 (parameters, gradients, optimizer state), a
    point for the prediction that needs no compile.
    """
    before, extra_before = steps.total, extra_compiles()
    probes = []
    known = {0: at_zero} | {s // multiple: m.total_bytes for s, m in seen.items()
                            if s % multiple == 0}

    def fits(k: int) -> bool:
        _, m = at(k * multiple)
        probes.append((k * multiple, None if m is None else m.total_bytes))
        if m is not None:
            known[k] = m.total_bytes
        return m is not None and m.total_bytes <= budget

    def compiles() -> int:
        return steps.total - before + extra_compiles() - extra_before

    try:
        units, capped = _search(fits, known.get, budget, max_units, start)
    except Exception as e:  # noqa: BLE001 - reported in the row, not as "does not fit"
        return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes),
                      error=f"{type(e).__name__}: {e}")
    size = units * multiple
    if size == 0:
        return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes))
    picked, memory = at(size)
    try:
        none = steps.get("none", size)
    except Exception as e:  # noqa: BLE001
        none, error = None, f"no remat at {size}: {type(e).__name__}: {e}"
    else:
        error = None
    if none is not None:
        none_flops, how = none.flops, "compiled"
    else:
        none_flops = _extrapolated_flops(steps.known("none"), size, 2 if vary == "seq" else 1)
        how = "extrapolated" if none_flops is not None else None
    b, s = sizes(size)
    return FitRow(
        spec, size, memory,
        flops_per_token=None if memory.flops is None else memory.flops * devices / (b * s),
        flop_overhead=(None if memory.flops is None or not none_flops
                       else memory.flops / none_flops),
        none_fits=None if none is None else none.total_bytes <= budget, none_flops=how,
        capped=capped, compiles=compiles(), probes=tuple(probes), error=error, picked=picked)
