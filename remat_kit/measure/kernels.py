"""Fused attention and grouped-matmul kernels priced from their shapes.

XLA's cost analysis gives a custom call (Pallas, cuDNN) no FLOPs; `price` reads every kernel call
of a program's jaxpr and prices attention by the FlashAttention-2 accounting (Dao 2023, section
3; `attention_flops`), masks where it can read them, and a mixture of experts' grouped matmuls
(megablox `gmm`/`tgmm`, `jax.lax.ragged_dot`) at 2·m·k·n (`grouped_flops`); any other is named,
unpriced. Main names: `price`, `Priced`, `Kernel`, `added`, `seconds`, `eqn_figures`.
The accounting: docs/targets.md ("Fused attention kernels", its grouped matmuls).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from remat_kit.trace import stand_in
from remat_kit.trace.roles import kernel_name
from remat_kit.units import fmt_flops

# The attention kernels priced from shapes, by name, and the axis of their q/k/v that is
# the sequence: splash and the TPU flash kernel keep heads before it ([..., heads, seq,
# head_dim]); Pallas GPU `mha` and cuDNN's (BTNH) have [batch, seq, heads, head_dim]. A
# kernel of any other name is priced by its cost_estimate or left unpriced: its layout
# cannot be read from a name (a custom [b, s, h, d] kernel read as [.., h, s, d] would
# take its heads for the keys).
_KNOWN = ((re.compile(r"^splash_m[hq]a_"), -2),
          (re.compile(r"^flash_attention_(d[kq]v?_)?kernel"), -2),
          (re.compile(r"^mha_(forward|backward|preprocess_backward)$"), -3),
          (re.compile(r"^(dot_product_attention|cudnn_attention)_(fwd|bwd)|fmha"), -3))
# Primitive names of fused attention, for kernels that are primitives rather than calls.
_ATTENTION = re.compile(r"attention|attn|flash|fmha|mha|mqa|splash", re.IGNORECASE)
# Grouped matmuls (a mixture of experts' expert matmuls): megablox's `gmm`/`tgmm` (JAX's
# pass no name: their source file says it), MaxText's `gmm_v2-...`, and XLA's ragged dot.
_GROUPED = re.compile(r"gmm|megablox|grouped|ragged", re.IGNORECASE)
# An XLA op the compiler lowers and counts itself, listed for the note only.
_RAGGED_DOT = "ragged_dot_general"
_CALLS = ("pallas_call", "ffi_call", "custom_call")
_TARGET = re.compile(r"custom_call @([\w$.]+)")
# StableHLO custom calls that are annotations (sharding, host offload), not kernels.
_ANNOTATIONS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "MoveToHost",
                "MoveToDevice", "annotate_device_placement", "LayoutConstraint"}
_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a program, as priced here.

    Attributes:
      name: the kernel's name (a Pallas call's `name=`, or the primitive's).
      calls: how many times the program runs it (loop trips included).
      flops: FLOPs of one call; 0.0 where unpriced.
      nbytes: bytes of its operands and results, one call.
      dtype: the element type of its first floating operand (which peak it runs at).
      how: "shapes" (priced here), "cost_estimate" (its author's estimate),
        "compiler" (an XLA op, `ragged_dot`: priced and timed by the compiler, which
        computes it as dense dots over every group; `flops` is the routed work),
        or "unpriced".
      counted: whether the compiler's cost analysis already holds `flops`.
      mask: "" or why its count is an upper bound ("mask not read"; a grouped
        matmul's rows at their static bound).
    """

    name: str
    calls: int
    flops: float
    nbytes: float
    dtype: object
    how: str
    counted: bool = False
    mask: str = ""


@dataclasses.dataclass(frozen=True)
class Priced:
    """The kernels of one program (`price`)."""

    kernels: tuple[Kernel, ...] = ()
    platform: str = ""  # the target's ("cpu", "tpu", "gpu"), where known

    @property
    def added_flops(self) -> float:
        """FLOPs to add to the compiler's count: priced kernels it left out."""
        return sum(k.flops * k.calls for k in self.kernels if not k.counted)

    @property
    def timed(self) -> tuple[Kernel, ...]:
        """The kernels whose FLOPs the time model's compiled ops lack: every custom call
        (`time_model.compiled_ops` gives one its bytes, never FLOPs, even where the
        compiler's cost analysis counted its cost estimate), not XLA's own ops."""
        return tuple(k for k in self.kernels if k.how not in ("compiler", "unpriced"))

    @property
    def kernel_flops(self) -> float:
        """FLOPs of every priced kernel, counted by the compiler or not."""
        return sum(k.flops * k.calls for k in self.kernels)

    @property
    def unpriced(self) -> tuple[str, ...]:
        """Names of the custom calls left unpriced, sorted, each once."""
        return tuple(sorted({k.name for k in self.kernels if k.how == "unpriced"}))

    def notes(self) -> tuple[str, ...]:
        """Report lines: which kernels were priced and how; what was left unpriced."""
        notes = []
        by_name: dict[tuple, list[Kernel]] = {}
        for k in self.kernels:
            if k.how != "unpriced":
                by_name.setdefault((k.name, k.how, k.mask), []).append(k)
        if by_name:
            parts = [f"{name} x{sum(k.calls for k in ks)} "
                     f"{fmt_flops(sum(k.flops * k.calls for k in ks))}"
                     f"{' (' + _HOW.get(how, how) + ')' if how != 'shapes' else ''}"
                     f"{' (' + mask + ')' if mask else ''}"
                     for (name, how, mask), ks in by_name.items()]
            grouped = any(_GROUPED.search(name) for name, _, _ in by_name)
            notes.append("kernels priced from shapes (FlashAttention-2 accounting"
                         + ("; grouped matmuls 2·m·k·n over the routed rows m" if grouped
                            else "") + "): " + ", ".join(parts))
        if any(k.name in (stand_in.FWD, stand_in.BWD) for k in self.kernels):
            notes.append("cuDNN attention stood in for: this machine cannot build the cuDNN "
                         "call, so the program was traced with a stand-in of its inputs, "
                         "outputs and residuals (remat_kit.trace.stand_in), the kernel "
                         "priced from its shapes")
            if self.platform in ("cpu", "tpu"):
                notes.append(f"cuDNN attention runs only on an NVIDIA GPU: on this "
                             f"{self.platform} target the model would fail; these figures "
                             "are of a program that cannot run there")
        notes += self._reruns()
        if self.unpriced:
            notes.append("FLOPs are a lower bound: custom calls left unpriced (no "
                         "cost_estimate, and not a kernel priced from its shapes): "
                         + ", ".join(self.unpriced))
        return tuple(notes)


    def _reruns(self) -> list[str]:
        """A line per fused attention kernel whose forward runs more often than its
        backward: the backward reruns it. JAX's cuDNN rule names none of its residuals;
        splash names them only with `residual_checkpoint_name`, so where a policy keeps
        `context` and the forward still reruns, they were not named (`measure` keeps the
        line on such policies only: under `full` the rerun is the policy's)."""
        lines = []
        for kernel, forward, backward, how in _RERUNS:
            fwd = sum(k.calls for k in self.kernels if forward.search(k.name))
            bwd = sum(k.calls for k in self.kernels if backward.search(k.name))
            if fwd > bwd:
                lines.append(f"{kernel}'s forward runs {fwd} times for {bwd} backward: the "
                             f"backward reruns it, as {how}, so {CONTEXT_NOT_KEPT}")
        return lines


_HOW = {"cost_estimate": "cost estimate",
        "compiler": "XLA's op: the FLOPs column holds the compiler's count, dense over "
                    "every group"}
# The end of a rerun line (`Priced._reruns`), which `measure` keeps on policies that save
# `context` only.
CONTEXT_NOT_KEPT = "saving `context` cannot keep them"
# (kernel, its forward's name, its backward's (one call per layer), why its residuals
# are not kept): JAX's cuDNN rule names none; splash's are named only where the caller
# passes residual_checkpoint_name.
_RERUNS = (
    ("cuDNN attention", re.compile(r"^(dot_product_attention|cudnn_attention)_fwd"),
     re.compile(r"^(dot_product_attention|cudnn_attention)_bwd"),
     "JAX's cuDNN rule names none of its residuals (its output and logsumexp)"),
    ("splash attention", re.compile(r"^splash_m[hq]a_fwd"), re.compile(r"^splash_m[hq]a_dkv"),
     "the kernel's residuals (its output and logsumexp) are not named: give splash "
     "residual_checkpoint_name=\"context\""))


def has_kernels(lowered_text: str) -> bool:
    """Whether a lowered program's StableHLO text holds a custom call that is not an
    annotation, or the cuDNN stand-in's call (`remat_kit.trace.stand_in`): what `price`
    would find (its trace is skipped otherwise)."""
    return any(t not in _ANNOTATIONS for t in _TARGET.findall(lowered_text)) or any(
        f"call @{name}(" in lowered_text for name in (stand_in.FWD, stand_in.BWD))


def added(costs: tuple[dict, tuple[str, ...]], priced: Priced) -> tuple[dict, tuple[str, ...]]:
    """The compiler's (figures, notes) (`lowering.costs`) with `priced`'s kernels:
    their FLOPs added where the compiler left them out, and their notes."""
    found, notes = costs
    if found.get("flops") is not None and priced.added_flops:
        found = {**found, "flops": found["flops"] + priced.added_flops}
    return found, tuple(notes) + priced.notes()


def seconds(priced: Priced, line) -> float:
    """Seconds the time model adds for the kernels its compiled ops give no FLOPs
    (`Priced.timed`: every custom call, its cost estimate counted by the compiler
    or not): each call's FLOPs at its dtype's peak (`chip_peaks.Roofline.seconds`);
    its bytes are already in the compiled op's roofline."""
    return sum(k.calls * line.seconds(k.flops, 0.0, k.dtype) for k in priced.timed)


def eqn_figures(eqn) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one kernel equation of a jaxpr, priced here (as `price`
    prices it), for a cost model that prices equations one at a time; None for an
    equation that is no custom call (`ragged_dot` included: XLA prices it) or a
    kernel left unpriced."""
    if not _is_kernel(eqn) or eqn.primitive.name == _RAGGED_DOT:
        return None
    k = _kernel(eqn, {}, 1, "cpu")
    return None if k.how == "unpriced" else (k.flops, k.nbytes)


def _floating(avals) -> list:
    return [a for a in avals if getattr(a, "ndim", 0) >= 2
            and jnp.issubdtype(a.dtype, jnp.floating)]


def _role(name: str, n_float_outs: int) -> float:
    """The kernel's FLOPs in units of the forward's (module docstring)."""
    low = name.lower()
    if "preprocess" in low:  # the backward's delta = rowsum(o * dO): no matmul
        return 0.0
    if "dkv" in low:
        return 2.5 if n_float_outs >= 3 else 2.0
    if re.search(r"(^|_)dq(_|$)", low):
        return 1.5
    if "bwd" in low or "backward" in low:
        return 2.5
    return 1.0


def _block_sizes(eqn, operands: list[int], seq_axis: int) -> list[int] | None:
    """The block sizes along the sequence of the Pallas call's operands at
    `operands` (indices into its inputs), from its grid mapping; None if unread."""
    mapping = eqn.params.get("grid_mapping")
    if mapping is None:
        return None
    first = int(getattr(mapping, "num_index_operands", 0))
    blocks = list(getattr(mapping, "block_mappings", ()))
    try:
        dims = [blocks[i - first].block_shape[seq_axis] for i in operands]
    except (IndexError, TypeError):
        return None
    sizes = [getattr(d, "block_size", d) for d in dims]
    return sizes if all(isinstance(n, int) for n in sizes) else None


def _block_fraction(name: str, eqn, values: dict, qk: list[int], seq_axis: int
                    ) -> tuple[float, str]:
    """(fraction of score blocks computed, "" or why unknown). Splash's second scalar
    prefetch operand is its block mask, [heads or 1, q blocks, kv blocks] (0:
    skipped; its grid may be shrunk to the widest row, so its nonzero blocks count
    at their block size against the whole score matrix)."""
    if name.startswith("splash") and len(eqn.invars) > 1:
        mask = values.get(eqn.invars[1]) if isinstance(eqn.invars[1], jcore.Var) \
            else getattr(eqn.invars[1], "val", None)
        sizes = _block_sizes(eqn, qk, seq_axis)
        if mask is not None and np.ndim(mask) == 3 and sizes:
            mask = np.asarray(mask)
            s_q, s_k = (eqn.invars[i].aval.shape[seq_axis] for i in qk)
            computed = np.count_nonzero(mask) / mask.shape[0]
            return float(min(1.0, computed * sizes[0] * sizes[1] / (s_q * s_k))), ""
    if "mask_type" in eqn.params:  # cuDNN's attention and its stand-in
        s_q, s_k = (eqn.invars[i].aval.shape[seq_axis] for i in qk)
        return _mask_fraction(eqn.params, s_q, s_k,
                              bool(eqn.params.get("variadic_args", (False,))[0]))
    return 1.0, "mask not read: priced unmasked"


def _mask_fraction(params: dict, s_q: int, s_k: int, mask_array: bool) -> tuple[float, str]:
    """(fraction of the s_q x s_k scores a cuDNN attention call computes, note) from its
    `mask_type` (causal: key j <= query i) and `sliding_window_length` w (keys
    i - w < j <= i); a bias or mask array (cuDNN's `variadic_args[0]`, has_bias) is not
    read: its scores count in full."""
    kind = str(getattr(params["mask_type"], "name", params["mask_type"])).lower()
    rows, window = np.arange(s_q), params.get("sliding_window_length")
    # cuDNN's window is a left one, (i - w, i]: it bounds the keys above as causal does.
    high = np.minimum(rows + 1, s_k) if "causal" in kind or window else np.full(s_q, s_k)
    low = np.maximum(rows + 1 - window, 0) if window else np.zeros(s_q, int)
    fraction = float(np.clip(high - low, 0, None).sum()) / (s_q * s_k)
    return fraction, "bias or mask array not read" if mask_array else ""


def attention_flops(q_shape, k_shape, seq_axis: int = -2, fraction: float = 1.0) -> float:
    """Forward FLOPs of attention, F = 4 x prod(q_shape[:-1]) x s_k x d x fraction.

    Args:
      q_shape: the query's shape, head_dim last ([..., s_q, d] or [b, s_q, h, d]).
      k_shape: the key's shape; its sequence axis is `seq_axis`.
      seq_axis: -2 for [..., heads, seq, d], -3 for [batch, seq, heads, d].
      fraction: of the score blocks the kernel computes.
    """
    return 4.0 * math.prod(q_shape[:-1]) * k_shape[seq_axis] * q_shape[-1] * fraction


def grouped_flops(operands, out_shape) -> float | None:
    """FLOPs of a grouped matmul, 2·m·k·n, m the rows routed (their static bound: the
    group sizes' sum is known only at run time), from its floating operands' and its
    output's shapes; None where they are no grouped matmul's.

    Forms (megablox's, and `jax.lax.ragged_dot`'s with its two transposes):
    - gmm: lhs [m, k], rhs [groups, k, n] (or [groups, n, k]) -> [m, n];
    - tgmm: lhs [m, k], grad [m, n] -> [groups, k, n] (each row adds to its group's).
    Args: operands: shapes of the floating operands, in order. out_shape: the result's.
    """
    two = [s for s in operands if len(s) == 2]
    three = [s for s in operands if len(s) == 3]
    if len(out_shape) == 2 and three and two:  # gmm: contract rhs's other axis
        m, n = out_shape
        k = math.prod(three[0][1:]) // n
        return 2.0 * m * k * n if k * n == math.prod(three[0][1:]) else None
    if len(out_shape) == 3 and len(two) >= 2:  # tgmm: the rows are contracted
        kn = math.prod(out_shape[1:])
        m = math.isqrt(math.prod(two[0]) * math.prod(two[1]) // kn)
        return 2.0 * m * kn if m * m * kn == math.prod(two[0]) * math.prod(two[1]) else None
    return None


def _grouped_name(eqn, name: str, floats: list, out: tuple) -> str | None:
    """The name a grouped-matmul kernel is listed by ("gmm", "tgmm", or its own up to
    its first "-"), or None where `eqn` is none: `_GROUPED` on its name or source, or,
    for a kernel wrapped so that both are a wrapper's (qwix's `<lambda>` in MaxText),
    megablox's group offsets among its operands (int32 [groups + 1])."""
    if eqn.primitive.name == _RAGGED_DOT:
        return "ragged_dot" if len(out) == 2 else "ragged_dot_transposed"
    if _GROUPED.search(name):
        return name.split("-")[0]
    body = getattr(eqn.params.get("jaxpr"), "debug_info", None)
    source = getattr(body, "func_src_info", None) or ""
    groups = out[0] if len(out) == 3 else next((a.shape[0] for a in floats if a.ndim == 3), 0)
    offsets = any(getattr(v.aval, "shape", None) == (groups + 1,)
                  and jnp.issubdtype(v.aval.dtype, jnp.integer) for v in eqn.invars)
    if _ATTENTION.search(name) or not (_GROUPED.search(source) or (groups and offsets)):
        return None
    return "tgmm" if len(out) == 3 else "gmm"


def _kernel(eqn, values: dict, calls: int, platform: str) -> Kernel:
    params, name = eqn.params, kernel_name(eqn.primitive.name, eqn.params)
    ins = [v.aval for v in eqn.invars]
    outs = [v.aval for v in eqn.outvars]
    nbytes = float(sum(a.size * np.dtype(a.dtype).itemsize for a in ins + outs
                       if hasattr(a, "size")))
    floats = _floating(ins)
    dtype = np.dtype(floats[0].dtype) if floats else None
    estimate = params.get("cost_estimate")
    out = outs[0].shape if outs and hasattr(outs[0], "shape") else ()
    grouped = _grouped_name(eqn, name, floats, out)
    flops = grouped and grouped_flops([a.shape for a in floats], out)
    if flops:
        how = "compiler" if eqn.primitive.name == _RAGGED_DOT else "shapes"
        counted = how == "compiler" or (estimate is not None and platform == "tpu"
                                        and bool(getattr(estimate, "flops", 0)))
        return Kernel(grouped, calls, flops, nbytes, dtype, how, counted=counted,
                      mask="rows at their static bound")
    if estimate is not None and getattr(estimate, "flops", 0):
        return Kernel(name, calls, float(estimate.flops), nbytes, dtype, "cost_estimate",
                      counted=platform == "tpu")
    seq_axis = _layout(name) or _layout(eqn.primitive.name)
    if seq_axis is None or len(floats) < 2 or len(floats[1].shape) < -seq_axis:
        return Kernel(name, calls, 0.0, nbytes, dtype, "unpriced")
    q, k = floats[0].shape, floats[1].shape
    qk = [i for i, a in enumerate(ins) if _floating([a])][:2]
    fraction, mask = _block_fraction(name, eqn, values, qk, seq_axis)
    role = _role(name, len([o for o in _floating(outs) if len(o.shape) == len(q)]))
    flops = (role * attention_flops(q, k, seq_axis, fraction) if role
             else 2.0 * math.prod(q))  # a product and a sum per element of o
    return Kernel(name, calls, flops, nbytes, dtype, "shapes", mask=mask if role else "")


def _layout(name: str) -> int | None:
    """The sequence axis of a known attention kernel's q/k/v (`_KNOWN`); None for any other."""
    return next((axis for pattern, axis in _KNOWN if pattern.search(name)), None)


def _is_kernel(eqn) -> bool:
    if eqn.primitive.name == "pallas_call":
        return not eqn.params.get("interpret")
    return eqn.primitive.name in _CALLS + (_RAGGED_DOT,) or (
        _ATTENTION.search(eqn.primitive.name) is not None
        and not any(k in eqn.params for k in _BODY_KEYS))


def price(closed, platform: str) -> Priced:
    """The kernels of a program's jaxpr, priced (module docstring).

    Walks `closed` (a ClosedJaxpr, e.g. a value-and-grad step's) into calls,
    remat regions and cond branches, and scan bodies once per trip (a while
    loop's body once: its trips are unknown here).

    Args:
      closed: a `jax.extend.core.ClosedJaxpr`.
      platform: the target's, "cpu", "tpu" or "gpu" (XLA:TPU counts a cost_estimate).
    Returns:
      `Priced`, its kernels in program order.
    """
    found: list[Kernel] = []

    def walk(jaxpr, values: dict, calls: int):
        for eqn in jaxpr.eqns:
            if _is_kernel(eqn):
                found.append(_kernel(eqn, values, calls, platform))
                continue
            if eqn.primitive.name in _PASSED and len(eqn.invars) == len(eqn.outvars):
                _bind(values, eqn.outvars, eqn.invars, values)
            trips = calls * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" \
                else calls
            for value in eqn.params.values():
                for sub, consts in _closed(value):
                    inner = dict(zip(sub.constvars, consts))
                    if len(sub.invars) == len(eqn.invars):  # a call: operands bound
                        _bind(inner, sub.invars, eqn.invars, values)
                    walk(sub, inner, trips)
                    if eqn.primitive.name in _RETURNING and len(sub.outvars) == len(
                            eqn.outvars):  # a call's results: a mask a jit-ed helper built
                        _bind(values, eqn.outvars, sub.outvars, inner)

    walk(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)), 1)
    return Priced(tuple(found), platform)


# Equations whose outputs are their inputs' values (a kernel's mask placed on a mesh), and
# calls whose results are their body's (a codebase's jit-ed wrapper returning its kernel's
# mask: MaxText's `wrap_jax_splash_kernel`).
_PASSED = ("sharding_constraint", "copy", "copy_p", "device_put", "reduce_precision")
_RETURNING = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
              "checkpoint", "remat")


def _bind(into: dict, targets, sources, known: dict) -> None:
    """`into[t]` = the known value of each source (a literal's, or `known`'s)."""
    for t, src in zip(targets, sources):
        value = src.val if isinstance(src, jcore.Literal) else known.get(src) \
            if isinstance(src, jcore.Var) else None
        if value is not None and isinstance(t, jcore.Var):
            into[t] = value


def _closed(value):
    """The sub-jaxprs a parameter holds, as (jaxpr, consts) pairs."""
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr, value.consts
    elif isinstance(value, jcore.Jaxpr):
        yield value, [None] * len(value.constvars)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _closed(v)


__all__ = ["Kernel", "Priced", "added", "attention_flops", "eqn_figures", "grouped_flops",
           "has_kernels", "price", "seconds"]
