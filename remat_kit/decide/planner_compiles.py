"""The planner's compiles: each policy's record, made once, and the programs traced for them.

`PlannerCompiles` is the compile cache a `Planner` holds: a policy (or one per layer) is compiled
once, as the value-and-grad step `compare` measures or, for step "train", the whole train step,
and its `Record` kept by `str(policy)`; no remat's figures, the program's fingerprint (the plan
cache's key) and the forward program the cost model reads come from here. `Policy` values only.
Docs: docs/architecture.md ("The planner's parts").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import threading
from collections.abc import Callable, Sequence

import jax

from remat_kit.decide.cost_model import Program, forward_jaxpr, with_region_policies
from remat_kit.decide.plan_cache import layers_summary
from remat_kit.decide.step import default_optimizer, step_peak
from remat_kit.decide.step_records import train_record
from remat_kit.errors import BudgetError
from remat_kit.measure import figure_cache, pool, targets
from remat_kit.measure.lowering import compile_options
from remat_kit.measure.measure import measure
from remat_kit.measure.record import Record
from remat_kit.measure.residuals import stage
from remat_kit.decide.cost_model import SAVE_TAGS
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parsed_only

# Bumped where the planner's answers change for the same program (the measured share of
# a saved byte), so plans cached by an older planner are planned again.
_PLANNER_REVISION = "byte-share"


class PlannerCompiles:
    """The compiles of a `Planner`: each policy's `Record`, made once.

    Args:
      loss_fn: policy -> loss(*args) (`trace.workload.as_factory`).
      args: the loss's arguments, arrays or `jax.ShapeDtypeStruct`s.
      target: the `measure.targets.Target` compiled for.
      per_device: (factory, args) of one device's program, or None.
      step: "grad" (the value-and-grad step) or "train" (the whole train step of
        `workload` with `optimizer`, `step_records.train_record`).
      progress: called with one line per compile, or None.

    Attributes:
      records: `str(policy)` (or `layers_summary`) -> its `Record`.
      phase, count, left: the progress line's phase, compiles so far, and
        compiles left where known (`remat_kit.decide.search` sets `left`).
    """

    def __init__(self, loss_fn: Callable, args: tuple, *, target, per_device, step: str,
                 optimizer, workload, progress: Callable[[str], None] | None):
        self.loss_fn, self.args, self.target, self.per_device = loss_fn, args, target, per_device
        self.step, self.optimizer, self.workload = step, optimizer, workload
        self.progress = progress
        self.phase, self.count, self.left = "search", 0, None
        self._counting = threading.Lock()
        self._spares: dict[str, tuple] = {}  # key -> (record, policy), compiled unasked
        self.records: dict[str, Record] = {}
        self._policies: dict[str, object] = {}  # record key -> Policy or per-layer tuple
        self._forwards: dict = {}
        self._staged = None
        self._program: Program | None = None
        self._fingerprint: str | None = None

    def measure_all(self, policies: Sequence[Policy],
                    names: Sequence[str] | None = None) -> list[Record]:
        """Records of `policies` (`Policy` values), compiling only those not
        measured yet, in one `measure` call (so policies that compile alike
        compile once); `names`: what the progress line and a new record call
        each (default `str(policy)`). Records may carry errors.

        Raises:
          TypeError: a spec string among `policies` (parse it above the planner).
          ValueError: `names` not one a policy.
        """
        policies = parsed_only(policies, "Planner.measure_all")
        keys = [str(p) for p in policies]
        names = keys if names is None else list(names)
        if len(names) != len(keys):
            raise ValueError(f"Planner.measure_all: {len(names)} names for {len(keys)} "
                             f"policies; give one name a policy, or none")
        for k in keys:
            self._take_spare(k)
        todo = [i for i, k in enumerate(keys) if k not in self.records]
        if todo and self.step == "train":
            distinct = list(dict.fromkeys(keys[i] for i in todo))  # each policy once

            def train(i: int, k: str) -> None:
                policy = policies[keys.index(k)]
                self.records[k] = self._compiled(policy, (i + 1, len(distinct)))
                self._policies[k] = policy
            # Each its own compile, side by side on the pool; an error is raised in order.
            for raised in pool.side_by_side([lambda i=i, k=k: train(i, k)
                                             for i, k in enumerate(distinct)]):
                if isinstance(raised, Exception):
                    raise raised
        elif todo:
            by_name = {names[i]: policies[i] for i in todo}
            for record in measure(self.loss_fn, *self.args, policies=[policies[i] for i in todo],
                                  names=[names[i] for i in todo],
                                  progress=self._progress, target=self.target,
                                  per_device=self.per_device):
                for name in record.names:
                    self.records.setdefault(str(by_name[name]), record)
                    self._policies.setdefault(str(by_name[name]), by_name[name])
        return [self.records[k] for k in keys]

    def spare(self, policy) -> None:
        """Compiles a Policy (or a per-layer tuple) a search may ask for next, kept out of
        `records` (no search sees it) until `record_of` or `measure_all` asks for it, which
        then takes it without compiling: a search's speculative compile, made while the
        compile it waits on runs (`remat_kit.decide.search`). A failure is dropped: the ask
        compiles it again and raises then."""
        key = layers_summary(policy) if isinstance(policy, tuple) else str(policy)
        if key not in self.records and key not in self._spares:
            self._spares[key] = (self._compiled(policy), policy)

    def _compiled(self, policy, count: tuple[int, int] = (1, 1)) -> Record:
        """The record of one Policy, or a per-layer tuple of them (the model's program with
        each layer's remat region under its own), compiled now, not kept; `count`: which of
        how many compiles of one call, for the progress line of a train step."""
        if isinstance(policy, tuple):
            key = layers_summary(policy)
            loss, per_device = self.layer_program(policy)
            if self.step == "train":
                return self._train_record(loss, key, key, per_device, count)
            [record] = measure(lambda _: loss, *self.args, policies=[Policy()], names=[key],
                               progress=self._progress, target=self.target,
                               per_device=per_device)
            return dataclasses.replace(record, policy=key)
        key = str(policy)
        if self.step == "train":
            local = self.per_device and (lambda _: self.per_device[0](policy),
                                         self.per_device[1])
            return self._train_record(self.loss_fn(policy), key, key, local, count)
        [record] = measure(self.loss_fn, *self.args, policies=[policy], names=[key],
                           progress=self._progress, target=self.target,
                           per_device=self.per_device)
        return record

    def _take_spare(self, key: str) -> None:
        """A spare compile of `key` (`spare`), now asked for, into `records`."""
        if key in self._spares and key not in self.records:
            self.records[key], self._policies[key] = self._spares.pop(key)

    def side_by_side(self, policies: Sequence[Policy]) -> None:
        """Compiles those of `policies` not measured yet, each in its own `measure_all`
        call (the records one at a time would give), side by side on the compile pool
        (`pool.side_by_side`): anchors a search reads next. Errors are left for the
        call that reads the record to raise."""
        todo = [p for p in dict.fromkeys(policies) if str(p) not in self.records]
        pool.side_by_side([lambda p=p: self.measure_all([p]) for p in todo])

    def peak(self, policy: Policy) -> dict | None:
        """What holds `policy`'s compiled figure (`Record.peak`,
        `remat_kit.measure.peak.breakdown`): one more compile, which writes
        XLA's buffer assignment; None where it fails. TypeError for a spec string."""
        (policy,) = parsed_only([policy], "Planner.peak")
        if self.step == "train":  # the whole step's, parameters and optimizer state named
            return step_peak(self.workload, policy, self.optimizer or default_optimizer(),
                             self.target)
        [record] = measure(self.loss_fn, *self.args, policies=[policy],
                           names=[str(policy)], target=self.target,
                           per_device=self.per_device, peak=True)
        return record.peak

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        """The progress line's phase ("presets", "verify") for the block; "search" after,
        with no count of compiles left."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase, self.left = "search", None

    def _progress(self, i, n, record):
        """One line per compile: "[presets 3/18] compiled minimal" while the presets are
        compiled (`phase`), else "[verify, compile 7, at most 2 left for this budget]
        compiled save:...": the phase (search: the base rules and the byte share;
        verify: a budget's plans), the compiles so far and, where known, those left."""
        with self._counting:  # compiles end side by side
            self.count += 1
        if not self.progress:
            return
        where = (f"presets {i}/{n}" if self.phase == "presets" else
                 f"{self.phase}, compile {self.count}" + (
                     f", at most {self.left} left for this budget" if self.left is not None
                     else ""))
        self.progress(f"[{where}] compiled {', '.join(record.names)}")

    def measure(self, policy: Policy) -> Record:
        """The compiled record of `policy` (memoized).

        Raises:
          BudgetError: `full` runs out of the target's memory when compiled:
            no policy fits the device at these shapes.
          RuntimeError: the policy fails to compile for another reason, or
            the backend gives no memory or FLOP figures.
        """
        record = self.measure_all([policy])[0]
        key = str(policy)
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
        self._take_spare(key)
        if key not in self.records:
            self.records[key] = self._compiled(policies)
            self._policies[key] = policies
        return self.records[key]

    def optimizer_key(self) -> str:
        """What the plan cache keys a train-step plan's optimizer by: its state's
        shapes and dtypes, which are all its memory depends on; "" for step "grad"."""
        if self.step != "train":
            return ""
        state = jax.eval_shape((self.optimizer or default_optimizer()).init, self.args[0])
        return f"|optimizer={jax.tree.map(lambda x: (x.shape, str(x.dtype)), state)}"

    def _train_record(self, loss, name: str, key: str, per_device,
                      count: tuple[int, int] = (1, 1)) -> Record:
        """The train step's record of `loss` (`step_records.train_record`), with progress
        (`count`: which of how many compiles of one call)."""
        record = train_record(self.workload, loss, name, key, target=self.target,
                              optimizer=self.optimizer, per_device=per_device)
        self._progress(*count, record)
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
        return self.layer_program(policy)[0] if isinstance(policy, tuple) else \
            self.loss_fn(policy)

    def layer_program(self, policies: tuple) -> tuple[Callable, tuple | None]:
        """(loss(*args), per_device or None) of the model's program with each layer's
        remat region under its own of `policies` (`cost_model.with_region_policies`)."""
        regions = dict(zip(self.program.layers, policies))
        loss = with_region_policies(self._forward("global"), regions)
        per_device = None
        if self.per_device is not None:
            local = with_region_policies(self._forward("local"), regions)
            per_device = (lambda _: local, self.per_device[1])
        return loss, per_device

    def record_of(self, policy) -> Record:
        """The compiled record (memoized) of a Policy or of a per-layer tuple of them."""
        return self._measure_layers(policy) if isinstance(policy, tuple) \
            else self.measure_all([policy])[0]

    @property
    def program(self) -> Program:
        """The forward program the cost model reads (`cost_model.Program`), per device."""
        if self._program is None:
            fn, args = self.per_device or (self.loss_fn, self.args)
            self._program = Program(forward_jaxpr(fn(SAVE_TAGS), args).jaxpr)
        return self._program

    @property
    def staged(self):
        """The loss traced under `SAVE_TAGS` (for the cost model and the fingerprint)."""
        if self._staged is None:
            self._staged = stage(self.loss_fn(SAVE_TAGS), self.args)
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

    def policy_of(self, record: Record):
        """The Policy (or per-layer tuple) a record of this planner measured."""
        return self._policies[record.policy]


__all__ = ["PlannerCompiles"]
