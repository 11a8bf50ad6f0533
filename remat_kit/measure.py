"""What each remat policy costs, measured compile-only: residuals by tag, memory, FLOPs, time.

For every policy, the loss's forward and backward pass is traced once with
`jax.make_jaxpr(jax.vjp(...))`. That one trace gives both

* the *residuals*, the values the forward pass saves for the backward pass,
  each attributed to the `checkpoint_name` tag, untagged primitive or
  function argument that produced it (see `residuals`), and
* the program that is lowered and compiled, `jax.jit(...).lower(...).compile()`
  on `jax.ShapeDtypeStruct`s, with the outputs of `jax.value_and_grad(loss)`
  with respect to the first argument. No arrays are allocated.

The compiled executable gives XLA's memory figures (`memory_fields`) and
FLOPs (`cost_analysis()`, corrected for loop trip counts, see
`loop_scaled_costs`). These numbers come from the compiler of the *target*
(`remat_kit.targets`): JAX's default backend, or e.g. a TPU v5e slice
compiled ahead of time with libtpu on a machine without a TPU. Records say
which ("XLA CPU compile", "XLA TPU compile (v5e:2x2, AOT)"): accelerator
compilers fuse differently, so CPU temp bytes are not a GPU/TPU figure. On the XLA CPU backend
`peak_memory_in_bytes` does not include temp buffers: it is about
arguments + outputs - aliased bytes, the same for every policy however much
their temp differs. Policies are compared on CPU by `temp_size_in_bytes`, on
accelerator targets by the compiler's `peak_memory_in_bytes`: `memory_kind`
and `Record.memory_bytes`.

Policies apply through a *loss factory*: `measure(loss_for_policy, ...)`
calls `loss_for_policy(policy)` to get the loss under that policy, so the
model decides where the policy applies (per layer, with the layer inputs
kept). A plain loss function is accepted too and is wrapped whole in one
remat region per policy (`checkpointed`). `measure_config` is the factory
for the reference transformers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
from jax.extend.core.primitives import (copy_p, device_put_p, reduce_precision_p,
                                        reshape_p, scan_p, squeeze_p, transpose_p)

from remat_kit import mesh as rk_mesh
from remat_kit import targets
from remat_kit._jax_private import hlo_text_cost_analysis
from remat_kit.models import DecoderLayer, Transformer, TransformerConfig, make_loss_fn
from remat_kit.models.transformer import remat_layer
from remat_kit.names import TAGS
from remat_kit.policy import Policy
from remat_kit.schedule import layer_policies
from remat_kit.spec import AutoSpec, parse
from remat_kit.validate import emitted_tags, tag_of

LossFactory = Callable[[Policy], Callable]

# ---------------------------------------------------------------------------
# Residuals: what the forward pass saves, and who produced it
# ---------------------------------------------------------------------------

# Copies and layout changes (the same bytes in another shape or memory): the
# value they take is the residual's real source, e.g. a reshaped query_proj.
_COPIES = (reduce_precision_p, device_put_p, copy_p, reshape_p, squeeze_p, transpose_p)


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the forward pass saves for the backward pass.

    Attributes:
      kind: "tag" (a `checkpoint_name` value), "primitive" (an untagged
        value, named by the primitive that computed it, e.g. "dot_general",
        "mul"; "scan input" for a loop-body input stacked per trip) or
        "argument" (an input of the function, kept by reference).
      name: the tag, primitive, or argument path (e.g. "params['embed']['embedding']").
      shape: the residual's shape; for a value saved inside a scanned layer
        stack, the stacked shape [layers, ...].
      dtype: its dtype name.
      nbytes: bytes, prod(shape) * itemsize.
      memory: "device", or "host" for an offloaded residual.
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    memory: str


def _body(eqn):
    """The jaxpr of a call-like equation (jit, remat, custom_jvp/vjp, scan) whose
    inputs and outputs match the equation's one to one, else None."""
    for key in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(key)
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        if (hasattr(body, "eqns") and len(body.invars) == len(eqn.invars)
                and len(body.outvars) == len(eqn.outvars)):
            return body
    return None


class _Sources:
    """Attributes the values of a jaxpr (and its sub-jaxprs) to tags and primitives."""

    def __init__(self):
        self._producers: dict[int, dict] = {}
        self._taggers: dict[int, dict] = {}

    def _index(self, jaxpr):
        key = id(jaxpr)
        if key not in self._producers:
            self._producers[key] = {v: e for e in jaxpr.eqns for v in e.outvars}
            self._taggers[key] = {v: t for e in jaxpr.eqns if (t := tag_of(e))
                                  for v in e.invars if not isinstance(v, Literal)}
        return self._producers[key], self._taggers[key]

    def source(self, var, jaxpr) -> tuple[str, str] | int:
        """(kind, name) of `var`, or the index of the `jaxpr` input it is."""
        while True:
            if isinstance(var, Literal):
                return ("primitive", "literal")
            producers, taggers = self._index(jaxpr)
            eqn = producers.get(var)
            if eqn is None:
                # An input of this jaxpr. A layer names its input itself
                # (decoder_layer_input), so the tag applied to it is its name.
                if var in taggers:
                    return ("tag", taggers[var])
                if var in jaxpr.invars:
                    return jaxpr.invars.index(var)
                return ("primitive", "constant")
            if tag := tag_of(eqn):
                return ("tag", tag)
            i = eqn.outvars.index(var)
            if eqn.primitive in _COPIES:
                var = eqn.invars[i]
                continue
            body = _body(eqn)
            if body is None:
                return ("primitive", eqn.primitive.name)
            found = self.source(body.outvars[i], body)
            if not isinstance(found, int):
                return found
            if eqn.primitive is scan_p:
                return ("primitive", "scan input")  # a loop-body input, stacked per trip
            var = eqn.invars[found]


def _aval_bytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def _memory(aval) -> str:
    return "host" if "host" in str(getattr(aval, "memory_space", "")).lower() else "device"


def _arg_names(f, n: int) -> list[str]:
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    if len(params) >= n and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                for p in params[:n]):
        return [p.name for p in params[:n]]
    return [f"arg{i}" for i in range(n)]


def _leaf_names(f, args) -> list[str]:
    """'params['embed']['embedding']' for each flattened leaf of `args`."""
    out = []
    for name, arg in zip(_arg_names(f, len(args)), args):
        out += [name + jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]
    return out


@dataclasses.dataclass(frozen=True)
class _Staged:
    program: ClosedJaxpr  # value_and_grad w.r.t. args[0], flat inputs and outputs
    residuals: tuple[Residual, ...]
    leaves: list
    residual_vars: tuple = ()  # program vars (or literals) saved for backward, as `residuals`


def _stage(f, args) -> _Staged:
    """Traces f's forward and backward pass once: the program and its residuals."""
    leaves, tree = jax.tree.flatten(args)
    n_grads = len(jax.tree.leaves(args[0]))

    def flat(*xs):
        return f(*jax.tree.unflatten(tree, xs))

    def value_grad_residuals(*xs):
        out, vjp_fn = jax.vjp(flat, *xs)
        if jnp.shape(out) != ():
            raise TypeError(f"the loss must return a scalar, got shape {jnp.shape(out)}")
        grads = vjp_fn(jnp.ones_like(out))
        return (out, grads[:n_grads]), jax.tree.leaves(vjp_fn)

    closed, (_, res_shapes) = jax.make_jaxpr(value_grad_residuals, return_shape=True)(*leaves)
    jaxpr, n_res = closed.jaxpr, len(res_shapes)
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res:]
    program = ClosedJaxpr(jaxpr.replace(outvars=jaxpr.outvars[:len(jaxpr.outvars) - n_res]),
                          closed.consts)
    names, sources, seen, found, kept = _leaf_names(f, args), _Sources(), set(), [], []
    for var in res_vars:
        if not isinstance(var, Literal):
            if var in seen:  # one buffer saved twice is stored once
                continue
            seen.add(var)
        src = sources.source(var, jaxpr)
        kind, name = ("argument", names[src]) if isinstance(src, int) else src
        found.append(Residual(kind, name, tuple(var.aval.shape), str(var.aval.dtype),
                              _aval_bytes(var.aval), _memory(var.aval)))
        kept.append(var)
    return _Staged(program, tuple(found), leaves, tuple(kept))


def residuals(f: Callable, *args) -> list[Residual]:
    """The values `f(*args)` saves for its backward pass, each with its source.

    Unlike `jax.ad_checkpoint.print_saved_residuals`, values saved inside a
    `scan` (e.g. `nn.scan` over layers) are named by the tag or primitive that
    produced them in the loop body, with their stacked [layers, ...] shape;
    offloaded values (`device_put` to host) and reshaped or transposed values
    by the value they copy; and values computed in a `jit`-wrapped function by
    the primitive inside it.

    Args:
      f: a function of arrays returning a scalar (a loss).
      args: arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
    Returns:
      One `Residual` per saved buffer, in forward order.
    Raises:
      TypeError: `f` does not return a scalar.
    """
    return list(_stage(f, args).residuals)


# ---------------------------------------------------------------------------
# FLOPs: count loop bodies once per trip
# ---------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+) \(", re.M)
_WHILE = re.compile(r"= [^\n]*? while\([^\n]*?body=%([^\s,]+)[^\n]*")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COST_KEYS = ("flops", "transcendentals")


def _hlo_computations(text: str) -> tuple[str, dict[str, str], str]:
    """(preamble, {name: computation text without 'ENTRY '}, entry name) of HLO text."""
    starts = list(_COMPUTATION.finditer(text))
    comps, entry = {}, None
    for m, nxt in zip(starts, starts[1:] + [None]):
        body = text[m.start():nxt.start() if nxt else len(text)]
        if m.group(1):
            entry, body = m.group(2), body[len("ENTRY "):]
        comps[m.group(2)] = body
    # Keep the file/stack-frame tables metadata refers to; drop the module header line.
    preamble = text[text.index("\n") + 1:starts[0].start()] if starts else ""
    return preamble, comps, entry


def loop_scaled_costs(compiled) -> tuple[dict[str, float], tuple[str, ...]]:
    """FLOPs and transcendentals of a compiled program, while loops counted per trip.

    XLA's `cost_analysis()` counts a while loop's body once, so a model whose
    layers run under `scan` reports about one layer's FLOPs. This reads the
    optimized HLO (`compiled.as_text()`), finds each while loop with a
    `known_trip_count` in its backend_config, runs XLA's HloCostAnalysis on
    the loop body alone (`_jax_private.hlo_text_cost_analysis`) and adds
    (trip count - 1) x the body's cost; nested loops are scaled the same way,
    inside every trip of the loop around them.

    Returns:
      ({"flops": FLOPs, "transcendentals": count}, notes). An empty dict if
      the backend gives no cost analysis. notes say which loops could not be
      scaled (no known trip count), which leaves their bodies counted once.
    """
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    if not costs:
        return {}, ("the backend gives no cost analysis",)
    total = {k: float(costs.get(k, 0.0)) for k in _COST_KEYS}
    text = compiled.as_text()
    if not _WHILE.search(text):
        return total, ()
    preamble, comps, entry = _hlo_computations(text)
    client = jax.devices()[0].client
    notes: list[str] = []

    def body_cost(name: str) -> dict[str, float]:
        """XLA's cost of computation `name`, nested loop bodies counted once."""
        module = "\n".join(("ENTRY " if n == name else "") + c
                           for n, c in comps.items() if n != entry)
        cost = hlo_text_cost_analysis(f"HloModule {name}\n{preamble}\n{module}", client)
        return {k: float(cost.get(k, 0.0)) for k in _COST_KEYS}

    def extra(name: str) -> dict[str, float]:
        """What counting every loop inside computation `name` per trip adds to
        XLA's count of `name`, which has each loop body once."""
        add = dict.fromkeys(_COST_KEYS, 0.0)
        for m in _WHILE.finditer(comps[name]):
            trips = _TRIP_COUNT.search(m.group(0))
            if not trips:
                notes.append(f"while loop with body {m.group(1)} has no known trip count; "
                             "its body is counted once")
            n = int(trips.group(1)) if trips else 1
            nested = extra(m.group(1))  # every trip runs the nested loops in full
            body = body_cost(m.group(1)) if n > 1 else dict.fromkeys(_COST_KEYS, 0.0)
            for k in _COST_KEYS:
                add[k] += (n - 1) * (body[k] + nested[k]) + nested[k]
        return add

    for k, v in extra(entry).items():
        total[k] += v
    return total, tuple(notes)


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepTime:
    """Wall-clock seconds of one training step (forward + backward, no optimizer).

    Attributes:
      median_s, min_s, max_s, q1_s, q3_s: over `steps` timed steps, after one
        warm-up step; seconds.
      steps: number of timed steps.
      ratio_to_none: median / median of the `none` policy timed in the same
        run, or None if `none` was not timed.
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
      flops, transcendentals: from `compiled.cost_analysis()`, loops counted
        per trip (`loop_scaled_costs`); None where the backend gives none.
      compile_seconds: tracing, lowering and compiling, seconds.
      step_time: timed mode only (`StepTime`), else None.
      layer_residual_bytes: residual bytes of one decoder layer measured
        alone (`layer_residuals`), excluding parameters; `measure_config`
        only, and None for a layer schedule (its layers differ).
      layers_residual_bytes: what the decoder stack stores, each layer
        measured alone under its own policy and summed: L x one layer for a
        uniform policy; for every:k / first:n the layers under the policy
        plus those without remat; for nested:g (g > 1) the L/g group inputs
        (a full-remat layer's bytes each). `measure_config` only.
      notes: caveats on these numbers.
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
    flops: float | None = None
    transcendentals: float | None = None
    compile_seconds: float | None = None
    step_time: StepTime | None = None
    layer_residual_bytes: int | None = None
    layers_residual_bytes: int | None = None
    notes: tuple[str, ...] = ()
    error: str | None = None

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
MEMORY_LABELS = {TEMP: "temp", PEAK: "peak"}  # short names for table headers and axes


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


def _split(found: Sequence[Residual]) -> dict:
    by = {"tag": {}, "primitive": {}, "argument": {}}
    for r in found:
        # Arguments are grouped by top-level name: "params['embed']" -> "params".
        key = re.match(r"[^\[.]+", r.name).group(0) if r.kind == "argument" else r.name
        by[r.kind][key] = by[r.kind].get(key, 0) + r.nbytes
    return {"residual_bytes_by_tag": by["tag"], "residual_bytes_by_primitive": by["primitive"],
            "residual_bytes_by_argument": by["argument"],
            "offloaded_bytes": sum(r.nbytes for r in found if r.memory == "host")}


def memory_fields(compiled) -> dict[str, int | None]:
    """XLA's memory figures of a compiled executable (`compiled.memory_analysis()`).

    Returns:
      {"temp_size_in_bytes", "peak_memory_in_bytes", "argument_size_in_bytes",
      "output_size_in_bytes", "alias_size_in_bytes"}: bytes per device, None
      for a figure the backend does not report; an empty dict if the backend
      gives no memory analysis. On the XLA CPU backend peak_memory_in_bytes
      leaves out temp buffers (it is about arguments + outputs - aliased
      bytes, alike for every policy): compare policies by temp_size_in_bytes
      there.
    """
    stats = compiled.memory_analysis()
    keys = ("temp_size_in_bytes", "peak_memory_in_bytes", "argument_size_in_bytes",
            "output_size_in_bytes", "alias_size_in_bytes")
    return {k: getattr(stats, k, None) for k in keys} if stats is not None else {}


def _local(leaf):
    """A leaf at its per-device shape (the shard shape of its sharding)."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return jax.ShapeDtypeStruct(shape, leaf.dtype)


def _is_sharded(leaf) -> bool:
    sharding = getattr(leaf, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1


def _random_like(structs, key):
    """Arrays shaped like `structs`: normal floats, zero ints/bools, fresh PRNG keys."""
    leaves, tree = jax.tree.flatten(structs)
    out = []
    for leaf, k in zip(leaves, jax.random.split(key, max(len(leaves), 1))):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            x = jax.random.split(k, math.prod(leaf.shape)).reshape(leaf.shape)
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            x = jax.random.normal(k, leaf.shape, leaf.dtype)
        else:
            x = jnp.zeros(leaf.shape, leaf.dtype)
        out.append(x)
    return jax.tree.unflatten(tree, out)


def _time(compiled, leaves, steps: int) -> StepTime:
    jax.block_until_ready(compiled(*leaves))  # warm-up: first-run allocation and caches
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*leaves))
        times.append(time.perf_counter() - start)
    q1, _, q3 = (statistics.quantiles(times, n=4, method="inclusive") if steps > 1
                 else (times[0],) * 3)
    return StepTime(statistics.median(times), min(times), max(times), q1, q3, steps)


def _group(policies: Sequence[Policy], names: Sequence[str],
           emitted: Sequence[str]) -> list[tuple[Policy, list[str]]]:
    """Policies that decide every emitted tag alike (and share base, memory
    kinds and layer schedule) compile to the same program; measure each such
    group once."""
    if len(names) != len(policies):
        raise ValueError(f"{len(names)} names for {len(policies)} policies")
    groups: dict[tuple, tuple[Policy, list[str]]] = {}
    for p, name in zip(policies, names):
        kinds = (p.offload_src, p.offload_dst) if p.offload else None
        key = (p.remat, p.base, kinds, p.schedule, tuple(p.decide(t) for t in emitted))
        groups.setdefault(key, (p, []))[1].append(name)
    return list(groups.values())


def _as_factory(fn: Callable) -> LossFactory:
    """`fn` if it maps a Policy to a loss, else `checkpointed(fn)` (fn is a plain loss)."""
    try:
        made = fn(parse("none"))
    except Exception:  # noqa: BLE001 - a plain loss fails on a Policy argument
        made = None
    return fn if callable(made) else checkpointed(fn)


def measure(loss_for_policy: LossFactory, *args, policies: Sequence, names=None,
            time_steps: int = 0, sample_args: Callable | None = None,
            progress: Callable[[int, int, Record], None] | None = None,
            per_device: tuple[LossFactory, tuple] | None = None,
            target: "str | targets.Target | None" = None) -> list[Record]:
    """Measures a loss under each policy, compile-only (optionally also timed).

    Args:
      loss_for_policy: a factory, policy -> loss(*args) returning a scalar
        (the model decides where the policy applies, e.g. per layer); or a
        plain loss(*args), which is then wrapped whole in one remat region per
        policy (`checkpointed`). It is a factory when calling it with a
        Policy returns a callable. The loss is differentiated with respect to
        `args[0]` (the parameters).
      args: arrays or `jax.ShapeDtypeStruct`s (with `sharding=` to measure a
        sharded program; figures are then per device, and residuals are
        traced at the per-device shard shapes).
      policies: spec strings or `Policy`s; "auto:budget=..." is planned
        first (`remat_kit.plan.resolve`). Policies that decide every tag
        the loss emits alike, or that lower to the same program (their
        decisions differ only on values the backward pass never reads), are
        measured once, as one record listing all their names.
      names: what to call each policy in the report; default its spec string.
      time_steps: if > 0, also run one warm-up step and `time_steps` timed
        steps of value-and-grad per policy on `sample_args` data.
      sample_args: key -> concrete args for timed mode; default random data
        shaped like `args` (normal floats, zero ints).
      progress: called as progress(i, n, record) after the i-th of the n
        distinct programs is compiled and measured (policies that lower to
        one program count once; one that fails to lower counts as one).
      per_device: (factory, args) of the program one device runs, whose
        residuals are reported instead of tracing `args` at their shard
        shapes; needed where a shard is not a valid input (parameters split
        over fsdp or tensor). `measure_config` passes it for its meshes.
      target: whose compiler to measure with (`remat_kit.targets`): e.g.
        "cpu", "tpu:v5e:1x1" (ahead of time, no TPU needed); default JAX's
        default backend. Sharded `args` must be sharded over the target's
        devices (`targets.make_mesh`); unsharded ones go to its first device.
    Returns:
      One `Record` per distinct policy, in first-seen order. A policy that
      fails to trace, compile or run gives a record with `error` set (for
      an AOT target, the compiler's message); the other records still come
      out.
    Raises:
      RematSpecError: a policy spec does not parse.
      BudgetError: an auto budget below full remat's memory.
      TargetError: a bad target, libtpu missing, args sharded over other
        devices, or `time_steps` > 0 for a target compiled ahead of time.
      ValueError: `names` and `policies` differ in length.
    """
    parsed = [parse(p) for p in policies]  # bad specs fail before any tracing
    target = targets.parse_target(target)
    if time_steps > 0 and target.aot:
        raise targets.TargetError(f"cannot time steps on target {target}: it is compiled "
                                  "ahead of time, for devices this machine does not have")
    args = targets.place(args, target)
    loss_for_policy = _as_factory(loss_for_policy)
    if any(isinstance(p, AutoSpec) for p in parsed):
        from remat_kit.plan import resolve  # the planner measures through this module
        parsed = resolve(parsed, loss_for_policy, *args, target=target, per_device=per_device)
    emitted = tuple(emitted_tags(loss_for_policy(parse("none")), *args))
    leaves = jax.tree.leaves(args)
    local_args = (jax.tree.map(_local, args) if any(_is_sharded(x) for x in leaves) else None)
    data = None
    if time_steps > 0:
        data = (sample_args or (lambda k: _random_like(args, k)))(jax.random.key(0))
        data = [jax.device_put(x, s.sharding) if getattr(s, "sharding", None) else x
                for x, s in zip(jax.tree.leaves(data), leaves)]
    label, found_versions = target.label, targets.versions(target)
    records = []
    groups = _group(parsed, names if names is not None else [str(p) for p in policies], emitted)
    programs = _lower_programs(groups, loss_for_policy, args, target)
    compile_at = _compiler([p[4] for p in programs], targets.compile_options(target, not time_steps),
                           workers=1 if time_steps else COMPILE_WORKERS)
    for i, (policy, group_names, loss, staged, lowered, seconds) in enumerate(programs):
        record = Record(str(policy), tuple(group_names), label, str(target),
                        found_versions["jax"], found_versions["compiler"])
        try:
            if isinstance(lowered, Exception):
                raise lowered
            compiled, compile_seconds = compile_at(i)
            seconds += compile_seconds
            local = (_stage(per_device[0](policy), per_device[1]) if per_device is not None
                     else _stage(loss, local_args) if local_args is not None else staged)
            costs, notes = targets.costs(compiled, target, jaxpr_as_fun(local.program),
                                         local.leaves)
            split = _split(local.residuals)
            if split["offloaded_bytes"] and target.platform == "cpu":
                notes += ("on CPU, host memory is device memory: temp_size_in_bytes "
                          "includes the offloaded residuals",)
            record = dataclasses.replace(
                record, **split, **memory_fields(compiled), flops=costs.get("flops"),
                transcendentals=costs.get("transcendentals"), compile_seconds=seconds,
                notes=notes)
            if data is not None:
                record = dataclasses.replace(record, step_time=_time(compiled, data, time_steps))
        except Exception as e:  # noqa: BLE001 - one failing policy must not hide the others
            detail = str(e) or "no message; JAX_TRACEBACK_FILTERING=off shows where"
            record = dataclasses.replace(record, error=f"{type(e).__name__}: {detail}")
        records.append(record)
        if progress is not None:
            progress(i + 1, len(programs), record)
    return _with_time_ratios(records)


# Distinct programs compile concurrently: XLA releases the GIL while it compiles.
COMPILE_WORKERS = min(4, os.cpu_count() or 1)


def _compiler(lowered: Sequence, options: dict | None, workers: int) -> Callable[[int], tuple]:
    """i -> (compiled, seconds) of lowered[i] (an exception raises it). With
    workers > 1 every program starts compiling now, that many at a time; with
    1, each compiles when asked for, so a timed step never runs beside a compile.
    A program's seconds are its own compile's wall time."""
    def compile_one(i):
        start = time.perf_counter()
        compiled = lowered[i].compile(options)
        return compiled, time.perf_counter() - start

    if workers <= 1 or len(lowered) <= 1:
        return compile_one
    pool = ThreadPoolExecutor(workers)
    futures = [None if isinstance(x, Exception) else pool.submit(compile_one, i)
               for i, x in enumerate(lowered)]
    pool.shutdown(wait=False)  # its threads finish the queued compiles, then exit
    return lambda i: futures[i].result()


def _lower_programs(groups, loss_for_policy: LossFactory, args, target) -> list[tuple]:
    """(policy, names, loss, staged, lowered, seconds) per distinct program, in
    first-seen order; `lowered` is the exception where tracing or lowering
    failed. Groups whose decisions differ only on values the backward pass
    never reads lower to the same program: they become one entry with all
    their names, so `measure` compiles, and counts, each program once."""
    out, seen = [], {}  # lowered program text -> its index in out
    for policy, group_names in groups:
        start = time.perf_counter()
        try:
            loss = loss_for_policy(policy)
            staged = _stage(loss, args)
            lowered = targets.lower(jaxpr_as_fun(staged.program), staged.leaves, target)
        except Exception as e:  # noqa: BLE001 - reported in the policy's record
            out.append((policy, list(group_names), None, None, e, 0.0))
            continue
        same = seen.setdefault(lowered.as_text(), len(out))
        if same != len(out):
            out[same][1].extend(group_names)
            continue
        out.append((policy, list(group_names), loss, staged, lowered,
                    time.perf_counter() - start))
    return out


def _with_time_ratios(records: list[Record]) -> list[Record]:
    base = next((r.step_time for r in records if r.policy == "none" and r.step_time), None)
    if base is None:
        return records
    return [dataclasses.replace(r, step_time=dataclasses.replace(
        r.step_time, ratio_to_none=r.step_time.median_s / base.median_s))
        if r.step_time else r for r in records]


def checkpointed(loss_fn: Callable) -> LossFactory:
    """A loss factory for `measure` that wraps all of `loss_fn` in one remat region.

    policy -> `jax.checkpoint(loss_fn, policy=policy.to_jax())`, or `loss_fn`
    itself for the `none` policy. The region's inputs (all of `loss_fn`'s
    arguments) are always kept.
    """
    def factory(policy: Policy):
        if not policy.remat:
            return loss_fn
        return jax.checkpoint(loss_fn, policy=policy.to_jax())
    return factory


# ---------------------------------------------------------------------------
# The reference transformers
# ---------------------------------------------------------------------------

def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def config_program(cfg: TransformerConfig, batch: int, seq: int, *, dtype: str | None = None,
                   mesh: jax.sharding.Mesh | None = None):
    """The language-model loss of a reference transformer, as `measure` takes it.

    Returns:
      (loss_for_policy, args, sample_args): a factory policy ->
      loss(params, inputs, targets, dropout_rng) building
      `Transformer(cfg.replace(remat=policy))` (traced under the mesh's
      logical constraints, `remat_kit.mesh.use`); the args as
      `jax.ShapeDtypeStruct`s (parameters from `jax.eval_shape`, sharded by
      their logical axes on the mesh; int32 tokens [batch, seq] split over
      the mesh's batch axes; a PRNG key); and key -> concrete args of those
      shapes, for timed runs.
    Raises:
      ValueError: as `measure_config`.
      MeshError: the mesh does not split the batch or the heads.
    """
    _check_positive("batch", batch)
    _check_positive("seq", seq)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    if cfg.family == "gpt2" and seq > cfg.max_len:
        raise ValueError(f"seq {seq} exceeds the model's max_len {cfg.max_len} "
                         "(GPT-2 learns one position embedding per position)")
    rk_mesh.check_fits(mesh, cfg, batch)
    deterministic = cfg.dropout_rate == 0
    model = Transformer(cfg.replace(remat="none"))
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((1, seq), jnp.int32)))["params"]
    params = nn.unbox(boxed)
    shardings = (rk_mesh.shardings(boxed, mesh) if mesh is not None
                 else jax.tree.map(lambda _: None, params))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          params, shardings)
    on_mesh = mesh is not None
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                                  sharding=rk_mesh.batch_sharding(mesh) if on_mesh else None)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=rk_mesh.replicated(mesh) if on_mesh else None)

    def loss_for_policy(policy):
        loss = make_loss_fn(Transformer(cfg.replace(remat=policy)), deterministic)
        if mesh is None:
            return loss

        def sharded_loss(*args):  # the models' logical constraints apply while tracing
            with rk_mesh.use(mesh):
                return loss(*args)
        return sharded_loss

    def sample_args(k):
        k_init, k_in, k_out, k_drop = jax.random.split(k, 4)
        init_tokens = jnp.zeros((1, seq), jnp.int32)
        draw = lambda kk: jax.random.randint(kk, (batch, seq), 0, cfg.vocab_size, jnp.int32)
        params = Transformer(cfg).init(k_init, init_tokens)["params"]
        return nn.unbox(params), draw(k_in), draw(k_out), k_drop

    return loss_for_policy, (params, tokens, tokens, key), sample_args


def per_device_program(cfg: TransformerConfig, batch: int, seq: int,
                       mesh: jax.sharding.Mesh | None, *, dtype: str | None = None):
    """The program one device of `mesh` runs, as `measure`'s `per_device` takes it.

    The model with its heads and MLP split by the mesh's tensor axis
    (`remat_kit.mesh.per_device_config`) on batch / (data-parallel devices)
    sequences of `seq` tokens, unsharded: a shard of a split parameter is not
    a valid input of the global model.

    Returns:
      (loss_for_policy, args) of `config_program`, or None without a mesh.
    """
    if mesh is None:
        return None
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    local_cfg = rk_mesh.per_device_config(cfg, mesh)
    return config_program(local_cfg, batch // rk_mesh.axis_size(mesh, "batch"), seq)[:2]


def measure_config(cfg: TransformerConfig, batch: int, seq: int, policies: Sequence | None = None,
                   *, names=None, dtype: str | None = None, time_steps: int = 0,
                   mesh: jax.sharding.Mesh | None = None, per_layer: bool = True,
                   progress: Callable[[int, int, Record], None] | None = None,
                   target: "str | targets.Target | None" = None) -> list[Record]:
    """Measures a reference transformer (`remat_kit.models`) under each policy.

    Per policy, builds `Transformer(cfg.replace(remat=policy))` and measures
    the language-model loss on int32 tokens [batch, seq] (`measure`).
    Parameters come from `jax.eval_shape`, so nothing is allocated unless
    `time_steps` > 0.

    Args:
      cfg: the model config; `cfg.remat` is the default policy list.
      batch, seq: global batch size and sequence length (positive ints).
      policies: spec strings or `Policy`s; default `[cfg.remat]`.
      names: see `measure`.
      dtype: activation dtype override ("float32", "bfloat16", "float16");
        parameters keep `cfg.param_dtype`.
      time_steps: see `measure`; timed data are random token ids.
      mesh: a `jax.sharding.Mesh` from `remat_kit.mesh.make` (axes data,
        fsdp, tensor): parameters and tokens are sharded by the model's
        logical axes (`remat_kit.mesh.RULES`) and traced under its rules.
        Every figure is then per device: XLA's memory and cost analysis of
        the SPMD-partitioned program are per device, and residuals are
        traced on the program one device runs (batch / (data x fsdp),
        heads and mlp / tensor, `remat_kit.mesh.per_device_config`).
        For a target compiled ahead of time the mesh must be over its
        devices (`targets.make_mesh`); default a data mesh over all of them
        (a TPU slice's chips).
      per_layer: also measure each decoder layer alone under its policy
        (`Record.layer_residual_bytes` and `layers_residual_bytes`, for the
        Korthikanti comparison); layer schedules are summed layer by layer.
      progress: see `measure`.
      target: see `measure`.
    Returns:
      As `measure`.
    Raises:
      ValueError: batch or seq not a positive int, seq above a GPT-2
        config's max_len, a bad dtype.
      MeshError: the mesh does not split the batch or the heads
        (`remat_kit.mesh.check_fits`).
      RematSpecError: a policy does not parse.
      TargetError: see `measure`.
    """
    target = targets.parse_target(target)
    if mesh is None and target.aot:
        mesh = targets.make_mesh(target, {"data": len(targets.devices(target))})
    loss_for_policy, args, sample_args = config_program(cfg, batch, seq, dtype=dtype, mesh=mesh)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    n = rk_mesh.axis_size(mesh, "batch")
    local_cfg = rk_mesh.per_device_config(cfg, mesh)
    per_device = per_device_program(cfg, batch, seq, mesh)

    records = measure(loss_for_policy, *args,
                      policies=policies if policies is not None else [cfg.remat], names=names,
                      time_steps=time_steps, sample_args=sample_args, progress=progress,
                      per_device=per_device, target=target)
    if not per_layer:
        return records
    return [dataclasses.replace(r, **_stack_stored_bytes(local_cfg, batch // n, seq,
                                                         parse(r.policy)))
            if r.error is None else r for r in records]


# ---------------------------------------------------------------------------
# One decoder layer, tag by tag (for `remat-kit explain`)
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One value of a decoder layer and what the policy does with it.

    decision: "saved" (kept in device memory), "offloaded" (kept in host
    memory), "recomputed" (the policy recomputes this tag in the backward
    pass) or "not needed" (the policy would keep it, but the backward pass
    never reads it, e.g. the layer's own output). nbytes: bytes per layer.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    decision: str


@dataclasses.dataclass(frozen=True)
class LayerBreakdown:
    """Residuals of one decoder layer under one policy.

    Attributes:
      policy: canonical spec string.
      rows: saved and offloaded residuals (tags, primitives, the layer input),
        then emitted tags that are not stored, in vocabulary order.
      parameter_bytes: inputs the backward pass reads that are not rows (kept
        by reference, not extra memory): the layer's parameters for
        `layer_residuals`, every argument for `explain`.
      num_layers: layers in the model.
      compiled: with a `target`, the layer's value-and-grad compiled for it
        (`targets.Compiled`: temp bytes, FLOPs, compile seconds), else None.
    """

    policy: str
    rows: tuple[LayerRow, ...]
    parameter_bytes: int
    num_layers: int
    compiled: "targets.Compiled | None" = None

    def _sum(self, decision: str) -> int:
        return sum(r.nbytes for r in self.rows if r.decision == decision)

    @property
    def saved_bytes(self) -> int:
        """Bytes one layer keeps in device memory for its backward pass."""
        return self._sum("saved")

    @property
    def offloaded_bytes(self) -> int:
        """Bytes one layer keeps in host memory."""
        return self._sum("offloaded")

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of tagged values one layer recomputes instead of storing."""
        return self._sum("recomputed")

    @property
    def stored_bytes(self) -> int:
        """saved + offloaded bytes of one layer."""
        return self.saved_bytes + self.offloaded_bytes


def _layer_program(cfg: TransformerConfig, batch: int, seq: int, policy: Policy):
    """(loss of one remat'd decoder layer, its args as ShapeDtypeStructs)."""
    _check_positive("batch", batch)
    _check_positive("seq", seq)
    cfg = cfg.replace(remat=policy)
    layer = remat_layer(DecoderLayer, cfg)(cfg)
    deterministic = cfg.dropout_rate == 0
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), cfg.activation_dtype)
    key = jax.eval_shape(lambda: jax.random.key(0))
    params = jax.eval_shape(lambda: layer.init(
        jax.random.key(0), jnp.zeros(x.shape, x.dtype), deterministic))["params"]

    def apply(params, x, dropout_rng):
        return layer.apply({"params": params}, x, deterministic,
                           rngs={"dropout": dropout_rng}).astype(jnp.float32).sum()

    return apply, (params, x, key)


def _is_param(r: Residual) -> bool:
    return r.kind == "argument" and r.name.startswith("params")


def _layer_stored_bytes(cfg: TransformerConfig, batch: int, seq: int, policy: Policy) -> int:
    apply, args = _layer_program(cfg, batch, seq, policy)
    return sum(r.nbytes for r in residuals(apply, *args) if not _is_param(r))


def _stack_stored_bytes(cfg: TransformerConfig, batch: int, seq: int,
                        policy: Policy) -> dict[str, int | None]:
    """{"layer_residual_bytes", "layers_residual_bytes"} of `Record` for the
    decoder stack of `cfg` under `policy`, one layer measured at a time."""
    schedule, L = policy.schedule, cfg.num_layers
    if schedule.kind == "nested" and schedule.group_size(L) > 1:
        # A group is rematerialized whole: the forward pass keeps its input only.
        per_layer = (Policy(),) * (L // schedule.group_size(L))
    else:
        per_layer = layer_policies(policy, L)
    measured = {p: _layer_stored_bytes(cfg, batch, seq, p) for p in set(per_layer)}
    return {"layer_residual_bytes": (measured[per_layer[0]] if schedule.kind == "uniform"
                                     else None),
            "layers_residual_bytes": sum(measured[p] for p in per_layer)}


def _breakdown(policy: Policy, f: Callable, args, keep_argument: Callable[[Residual], bool],
               num_layers: int, target) -> LayerBreakdown:
    """Rows for `f`'s residuals, then for the tags it emits but does not store; with a
    `target`, `f`'s value-and-grad compiled for it."""
    found = residuals(f, *args)
    listed = [r for r in found if r.kind != "argument" or keep_argument(r)]
    rows = [LayerRow(r.name, r.kind, r.shape, r.dtype, r.nbytes,
                     "offloaded" if r.memory == "host" else "saved") for r in listed]
    stored = {r.name for r in rows if r.kind == "tag"}
    order = {t: i for i, t in enumerate(TAGS)}
    for t, aval in sorted(emitted_tags(f, *args).items(),
                          key=lambda kv: order.get(kv[0], len(order))):
        if t not in stored:
            decision = "recomputed" if policy.decide(t) == "recompute" else "not needed"
            rows.append(LayerRow(t, "tag", tuple(aval.shape), str(aval.dtype),
                                 _aval_bytes(aval), decision))
    unlisted = sum(r.nbytes for r in found if r not in listed)
    compiled = (None if target is None
                else targets.compile_for(jax.value_and_grad(f), *args, target=target))
    return LayerBreakdown(str(policy), tuple(rows), unlisted, num_layers, compiled)


def explain(policy: "str | Policy", fn: Callable, *args,
            target: "str | targets.Target | None" = None) -> LayerBreakdown:
    """What `fn` saves, offloads and recomputes under `policy`: one row per residual.

    `fn` is wrapped in one remat region (`checkpointed`) and traced under
    `jax.vjp`; nothing is computed or allocated.

    Args:
      policy: a spec string or Policy.
      fn: a function of arrays returning a scalar, without remat of its own
        (e.g. one layer and a sum).
      args: arrays or `jax.ShapeDtypeStruct`s.
      target: if given (e.g. "tpu:v5e:1x1", `remat_kit.targets`), also
        compile `fn`'s value-and-grad (w.r.t. the first argument) for it:
        `LayerBreakdown.compiled`.
    Returns:
      A `LayerBreakdown` (num_layers=1): rows of (tag or primitive, shape,
      dtype, bytes, decision) for every stored residual, then a row for each
      emitted tag the policy recomputes ("recomputed") or keeps but the
      backward pass never reads ("not needed"). Arguments are not rows: they
      are kept by reference, and their bytes are `parameter_bytes`.
    Raises:
      RematSpecError: the policy does not parse.
      TargetError: a bad target, or libtpu / the CUDA plugin missing.
      TypeError: `fn` does not return a scalar.
    """
    policy = parse(policy)
    return _breakdown(policy, checkpointed(fn)(policy), args, lambda r: False, 1, target)


def layer_residuals(cfg: TransformerConfig, batch: int, seq: int,
                    policy: "str | Policy | None" = None,
                    target: "str | targets.Target | None" = None) -> LayerBreakdown:
    """What one decoder layer of `cfg` saves, offloads and recomputes under `policy`.

    Applies `remat_layer(DecoderLayer, cfg)` (the layer exactly as the model
    wraps it) alone to an input [batch, seq, d_model] of `cfg.dtype`, under
    `jax.vjp`, and lists its residuals (`residuals`). Tags the layer emits
    (found by tracing it with `jax.make_jaxpr`) that are not stored get a row
    too, with the policy's decision (`Policy.decide`). The layer input is a
    row; the parameters are `parameter_bytes`. Nothing is allocated.

    Args:
      cfg: model config; policy: spec or Policy, default `cfg.remat`.
      batch, seq: per-device batch size and sequence length.
      target: if given, also compile the layer's value-and-grad for it
        (`LayerBreakdown.compiled`), see `explain`.
    Raises:
      ValueError: batch or seq not a positive int.
      RematSpecError: the policy does not parse.
      TargetError: see `explain`.
    """
    policy = parse(cfg.remat if policy is None else policy)
    apply, args = _layer_program(cfg, batch, seq, policy)
    return _breakdown(policy, apply, args, lambda r: not _is_param(r), cfg.num_layers, target)


__all__ = ["MEMORY_LABELS", "PEAK", "TEMP", "LayerBreakdown", "LayerRow", "Record", "Residual",
           "StepTime", "checkpointed",
           "config_program", "explain",
           "layer_residuals", "loop_scaled_costs", "measure", "measure_config",
           "memory_fields", "memory_kind", "platform_label", "residuals"]
