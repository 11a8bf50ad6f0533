"""What one policy costs: the `Record` of a measurement, and which memory figure counts.
Its fields, as JSON: docs/compare.md (the JSON schema).
"""

from __future__ import annotations

import dataclasses

import jax

from remat_kit.measure import targets

@dataclasses.dataclass(frozen=True)
class StepTime:
    """Wall-clock seconds of one training step (forward + backward, no optimizer).

    Attributes:
      median_s, min_s, max_s, q1_s, q3_s: over `steps` timed steps, after one
        warm-up step; seconds.
      steps: number of timed steps.
      ratio_to_none: the median over the timing rounds of this policy's step
        over the `none` policy's step in the same round (every policy runs one
        step per round, `step_times.time_rounds`), or None if `none` was not timed.
    """

    median_s: float
    min_s: float
    max_s: float
    q1_s: float
    q3_s: float
    steps: int
    ratio_to_none: float | None = None


@dataclasses.dataclass(frozen=True)
class Record:
    """What one policy costs. All byte figures are per device.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> r = rk.measure(loss, jnp.ones((8, 8)), jnp.ones((4, 8)), policies="full")[0]
    >>> r.policy, r.memory_kind, r.memory_bytes  # CPU: the compiled temp bytes
    ('full', 'temp_size_in_bytes', 128)

    Attributes:
      policy: the canonical spec string (`str(Policy)`).
      names: every name the user gave that maps to this measurement
        (policies that compile to the same program are measured once).
      platform: whose compiler the numbers come from, e.g. "XLA CPU compile",
        "XLA TPU compile (v5e:2x2, AOT)" (`targets.Target.label`).
      target: the target string, e.g. "cpu", "tpu:v5e:2x2".
      jax_version, compiler_version: e.g. "0.12.0.1", "libtpu 0.0.52"
        (`targets.versions`).
      residual_bytes_by_tag: bytes saved for backward per `checkpoint_name` tag.
      residual_bytes_by_primitive: bytes of untagged residuals, per producing
        primitive ("dot_general", "mul", ...).
      residual_bytes_by_argument: bytes of function arguments the backward
        pass reads, per top-level argument (kept by reference, not copied).
      offloaded_bytes: residual bytes placed in host memory (also counted in
        the splits above).
      temp_size_in_bytes, peak_memory_in_bytes, argument_size_in_bytes,
        output_size_in_bytes, alias_size_in_bytes: from
        `compiled.memory_analysis()` (`memory_fields`); None where the
        backend gives none. Which of the first two a policy is ranked and
        budgeted by is `memory_kind` (`memory_bytes` is its value).
      host_temp_size_in_bytes, host_argument_size_in_bytes,
        host_output_size_in_bytes: the same analysis of host memory, where
        offloaded residuals live (None where the backend gives none).
      flops, transcendentals: from `compiled.cost_analysis()`, loops counted
        per trip (`loop_scaled_costs`); None where the backend gives none.
      kernel_flops: the share of `flops` that fused kernels (Pallas calls, cuDNN
        attention) take, priced from their shapes or their cost estimates
        (`remat_kit.measure.kernels`; the notes name them); 0.0 where the
        program has none, None where not measured.
      compile_seconds: tracing, lowering and compiling, seconds.
      predicted_seconds: predicted seconds of one step on the target
        (`time_model.compiled_seconds`: a roofline per op of the compiled
        program, a fusion one op); None where it could not be predicted.
      step_time: timed mode only (`StepTime`), else None.
      layer_residual_bytes: residual bytes of one decoder layer measured
        alone (`layer_residuals`), excluding parameters and constants (the
        same in every layer, `LayerBreakdown.constants`); `measure_config`
        only, and None for a layer schedule (its layers differ).
      layers_residual_bytes: what the decoder stack stores, each layer
        measured alone under its own policy and summed: L x one layer for a
        uniform policy; for every:k / first:n the layers under the policy
        plus those without remat; for nested:g (g > 1) the L/g group inputs
        (a full-remat layer's bytes each). `measure_config` only.
      peak: what holds the compiler's figure (`memory_kind`), where asked
        (`measure(..., peak=True)`): `remat_kit.measure.peak.breakdown`'s
        {"figure", "bytes", "step", "parts": {group: bytes}, "roles": {group:
        {tag: bytes}}, "logits_shape"}; else None.
      notes: caveats on these numbers.
      train_step_bytes: where the record is of the whole train step (a planner
        with `step="train"`, `remat_kit.decide.step_records`): its device memory
        at the peak, `StepMemory.total_bytes` as `fit` measures it; its memory
        figures and FLOPs above are then the train step's, and `memory_kind` is
        STEP. None for the value-and-grad step `measure` compiles.
      audit: what the compiler did to the policy, per tag, as compiled against as asked
        (`remat_kit.measure.audit.audit`: {"tags", "findings", "unchecked",
        "as_asked"}); None where not audited.
      parameter_bytes_per_device: bytes of the parameters one device takes, by
        the compiled program's own argument shardings (`compiled.input_shardings`);
        a caption's sharding claim is checked against it. None where unread.
      error: why the policy could not be measured ("TypeName: message"); the
        numbers are then None / empty.
    """

    policy: str
    names: tuple[str, ...]
    platform: str
    target: str = ""
    jax_version: str = ""
    compiler_version: str = ""
    residual_bytes_by_tag: dict[str, int] = dataclasses.field(default_factory=dict)
    residual_bytes_by_primitive: dict[str, int] = dataclasses.field(default_factory=dict)
    residual_bytes_by_argument: dict[str, int] = dataclasses.field(default_factory=dict)
    offloaded_bytes: int = 0
    temp_size_in_bytes: int | None = None
    peak_memory_in_bytes: int | None = None
    argument_size_in_bytes: int | None = None
    output_size_in_bytes: int | None = None
    alias_size_in_bytes: int | None = None
    host_temp_size_in_bytes: int | None = None
    host_argument_size_in_bytes: int | None = None
    host_output_size_in_bytes: int | None = None
    flops: float | None = None
    transcendentals: float | None = None
    kernel_flops: float | None = None
    compile_seconds: float | None = None
    predicted_seconds: float | None = None
    step_time: StepTime | None = None
    layer_residual_bytes: int | None = None
    layers_residual_bytes: int | None = None
    peak: dict | None = None
    notes: tuple[str, ...] = ()
    error: str | None = None
    train_step_bytes: int | None = None
    audit: dict | None = None
    parameter_bytes_per_device: int | None = None

    @property
    def activation_residual_bytes(self) -> int:
        """Residual bytes the forward pass stores: tagged plus untagged values."""
        return (sum(self.residual_bytes_by_tag.values())
                + sum(self.residual_bytes_by_primitive.values()))

    @property
    def memory_kind(self) -> str:
        """The figure this policy's memory is ranked and budgeted by: `memory_kind(platform)`
        of the record's target; TEMP where the compiler reported no peak or the
        record names no target."""
        if self.train_step_bytes is not None:
            return STEP
        kind = memory_kind(self.target.split(":", 1)[0]) if self.target else TEMP
        return kind if getattr(self, kind) is not None else TEMP

    @property
    def memory_bytes(self) -> int | None:
        """The memory this policy costs on its target, per device, in bytes: the
        `memory_kind` field's value (None if the policy did not compile)."""
        return getattr(self, self.memory_kind)

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field, plus activation_residual_bytes,
        memory_kind and memory_bytes."""
        d = dataclasses.asdict(self)
        d["names"] = list(self.names)
        d["notes"] = list(self.notes)
        d["activation_residual_bytes"] = self.activation_residual_bytes
        d["memory_kind"], d["memory_bytes"] = self.memory_kind, self.memory_bytes
        return d


TEMP, PEAK = "temp_size_in_bytes", "peak_memory_in_bytes"
STEP = "train_step_bytes"  # the whole train step's memory, as fit measures it
MEMORY_LABELS = {TEMP: "temp", PEAK: "peak", STEP: "train step"}  # table headers and axes


def memory_kind(platform: str) -> str:
    """Which compiled memory figure says what a policy costs on `platform`.

    The one definition that `compare` (sorting, x none, Pareto front, plot) and
    the planner (budgets, fractions, minimum, verification) use:

    * "cpu": TEMP, `temp_size_in_bytes`. The XLA CPU backend's
      `peak_memory_in_bytes` leaves temp buffers out (it is about arguments +
      outputs - aliased bytes, alike for every policy).
    * any other platform ("tpu", "gpu"): PEAK, `peak_memory_in_bytes`, the
      compiler's own peak. XLA:TPU's temp figure leaves out buffers its peak
      counts: tiny, batch 8, seq 128 on TPU v5e has temp 1.17 MiB for no
      remat and 1.30 MiB for full remat, peak 11.67 and 7.28 MiB, so temp
      would rank full remat above no remat. (A record whose compiler gave no
      peak falls back to TEMP, `Record.memory_kind`.)

    Args:
      platform: a target's platform, "cpu", "tpu" or "gpu" (`targets.Target.platform`).
    Returns:
      TEMP or PEAK, the name of the `Record` / `memory_fields` field.
    """
    return TEMP if platform == "cpu" else PEAK


def platform_label(platform: str | None = None) -> str:
    """The label of a platform's figures, e.g. "XLA CPU compile" for "cpu".

    platform: a JAX platform name; default JAX's default backend.
    """
    return targets.Target(platform or jax.default_backend()).label


__all__ = ["MEMORY_LABELS", "PEAK", "STEP", "TEMP", "Record", "StepTime", "memory_kind",
           "platform_label"]
