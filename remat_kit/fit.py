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
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_kit import targets
from remat_kit.errors import BudgetError, RematSpecError
from remat_kit.measure import _check_positive
from remat_kit.models import Transformer, TransformerConfig, make_loss_fn
from remat_kit.plan import parse_budget
from remat_kit.policy import Policy
from remat_kit.report import fmt_bytes
from remat_kit.spec import parse

VARY = ("seq", "batch")
DEFAULT_MULTIPLE = {"seq": 128, "batch": 1}
# Sizes beyond these are not searched: XLA takes shapes as 32-bit ints, and a
# policy that still fits there is reported as capped.
DEFAULT_MAX_SIZE = {"seq": 1 << 20, "batch": 1 << 16}


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
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _sized(cfg: TransformerConfig, seq: int) -> TransformerConfig:
    # GPT-2 learns one position embedding per position: a longer context
    # needs a longer table, as it would in the user's run.
    return cfg.replace(max_len=seq) if cfg.family == "gpt2" and seq > cfg.max_len else cfg


def _check_args(cfg, optimizer, **sizes) -> None:
    """TypeError / ValueError naming the argument, before anything compiles."""
    if not isinstance(cfg, TransformerConfig):
        raise TypeError(f"cfg must be a remat_kit.models.TransformerConfig (e.g. "
                        f"get_config('tiny')), got {type(cfg).__name__} {cfg!r}")
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {optimizer!r}")
    for name, value in sizes.items():
        _check_positive(name, value)


def _policy(spec) -> Policy:
    """parse(spec), refusing an auto:budget= spec (the planner budgets value-and-grad
    temp memory; fit measures the whole step)."""
    policy = parse(spec)
    if not isinstance(policy, Policy):
        raise RematSpecError(f"fit does not plan {policy} specs yet; run remat-kit plan, then "
                             "fit the policy it picks", token=str(policy))
    return policy


def default_optimizer() -> optax.GradientTransformation:
    """optax AdamW (Loshchilov & Hutter 2019): two float32-like moments per parameter."""
    return optax.adamw(1e-4)


def in_use_bytes(memory: dict, platform: str) -> tuple[int, str]:
    """Device memory a compiled step holds at its peak, and how it was found.

    Args:
      memory: `measure.memory_fields(compiled)`.
      platform: the compiler's platform ("cpu", "tpu", "gpu").
    Returns:
      (bytes, source): `peak_memory_in_bytes` where a non-CPU compiler
      reports it; else argument + temp + output - alias bytes (the XLA CPU
      peak figure leaves out temp buffers).
    """
    if platform != "cpu" and memory.get("peak_memory_in_bytes"):
        return memory["peak_memory_in_bytes"], "peak_memory_in_bytes"
    return (memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]
            + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"],
            "argument + temp + output - alias")


def step_memory(cfg: TransformerConfig, batch: int, seq: int, policy: "str | Policy", *,
                optimizer: optax.GradientTransformation | None = None,
                target: "str | targets.Target | None" = None) -> StepMemory:
    """Compiles one train step of a reference transformer and returns its memory.

    The step is `jax.value_and_grad` of the language-model loss on int32
    tokens [batch, seq], then `optimizer.update` and `optax.apply_updates`;
    it is jitted with the parameters and the optimizer state donated. For a
    GPT-2 config and seq > max_len, the position table is made seq long.

    Args:
      cfg: the model config (its dtype, param_dtype, dropout); its remat is
        replaced by `policy`.
      batch, seq: per-device batch size and sequence length, positive ints.
      policy: a spec string or `Policy`.
      optimizer: an optax transformation; default `default_optimizer()`.
      target: whose compiler (`remat_kit.targets`): "cpu", "tpu:v5e:1x1"
        (ahead of time), "gpu:h100", ...; default JAX's default backend. The
        step runs on one device of the target.
    Returns:
      A `StepMemory` (bytes, FLOPs, seconds).
    Raises:
      TypeError, ValueError: cfg, batch, seq or optimizer of the wrong type
        or not positive.
      RematSpecError: the policy does not parse, or is an auto:budget= spec.
      TargetError: a bad target, or libtpu missing.
      Any compiler error, e.g. an out-of-memory error from an accelerator's
      compiler (see `is_out_of_memory`).
    """
    _check_args(cfg, optimizer, batch=batch, seq=seq)
    cfg = _sized(cfg, seq).replace(remat=_policy(policy))
    optimizer = optimizer or default_optimizer()
    model = Transformer(cfg.replace(remat="none"))
    params = nn.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))["params"])
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    loss_fn = make_loss_fn(Transformer(cfg), deterministic=cfg.dropout_rate == 0)

    def step(params, opt_state, inputs, targets, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    target = targets.parse_target(target)
    c = targets.compile_for(step, params, opt_state, tokens, tokens, rng, target=target,
                            donate=(0, 1))
    mem = c.memory
    total, source = in_use_bytes(mem, target.platform)
    p_bytes, o_bytes = _tree_bytes(params), _tree_bytes(opt_state)
    return StepMemory(total, source, p_bytes, p_bytes, o_bytes,
                      max(0, total - 2 * p_bytes - o_bytes), mem.get("temp_size_in_bytes"),
                      mem.get("argument_size_in_bytes"), mem.get("output_size_in_bytes"),
                      mem.get("alias_size_in_bytes"), mem.get("peak_memory_in_bytes"),
                      c.flops, c.seconds)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a compile failed for lack of device memory (RESOURCE_EXHAUSTED)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


@dataclasses.dataclass(frozen=True)
class FitRow:
    """The largest size one policy allows within the budget.

    Attributes:
      policy: the spec as given.
      size: the largest fitting sequence length or batch size (a multiple
        of `multiple`); 0 if not even one multiple fits.
      memory: the step at `size` (`StepMemory`); None if size is 0 or on error.
      flops_per_token: step FLOPs / (batch * seq) at `size`.
      flop_overhead: step FLOPs / no remat's step FLOPs at the same size.
      none_fits: whether no remat fits the budget at `size`.
      none_flops: how no remat's FLOPs at `size` were found: "compiled", or
        "extrapolated" (its compile failed for memory; FLOPs are a
        polynomial in the size, degree 2 in seq and 1 in batch, fitted
        exactly through compiled smaller sizes).
      capped: `size` is the search's upper limit and still fits.
      compiles: train-step compiles this row needed (cached ones not counted).
      probes: (size, total bytes or None on an out-of-memory compile) for
        every size compiled for this policy, in search order.
      error: why the search stopped ("TypeName: message"), for a compile that
        failed for a reason other than memory; the other fields are then
        what was found before it.
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


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` found, with its context.

    Attributes:
      rows: one `FitRow` per policy, in the order given.
      vary: "seq" or "batch".
      fixed: the other size (the batch when varying seq, and vice versa).
      multiple: the search unit.
      budget_bytes: the per-device budget, bytes.
      floor_bytes: parameters plus optimizer state, bytes (per device).
      platform: whose compiler the figures come from, e.g. "XLA CPU compile".
      seconds: wall time of the whole search.
    """

    rows: tuple[FitRow, ...]
    vary: str
    fixed: int
    multiple: int
    budget_bytes: int
    floor_bytes: int
    platform: str
    seconds: float


class _Steps:
    """Compiled step figures by (policy, size), so no size is compiled twice."""

    def __init__(self, measure: Callable[[str, int], StepMemory]):
        self._measure, self._cache, self.total = measure, {}, 0

    def get(self, policy: str, size: int) -> StepMemory | None:
        """The step at `size`, or None if its compile ran out of memory."""
        key = (policy, size)
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
        return {s: m for (p, s), m in self._cache.items() if p == policy and m is not None}


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
    already probed (None if not probed or out of memory), for prediction.
    `start`: the first unit probed, e.g. another policy's answer.
    """
    start = min(max(start, 1), max_units)
    if fits(start):
        lo, hi = start, None  # fits(lo); not fits(hi)
        if lo == max_units:
            return lo, True
    elif start == 1 or not fits(1):
        return 0, False
    else:
        lo, hi = 1, start
    stalls = 0
    while hi is None or hi - lo > 1:
        points = {k: b for k in range(1, (hi or lo) + 1) if (b := bytes_at(k)) is not None}
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


def fit(cfg: TransformerConfig, budget: "int | str", *, vary: str = "seq",
        policies: Sequence["str | Policy"] = ("none", "full", "minimal", "selective", "dots"),
        batch: int | None = None, seq: int | None = None, multiple: int | None = None,
        max_size: int | None = None, optimizer: optax.GradientTransformation | None = None,
        target: "str | targets.Target | None" = None,
        progress: Callable[[int, int, FitRow], None] | None = None) -> FitResult:
    """For each policy, the largest sequence length or batch whose train step fits `budget`.

    Args:
      cfg: the model config (dtype, dropout, family, sizes).
      budget: device memory per device: bytes as an int, or a size string
        ("16GiB", "512MiB", "8e9"; `remat_kit.plan.parse_budget`, but not a
        fraction: there is no fixed no-remat figure to take it of).
      vary: "seq" (find the longest sequence at a fixed batch) or "batch"
        (the largest batch at a fixed sequence length).
      policies: spec strings or `Policy`s; "none" is compiled as well when
        absent, for the FLOP overhead.
      batch: the fixed batch when vary="seq" (default 1).
      seq: the fixed sequence length when vary="batch" (default
        min(cfg.max_len, 1024)).
      multiple: the search unit, a positive int (default 128 for seq, 1 for
        batch); every size searched is a multiple of it.
      max_size: the largest size searched (default 2**20 tokens for seq,
        2**16 for batch); a policy that fits there is `capped`.
      optimizer, target: see `step_memory`; the budget is per device of
        the target.
      progress: called as progress(i, n, row) after the i-th of n policies.
    Returns:
      A `FitResult`; its rows follow `policies`' order.
    Raises:
      TypeError: cfg not a TransformerConfig, optimizer not an optax
        transformation.
      ValueError: vary not in VARY; batch, seq, multiple or max_size not a
        positive int; a layer schedule that does not fit the model.
      BudgetError: a budget that is not a size in bytes, or one below the
        parameters plus the optimizer state (the floor, stated in bytes), so
        no size can fit.
      TargetError: a bad target, or libtpu missing.
      RematSpecError: a policy does not parse (before anything compiles).
    """
    if vary not in VARY:
        raise ValueError(f"vary must be one of {list(VARY)}, got {vary!r}")
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    multiple = DEFAULT_MULTIPLE[vary] if multiple is None else multiple
    batch = 1 if batch is None else batch
    seq = (min(cfg.max_len, 1024) if isinstance(cfg, TransformerConfig) else 1) if seq is None \
        else seq
    max_size = DEFAULT_MAX_SIZE[vary] if max_size is None else max_size
    _check_args(cfg, optimizer, batch=batch, seq=seq, multiple=multiple, max_size=max_size)
    if max_size < multiple:
        raise ValueError(f"max_size {max_size} is below multiple {multiple}")
    budget_bytes = parse_budget(budget).bytes
    if budget_bytes is None:
        raise BudgetError(f"fit needs a budget in bytes, such as 16GiB; {budget!r} is a "
                          "fraction of no-remat memory, which changes with the size searched",
                          budget=budget)
    target = targets.parse_target(target)
    specs = [p if isinstance(p, str) else str(p) for p in policies]
    for p in specs:
        _policy(p).schedule.check(cfg.num_layers)  # bad specs fail before anything compiles
    optimizer = optimizer or default_optimizer()

    model = Transformer(cfg.replace(remat="none"))
    params = nn.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"])
    floor = _tree_bytes(params) + _tree_bytes(jax.eval_shape(optimizer.init, params))
    if budget_bytes < floor:
        raise BudgetError(
            f"budget {fmt_bytes(budget_bytes)} ({budget_bytes} bytes) is below the parameters "
            f"plus optimizer state alone, {fmt_bytes(floor)} ({floor} bytes): no "
            f"{vary} fits", budget=budget, minimum_bytes=floor)

    def sizes(size: int) -> tuple[int, int]:
        return (batch, size) if vary == "seq" else (size, seq)

    steps = _Steps(lambda p, size: step_memory(cfg, *sizes(size), p, optimizer=optimizer,
                                               target=target))
    start = time.perf_counter()
    rows = []
    for i, spec in enumerate(specs):
        # Policies land near each other: start at the largest size found so far.
        start_units = max((r.size for r in rows), default=0) // multiple
        row = _fit_one(spec, steps, budget_bytes, multiple, max_size // multiple, vary,
                       sizes, start_units)
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(specs), row)
    return FitResult(tuple(rows), vary, batch if vary == "seq" else seq, multiple, budget_bytes,
                     floor, target.label, time.perf_counter() - start)


def _fit_one(spec: str, steps: _Steps, budget: int, multiple: int, max_units: int, vary: str,
             sizes: Callable[[int], tuple[int, int]], start: int) -> FitRow:
    before = steps.total
    probes = []

    def at(k: int) -> StepMemory | None:
        m = steps.get(spec, k * multiple)
        probes.append((k * multiple, None if m is None else m.total_bytes))
        return m

    def fits(k: int) -> bool:
        m = at(k)
        return m is not None and m.total_bytes <= budget

    def bytes_at(k: int) -> int | None:
        m = steps.known(spec).get(k * multiple)
        return None if m is None else m.total_bytes

    try:
        units, capped = _search(fits, bytes_at, budget, max_units, start)
    except Exception as e:  # noqa: BLE001 - reported in the row, not as "does not fit"
        return FitRow(spec, 0, compiles=steps.total - before, probes=tuple(probes),
                      error=f"{type(e).__name__}: {e}")
    size = units * multiple
    if size == 0:
        return FitRow(spec, 0, compiles=steps.total - before, probes=tuple(probes))
    memory = steps.get(spec, size)
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
    compiles = steps.total - before
    return FitRow(
        spec, size, memory,
        flops_per_token=None if memory.flops is None else memory.flops / (b * s),
        flop_overhead=(None if memory.flops is None or not none_flops
                       else memory.flops / none_flops),
        none_fits=None if none is None else none.total_bytes <= budget, none_flops=how,
        capped=capped, compiles=compiles, probes=tuple(probes), error=error)
