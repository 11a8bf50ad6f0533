"""fit's search: for one policy, the largest size whose compiled train step fits.

`fit_one` searches sizes (multiples of the unit): compiled sizes predict the next, bisecting where
predictions do not close in; `Steps` keeps every compiled step so rows share them; `AutoRow` is
the planner's row, choosing at each size among its plan and the steps already compiled.
The public call and its checks are `remat_kit.decide.fit.fit`. Docs: docs/fit.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable

import numpy as np

from remat_kit.errors import BudgetError
from remat_kit.decide.plan_cache import layers_summary
from remat_kit.policy.policy import Policy
from remat_kit.decide.step import (StepMemory, one_policy)
from remat_kit.decide.fit_estimate import Estimate
from remat_kit.measure import pool
from remat_kit.measure.targets import is_out_of_memory


@dataclasses.dataclass(frozen=True)
class FitRow:
    """The largest size one policy allows within the budget.

    Attributes:
      policy: the row's label: the spec as the user gave it.
      size: the largest fitting sequence length or global batch size (a
        multiple of `multiple`); 0 if not even one multiple fits.
      memory: the step at `size` (`StepMemory`, per device); None if size is
        0 or on error.
      flops_per_token: FLOPs of the whole step over all devices per token:
        per-device step FLOPs x devices / (global batch * seq), at `size`.
      flop_overhead: step FLOPs / no remat's step FLOPs at the same size.
      none_fits: whether no remat fits the budget at `size`.
      none_flops: how no remat's FLOPs at `size` were found: "compiled";
        "extrapolated" (its compile failed for memory; FLOPs are a
        polynomial in the size, degree 2 in seq and 1 in batch, fitted
        exactly through compiled smaller sizes); or "traced" (not compiled:
        its traced estimate is far over the budget, `fit_estimate.far_over`,
        so `none_fits` is False; FLOPs are this row's compiled FLOPs times the
        ratio of the two programs' traced counts, `fit_estimate.traced_flops`:
        the overhead within 1.1% of the compiled one on the tiny configs).
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
      xla_remat: on a GPU, where the step at `size` is over what XLA holds a program to
        there (`chip_memory.gpu_remat_limit` of the memory JAX takes), the line saying
        XLA would rematerialize on its own at that size (fit compiles with that held
        off: the policy as asked); else None.
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
    xla_remat: str | None = None


# The policies every search compiles: no remat (the FLOP overhead), full remat (the auto row).
NONE, FULL = Policy(remat=False), Policy()


class Steps:
    """Compiled step figures by (policy key, size), so no policy is compiled
    twice at a size, whichever name (or planner) asked for it.

    measure(policy, size, loss) compiles the train step of `policy` (a Policy)
    at `size`, or with `loss` (a loss(*args) of the workload's arguments) of
    that loss under no further remat: a per-layer plan's program.
    """

    def __init__(self, measure: Callable[[Policy, int, Callable | None], StepMemory]):
        self._measure, self._cache, self.total = measure, {}, 0
        self._count = threading.Lock()
        self._failed: dict[tuple, Exception] = {}  # raised again, not compiled again
        self._policies: dict[str, "Policy | tuple[Policy, ...]"] = {}  # key -> its policy

    def get(self, policy, size: int, loss: Callable | None = None) -> StepMemory | None:
        """The step at `size`, or None if its compile ran out of memory.

        policy: a `Policy` (its key: its canonical spec); or, with `loss`, the
        per-layer tuple of Policies that loss runs (its key: their runs of layers,
        `layers_summary`). Raises TypeError for a spec string (`one_policy`).
        """
        key = (_key(policy), size)
        if key in self._failed:
            raise self._failed[key]
        if key not in self._cache:
            with self._count:  # a round's sizes are measured side by side
                self.total += 1
            self._policies.setdefault(key[0], policy)
            try:
                self._cache[key] = self._measure(
                    Policy() if loss is not None else one_policy(policy), size, loss)
            except Exception as e:  # noqa: BLE001 - only memory errors mean "does not fit"
                if not is_out_of_memory(e):
                    self._failed[key] = e
                    raise
                self._cache[key] = None
        return self._cache[key]

    def known(self, policy: "Policy | tuple[Policy, ...]") -> dict[int, StepMemory]:
        policy = _key(policy)
        return {s: m for (p, s), m in self._cache.items() if p == policy and m is not None}

    def at(self, size: int) -> dict[str, StepMemory]:
        """Every policy compiled at `size` that did not run out of memory, by key."""
        return {p: m for (p, s), m in self._cache.items() if s == size and m is not None}

    def policy(self, key: str) -> "Policy | tuple[Policy, ...]":
        """The policy (or per-layer tuple) a step key stands for."""
        return self._policies[key]


class SizeRefused(Exception):
    """The workload cannot be built at a size (its own limit, not memory), "seq 48: ..."."""


def _key(policy) -> str:
    """A step's policy as one string: its canonical spec, or for one Policy per
    layer their runs of layers ('0-6 save:mlpwi / 7-11 full')."""
    return layers_summary(policy) if isinstance(policy, tuple) else str(policy)


def _root(coef, budget: int) -> float | None:
    """The largest positive real size where the polynomial `coef` (numpy order) meets `budget`."""
    roots = [r.real for r in np.roots(np.asarray(coef, float) - np.eye(len(coef))[-1] * budget)
             if abs(r.imag) < 1e-9 and r.real > 0]
    return max(roots) if roots else None


def _two_point_root(a: tuple[int, int], b: tuple[int, int], budget: int,
                    degree: int) -> float | None:
    """Where a curve through two (unit, bytes) points meets the budget: the line for degree 1;
    for degree 2 the middle of the line's answer and the pure square's (no linear term). Every
    curve c0 + c1 k + c2 k² with c1, c2 >= 0 through both points meets the budget between
    those two, so the middle is off by at most half their distance."""
    (k1, m1), (k2, m2) = sorted((a, b))
    if m2 <= m1:
        return None  # flat or falling: XLA's noise, no slope to go by
    line = _root(np.polyfit([k1, k2], [m1, m2], 1), budget)
    if degree == 1 or line is None:
        return line
    c2 = (m2 - m1) / (k2 * k2 - k1 * k1)
    square = _root([c2, 0.0, m1 - c2 * k1 * k1], budget)
    return line if square is None else (line + square) / 2


def _predict(points: dict[int, int], budget: int, lo: int, hi: int | None,
             degree: int = 2) -> int | None:
    """The unit nearest to where a curve through the compiled points meets the budget; None
    if no prediction can be made.

    points: bytes by unit; unit 0, if given, is the step's floor (parameters and optimizer
    state: every step holds at least that), used only while one size is compiled: the line
    from it through that size over-estimates the slope by the step's constant workspace, so
    the first jump lands below the answer, where a compile gives bytes (an out-of-memory
    compile gives none). With two sizes, `_two_point_root`; with three or more and
    `degree` 2 (attention scores grow with seq²), a quadratic through the two nearest the
    bracket and the farthest (adjacent sizes differ by little more than XLA's noise, so a
    wide base gives the slope), the two-point answer where it falls outside the bracket."""
    real = {k: b for k, b in points.items() if k}
    if not real:
        return None
    near = sorted(real, key=lambda k: min(abs(k - lo), abs(k - (hi or lo))))
    far = max(near, key=lambda k: abs(k - near[0]))
    if len(real) == 1:
        floor = points.get(0)
        if floor is None or floor >= real[near[0]]:
            return None
        guess = _two_point_root((0, floor), (near[0], real[near[0]]), budget, 1)
    else:
        guess = _two_point_root((near[0], real[near[0]]), (far, real[far]), budget, degree)
    if degree == 2 and len(real) >= 3:
        xs = [near[0], near[1] if near[1] != far else near[2], far]
        quad = _root(np.polyfit(xs, [real[k] for k in xs], 2), budget)
        if quad is not None and lo - 0.5 < quad < (hi if hi is not None else math.inf) - 0.5:
            guess = quad
    return None if guess is None else int(math.floor(guess + 0.5))


def _search(fits: Callable[[int], bool], bytes_at: Callable[[int], int | None],
            budget: int, max_units: int, start: int = 1, degree: int = 2,
            estimate: Estimate | None = None, jobs: int = 1,
            fits_many: Callable[[list[int]], list[bool]] | None = None) -> tuple[int, bool]:
    """The largest k in [0, max_units] with fits(k), assuming fits is monotone.

    Prediction, then verification: each compile goes to the boundary a curve through
    the sizes compiled so far predicts, and the answer is proved by the pair k, k + 1
    (fits, does not). With an `estimate` (the policy's step traced at each size, no
    compile), the first compile goes where it puts the answer, a little below
    (`Estimate.first`), and the curve is the estimate scaled through the compiled sizes
    (`Estimate.guess`): 3 or 4 compiles on step shapes like llama_1b's on XLA:TPU v5e and a
    70B's on a v5p mesh (4 for the 70B-shaped fit in docs/speed.md). Without one, or where it cannot say,
    `_predict`: `start`, the line from
    the floor (bytes_at(0)) through it, the quadratic's boundary, its neighbour. A
    prediction that does not halve the bracket twice in a row gives way to bisection, so
    the worst case is a binary search's.

    With `jobs` > 1 each round probes up to `jobs` sizes at once (`_round`: the serial
    search's next size and its neighbours, or the bracket split in jobs + 1 where it
    bisects), `fits_many(ks)` giving each one's answer (default: fits, one after
    another): fewer rounds, and the same answer where fits is monotone.

    Returns (k, capped). `bytes_at(k)` is the memory measured at a unit
    already probed (None if not probed or out of memory), for prediction;
    bytes_at(0) may give what every step holds at least (its parameters and
    optimizer state), which is never compiled.
    `start`: the first unit probed, e.g. another policy's answer (an estimate's first
    probe is taken only where start is 1). `degree`: of the memory in the size (2 for
    seq, 1 for batch), `_predict`.
    """
    if max_units < 1:
        return 0, False
    fits_many = fits_many or (lambda ks: [fits(k) for k in ks])
    lo, hi = 0, None  # fits(lo) (size 0 trivially); not fits(hi)
    first = estimate.first(budget, max_units) if estimate is not None and start <= 1 else None
    k, stalls, halving = min(max(first or start, 1), max_units), 0, False
    while True:
        width = None if hi is None else hi - lo
        ks = _round(k, lo, hi, max_units, jobs, halving)
        for k_, ok in zip(ks, fits_many(ks) if len(ks) > 1 else [fits(k)]):
            if ok and (hi is None or k_ < hi):
                lo = max(lo, k_)
            elif not ok:
                hi = k_ if hi is None else min(hi, k_)
        lo = min(lo, hi - 1) if hi is not None else lo
        if lo == max_units:
            return lo, True
        if hi is not None and hi - lo <= 1:
            return lo, False
        # A prediction that does not halve the bracket twice in a row gives way to bisection.
        stalls = stalls + 1 if width is not None and hi - lo > width / 2 else 0
        points = {u: b for u in range(0, (hi or lo) + 1) if (b := bytes_at(u)) is not None}
        real = {u: b for u, b in points.items() if u}
        guess = (estimate.guess(real, budget, lo, hi, max_units)
                 if estimate is not None and real else None)
        if guess is None:
            room = budget if estimate is None else min(budget, estimate.capacity() or budget)
            guess = _predict(points, room, lo, hi, degree)
        halving = hi is not None
        if hi is None:
            k, halving = (2 * lo, False) if guess is None else (guess, False)
        elif guess is None or stalls >= (3 if guess <= lo + 1 or (
                guess >= hi - 1 and bytes_at(hi) is not None) else 2):
            # (A guess at the bracket's edge is the proof of the answer it predicts: a
            # stall more is let through for it; not below a size out of memory, which
            # says nothing of how far over it is.)
            k, stalls = (lo + hi) // 2, 0
        else:
            k, halving = guess, False
        if hi is not None and k >= hi:
            # The curve through hi's bytes puts the answer just below it; where hi ran out
            # of memory (no bytes to learn from) the curve says hi fits: bisect, rather than
            # walk down from hi.
            k = hi - 1 if bytes_at(hi) is not None else (lo + hi) // 2
            halving = bytes_at(hi) is None
        # At or below lo: verify lo + 1 fails.
        k = min(max(k, lo + 1), max_units)


def _round(k: int, lo: int, hi: int | None, max_units: int, jobs: int,
           halving: bool) -> list[int]:
    """The sizes one round of `_search` probes, ascending: `k` (the serial search's next)
    and, with `jobs` > 1, more inside the bracket (lo, hi): where the search bisects,
    the bracket split in jobs + 1 (a k-ary search); else k's neighbours, k + 1 first (the
    pair that proves a prediction that lands on the answer), then k - 1, k + 2, ..."""
    top = max_units if hi is None else min(max_units, hi - 1)
    ks = {k}
    if jobs > 1 and halving and hi is not None:
        ks |= {lo + (hi - lo) * i // (jobs + 1) for i in range(1, jobs + 1)}
    step = 1
    while len(ks) < jobs and (k + step <= top or k - step > lo):
        for near in (k + step, k - step):
            if lo < near <= top and len(ks) < jobs:
                ks.add(near)
        step += 1
    return sorted(u for u in ks if lo < u <= top) or [k]


def _extrapolated_flops(known: dict[int, StepMemory], size: int, degree: int) -> float | None:
    pts = sorted((s, m.flops) for s, m in known.items() if m.flops is not None)
    if len(pts) < degree + 1:
        return None
    pts = pts[-(degree + 1):]
    coef = np.polyfit([s for s, _ in pts], [f for _, f in pts], degree)
    return float(np.polyval(coef, size))

class AutoRow:
    """The auto row's choice at each size: the fewest-FLOP policy whose whole
    step fits, among the planner's verified plan and every policy already
    compiled at that size (see `fit`)."""

    TRIES = 3

    def __init__(self, steps: Steps, budget: int, planner_at: Callable[[int], object]):
        self.steps, self.budget, self.planner_at = steps, budget, planner_at
        self.planner_compiles, self._count = 0, threading.Lock()
        self.layer_specs: dict[str, tuple[str, ...]] = {}  # step key -> a per-layer plan's specs
        self._chosen: dict[int, tuple[str | None, StepMemory | None]] = {}

    def at(self, size: int) -> tuple[str | None, StepMemory | None]:
        """(picked spec, its step) at `size`; (None, None) if nothing fits."""
        if size not in self._chosen:
            self._chosen[size] = self._choose(size)
        return self._chosen[size]

    def _choose(self, size: int) -> tuple[str | None, StepMemory | None]:
        full = self.steps.get(FULL, size)
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
                        step = self.steps.get(plan.policy, size)
                    if step is not None and step.total_bytes <= self.budget:
                        break
                    # Over: take the overshoot off the planner's budget (an out-of-memory
                    # compile: plan below what this plan measured).
                    limit = (limit - (step.total_bytes - self.budget) if step is not None
                             else plan.measured_bytes - 1)
            except BudgetError:
                pass  # below what the planner can reach: full (compiled) is the fallback
            with self._count:  # sizes chosen side by side
                self.planner_compiles += len({id(r) for r in planner.records.values()})
        fitting = [(m.flops, m.total_bytes, spec) for spec, m in self.steps.at(size).items()
                   if m.total_bytes <= self.budget and m.flops is not None]
        if not fitting:
            return None, None
        spec = min(fitting)[2]
        return spec, self.steps.at(size)[spec]


def _none_at(steps: Steps, size: int, budget: int, vary: str, flops: float | None,
             none_far: Callable[[int], float | None] | None):
    """(none_fits, no remat's FLOPs, how they were found, error) at `size`, for a row's
    overhead (`flops`: the row's step FLOPs there): compiled (or compiled before); where
    no remat is not compiled yet and `none_far(size)` gives the ratio of its traced
    FLOPs to the row's policy's (its estimate far over the budget), `flops` times that,
    "traced", and it does not fit; else extrapolated from its compiled sizes where its
    compile runs out of memory."""
    ratio = (None if flops is None or none_far is None or size in steps.known(NONE)
             else none_far(size))
    if ratio is not None:
        return False, flops * ratio, "traced", None
    try:
        none = steps.get(NONE, size)
    except Exception as e:  # noqa: BLE001
        none, error = None, f"no remat at {size}: {type(e).__name__}: {e}"
    else:
        error = None
    if none is not None:
        return none.total_bytes <= budget, none.flops, "compiled", error
    flops = _extrapolated_flops(steps.known(NONE), size, 2 if vary == "seq" else 1)
    return None, flops, "extrapolated" if flops is not None else None, error


class _Probes:
    """One row's compiled sizes: `fits(k)` (unit k, `at` there) and `fits_many` (a round's
    units side by side), keeping `probes` ((size, total bytes or None out of memory), in
    search order), `known` (bytes by unit; unit 0 the floor) and `refused` (units the
    workload itself refuses to build, by message)."""

    def __init__(self, at: Callable, multiple: int, budget: int, known: dict[int, int]):
        self.at, self.multiple, self.budget, self.known = at, multiple, budget, known
        self.probes: list[tuple[int, int | None]] = []
        self.refused: dict[int, str] = {}

    def fits(self, k: int, found=None) -> bool:
        """Whether unit k fits: `at` there, or what it gave or raised (`found`, a round's)."""
        if found is None:
            try:
                found = self.at(k * self.multiple)
            except Exception as e:  # noqa: BLE001 - handled below, as a round's
                found = e
        if isinstance(found, SizeRefused):
            if not any(0 < u < k for u in self.known):
                raise found
            # A smaller size was built: the workload stops at a limit of its own (e.g. a
            # learned position table). The search bounds its bracket there, as it does at a
            # size out of memory, so it bisects down to the limit instead of walking it.
            self.refused[k] = str(found)
            return False
        if isinstance(found, Exception):
            raise found
        m = found[1]
        self.probes.append((k * self.multiple, None if m is None else m.total_bytes))
        if m is not None:
            self.known[k] = m.total_bytes
        return m is not None and m.total_bytes <= self.budget

    def fits_many(self, ks: list[int]) -> list[bool]:
        """`fits` at each of `ks`, their compiles side by side (`pool.side_by_side`), read in
        ascending order, so a round says what the serial search would of the same sizes."""
        found = pool.side_by_side([lambda k=k: self.at(k * self.multiple) for k in ks])
        return [self.fits(k, f) for k, f in zip(ks, found)]


def fit_one(spec: str, at: Callable[[int], tuple[str | None, StepMemory | None]],
             extra_compiles: Callable[[], int], steps: Steps, budget: int, multiple: int,
             max_units: int, vary: str, sizes: Callable[[int], tuple[int, int]], devices: int,
             start: int, seen: dict[int, StepMemory], floor: int,
             exact: bool = False, limit: str | None = None, estimate: Estimate | None = None,
             none_far: Callable[[int], float | None] | None = None) -> tuple[FitRow, int]:
    """One row: search the largest size where `at(size)` gives a fitting step.

    Returns (the row, max_units for the next rows: below the model's own
    limit where this search found one, `FitRow.limit`).

    at(size) -> (picked spec or None for a fixed policy, step or None if out of memory).
    seen: steps of this row compiled before, by size, for the search's prediction.
    floor: parameters plus optimizer state, bytes per device: every step holds at least
    that, the prediction's point at size 0 (no compile).
    exact: max_units is the most the budget allows (`size_bound`): fitting there is not capped.
    limit: the workload's own limit found by an earlier row (max_units is below it).
    estimate: the policy's traced estimate, for the search (`_search`).
    none_far: size -> the ratio of no remat's traced FLOPs to this policy's where no remat's
    estimate is far over the budget (it is not compiled there, `_none_at`), else None.
    """
    before, extra_before = steps.total, extra_compiles()
    probed = _Probes(at, multiple, budget, {0: floor} | {
        s // multiple: m.total_bytes for s, m in seen.items() if s % multiple == 0})
    probes, known, refused = probed.probes, probed.known, probed.refused

    def compiles() -> int:
        return steps.total - before + extra_compiles() - extra_before

    try:
        units, capped = _search(probed.fits, known.get, budget, max_units, start,
                                2 if vary == "seq" else 1, estimate, pool.current().jobs,
                                probed.fits_many)
    except Exception as e:  # noqa: BLE001 - reported in the row, not as "does not fit"
        error = str(e) if isinstance(e, SizeRefused) else f"{type(e).__name__}: {e}"
        return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes),
                      error=error), max_units
    if refused:
        first = min(refused)
        limit, max_units = refused[first], first - 1
        capped = capped or units == max_units
    capped = capped and (limit is not None or not exact)
    size = units * multiple
    if size == 0:
        return FitRow(spec, 0, compiles=compiles(), probes=tuple(probes)), max_units
    picked, memory = at(size)
    none_fits, none_flops, how, error = _none_at(steps, size, budget, vary, memory.flops,
                                                  none_far)
    b, s = sizes(size)
    return FitRow(
        spec, size, memory, limit=limit,
        flops_per_token=None if memory.flops is None else memory.flops * devices / (b * s),
        flop_overhead=(None if memory.flops is None or not none_flops
                       else memory.flops / none_flops),
        none_fits=none_fits, none_flops=how,
        capped=capped, compiles=compiles(), probes=tuple(probes), error=error,
        picked=picked), max_units


__all__ = ["AutoRow", "FitRow", "SizeRefused", "Steps", "fit_one"]
