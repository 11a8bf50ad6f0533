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
                   sum_t bytes_t s_t <= room   room = budget - memory of the base alone

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

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Collection, Sequence

import jax
import jax.numpy as jnp

from remat_kit.decide import offload as host_offload
from remat_kit.decide import offload_probe
from remat_kit.decide import search
from remat_kit.decide.step import default_optimizer, step_peak
from remat_kit.decide.step_records import check_step, default_step, train_record
from remat_kit.measure import figure_cache
from remat_kit.measure import targets
from remat_kit.measure import time_model
from remat_kit.decide.cost_model import (PLANNED_BASES, SAVE_TAGS, CostModel, Program, cost_model,
                                  forward_jaxpr, with_region_policies)
from remat_kit.errors import BudgetError
from remat_kit.measure.lowering import compile_options
from remat_kit.measure.measure import measure
from remat_kit.decide.plan_cache import Plan, default_cache_path, layers_summary, \
    read_cache
from remat_kit.policy.names import TAGS, is_path, register_emitted
from remat_kit.policy.policy import Policy
from remat_kit.measure.record import Record
from remat_kit.measure.residuals import _stage
from remat_kit.policy.spec import parse
from remat_kit.decide.offload import CPU_OFFLOAD_NOTE, offload_bandwidth
from remat_kit.measure.time_checks import time_check
from remat_kit.measure.time_model import OBJECTIVES
from remat_kit.trace.workload import Workload, _as_factory, from_loss

# Predicted step times closer than this fraction of no remat's are ranked by FLOPs.
TIME_RESOLUTION = 5e-3
# Stacks up to this many layers get one group per layer by default (`groups="layers"`).
MAX_DEFAULT_GROUPS = 64



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


# Bumped where the planner's answers change for the same program (the offload probe's
# device share), so plans cached by an older planner are planned again.
_PLANNER_REVISION = "offload-probe"


class Planner:
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
                 optimizer=None, bases: Sequence[str] = PLANNED_BASES):
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
        self.loss_fn, self.args = _as_factory(loss_fn, len(args)), args
        self.cache = default_cache_path() if cache is True else (cache or None)
        self.max_iterations, self.progress = max_iterations, progress
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
        self.host_bandwidth = offload_bandwidth(self.target, offload)
        self.predict_time = (predict_time or self.objective == "time"
                             or self.host_bandwidth is not None)
        if groups != "layers":
            self.group_count()  # a group count outside 1..layers fails here, not at plan

    # -- measurements, each made once -------------------------------------

    def measure_all(self, policies: Sequence) -> list[Record]:
        """Records of `policies` (specs or Policies; auto specs not allowed),
        compiling only those not measured yet, in one `measure` call (so
        policies that compile alike compile once). Records may carry errors."""
        keys = [str(parse(p)) for p in policies]
        todo = [p for p, k in zip(policies, keys) if k not in self.records]
        if todo and self.step == "train":
            for k in dict.fromkeys(str(parse(p)) for p in todo):  # each policy once
                policy = parse(k)
                local = self.per_device and (lambda _: self.per_device[0](policy),
                                             self.per_device[1])
                self.records[k] = self._train_record(self.loss_fn(policy), k, k, local)
                self._policies[k] = policy
        elif todo:
            for record in measure(self.loss_fn, *self.args, policies=todo,
                                  progress=self._progress, target=self.target,
                                  per_device=self.per_device):
                for name in record.names:
                    self.records.setdefault(str(parse(name)), record)
                    self._policies.setdefault(str(parse(name)), parse(name))
        return [self.records[k] for k in keys]

    def peak(self, policy: "Policy | str") -> dict | None:
        """What holds `policy`'s compiled figure (`Record.peak`,
        `remat_kit.measure.peak.breakdown`): one more compile, which writes
        XLA's buffer assignment; None where it fails."""
        if self.step == "train":  # the whole step's, parameters and optimizer state named
            return step_peak(self.workload, parse(policy), self.optimizer or default_optimizer(),
                             self.target)
        [record] = measure(self.loss_fn, *self.args, policies=[policy], target=self.target,
                           per_device=self.per_device, peak=True)
        return record.peak

    def _progress(self, i, n, record):
        if self.progress:
            self.progress(f"[{i}/{n}] compiled {', '.join(record.names)}")

    def measure(self, policy: "Policy | str") -> Record:
        """The compiled record of `policy` (memoized).

        Raises:
          BudgetError: `full` runs out of the target's memory when compiled:
            no policy fits the device at these shapes.
          RuntimeError: the policy fails to compile for another reason, or
            the backend gives no memory or FLOP figures.
        """
        record = self.measure_all([policy])[0]
        key = str(parse(policy))
        if record.error and key == "full" and targets.is_out_of_memory(record.error):
            raise BudgetError(f"even full remat runs out of {self.target}'s memory at these "
                              f"shapes, so no policy fits: {record.error.splitlines()[0]}")
        if record.error or record.memory_bytes is None or record.flops is None:
            raise RuntimeError(f"cannot plan: policy {key!r} did not compile to memory and "
                               f"FLOP figures: {record.error or 'the backend reports none'}")
        return record

    def _measure_layers(self, policies: tuple) -> Record:
        """The compiled record of one policy per layer (the model's program with
        each layer's remat region under its policy, `cost_model.with_region_policies`)."""
        key = layers_summary(policies)
        if key not in self.records and self.step == "train":
            loss, per_device = self._layer_program(policies)
            self.records[key] = self._train_record(loss, key, key, per_device)
            self._policies[key] = policies
        elif key not in self.records:
            loss, per_device = self._layer_program(policies)
            [record] = measure(lambda _: loss, *self.args, policies=[Policy()], names=[key],
                               progress=self._progress, target=self.target,
                               per_device=per_device)
            self.records[key] = dataclasses.replace(record, policy=key)
            self._policies[key] = policies
        return self.records[key]

    def optimizer_key(self) -> str:
        """What the plan cache keys a train-step plan's optimizer by: its state's
        shapes and dtypes, which are all its memory depends on; "" for step "grad"."""
        if self.step != "train":
            return ""
        state = jax.eval_shape((self.optimizer or default_optimizer()).init, self.args[0])
        return f"|optimizer={jax.tree.map(lambda x: (x.shape, str(x.dtype)), state)}"

    def aliases_of(self, policy) -> dict[str, list[str]]:
        """Tag -> the other names the program gives its values (`CostModel.aliases`),
        for each tag `policy` (a Policy or a per-layer tuple) saves or offloads."""
        kept = {t for p in (policy if isinstance(policy, tuple) else (policy,))
                for t in (*p.save, *p.offload)}
        found = {}
        for model in self._models.values():
            found |= model.aliases
        return {t: list(found.get(t, ())) for t in sorted(kept)
                if found.get(t) or not (t in TAGS or is_path(t) or t == "*")}

    def _train_record(self, loss, name: str, key: str, per_device) -> Record:
        """The train step's record of `loss` (`step_records.train_record`), with progress."""
        record = train_record(self.workload, loss, name, key, target=self.target,
                              optimizer=self.optimizer, per_device=per_device)
        self._progress(1, 1, record)
        return record

    def _forward(self, which: str):
        """The forward jaxpr under `full` of the loss ("global") or of the per-device program."""
        if which not in self._forwards:
            fn, args = ((self.loss_fn, self.args) if which == "global" else self.per_device)
            self._forwards[which] = forward_jaxpr(fn(Policy()), args)
        return self._forwards[which]

    def loss_of(self, policy) -> Callable:
        """loss(*args) under `policy`: a `Policy`, or a tuple of one per layer
        (the model's program with each layer's remat region under its own, as
        a per-layer plan is verified), e.g. to compile a plan inside a train
        step (`remat_kit.decide.fit`)."""
        return self._layer_program(policy)[0] if isinstance(policy, tuple) else \
            self.loss_fn(policy)

    def _layer_program(self, policies: tuple):
        regions = dict(zip(self.program.layers, policies))
        loss = with_region_policies(self._forward("global"), regions)
        per_device = None
        if self.per_device is not None:
            local = with_region_policies(self._forward("local"), regions)
            per_device = (lambda _: local, self.per_device[1])
        return loss, per_device

    # -- the cost model ----------------------------------------------------

    @property
    def program(self) -> Program:
        """The forward program the cost model reads (`cost_model.Program`), per device."""
        if self._program is None:
            fn, args = self.per_device or (self.loss_fn, self.args)
            self._program = Program(forward_jaxpr(fn(SAVE_TAGS), args).jaxpr)
        return self._program

    @property
    def roofline(self):
        """The target's `time_model.Roofline` (on CPU, measured once and cached)."""
        if self._roofline is None:
            self._roofline = time_model.roofline(self.target)
        return self._roofline

    def model_for(self, base: str = "nothing", groups: int = 1) -> CostModel:
        """The `CostModel` under base rule `base` with tags decided in `groups` layer
        groups. Where offload is asked for, the offload probe decides: an offloaded
        byte is charged 1 - its figure in device bytes where it pays
        (`plans_offload`), else offload is not among the choices."""
        if (base, groups) not in self._models:
            bandwidth = self.host_bandwidth if self.plans_offload else None
            model = self._build_model(base, groups, bandwidth)
            if bandwidth is not None:
                model = dataclasses.replace(model, offload_share=1 - self.offload_probe.figure)
            self._models[(base, groups)] = model
        return self._models[(base, groups)]

    def offload_free_model(self) -> CostModel:
        """The uniform `CostModel` (base nothing, one decision per tag) without offload:
        what the offload probe reads its tag set from."""
        if "offload-free" not in self._models:
            self._models["offload-free"] = self._build_model("nothing", 1, None)
        return self._models["offload-free"]

    @property
    def offload_probe(self) -> "offload_probe.Probe | None":
        """The offload probe of this loss on this target (`remat_kit.decide.offload_probe`,
        two compiles or a figure cache hit, made once); None where offload is not asked for."""
        if self.host_bandwidth is not None and self._probe is None:
            self._probe = offload_probe.probe(self)
        return self._probe

    @property
    def plans_offload(self) -> bool:
        """Offload is asked for and the probe's compiles show it lowers device memory."""
        return self.host_bandwidth is not None and self.offload_probe.pays

    def _build_model(self, base: str, groups: int, host_bandwidth) -> CostModel:
        """The `CostModel` as measured from the program, offload at `host_bandwidth`."""
        free = set(self.measure(Policy()).residual_bytes_by_tag)
        staged = (_stage(self.per_device[0](SAVE_TAGS), self.per_device[1])
                  if self.per_device is not None else self.staged)
        needed = {r.name for r in staged.residuals if r.kind == "tag"} - free
        model = self.program.model(
            free=free, needed=needed, base=base, groups=groups,
            roofline=self.roofline if self.predict_time else None, cache=self._eqn_cache,
            host_bandwidth=host_bandwidth)
        # The model's own names outside the vocabulary (attention_out) are tags a plan
        # may keep; those a spec cannot hold are always recomputed.
        own = register_emitted(names := {t if groups == 1 else t[0] for t in model.tags})
        keep = {n for n in names if n in own or n in TAGS or is_path(n)}
        if self.decide is not None:
            keep &= self.decide
        if keep != names:
            model = model.narrowed(lambda t: (t if groups == 1 else t[0]) in keep)
        return model

    @property
    def model(self) -> CostModel:
        """The measured `CostModel`: one decision per tag, base rule nothing."""
        return self.model_for()

    def group_count(self) -> tuple[int, str | None]:
        """(groups the tags are decided in, a note where fewer than asked).

        Raises:
          ValueError: an int `groups` above the number of layers.
        """
        why, layers = self.program.per_layer, len(self.program.layers)
        if self.groups == "layers":
            return (1, None) if why else (min(layers, MAX_DEFAULT_GROUPS), None)
        if self.groups == 1:
            return 1, None
        if why and self.groups > 1:
            return 1, f"groups={self.groups} not possible ({why}): one decision per tag"
        if not 1 <= self.groups <= layers:
            raise ValueError(f"groups={self.groups}: give a whole number of layer groups from 1 "
                             f"to {max(layers, 1)} (the program's layers), or 'layers'")
        return self.groups, None

    def _policy(self, saved, base: str, groups: int, offloaded=frozenset()):
        """The policy saving `saved` items and offloading `offloaded`: one Policy, or
        one per layer where they differ."""
        if groups == 1:
            return Policy(save=frozenset(saved), offload=frozenset(offloaded), base=base)
        group = self.program.groups(groups)
        layers = tuple(Policy(save=frozenset(t for t, g in saved if g == group[r]),
                              offload=frozenset(t for t, g in offloaded if g == group[r]),
                              base=base)
                       for r in self.program.layers)
        return layers[0] if len(set(layers)) == 1 else layers

    def transfer_seconds(self, policy) -> float:
        """Predicted seconds of `policy`'s host transfers not hidden behind its
        layers' compute (`remat_kit.decide.offload.transfer_seconds`)."""
        return host_offload.transfer_seconds(self, policy)

    def record_of(self, policy) -> Record:
        """The compiled record (memoized) of a Policy or of a per-layer tuple of them."""
        return self._measure_layers(policy) if isinstance(policy, tuple) \
            else self.measure_all([policy])[0]

    def _record(self, policy) -> Record:
        return self._measure_layers(policy) if isinstance(policy, tuple) \
            else self.measure_all([policy])[0]

    def seconds(self, policy) -> float:
        """Predicted step seconds of `policy` (a Policy, spec or per-layer tuple), per
        device: its compiled record's (`Record.predicted_seconds`, a roofline per
        compiled op; compiles it if not yet), else where that has none the
        roofline of every equation of its value-and-grad program
        (`time_model.program_seconds`); plus its host transfers not hidden behind
        compute (`transfer_seconds`)."""
        key = layers_summary(policy) if isinstance(policy, tuple) else str(parse(policy))
        if key not in self._seconds:
            layered = isinstance(policy, tuple)
            policy = policy if layered else parse(policy)
            found = self._record(policy).predicted_seconds
            if found is None:
                if layered:
                    loss, per_device = self._layer_program(policy)
                    fn, args = per_device or ((lambda _: loss), self.args)
                else:
                    fn, args = self.per_device or (self.loss_fn, self.args)
                program = _stage(fn(None if layered else policy), args).program
                found = time_model.program_seconds(program.jaxpr, self.roofline,
                                                   self._eqn_cache)
            self._seconds[key] = found + self.transfer_seconds(policy)
        return self._seconds[key]

    def _policy_of(self, record: Record):
        """The Policy (or per-layer tuple) a compiled record measured."""
        return self._policies.get(record.policy) or parse(record.policy)

    def score(self, record: Record) -> tuple:
        """What the objective ranks a compiled record by (measured FLOPs, or
        predicted seconds), then its memory. Predicted seconds within
        `TIME_RESOLUTION` of no remat's are a tie, broken by FLOPs: the time
        model is not that accurate, and fewer FLOPs never cost time."""
        policy = self._policy_of(record)
        stored = record.memory_bytes + record.offloaded_bytes  # saving beats offloading
        if self.objective == "time":
            step = TIME_RESOLUTION * self.seconds(Policy(remat=False))
            return (round(self.seconds(policy) / step), record.flops, stored)
        excess = self.transfer_seconds(policy) * self.roofline.bf16_flops if \
            self.host_bandwidth is not None else 0.0
        return (record.flops + excess, stored)

    @property
    def staged(self):
        """The loss traced under `SAVE_TAGS` (for the cost model and the fingerprint)."""
        if self._staged is None:
            self._staged = _stage(self.loss_fn(SAVE_TAGS), self.args)
        return self._staged

    def fingerprint(self) -> str:
        """A hash of the traced program, argument shardings, JAX version, target and
        compiler (`figure_cache.compiler_parts`)."""
        if self._fingerprint is None:
            text = re.sub(r"0x[0-9a-f]+", "", str(self.staged.program))  # object addresses vary
            shardings = [str(getattr(x, "sharding", None)) for x in jax.tree.leaves(self.args)]
            # What the figure cache keys by besides the program ($XLA_FLAGS, the
            # compiler version, ...): a plan compiled under other flags is another plan.
            compiler = figure_cache.compiler_parts(
                self.target, compile_options(self.target, True))
            blob = "\n".join([text, *shardings, jax.__version__, repr(compiler),
                              str(jax.device_count()), _PLANNER_REVISION])
            self._fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:32]
        return self._fingerprint

    # -- planning ---------------------------------------------------------

    @property
    def memory_kind(self) -> str:
        """The figure this planner budgets, "temp_size_in_bytes" or
        "peak_memory_in_bytes": `full`'s `Record.memory_kind` (compiles `full`)."""
        return self.measure(Policy()).memory_kind

    def none(self) -> Record | None:
        """No remat's record; None where its compile runs out of the target's
        memory (it cannot fit any budget on that device)."""
        record = self.measure_all([Policy(remat=False)])[0]
        if record.error and targets.is_out_of_memory(record.error):
            return None
        return self.measure(Policy(remat=False))

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
        return min(r.memory_bytes for r in self._compiled()), none and none.memory_bytes

    def plan(self, budget: "str | int | float") -> Plan:
        """The policy with the fewest FLOPs (or least predicted time) whose
        compiled memory fits `budget`: `remat_kit.decide.search.plan`."""
        return search.plan(self, budget)

    def _compiled(self) -> list[Record]:
        """Every policy compiled for this loss that has memory and FLOP figures and,
        where offload is not planned (not asked for, or the offload probe shows it
        does not pay), offloads nothing (a preset such as minimal_offloaded is then
        never a plan)."""
        return [r for r in {id(r): r for r in self.records.values()}.values()  # no hash
                if r.error is None and r.flops is not None and r.memory_bytes is not None
                and (not r.offloaded_bytes or self.plans_offload) and self._allowed(r)]

    def _allowed(self, record: Record) -> bool:
        """Whether a compiled policy keeps to `bases` and `decide` (full always does)."""
        policy = self._policy_of(record)
        for p in policy if isinstance(policy, tuple) else (policy,):
            if p.remat and p.base not in self.bases:
                return False
            if self.decide is not None and p.remat and not (p.save | p.offload) <= self.decide:
                return False
        return True

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
    return Planner(loss_fn, *args, cache=cache, max_iterations=max_iterations,
                   target=target, groups=groups, objective=objective, offload=offload,
                   step=step or default_step(target, [budget]),
                   optimizer=optimizer).plan(budget)


__all__ = ["CPU_OFFLOAD_NOTE", "CostModel", "MAX_DEFAULT_GROUPS", "Plan", "Planner",
           "cost_model", "default_cache_path", "layers_summary", "offload_bandwidth", "plan",
           "read_cache"]
