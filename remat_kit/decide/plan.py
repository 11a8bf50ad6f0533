"""The budget planner: the policy with the fewest FLOPs (or least predicted time) whose
compiled memory fits a budget, for one loss and any number of budgets (`Planner`, `plan`).
The `Planner` holds its compile cache (`planner_compiles`) and its cost model
(`planner_costs`, measured from the program: `cost_model`); a MILP over the tags (`milp`),
each answer verified by compiling (`search`), plans cached (`plan_cache`).
How it works, the arguments and the figures: docs/plan.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Sequence

import jax
import jax.numpy as jnp

from remat_kit.decide import search
from remat_kit.decide.cost_model import PLANNED_BASES, CostModel, Program, cost_model
from remat_kit.decide.offload import CPU_OFFLOAD_NOTE, offload_bandwidth
from remat_kit.decide.plan_cache import Plan, default_cache_path, layers_summary, read_cache
from remat_kit.decide.planner_compiles import PlannerCompiles
from remat_kit.decide.planner_costs import MAX_DEFAULT_GROUPS, TIME_RESOLUTION, PlannerCosts
from remat_kit.decide.step_records import check_step, default_step
from remat_kit.measure import pool, targets
from remat_kit.measure.record import Record
from remat_kit.policy.policy import Policy
from remat_kit.measure.time_checks import time_check
from remat_kit.measure.time_model import OBJECTIVES
from remat_kit.trace.workload import Workload, as_factory, from_loss


def _check_differentiable(args) -> None:
    """ValueError unless args[0], what the loss is differentiated by, holds a float array."""
    if not args:
        raise ValueError("cannot plan a loss called with no arguments: there is nothing to "
                         "differentiate (a plan decides what the backward pass with respect "
                         "to the first argument, the parameters, saves); pass them: "
                         "rk.plan(loss_fn, params, *batch, budget=...)")
    dtypes = {str(x.dtype if hasattr(x, "dtype") else jnp.result_type(x))
              for x in jax.tree.leaves(args[0])}
    if not any(jnp.issubdtype(d, jnp.inexact) for d in dtypes):
        found = ", ".join(sorted(dtypes)) or "no arrays"
        raise ValueError(f"cannot plan: the first argument, which the loss is differentiated "
                         f"by, holds no floating-point array ({found}), so there is no "
                         "backward pass to plan; pass the float parameters first: "
                         "rk.plan(loss_fn, params, *batch, budget=...)")


class Planner:
    """Plans one loss for any number of budgets, sharing the measurements:
    `Planner(loss_fn, *args).plan("6GiB")`, `.frontier([0.1, 0.2])`. Every argument
    (loss_fn, args, cache, max_iterations, progress, target, per_device, groups,
    objective, predict_time, offload, decide, step, optimizer, bases, no_remat, jobs) and
    the errors raised: docs/plan.md, "`Planner`'s arguments".

    It holds two parts: `compiles` (`PlannerCompiles`: each policy's record, made
    once) and `costs` (`PlannerCosts`: the cost model and the scores, reading
    `compiles`); `remat_kit.decide.search` plans with them. Its methods take
    `Policy` values (or a tuple of one per layer), never spec strings.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.sin(jnp.sin(x @ w) @ w))
    >>> planner = rk.Planner(loss, jnp.ones((8, 8)), jnp.ones((64, 8)), cache=False)
    >>> [p.spec for p in planner.frontier([0.8, 1.0])]  # fractions of no remat's memory
    ['full', 'none']

    Raises:
      ValueError: a bad max_iterations, groups, offload, bases or objective (named).
      TargetError: offload=True on a target that lists no host bandwidth.
    """

    def __init__(self, loss_fn: Callable, *args, cache: "str | bool | None" = True,
                 max_iterations: int = 3, progress: Callable[[str], None] | None = None,
                 target=None, per_device: tuple[Callable, tuple] | None = None,
                 groups: "int | str" = "layers", objective: str | None = None,
                 predict_time: bool = True, offload: "bool | float | None" = None,
                 decide: "Collection[str] | None" = None, step: str = "grad",
                 optimizer=None, bases: Sequence[str] = PLANNED_BASES, no_remat: bool = True,
                 jobs: int | None = None):
        self.jobs = None if jobs is None else pool.check_jobs(jobs)
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
                or max_iterations < 1:
            raise ValueError(f"max_iterations must be a positive int, got {max_iterations!r}")
        if groups != "layers" and (isinstance(groups, bool) or not isinstance(groups, int)):
            raise ValueError(f"groups must be a whole number of layer groups or 'layers', "
                             f"got {groups!r}")
        # `is`, not `in`: 0 == False and 1 == True, but 0 is no bandwidth.
        if not (offload is None or offload is True or offload is False
                or isinstance(offload, (int, float)) and not isinstance(offload, bool)
                and math.isfinite(offload) and offload > 0):
            raise ValueError(f"offload must be None, True, False or a host bandwidth in "
                             f"bytes/s > 0, got {offload!r}")
        self.made_for = {}  # a model's: its plans name it (Plan.model)
        if isinstance(loss_fn, Workload):
            if args:
                raise TypeError("Planner takes a Workload or a loss and its args, not both")
            per_device = per_device or loss_fn.per_device
            self.made_for = {k: v for k, v in (("block", loss_fn.block_name),
                                               ("num_layers", loss_fn.num_layers),
                                               ("parameters", loss_fn.parameter_count))
                             if v is not None}
            workload = loss_fn
            loss_fn, args = loss_fn.loss_for_policy, loss_fn.args
        else:
            workload = from_loss(loss_fn, *args)
        _check_differentiable(args)
        self.step = check_step(step)
        if not (cache is None or isinstance(cache, (bool, str, os.PathLike))):
            raise TypeError(f"cache must be a plan cache path, True for the default one, or "
                            f"None for none; got {type(cache).__name__} {cache!r:.80}")
        self.cache = (default_cache_path() if cache is True
                      else os.fspath(cache) if cache else None)
        self.max_iterations = max_iterations
        self.target = targets.parse_target(target)
        checked, self.time_check = time_check(self.target)
        objective = objective or ("time" if checked and self.target.platform != "cpu"
                                  else "flops")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{objective!r}")
        if not bases or set(bases) - set(PLANNED_BASES):
            raise ValueError(f"bases must be some of {', '.join(PLANNED_BASES)}, got {bases!r}")
        self.bases = tuple(b for b in PLANNED_BASES if b in bases)
        self.no_remat = bool(no_remat)
        host_bandwidth = offload_bandwidth(self.target, offload)
        self.compiles = PlannerCompiles(
            as_factory(loss_fn, len(args)), args, target=self.target, per_device=per_device,
            step=self.step, optimizer=optimizer, workload=workload, progress=progress)
        # The cost model holds objective, host_bandwidth and predict_time; the Planner reads them.
        self.costs = PlannerCosts(
            self.compiles, groups=groups, decide=None if decide is None else frozenset(decide),
            host_bandwidth=host_bandwidth, objective=objective,
            predict_time=predict_time or objective == "time" or host_bandwidth is not None)
        if groups != "layers":
            self.group_count()  # a group count outside 1..layers fails here, not at plan

    def plan(self, budget: "str | int | float") -> Plan:
        """The policy with the fewest FLOPs (or least predicted time) whose
        compiled memory fits `budget`: `remat_kit.decide.search.plan`."""
        with pool.using(self.jobs):
            return search.plan(self, budget)

    def frontier(self, budgets: Sequence) -> list[Plan]:
        """`plan` for each budget, made monotone: `remat_kit.decide.search.frontier`."""
        with pool.using(self.jobs):
            return search.frontier(self, budgets)

    @property
    def objective(self) -> str:
        """What a plan minimises among those that fit: "flops" or "time" (`OBJECTIVES`)."""
        return self.costs.objective

    @property
    def host_bandwidth(self) -> "float | None":
        """Bytes/s each way to host memory where offload is planned, else None."""
        return self.costs.host_bandwidth

    @property
    def predict_time(self) -> bool:
        """Whether plans carry a predicted step time."""
        return self.costs.predict_time

    @property
    def decide(self) -> "frozenset | None":
        """The tags a plan may save or offload (None: every one); settable, as
        `remat-kit plan --emit maxtext` keeps to those MaxText names."""
        return self.costs.decide

    @decide.setter
    def decide(self, tags: "Collection[str] | None") -> None:
        self.costs.decide = None if tags is None else frozenset(tags)

    def none_flops(self) -> float:
        """No remat's FLOPs: compiled, or where it runs out of memory, the cost
        model's (`full`'s measured FLOPs less its predicted recompute)."""
        none = self.none()
        if none is not None:
            return none.flops
        return self.measure(Policy()).flops - self.model.cost(frozenset())[1]

    def minimum(self) -> tuple[int, int | None]:
        """(least memory of any compiled policy, memory of `none` or None where
        it runs out of memory), bytes of `memory_kind`, after compiling `full`
        and `none`. The least is `full`'s except on small models, where XLA
        can give another policy less."""
        self.measure(Policy())
        none = self.none()
        return min(r.memory_bytes for r in self.compiled_records()), none and none.memory_bytes

    def compiled_records(self) -> list[Record]:
        """Every policy compiled for this loss that has memory and FLOP figures and,
        where offload is not planned (not asked for, or the offload probe shows it
        does not pay), offloads nothing (a preset such as minimal_offloaded is then
        never a plan)."""
        return [r for r in {id(r): r for r in self.records.values()}.values()  # no hash
                if r.error is None and r.flops is not None and r.memory_bytes is not None
                and (not r.offloaded_bytes or self.plans_offload) and self._allowed(r)]

    def _allowed(self, record: Record) -> bool:
        """Whether a compiled policy keeps to `bases`, `decide` and `no_remat` (full
        always does)."""
        policy = self.policy_of(record)
        for p in policy if isinstance(policy, tuple) else (policy,):
            if not p.remat and not self.no_remat:
                return False
            if p.remat and p.base not in self.bases:
                return False
            if self.decide is not None and p.remat and not (p.save | p.offload) <= self.decide:
                return False
        return True

    # The parts' answers, as callers of the Planner know them (one line each).
    @property
    def records(self) -> dict[str, Record]:
        """`PlannerCompiles.records`."""
        return self.compiles.records

    def measure(self, policy: Policy) -> Record:
        """`PlannerCompiles.measure`."""
        return self.compiles.measure(policy)

    def measure_all(self, policies: Sequence[Policy], names=None) -> list[Record]:
        """`PlannerCompiles.measure_all`."""
        return self.compiles.measure_all(policies, names)

    def record_of(self, policy) -> Record:
        """`PlannerCompiles.record_of`."""
        return self.compiles.record_of(policy)

    def policy_of(self, record: Record):
        """`PlannerCompiles.policy_of`."""
        return self.compiles.policy_of(record)

    def loss_of(self, policy) -> Callable:
        """`PlannerCompiles.loss_of`."""
        return self.compiles.loss_of(policy)

    def none(self) -> Record | None:
        """`PlannerCompiles.none`."""
        return self.compiles.none()

    def in_phase(self, phase: str):
        """`PlannerCompiles.in_phase`."""
        return self.compiles.in_phase(phase)

    @property
    def memory_kind(self) -> str:
        """`PlannerCompiles.memory_kind`."""
        return self.compiles.memory_kind

    @property
    def program(self) -> Program:
        """`PlannerCompiles.program`."""
        return self.compiles.program

    @property
    def roofline(self):
        """`PlannerCosts.roofline`."""
        return self.costs.roofline

    @property
    def model(self) -> CostModel:
        """`PlannerCosts.model`."""
        return self.costs.model

    def model_for(self, base: str = "nothing", groups: int = 1) -> CostModel:
        """`PlannerCosts.model_for`."""
        return self.costs.model_for(base, groups)

    def offload_free_model(self) -> CostModel:
        """`PlannerCosts.offload_free_model`."""
        return self.costs.offload_free_model()

    @property
    def byte_share(self) -> float:
        """`PlannerCosts.byte_share`."""
        return self.costs.byte_share

    @property
    def offload_probe(self):
        """`PlannerCosts.offload_probe`."""
        return self.costs.offload_probe

    @property
    def plans_offload(self) -> bool:
        """`PlannerCosts.plans_offload`."""
        return self.costs.plans_offload

    def group_count(self) -> tuple[int, str | None]:
        """`PlannerCosts.group_count`."""
        return self.costs.group_count()

    def seconds(self, policy) -> float:
        """`PlannerCosts.seconds`."""
        return self.costs.seconds(policy)

    def score(self, record: Record) -> tuple:
        """`PlannerCosts.score`."""
        return self.costs.score(record)

    def aliases_of(self, policy) -> dict[str, list[str]]:
        """`PlannerCosts.aliases_of`."""
        return self.costs.aliases_of(policy)


def plan(loss_fn: Callable, *args, budget, cache: "str | bool | None" = True,
         max_iterations: int = 3, target=None, groups: "int | str" = "layers",
         objective: str | None = None, offload: "bool | float | None" = None,
         step: str | None = None, optimizer=None) -> Plan:
    """The cheapest policy (fewest FLOPs) whose compiled memory fits `budget`.

    `rk.plan(loss_fn, *args, budget="6GiB")`: a mixed-integer program over the
    tags `loss_fn` emits, costs measured from its jaxpr and XLA, verified by
    compiling (docs/plan.md, "How it works").

    Args:
      loss_fn: a `Workload`, a loss(*args) -> scalar, or a policy -> loss factory.
      args: with a loss, arrays or `jax.ShapeDtypeStruct`s.
      budget: bytes ("6GiB", "512MiB", 6_000_000_000) or a fraction 0 < f <= 1
        of no remat's memory (0.25); memory is `temp_size_in_bytes` on the XLA
        CPU backend, `peak_memory_in_bytes` on TPU and GPU (`Planner`).
      cache: plan cache path, True for `default_cache_path()`, None for none.
      max_iterations: compiles per budget before falling back to `full`.
      target: whose compiler to plan for (`remat_kit.measure.targets`, e.g.
        "tpu:v5e:1x1"); default JAX's default backend.
      groups, objective, offload: see `Planner` (default: each layer its own
        group, for stacks up to `MAX_DEFAULT_GROUPS` layers; offload only when
        asked for, and then only where the offload probe shows it pays).
      step, optimizer: the step the budget covers, "grad" or "train" (see
        `Planner`); default "train" where the budget is a size on a TPU or GPU
        target (the device's memory as it is), else "grad"
        (`step_records.default_step`).
    Returns:
      A `Plan` with measured_bytes <= budget_bytes.
    Raises:
      BudgetError: a malformed budget, or one below full remat's memory.
      TargetError: a bad target, or libtpu / the CUDA plugin missing, or
        offload=True on a target without host memory.
      ValueError: no args, or args[0] holds no floating-point array: there
        is nothing to differentiate; a group count outside 1..layers.
    """
    target = targets.parse_target(target)  # once: the step's default and the Planner read it
    return Planner(loss_fn, *args, cache=cache, max_iterations=max_iterations,
                   target=target, groups=groups, objective=objective, offload=offload,
                   step=step or default_step(target, [budget]),
                   optimizer=optimizer).plan(budget)


__all__ = ["CPU_OFFLOAD_NOTE", "CostModel", "MAX_DEFAULT_GROUPS", "Plan", "Planner",
           "TIME_RESOLUTION", "cost_model", "default_cache_path", "layers_summary",
           "offload_bandwidth", "plan", "read_cache"]