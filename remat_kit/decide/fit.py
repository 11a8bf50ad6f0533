"""Fit: the longest sequence or the largest batch each policy allows within a device-memory budget.

`fit` compiles the whole train step (`step.step_memory`) at sizes a curve predicts and proves the
answer exact (size fits, size + multiple does not); an "auto" row lets the planner pick per size.
Main names: `fit`, `FitResult`, `FitRow`. MaxText's memory estimator answers a narrower form
(a binary search on the batch against an out-of-memory compile).
The search, meshes and the auto row: docs/fit.md (and "The auto row").
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import optax
from jax.sharding import Mesh

from remat_kit import mesh as rk_mesh
from remat_kit.measure import pool, targets
from remat_kit.policy.budget import parse_budget
from remat_kit.errors import BudgetError, MeshError
from remat_kit.decide.floor import train_state, tree_bytes
from remat_kit.decide.plan import Planner
from remat_kit.policy.policy import Policy
from remat_kit.units import fmt_bytes, fmt_bytes_exact
from remat_kit.policy.spec import AutoSpec, parsed_only
from remat_kit.decide.step import (StepMemory, check_args, check_mesh, compile_step, default_optimizer,
                            one_policy, resizer, step_peak)
from remat_kit.measure.peak import held_line, vocab_chunks_for
from remat_kit.decide.fit_search import FitRow, Steps, SizeRefused, AutoRow, fit_one
from remat_kit.decide import fit_estimate

VARY = ("seq", "batch")
FIT_POLICIES = ("none", "full", "minimal", "selective", "dots")  # the default rows
DEFAULT_MULTIPLE = {"seq": 128, "batch": 1}
# Sizes beyond these are not searched, and a policy that still fits there is
# reported as capped.
DEFAULT_MAX_SIZE = {"seq": 1 << 19, "batch": 1 << 16}
def is_auto_spec(policy: "Policy | AutoSpec", budget_bytes: int, label: str | None = None) -> bool:
    """Whether `policy` (parsed) is fit's auto row: an `AutoSpec` at the fit budget.

    Raises:
      TypeError: a spec string (parse it first: `rk.fit` does). BudgetError: an auto
        spec with another budget (in fit, auto's budget is the step budget), named by
        `label` (the spec as the user wrote it; default its canonical spec).
    """
    [policy] = parsed_only([policy], "fit's rows")
    if not isinstance(policy, AutoSpec):
        return False
    if parse_budget(policy.budget).bytes != budget_bytes:
        raise BudgetError(
            f"in fit, auto's budget is the fit budget ({fmt_bytes(budget_bytes)}, "
            f"{budget_bytes} bytes per device, of the whole step); write 'auto' or "
            f"'auto:budget={budget_bytes}B', not {label or str(policy)!r}", budget=policy.budget)
    return True


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
      below_minimum: where no policy fits even the smallest size, what holds
        the least step memory compiled there (normally full remat's), in one
        line (`peak.held_line`): "at seq 128, full remat's step memory 40.25
        MiB: logits and their gradient 32.00 MiB, ...; no layer policy lowers
        the logits and their gradient; --vocab-chunks 32 ..."; else "".
      minimum_peak: that step's `peak.breakdown` (JSON-ready); else None.
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
    below_minimum: str = ""
    minimum_peak: dict | None = None


def fit(model, budget: "int | str", *, vary: str = "seq",
        policies: "Mapping[str, Policy | AutoSpec] | Sequence[Policy | AutoSpec]",
        batch: int | None = None, seq: int | None = None, multiple: int | None = None,
        max_size: int | None = None, optimizer: optax.GradientTransformation | None = None,
        target: "str | targets.Target | None" = None, mesh: Mesh | None = None,
        cache: "str | bool | None" = None,
        progress: Callable[[int, int, FitRow], None] | None = None,
        rechunk: Callable | None = None, jobs: int | None = None) -> FitResult:
    """For each policy, the largest sequence length or batch whose train step fits `budget`.

    Sizes are global (the whole mesh's batch, the sequence length); memory
    is per device, and the budget is per device: on a mesh each device's
    step (its parameter, gradient and optimizer-state shards, its part of
    the batch) must fit it.

    The auto row ("auto", or "auto:budget=" the same budget) is the
    planner's choice at each size, searched last (see the module docstring).

    Args:
      model: a `TransformerConfig` (dtype, dropout, family, sizes), a
        `Workload` that can be resized (`Workload.at`; e.g.
        `rk.from_model.workload(model, batch, seq)`), or a function
        (batch, seq) -> Workload.
      budget: device memory per device: bytes as an int, or a size string
        ("16GiB", "512MiB", "8e9B"; `remat_kit.policy.budget.parse_budget`, but not a
        fraction: there is no fixed no-remat figure to take it of).
      vary: "seq" (find the longest sequence at a fixed batch) or "batch"
        (the largest global batch at a fixed sequence length).
      policies: the rows, parsed (`rk.fit` parses specs): {the label a row
        shows: a `Policy`, or an `AutoSpec` at the fit budget for the planner's
        row}, or a sequence of them labelled by their specs; "none" is compiled
        as well when absent, for the FLOP overhead.
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
      cache: the auto row's planner's plan cache (`decide.plan.Planner`); default none.
      progress: called as progress(i, n, row) after the i-th of n policies.
      rechunk: rechunk(n) -> `model` (of the same kinds) with its loss over n
        vocabulary chunks. Where no policy fits the smallest size and the
        logits hold the most of its step, `FitResult.below_minimum` names a
        chunk count (`peak.vocab_chunks_for`), and with rechunk gives the
        step memory it compiles to (one more compile).
      jobs: compiles run at once, 1..the cores (`measure.pool.using`; default one a core,
        as the free memory allows): each row's search probes that many sizes a round
        (`fit_search._search`), the same answers where a step's memory grows with its size.
    Returns:
      A `FitResult`; its rows follow `policies`' order.
    Raises:
      TypeError: model not one of the above, optimizer not an optax
        transformation, mesh not a `jax.sharding.Mesh`, a policy given as
        a spec string (parse it first, or call `rk.fit`).
      ValueError: vary not in VARY; batch, seq, multiple or max_size not a
        positive int; a layer schedule that does not fit the model; vary "seq"
        for a workload without a sequence axis (`Workload.seq` None).
      MeshError: the mesh does not split the batch or the heads, or (vary
        "batch") a multiple that its data x fsdp size does not divide.
      BudgetError: a budget that is not a size in bytes, one below the
        parameters plus the optimizer state per device (the floor, stated
        in bytes), so no size can fit, or an auto spec with another budget.
      TargetError: a bad target, or libtpu missing.
      ValueError: also a bad `jobs` (`pool.check_jobs`).
    """
    with pool.using(jobs):
        return _fit(model, budget, vary, policies, batch, seq, multiple, max_size, optimizer,
                    target, mesh, cache, progress, rechunk)


def _fit(model, budget, vary, policies, batch, seq, multiple, max_size, optimizer, target,
         mesh, cache, progress, rechunk) -> FitResult:
    """`fit`, on the compile pool it set."""
    search = _prepare(model, budget, vary, policies, batch, seq, multiple, max_size, optimizer,
                      target, mesh)
    steps = Steps(_step_measurer(search))
    start = time.perf_counter()
    rows = [dataclasses.replace(r, xla_remat=fit_estimate.gpu_own_remat(
        r.size, r.memory, search.target)) for r in _search_rows(search, steps, cache, progress)]
    held, found = _below_minimum(search, steps, rows, rechunk)
    return FitResult(tuple(rows), vary, search.size.fixed, search.size.multiple,
                     search.budget_bytes, search.floor, search.target.label,
                     time.perf_counter() - start, rk_mesh.spec_text(search.mesh), search.devices,
                     held, found)


@dataclasses.dataclass(frozen=True)
class _Search:
    """What `fit` searches, its arguments resolved and checked (`_prepare`).

    Attributes:
      size: the sizes searched. budget_bytes: the budget per device, bytes.
      target: whose compiler. labels: the rows' labels (the specs as given), in order;
        policies: their parsed policies; auto: whether each is the auto row.
        at_size: size -> the workload at that size (cached); smallest: the workload at
        `size.multiple`. optimizer: the step's optimizer.
      floor: parameters plus optimizer state, bytes per device (every step holds at
        least that: the search's point at size 0). max_units: the most units searched;
        exact: whether that bound is the budget's own (`_max_units`).
      mesh: the workload's mesh, or None. estimated: each row's Policy for its traced
        estimate (None for the auto row). state: parameters + gradients + optimizer state,
        bytes per device, the estimate's point at size 0 (`fit_estimate.Estimate`).
      capacity: the device memory a step is held to (key "bytes"), where the compiler says.
    """

    size: "_Sizes"
    budget_bytes: int
    target: targets.Target
    labels: list[str]
    policies: list
    auto: list[bool]
    at_size: Callable
    smallest: object
    optimizer: optax.GradientTransformation
    floor: int
    max_units: int
    exact: bool
    mesh: Mesh | None
    estimated: tuple = ()
    state: int = 0
    capacity: dict = dataclasses.field(default_factory=dict)

    @property
    def devices(self) -> int:
        """Devices the step runs on: the mesh's size, else 1."""
        return 1 if self.mesh is None else self.mesh.size


def _prepare(model, budget, vary, policies, batch, seq, multiple, max_size, optimizer, target,
             mesh) -> _Search:
    """`fit`'s arguments resolved and checked (see `fit`'s Args and Raises), before any
    step compiles."""
    if vary not in VARY:
        raise ValueError(f"vary must be one of {list(VARY)}, got {vary!r}")
    check_mesh(mesh)
    make, given = resizer(model, mesh)
    mesh = mesh if given is None else given.mesh
    size = _search_sizes(vary, given, mesh, batch, seq, multiple, max_size, optimizer)
    budget_bytes = fit_budget_bytes(budget)
    target = targets.parse_target(target)
    labels, parsed, auto = _rows(policies, budget_bytes)
    at_size = functools.lru_cache(maxsize=None)(lambda n: make(*size.shape(n)))
    smallest = at_size(size.multiple)
    _check_schedules(parsed, auto, smallest)
    optimizer = optimizer or default_optimizer()
    floor = _floor(smallest, optimizer, budget, budget_bytes, mesh, vary)
    max_units, exact = _max_units(given, size, budget_bytes, floor, target)
    state = floor + tree_bytes(train_state(smallest, optimizer)[0])  # + the gradients
    estimated = tuple(None if a else one_policy(p) for p, a in zip(parsed, auto))
    return _Search(size, budget_bytes, target, labels, parsed, auto, at_size, smallest, optimizer,
                   floor, max_units, exact, mesh, estimated, state,
                   {"bytes": fit_estimate.compiler_capacity(target)})


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The sizes `fit` searches: `vary` in steps of `multiple` up to `max_size`, the other
    size fixed at `batch` (vary "seq") or `seq` (vary "batch"); all global, ints."""

    vary: str
    batch: int
    seq: int
    multiple: int
    max_size: int

    def shape(self, size: int) -> tuple[int, int]:
        """(batch, seq) with the varied one at `size`."""
        return (self.batch, size) if self.vary == "seq" else (size, self.seq)

    @property
    def fixed(self) -> int:
        """The size that does not vary (`FitResult.fixed`)."""
        return self.batch if self.vary == "seq" else self.seq


def _search_sizes(vary: str, given, mesh: Mesh | None, batch: int | None, seq: int | None,
                  multiple: int | None, max_size: int | None, optimizer) -> _Sizes:
    """`fit`'s sizes with their defaults filled in (see `fit`'s Args), checked.

    Raises:
      ValueError: vary "seq" for a workload without a sequence axis; a size not a positive
        int, or max_size below multiple. MeshError: vary "batch" with a multiple that the
        mesh's data x fsdp size does not divide.
    """
    if vary == "seq" and given is not None and given.seq is None and given.batch is not None:
        raise ValueError(f"workload {given.name!r} has no sequence axis (a batch of images?): "
                         "vary='seq' has nothing to search; use vary='batch'")
    split = rk_mesh.axis_size(mesh, "batch")
    multiple = (DEFAULT_MULTIPLE[vary] * (split if vary == "batch" else 1) if multiple is None
                else multiple)
    batch = split if batch is None else batch
    if seq is None:  # a batch without a sequence axis (images): FLOPs "per token" per example
        seq = 1024 if given is None else given.seq or (1 if given.batch else 1024)
    max_size = DEFAULT_MAX_SIZE[vary] if max_size is None else max_size
    check_args(optimizer, batch=batch, seq=seq, multiple=multiple, max_size=max_size)
    if max_size < multiple:
        raise ValueError(f"multiple {multiple} is above the largest {vary} searched, "
                         f"max_size {max_size}")
    if vary == "batch" and multiple % split:
        raise MeshError(f"multiple {multiple} does not split over the {split} data-parallel "
                        f"devices of mesh {rk_mesh.spec_text(mesh)} (data x fsdp = {split}): the "
                        f"batch is global; use a multiple of {split}")
    return _Sizes(vary, batch, seq, multiple, max_size)


def fit_budget_bytes(budget: "int | str") -> int:
    """The fit budget in bytes. Raises BudgetError for a fraction or a non-size, offering
    sizes only (fit takes no fraction)."""
    try:
        budget_bytes = parse_budget(budget).bytes
    except BudgetError as e:
        if "fraction" not in e.message:
            raise
        # fit takes no fraction: the message offers sizes only.
        raise BudgetError(f"fit needs a budget in bytes: a number and a unit, such as 16GiB, "
                          f"512MiB or 6000000000B ({e.message.split(' (')[0]})",
                          budget=budget) from None
    if budget_bytes is None:
        raise BudgetError(f"fit needs a budget in bytes, such as 16GiB; {budget!r} is a "
                          "fraction of no-remat memory, which changes with the size searched",
                          budget=budget)
    return budget_bytes


def _rows(policies, budget_bytes: int) -> tuple[list[str], list, list[bool]]:
    """(the rows' distinct labels in order, their parsed policies, whether each is the
    auto row), from `fit`'s `policies`.

    Raises:
      ValueError: no policies. TypeError, BudgetError: see `is_auto_spec`.
    """
    if isinstance(policies, (str, Policy, AutoSpec)):
        policies = [policies]
    if not isinstance(policies, Mapping):
        labelled: dict = {}
        for p in parsed_only(policies, "fit"):
            labelled.setdefault(str(p), p)
        policies = labelled
    if not policies:
        raise ValueError("policies is empty; give at least one spec, e.g. ['none', 'full']")
    labels, parsed = list(policies), list(policies.values())
    return labels, parsed, [is_auto_spec(p, budget_bytes, label)
                            for label, p in policies.items()]


def _check_schedules(policies: list, auto: list[bool], smallest) -> None:
    """Bad policies (a layer schedule that does not fit the model) fail before anything
    compiles."""
    for p, is_auto in zip(policies, auto):
        if not is_auto and smallest.num_layers:
            one_policy(p).schedule.check(smallest.num_layers)


def _floor(smallest, optimizer, budget, budget_bytes: int, mesh: Mesh | None,
           vary: str) -> int:
    """Parameters plus optimizer state, bytes per device. Raises BudgetError where the
    budget is below it."""
    params, opt_state, _ = train_state(smallest, optimizer)
    floor = tree_bytes(params) + tree_bytes(opt_state)
    if budget_bytes < floor:
        where = f"per device of mesh {rk_mesh.spec_text(mesh)}" if mesh is not None else "per device"
        raise BudgetError(
            f"budget {fmt_bytes_exact(budget_bytes)} is below the parameters plus optimizer "
            f"state alone, {fmt_bytes_exact(floor, where)}: no "
            f"{vary} fits", budget=budget, minimum_bytes=floor)
    return floor


def _max_units(given, size: _Sizes, budget_bytes: int, floor: int,
               target: targets.Target) -> tuple[int, bool]:
    """(the most units of `size.multiple` searched, whether that bound is exact).

    No size is compiled past what the workload says can fit (`Workload.size_bound`, e.g.
    one layer's attention scores); at a bound the budget set, a policy that fits has its
    exact answer, not a capped one. A workload with no bound stops at max_size.
    """
    bound, exact = (given.size_bound(size.vary, size.fixed, budget_bytes, floor, target.platform)
                    if given is not None and given.size_bound is not None
                    else (size.max_size, False))
    return min(size.max_size, bound) // size.multiple, exact and bound < size.max_size


def _step_measurer(search: _Search) -> Callable[[Policy, int, Callable | None], StepMemory]:
    """The compile behind `Steps`: (policy, size, loss or None) -> the step's `StepMemory`,
    raising `SizeRefused` where the workload cannot be built at that size."""
    def measure_step(policy: Policy, size: int, loss: Callable | None) -> StepMemory:
        try:
            work = search.at_size(size)
        except Exception as e:  # noqa: BLE001 - e.g. a position table shorter than size
            raise SizeRefused(f"{search.size.vary} {size}: {type(e).__name__}: {e}") from e
        if loss is not None:
            work = dataclasses.replace(work, loss_for_policy=lambda _: loss)
        try:
            # XLA's own remat held off (GPU): the step is the policy's, monotone in size.
            return compile_step(work, policy, search.optimizer, search.target,
                                xla_remat=False)
        except Exception as e:  # noqa: BLE001 - re-raised; an out-of-memory one says the HBM
            if targets.is_out_of_memory(e) and (found := fit_estimate.capacity(e)):
                search.capacity["bytes"] = found
            raise
    return measure_step


def _search_rows(search: _Search, steps: Steps, cache: "str | bool | None",
                 progress) -> list[FitRow]:
    """One `FitRow` per row, in `search.labels`' order, by `fit_one`.

    Fixed policies are searched first (the auto row picks among what they compiled), each
    starting at the largest size found so far: policies land near each other.
    """
    specs, auto, multiple = search.labels, search.auto, search.size.multiple
    rows: list[FitRow | None] = [None] * len(specs)
    limit = None  # the workload's own limit, once a row finds it (`FitRow.limit`)
    max_units = search.max_units
    order = [i for i in range(len(specs)) if not auto[i]] + [i for i in range(len(specs))
                                                            if auto[i]]
    for n, i in enumerate(order):
        start_units = max((r.size for r in rows if r is not None), default=0) // multiple
        if auto[i]:
            # On the step's devices: without a mesh, one device of the target; each
            # tag decided per layer (the planner's default groups).
            chooser = AutoRow(steps, search.budget_bytes, lambda size: Planner(
                search.at_size(size), cache=cache, target=search.target))
            at, extra, seen = chooser.at, lambda: chooser.planner_compiles, {}
        else:
            # A policy's sizes compiled before (no remat's, for the overhead) help predict.
            at, extra, seen = ((lambda size, p=search.policies[i]: (None, steps.get(p, size))),
                               lambda: 0, steps.known(search.policies[i]))
        estimate, none_far = fit_estimate.for_row(
            search.at_size, search.estimated[i], search.optimizer, multiple, search.state,
            search.budget_bytes, lambda: search.capacity.get("bytes"), search.target.platform)
        rows[i], max_units = fit_one(specs[i], at, extra, steps, search.budget_bytes, multiple,
                                      max_units, search.size.vary, search.size.shape,
                                      search.devices, start_units, seen, search.floor,
                                      search.exact, limit, estimate, none_far)
        limit = rows[i].limit or limit
        if auto[i] and rows[i].picked in chooser.layer_specs:
            rows[i] = dataclasses.replace(rows[i], picked_layers=chooser.layer_specs[
                rows[i].picked])
        if progress is not None:
            progress(n + 1, len(specs), rows[i])
    return rows


def _below_minimum(search: _Search, steps: Steps, rows: list[FitRow],
                   rechunk: Callable | None) -> tuple[str, dict | None]:
    """(`FitResult.below_minimum`, `minimum_peak`): `_what_holds` where no row fits even the
    smallest size (and none failed); else ("", None)."""
    if not all(r.size == 0 and r.error is None for r in rows):
        return "", None
    size = search.size
    remade = None if rechunk is None else (
        lambda n: resizer(rechunk(n), None)[0](*size.shape(size.multiple)))
    return _what_holds(steps, search.smallest, size.multiple, size.vary, search.optimizer,
                       search.target, remade)


def _what_holds(steps: Steps, work, size: int, vary: str, optimizer, target,
                remade: Callable[[int], object] | None) -> tuple[str, dict | None]:
    """(`FitResult.below_minimum`, `minimum_peak`) of the least step compiled at
    `size` (the smallest size searched), by `step_peak`: one more compile, and one
    of full remat at `remade(n)` (the workload at `size` with its loss over n
    vocabulary chunks) where the line names a chunk count. ("", None) where
    nothing compiled at `size` or the breakdown cannot be had."""
    # A per-layer plan's step (its runs of layers) is not one policy to break down.
    compiled = {key: (p, m) for key, m in steps.at(size).items()
                if isinstance(p := steps.policy(key), Policy)}
    if not compiled:
        return "", None
    key = min(compiled, key=lambda k: compiled[k][1].total_bytes)
    try:
        found = step_peak(work, compiled[key][0], optimizer, target)
    except Exception:  # noqa: BLE001 - fit's answer must not be lost to it
        return "", None
    chunks, chunked = vocab_chunks_for(found), None
    if chunks is not None and remade is not None:
        try:
            chunked = compile_step(remade(chunks), Policy(), optimizer, target).total_bytes
        except Exception:  # noqa: BLE001 - the line stands without the figure
            chunked = None
    which = "full remat" if key == "full" else key
    return held_line(found, f"at {vary} {size}, {which}'s step memory", chunked), found

