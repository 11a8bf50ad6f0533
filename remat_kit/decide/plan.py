"""Budget planner: the policy with the fewest FLOPs whose compiled memory fits a budget.

`plan(loss_fn, *args, budget=...)` answers "what should I save for this much
memory?" in three steps:

1. A cost model, measured from the program itself (`remat_kit.decide.cost_model`).
   The loss is traced under `save:*`; the tags the backward pass then reads
   are the *needed* tags. Each tag's *segment* (the equations between it and
   its nearest tagged ancestors, the remat region's inputs, or values the
   base rule saves) gives its recompute FLOPs and predicted seconds
   (`remat_kit.measure.time_model`); its bytes are its values' bytes. Tags inside
   `jax.jit`-ed calls are seen; tags inside a scan count once per trip. Tags
   that the remat region keeps anyway (its inputs, e.g.
   `decoder_layer_input`, found as the tag residuals of `full`) are always
   available. Decisions are per tag, or per tag and group of layers
   (`groups`), over each base rule for untagged values (nothing,
   dots_no_batch, dots), each compiled alone as the floor the tags fill above.
2. A mixed-integer program over the tags, after Checkmate (Jain et al. 2020,
   "Checkmate: Breaking the Memory Wall with Optimal Tensor
   Rematerialization") with one recompute stage, as in PyTorch's
   `activation_memory_budget` min-cut partitioner (torch/_functorch/partitioners.py),
   which chooses saved values by their recompute cost, but with the
   dependencies between tags as constraints rather than a knapsack over
   independent items. Binary s_t (save t) and r_t (recompute t):

       minimize    sum_t cost_t r_t           cost: FLOPs, or predicted seconds
       subject to  s_t + r_t >= 1              t needed by the backward pass
                   s_p + r_p >= r_t            p a parent of t (recomputing t reads p)
                   sum_t k bytes_t s_t <= room room = budget - memory of the base alone

   where k, what a saved byte adds to the compiled figure, is measured on the
   program by one compile (every tag saved, against `full`: `Planner.byte_share`);
   solved with `scipy.optimize.milp` (HiGHS), then again for the fewest bytes
   among solutions within `search.FLOP_RESOLUTION` of the cheapest, so nothing
   useless is saved. Where offload is asked for (`offload`), a third
   binary o_t offloads t where the offload probe (`remat_kit.decide.offload_probe`:
   two compiles of the loss, its tags offloaded and saved) shows that offload
   lowers device memory: it takes 1 - the probe's figure of its bytes on the
   device, and its transfer (bytes
   over the target's host bandwidth, each way) hides behind its layers'
   predicted forward compute; only the excess is charged (as seconds, or for
   objective "flops" as the FLOPs the device could have run meanwhile), see
   `CostModel.solve`. Recomputing
   `mlpwo`'s input means recomputing `mlp_act`, which reads `mlpwi`: the
   parent constraints carry such chains.
3. Verification: the chosen policy (`save:` the tags with s_t = 1; one per
   layer for a per-layer plan, the model's program with each layer's remat
   region under its own policy) is compiled
   and its real memory checked. Over budget, the room shrinks
   by the overshoot (and below the rejected plan's bytes) and the program is
   solved again; under budget, the unused bytes are offered back (XLA's
   buffer reuse often makes saved tags cost less than their size). Up to
   `max_iterations` policies are compiled; the one with the fewest measured
   FLOPs (or least predicted time) that fits is returned, and `full` always fits.
   A plan that offloads is compiled once more with those tags saved instead:
   its notes give the probe's figure, how far device memory fell beside what
   the probe predicted, and the compiler's host temp memory
   (`Plan.offload_notes`, `Plan.host_bytes`). Every other policy
   the `Planner` has compiled for this loss (e.g. the presets `remat-kit plan`
   compares) is a candidate too. A budget that holds no remat returns `none`.

Memory is the figure `remat_kit.measure.measure.memory_kind` names for the target
(`Record.memory_bytes`), per device, as `remat-kit compare` ranks by: XLA's
`temp_size_in_bytes` on the XLA CPU backend (its peak figure leaves temp
buffers out), the compiler's `peak_memory_in_bytes` on TPU and GPU targets
(XLA:TPU's temp figure leaves out buffers its peak counts, and can rank full
remat above no remat). A fractional budget is a fraction of the `none`
policy's figure, the minimum is the least figure of any compiled policy, and
the room the MILP fills is the budget minus `full`'s figure; saved tags add
to either figure about their bytes, and verification by compiling corrects
what they do not. `Plan.memory_kind` says which figure a plan's bytes are.

Plans are cached (`remat_kit.decide.plan_cache`), so a restarted run does not plan again.
"""

from __future__ import annotations

import math
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
from remat_kit.measure import targets
from remat_kit.measure.record import Record
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


class Planner(PlannerCompiles, PlannerCosts):
    """Plans one loss for any number of budgets, sharing the measurements.

    `Planner(loss_fn, *args).plan("6GiB")`; `.frontier([0.1, 0.2])`.

    Args:
      loss_fn: a loss(*args) returning a scalar (wrapped whole in one remat
        region per policy) or a factory policy -> loss (the model applies the
        policy, e.g. per layer), as `measure` takes; differentiated with
        respect to args[0].
      args: arrays or `jax.ShapeDtypeStruct`s (with shardings for a mesh).
      cache: path of the JSON plan cache; True for `default_cache_path()`;
        None or False for none.
      max_iterations: policies compiled per budget before falling back to
        `full`, which always fits.
      progress: called with a one-line message as each policy is compiled.
      target: whose compiler the plan is verified with and whose memory it
        fits (`remat_kit.measure.targets`, e.g. "tpu:v5e:1x1"); default JAX's
        default backend. It sets the memory figure budgeted:
        `temp_size_in_bytes` on CPU, `peak_memory_in_bytes` on TPU and GPU
        (`remat_kit.measure.measure.memory_kind`).
      per_device: for args sharded over a mesh, (factory, args) of the
        program one device runs (`Workload.per_device`), as `measure`
        takes it: the cost model's bytes and FLOPs are then per device, like
        the compiled figures. Needed where a shard is not a valid input
        (parameters split over fsdp or tensor).
      groups: layer groups each tag is decided in: "layers" (the default: one
        group per layer, up to `MAX_DEFAULT_GROUPS` groups), 1 (one decision
        per tag for every layer), or an int G from 1 to the number of layers
        (G runs of consecutive layers, as even as possible). The layers are the remat
        regions that hold tags (`cost_model.Program`); where they cannot take
        their own policies (a scanned stack, one remat region) plans are
        uniform and say why in their status.
      objective: "flops" (fewest FLOPs) or "time" (least predicted step time,
        `remat_kit.measure.time_model`); default "time" on a TPU or GPU target whose
        time model came within reach of measured step times
        (`time_checks.time_check`), else "flops" (today every target: on the
        A100, predicted full recompute is 1.22x no remat's step against the
        1.39x Korthikanti et al. 2022 measured). `time_check` is the line
        saying how far the target's model was checked.
      predict_time: also predict each plan's step time (`Plan.predicted_seconds`);
        always on for objective "time" and where offload is planned.
      offload: plan offload to host memory as a third decision per tag (see
        the module docstring): None (default) or False for none, True to ask
        for it at the target's host bandwidth (`targets.PEAKS`: TPU v5e / v5p,
        H100, H200; on the CPU at its memory bandwidth), or a host bandwidth in
        bytes/s in place of the target's (a what-if for a faster link). Asked
        for, it is planned only where the offload probe's figure is above 0
        (`offload_probe`, `plans_offload`): XLA's TPU and GPU compiles keep part
        of an offloaded residual on the device, and on the CPU, where host
        memory is device memory, the figure is what its compile shows (0).
      decide: tag names the plan may save or offload; the others are always
        recomputed. Default every tag (the optimality benchmark narrows it).
      step: the step a budget covers: "grad" (the default), the value-and-grad
        step `compare` measures, or "train", the whole train step as `fit`
        measures it (parameters, gradients, optimizer state and update, the
        batch: `remat_kit.decide.step_records`); every record is then that
        step's, so a budget can be the device's memory as it is.
      optimizer: with step "train", the optax optimizer of the step; default
        AdamW (`step.default_optimizer`).
      bases: the base rules for untagged values a plan may take (default
        `cost_model.PLANNED_BASES`); ("nothing",) for a framework that names
        every value it keeps (`remat_kit.decide.emit`). With `decide`, it also
        narrows which compiled policies (presets) may be the plan.
      no_remat: whether no remat may be the plan. False for a framework whose every
        setting recomputes what it does not name: MaxText (`--emit maxtext`), whose
        config reads remat_policy 'none' as None, which checkpoints every layer
        (maxtext 0.2.5, configs/pyconfig.py and layers/nnx_decoders.py).

    Raises:
      ValueError: max_iterations not a positive int, groups not a positive int
        or "layers", or above the number of layers (the message gives the
        range), an objective other than "flops" or "time".
      TargetError: offload=True on a target that lists no host bandwidth.
    """

    def __init__(self, loss_fn: Callable, *args, cache: "str | bool | None" = True,
                 max_iterations: int = 3, progress: Callable[[str], None] | None = None,
                 target=None, per_device: tuple[Callable, tuple] | None = None,
                 groups: "int | str" = "layers", objective: str | None = None,
                 predict_time: bool = True, offload: "bool | float | None" = None,
                 decide: "Collection[str] | None" = None, step: str = "grad",
                 optimizer=None, bases: Sequence[str] = PLANNED_BASES, no_remat: bool = True):
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
            self.workload = loss_fn
            loss_fn, args = loss_fn.loss_for_policy, loss_fn.args
        else:
            self.workload = from_loss(loss_fn, *args)
        _check_differentiable(args)
        self.step, self.optimizer = check_step(step), optimizer
        self.loss_fn, self.args = as_factory(loss_fn, len(args)), args
        self.cache = default_cache_path() if cache is True else (cache or None)
        self.max_iterations, self.progress = max_iterations, progress
        # The progress line's phase, compiles so far, and compiles left where known.
        self.phase, self.compiles, self.left = "search", 0, None
        self.target = targets.parse_target(target)
        checked, self.time_check = time_check(self.target)
        self.objective = objective or ("time" if checked and self.target.platform != "cpu"
                                       else "flops")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got "
                             f"{objective!r}")
        self.groups = groups
        self.decide = None if decide is None else frozenset(decide)
        if not bases or set(bases) - set(PLANNED_BASES):
            raise ValueError(f"bases must be some of {', '.join(PLANNED_BASES)}, got {bases!r}")
        self.bases = tuple(b for b in PLANNED_BASES if b in bases)
        self.no_remat = bool(no_remat)
        self.per_device = per_device
        self.records: dict[str, Record] = {}
        self._policies: dict[str, object] = {}  # record key -> Policy or per-layer tuple
        self._models: dict[tuple, CostModel] = {}
        self._seconds: dict[str, float] = {}
        self._eqn_cache: dict = {}
        self._program: Program | None = None
        self._forwards: dict = {}
        self._roofline = None
        self._fingerprint: str | None = None
        self._staged = None
        self._probe = None
        self._byte_share: float | None = None
        self.host_bandwidth = offload_bandwidth(self.target, offload)
        self.predict_time = (predict_time or self.objective == "time"
                             or self.host_bandwidth is not None)
        if groups != "layers":
            self.group_count()  # a group count outside 1..layers fails here, not at plan

    def plan(self, budget: "str | int | float") -> Plan:
        """The policy with the fewest FLOPs (or least predicted time) whose
        compiled memory fits `budget`: `remat_kit.decide.search.plan`."""
        return search.plan(self, budget)

    def frontier(self, budgets: Sequence) -> list[Plan]:
        """`plan` for each budget, made monotone: `remat_kit.decide.search.frontier`."""
        return search.frontier(self, budgets)


def plan(loss_fn: Callable, *args, budget, cache: "str | bool | None" = True,
         max_iterations: int = 3, target=None, groups: "int | str" = "layers",
         objective: str | None = None, offload: "bool | float | None" = None,
         step: str | None = None, optimizer=None) -> Plan:
    """The cheapest policy (fewest FLOPs) whose compiled memory fits `budget`.

    `rk.plan(loss_fn, *args, budget="6GiB")`: a mixed-integer program over the
    tags `loss_fn` emits, costs measured from its jaxpr and XLA, verified by
    compiling (see the module docstring and `Planner`).

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