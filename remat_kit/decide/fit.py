"""Fit: the longest sequence or the largest batch each policy allows within a device-memory budget.

The question remat answers for most users is not "how many bytes does
`minimal` use" but "with 16 GiB per chip, how long a context can I train
with each policy, and what does each cost in FLOPs?". MaxText's memory
estimator answers a narrower version for its own models: it binary-searches
the batch size against an out-of-memory compile. `fit` answers it for the
workload (a reference config, a model of the user's) under any policy,
compile-only.

What is measured is the whole train step (`remat_kit.decide.step.step_memory`).

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
the workload's loss plus the update; the budget and every byte
figure are per device, the sizes global (the batch is split over data x
fsdp). The auto row ("auto") asks the budget planner (`remat_kit.decide.plan`) for
a policy at each size, with the step budget translated into its
value-and-grad budget, and verifies the plan on the whole step (`fit`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import optax
from jax.sharding import Mesh

from remat_kit import mesh as rk_mesh
from remat_kit.measure import targets
from remat_kit.policy.budget import parse_budget
from remat_kit.errors import BudgetError, MeshError
from remat_kit.decide.floor import train_state, tree_bytes
from remat_kit.decide.plan import Planner
from remat_kit.decide.plan_cache import layers_summary
from remat_kit.policy.policy import Policy
from remat_kit.units import fmt_bytes
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.decide.step import (StepMemory, check_args, check_mesh, compile_step, default_optimizer,
                            one_policy, resizer)
from remat_kit.measure.targets import is_out_of_memory

VARY = ("seq", "batch")
FIT_POLICIES = ("none", "full", "minimal", "selective", "dots")  # the default rows
DEFAULT_MULTIPLE = {"seq": 128, "batch": 1}
# Sizes beyond these are not searched, and a policy that still fits there is
# reported as capped.
DEFAULT_MAX_SIZE = {"seq": 1 << 19, "batch": 1 << 16}
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
            f"'auto:budget={budget_bytes}B', not {spec!r}", budget=policy.budget)
    return True


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
        spec string; for a per-layer plan, its runs of layers, "0-6
        save:mlpwi / 7-11 full", `plan_cache.layers_summary`); None for a
        fixed policy.
      picked_layers: for an auto row that picked a per-layer plan, each
        layer's spec (`Plan.layer_specs`: compile it as
        `TransformerConfig(remat="none", layer_remat=...)`); else empty.
      limit: where the workload itself stopped the search: the first size
        at which it could not be built (traced) although a smaller one was
        (e.g. a learned position table shorter than the sequence), "seq 48:
        BadInput: ..."; `size` is then the largest fitting size below it,
        `capped` if the budget would allow more. Compile errors are `error`.
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
    picked_layers: tuple[str, ...] = ()
    limit: str | None = None


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
    """Compiled step figures by (policy key, size), so no policy is compiled
    twice at a size, whichever name (or planner) asked for it.

    measure(policy, size, loss) compiles the train step of `policy` (a Policy)
    at `size`, or with `loss` (a loss(*args) of the workload's arguments) of
    that loss under no further remat: a per-layer plan's program.
    """

    def __init__(self, measure: Callable[[Policy, int, Callable | None], StepMemory]):
        self._measure, self._cache, self.total = measure, {}, 0
        self._failed: dict[tuple, Exception] = {}  # raised again, not compiled again

    def get(self, policy, size: int, loss: Callable | None = None) -> StepMemory | None:
        """The step at `size`, or None if its compile ran out of memory.

        policy: a spec or `Policy`; or, with `loss`, the per-layer tuple of
        Policies that loss runs (its key: their runs of layers, `layers_summary`).
        """
        key = (_key(policy), size)
        if key in self._failed:
            raise self._failed[key]
        if key not in self._cache:
            self.total += 1
            try:
                self._cache[key] = self._measure(
                    Policy() if loss is not None else one_policy(policy), size, loss)
            except Exception as e:  # noqa: BLE001 - only memory errors mean "does not fit"
                if not is_out_of_memory(e):
                    self._failed[key] = e
                    raise
                self._cache[key] = None
        return self._cache[key]

    def known(self, policy: str) -> dict[int, StepMemory]:
        policy = _key(policy)
        return {s: m for (p, s), m in self._cache.items() if p == policy and m is not None}

    def at(self, size: int) -> dict[str, StepMemory]:
        """Every policy compiled at `size` that did not run out of memory, by key."""
        return {p: m for (p, s), m in self._cache.items() if s == size and m is not None}


class _SizeRefused(Exception):
    """The workload cannot be built at a size (its own limit, not memory), "seq 48: ..."."""


def _key(policy) -> str:
    """A step's policy as one string: its canonical spec, or for one Policy per
    layer their runs of layers ('0-6 save:mlpwi / 7-11 full')."""
    return layers_summary(policy) if isinstance(policy, tuple) else str(parse(policy))


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
    if max_units < 1:
        return 0, False
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
    planner's choice at each size (`remat_kit.decide.plan`, each tag decided per
    layer, so a plan may differ from layer to layer): the whole-step budget
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
        ("16GiB", "512MiB", "8e9"; `remat_kit.policy.budget.parse_budget`, but not a
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
      max_size: the largest size searched (default 2**19 tokens for seq,
        2**16 for batch); a policy that fits there is `capped`. Sizes whose
        attention scores alone outgrow the budget, or XLA's limit
        (`size_bound`), are not searched either.
      optimizer, target, mesh: see `step_memory`.
      cache: the plan cache of the auto row's planner (`remat_kit.decide.plan.Planner`);
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
    check_mesh(mesh)
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    make, given = resizer(model, mesh)
    mesh = mesh if given is None else given.mesh
    split = rk_mesh.axis_size(mesh, "batch")
    multiple = (DEFAULT_MULTIPLE[vary] * (split if vary == "batch" else 1) if multiple is None
                else multiple)
    batch = split if batch is None else batch
    if seq is None:
        seq = given.seq if given is not None and given.seq else 1024
    max_size = DEFAULT_MAX_SIZE[vary] if max_size is None else max_size
    check_args(optimizer, batch=batch, seq=seq, multiple=multiple, max_size=max_size)
    if max_size < multiple:
        raise ValueError(f"multiple {multiple} is above the largest {vary} searched, "
                         f"max_size {max_size}")
    if vary == "batch" and multiple % split:
        raise MeshError(f"multiple {multiple} does not split over the {split} data-parallel "
                        f"devices of mesh {rk_mesh.spec_text(mesh)} (data x fsdp = {split}): the "
                        f"batch is global; use a multiple of {split}")
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
            one_policy(p).schedule.check(smallest.num_layers)
    optimizer = optimizer or default_optimizer()

    params, opt_state, _ = train_state(smallest, optimizer)
    floor = tree_bytes(params) + tree_bytes(opt_state)
    at_zero = floor + tree_bytes(params)  # and the gradients: the step's memory at size 0
    if budget_bytes < floor:
        where = f"per device of mesh {rk_mesh.spec_text(mesh)}" if mesh is not None else "per device"
        raise BudgetError(
            f"budget {fmt_bytes(budget_bytes)} ({budget_bytes} bytes) is below the parameters "
            f"plus optimizer state alone, {fmt_bytes(floor)} ({floor} bytes {where}): no "
            f"{vary} fits", budget=budget, minimum_bytes=floor)

    # No size is compiled past what the workload says can fit (`Workload.size_bound`, e.g.
    # one layer's attention scores); at a bound the budget set, a policy that fits has its
    # exact answer, not a capped one. A workload with no bound stops at max_size.
    bound, exact = (given.size_bound(vary, batch if vary == "seq" else seq, budget_bytes,
                                     floor, target.platform)
                    if given is not None and given.size_bound is not None
                    else (max_size, False))
    exact = exact and bound < max_size
    max_units = min(max_size, bound) // multiple

    def measure_step(policy: Policy, size: int, loss: Callable | None) -> StepMemory:
        try:
            work = at_size(size)
        except Exception as e:  # noqa: BLE001 - e.g. a position table shorter than size
            raise _SizeRefused(f"{vary} {size}: {type(e).__name__}: {e}") from e
        if loss is not None:
            work = dataclasses.replace(work, loss_for_policy=lambda _: loss)
        return compile_step(work, policy, optimizer, target)

    steps = _Steps(measure_step)
    devices = 1 if mesh is None else mesh.size
    start = time.perf_counter()
    rows: list[FitRow | None] = [None] * len(specs)
    limit = None  # the workload's own limit, once a row finds it (`FitRow.limit`)
    # Fixed policies first (the auto row picks among what they compiled), each
    # starting at the largest size found so far: policies land near each other.
    order = [i for i in range(len(specs)) if not auto[i]] + [i for i in range(len(specs))
                                                            if auto[i]]
    for n, i in enumerate(order):
        start_units = max((r.size for r in rows if r is not None), default=0) // multiple
        if auto[i]:
            # On the step's devices: without a mesh, one device of the target; each
            # tag decided per layer (the planner's default groups).
            chooser = _Auto(steps, budget_bytes, lambda size: Planner(
                at_size(size), cache=cache, target=target))
            at, extra, seen = chooser.at, lambda: chooser.planner_compiles, {}
        else:
            # A policy's sizes compiled before (no remat's, for the overhead) help predict.
            at, extra, seen = ((lambda size, spec=specs[i]: (None, steps.get(spec, size))),
                               lambda: 0, steps.known(specs[i]))
        rows[i], max_units = _fit_one(specs[i], at, extra, steps, budget_bytes, multiple,
                                      max_units, vary, sizes, devices, start_units, seen,
                                      at_zero, exact, limit)
        limit = rows[i].limit or limit
        if auto[i] and rows[i].picked in chooser.layer_specs:
            rows[i] = dataclasses.replace(rows[i], picked_layers=chooser.layer_specs[
                rows[i].picked])
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
        self.layer_specs: dict[str, tuple[str, ...]] = {}  # step key -> a per-layer plan's specs
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
                    if plan.layer_specs:
                        self.layer_specs[_key(plan.policy)] = plan.layer_specs
                        step = self.steps.get(plan.policy, size, planner.loss_of(plan.policy))
                    else:
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
        return spec, self.steps.at(size)[spec]


def _fit_one(spec: str, at: Callable[[int], tuple[str | None, StepMemory | None]],
             extra_compiles: Callable[[], int], steps: _Steps, budget: int, multiple: int,
             max_units: int, vary: str, sizes: Callable[[int], tuple[int, int]], devices: int,
             start: int, seen: dict[int, StepMemory], at_zero: int,
             exact: bool = False, limit: str | None = None) -> tuple[FitRow, int]:
    """One row: search the largest size where `at(size)` gives a fitting step.

    Returns (the row, max_units for the next rows: below the model's own
    limit where this search found one, `FitRow.limit`).

    at(size) -> (picked spec or None for a fixed policy, step or None if out of memory).
    seen: steps of this row compiled before, by size, for the search's prediction.
    at_zero: the step's bytes at size 0 (parameters, gradients, optimizer state), a
    point for the prediction that needs no compile.
    exact: max_units is the most the budget allows (`size_bound`): fitting there is not capped.
    limit: the workload's own limit found by an earlier row (max_units is below it).
    """
    before, extra_before = steps.total, extra_compiles()
    probes = []
    known = {0: at_zero} | {s // multiple: m.total_bytes for s, m in seen.items()
                            if s % multiple == 0}

    trying = [0]  # the unit being compiled, where an error comes from

    def fits(k: int) -> bool:
        trying[0] = k
        _, m = at(k * multiple)
        probes.append((k * multiple, None if m is None else m.total_bytes))
        if m is not None:
            known[k] = m.total_bytes
        return m is not None and m.total_bytes <= budget

    def compiles() -> int:
        return steps.total - before + extra_compiles() - extra_before

    while True:
        try:
            units, capped = _search(fits, known.get, budget, max_units, start)
            break
        except Exception as e:  # noqa: BLE001 - reported in the row, not as "does not fit"
            k = trying[0]
            if not isinstance(e, _SizeRefused) or not any(0 < u < k for u in known):
                error = str(e) if isinstance(e, _SizeRefused) else f"{type(e).__name__}: {e}"
                return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes),
                              error=error), max_units
            # A smaller size was built: the workload stops at a limit of its own (e.g. a
            # learned position table), so search below it.
            limit, max_units, start = str(e), k - 1, min(start, k - 1)
    capped = capped and (limit is not None or not exact)
    size = units * multiple
    if size == 0:
        return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes)), max_units
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
        spec, size, memory, limit=limit,
        flops_per_token=None if memory.flops is None else memory.flops * devices / (b * s),
        flop_overhead=(None if memory.flops is None or not none_flops
                       else memory.flops / none_flops),
        none_fits=None if none is None else none.total_bytes <= budget, none_flops=how,
        capped=capped, compiles=compiles(), probes=tuple(probes), error=error,
        picked=picked), max_units
