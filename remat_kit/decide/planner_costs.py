"""The planner's costs: the cost model of the program, and how a compiled policy is ranked.

`PlannerCosts` is the cost model a `Planner` holds: one `milp.CostModel` per base rule and layer
grouping, with the measured share of a saved byte (`MIN_BYTE_SHARE`) and the offload probe's
figure; the policy a MILP solution stands for, each policy's predicted step seconds, and the
score the objective ranks compiled records by (`TIME_RESOLUTION`).
Docs: docs/architecture.md ("The planner's parts"), docs/plan.md ("How it works").
"""

from __future__ import annotations

import dataclasses

from remat_kit.decide import offload as host_offload
from remat_kit.decide import offload_probe
from remat_kit.decide.cost_model import SAVE_TAGS, CostModel
from remat_kit.decide.plan_cache import layers_summary
from remat_kit.measure import time_model
from remat_kit.measure.record import Record
from remat_kit.measure.residuals import stage
from remat_kit.policy.names import TAGS, is_path, register_emitted
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parsed_only

# Predicted step times closer than this fraction of no remat's are ranked by FLOPs.
TIME_RESOLUTION = 5e-3
# Stacks up to this many layers get one group per layer by default (`groups="layers"`).
MAX_DEFAULT_GROUPS = 64
# The least share of its bytes a saved tag is taken to add (`PlannerCosts.byte_share`): a
# compile where saving every tag grew the figure by less (XLA's CPU temp can shrink) must
# not make saving look free to the MILP.
MIN_BYTE_SHARE = 0.1


class PlannerCosts:
    """The cost model and scores of a `Planner`.

    Args:
      compiles: the planner's `PlannerCompiles` (the program, the records measured).
      groups, decide, objective, predict_time: as the `Planner` takes them (decide a
        frozenset or None; objective "flops" or "time").
      host_bandwidth: bytes/s offload is planned at, or None for no offload.
    """

    def __init__(self, compiles, *, groups: "int | str", decide: "frozenset | None",
                 host_bandwidth: "float | None", predict_time: bool, objective: str):
        self.compiles, self.target = compiles, compiles.target
        self.groups, self.decide, self.objective = groups, decide, objective
        self.host_bandwidth, self.predict_time = host_bandwidth, predict_time
        self._models: dict[tuple, CostModel] = {}
        self._seconds: dict[str, float] = {}
        self._eqn_cache: dict = {}
        self._roofline = None
        self._probe = None
        self._byte_share: float | None = None

    @property
    def roofline(self):
        """The target's `time_model.Roofline` (on CPU, measured once and cached)."""
        if self._roofline is None:
            self._roofline = self.target.roofline
        return self._roofline

    def model_for(self, base: str = "nothing", groups: int = 1) -> CostModel:
        """The `CostModel` under base rule `base` with tags decided in `groups` layer
        groups. Where offload is asked for, the offload probe decides: an offloaded
        byte is charged 1 - its figure in device bytes where it pays
        (`plans_offload`), else offload is not among the choices."""
        if (base, groups) not in self._models:
            bandwidth = self.host_bandwidth if self.plans_offload else None
            model = self._build_model(base, groups, bandwidth)
            if base == "nothing":  # where the share was measured; above dots it is not
                model = dataclasses.replace(model, byte_share=self.byte_share)
            if bandwidth is not None:
                model = dataclasses.replace(model, offload_share=1 - self.offload_probe.figure)
            self._models[(base, groups)] = model
        return self._models[(base, groups)]

    @property
    def byte_share(self) -> float:
        """What a saved byte adds to the compiled figure, measured on this program:
        (memory of every decidable tag saved, base nothing - `full`'s) / those tags'
        bytes, within [`MIN_BYTE_SHARE`, 1]; 1 where that policy does not compile.
        One more compile, made once (it is a candidate plan like any other).

        A layer's saved tags stand in for values its recompute would hold anyway (at
        the peak, the backward pass entering the last layer, that layer's kept tags
        cost nothing: about (L-1)/L of a uniform plan's bytes count), and XLA
        reuses buffers besides; the share measures both at once. On the zoo's
        own-tags decoder and the reference configs tiny and tiny_llama (2 layers,
        batch 8) it is 0.28 to 0.45 on the XLA CPU compile (temp) and 0.7 to 0.85 on
        `tpu:v5e:1x1` (peak): docs/plan.md, "The first estimate". Only the models of
        base nothing take it: above a base rule that saves dots, the kept tags were
        measured to add more (a tiny scanned stack's dots_no_batch plan went over).
        """
        if self._byte_share is None:
            model = self.offload_free_model()
            kept = frozenset(t for t in model.tags if t not in model.fixed)
            total = sum(model.nbytes[t] for t in kept)
            every = self.compiles.measure_all([Policy(save=kept)])[0] if total else None
            if every is None or every.error or every.memory_bytes is None:
                self._byte_share = 1.0
            else:
                grown = (every.memory_bytes - self.compiles.measure(Policy()).memory_bytes) / total
                self._byte_share = min(1.0, max(MIN_BYTE_SHARE, grown))
        return self._byte_share

    @property
    def byte_share_measured(self) -> bool:
        """Whether `byte_share` has been measured (its compile made), without measuring it."""
        return self._byte_share is not None

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
            self._probe = offload_probe.probe(self.offload_free_model(), self.compiles)
        return self._probe

    @property
    def plans_offload(self) -> bool:
        """Offload is asked for and the probe's compiles show it lowers device memory."""
        return self.host_bandwidth is not None and self.offload_probe.pays

    def _build_model(self, base: str, groups: int, host_bandwidth) -> CostModel:
        """The `CostModel` as measured from the program, offload at `host_bandwidth`."""
        compiles = self.compiles
        free = set(compiles.measure(Policy()).residual_bytes_by_tag)
        staged = (stage(compiles.per_device[0](SAVE_TAGS), compiles.per_device[1])
                  if compiles.per_device is not None else compiles.staged)
        needed = {r.name for r in staged.residuals if r.kind == "tag"} - free
        model = compiles.program.model(
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
        why, layers = self.compiles.program.per_layer, len(self.compiles.program.layers)
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

    def policy_from_items(self, saved, base: str, groups: int, offloaded=frozenset()):
        """The policy saving `saved` items and offloading `offloaded`: one Policy, or
        one per layer where they differ."""
        if groups == 1:
            return Policy(save=frozenset(saved), offload=frozenset(offloaded), base=base)
        group = self.compiles.program.groups(groups)
        layers = tuple(Policy(save=frozenset(t for t, g in saved if g == group[r]),
                              offload=frozenset(t for t, g in offloaded if g == group[r]),
                              base=base)
                       for r in self.compiles.program.layers)
        return layers[0] if len(set(layers)) == 1 else layers

    def transfer_seconds(self, policy) -> float:
        """Predicted seconds of `policy`'s host transfers not hidden behind its
        layers' compute (`remat_kit.decide.offload.transfer_seconds`)."""
        return host_offload.transfer_seconds(self, policy)

    def seconds(self, policy) -> float:
        """Predicted step seconds of `policy` (a Policy or per-layer tuple), per
        device: its compiled record's (`Record.predicted_seconds`, a roofline per
        compiled op; compiles it if not yet), else where that has none the
        roofline of every equation of its value-and-grad program
        (`time_model.program_seconds`); plus its host transfers not hidden behind
        compute (`transfer_seconds`)."""
        layered = isinstance(policy, tuple)
        if not layered:
            (policy,) = parsed_only([policy], "Planner.seconds")
        key = layers_summary(policy) if layered else str(policy)
        if key not in self._seconds:
            compiles = self.compiles
            found = compiles.record_of(policy).predicted_seconds
            if found is None:
                if layered:
                    loss, per_device = compiles.layer_program(policy)
                    fn, args = per_device or ((lambda _: loss), compiles.args)
                else:
                    fn, args = compiles.per_device or (compiles.loss_fn, compiles.args)
                program = stage(fn(None if layered else policy), args).program
                found = time_model.program_seconds(program.jaxpr, self.roofline,
                                                   self._eqn_cache)
            self._seconds[key] = found + self.transfer_seconds(policy)
        return self._seconds[key]

    def score(self, record: Record) -> tuple:
        """What the objective ranks a compiled record by (measured FLOPs, or
        predicted seconds), then its memory. Predicted seconds within
        `TIME_RESOLUTION` of no remat's are a tie, broken by FLOPs: the time
        model is not that accurate, and fewer FLOPs never cost time."""
        policy = self.compiles.policy_of(record)
        stored = record.memory_bytes + record.offloaded_bytes  # saving beats offloading
        if self.objective == "time":
            step = TIME_RESOLUTION * self.seconds(Policy(remat=False))
            return (round(self.seconds(policy) / step), record.flops, stored)
        excess = self.transfer_seconds(policy) * self.roofline.bf16_flops if \
            self.host_bandwidth is not None else 0.0
        return (record.flops + excess, stored)

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


__all__ = ["MAX_DEFAULT_GROUPS", "MIN_BYTE_SHARE", "PlannerCosts", "TIME_RESOLUTION"]
