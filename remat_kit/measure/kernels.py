"""Fused attention kernels priced from their shapes, where the compiler gives them none.

XLA's cost analysis gives a custom call (Pallas, cuDNN) no FLOPs; `price` reads every kernel call
of a program's jaxpr and prices the attention ones by the FlashAttention-2 accounting (Dao 2023,
section 3; `attention_flops`), masks where it can read them; any other is named, unpriced.
Main names: `price` (a `Priced` of `Kernel`s), `attention_flops`, `added`, `seconds`.
The accounting, per kernel and mask: docs/targets.md ("Fused attention kernels").
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

# Kernel and primitive names of fused attention (splash_mha_fwd, flash_mha_bwd_dq,
# mha_forward, dot_product_attention_fwd, ...).
_ATTENTION = re.compile(r"attention|attn|flash|fmha|mha|mqa|splash", re.IGNORECASE)
# Kernels whose q/k/v are [batch, seq, heads, head_dim] (Pallas GPU `mha`, cuDNN's
# BTNH); the others keep heads before the sequence ([..., heads, seq, head_dim]).
_SEQ_THIRD_LAST = re.compile(r"^mha_|dot_product_attention|cudnn|fmha", re.IGNORECASE)
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
        or "unpriced".
      counted: whether the compiler's cost analysis already holds `flops`.
      mask: "" or why its count is an upper bound ("mask not read").
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

    @property
    def added_flops(self) -> float:
        """FLOPs to add to the compiler's count: priced kernels it left out."""
        return sum(k.flops * k.calls for k in self.kernels if not k.counted)

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
                     f"{' (' + how.replace('_', ' ') + ')' if how != 'shapes' else ''}"
                     f"{' (' + mask + ')' if mask else ''}"
                     for (name, how, mask), ks in by_name.items()]
            notes.append("kernels priced from shapes (FlashAttention-2 accounting): "
                         + ", ".join(parts))
        if any(k.name in (stand_in.FWD, stand_in.BWD) for k in self.kernels):
            notes.append("cuDNN attention stood in for: this machine cannot build the cuDNN "
                         "call, so the program was traced with a stand-in of its inputs, "
                         "outputs and residuals (remat_kit.trace.stand_in), the kernel "
                         "priced from its shapes")
        notes += self._reruns()
        if self.unpriced:
            notes.append("FLOPs are a lower bound: custom calls left unpriced: "
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
    """Seconds the time model adds for the kernels the compiler gave no FLOPs:
    each call's FLOPs at its dtype's peak (`chip_peaks.Roofline.seconds`); its
    bytes are already in the compiled op's roofline."""
    return sum(k.calls * line.seconds(k.flops, 0.0, k.dtype)
               for k in priced.kernels if not k.counted)


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
            return min(1.0, computed * sizes[0] * sizes[1] / (s_q * s_k)), ""
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


def _kernel(eqn, values: dict, calls: int, platform: str) -> Kernel:
    params, name = eqn.params, kernel_name(eqn.primitive.name, eqn.params)
    ins = [v.aval for v in eqn.invars]
    outs = [v.aval for v in eqn.outvars]
    nbytes = float(sum(a.size * np.dtype(a.dtype).itemsize for a in ins + outs
                       if hasattr(a, "size")))
    floats = _floating(ins)
    dtype = np.dtype(floats[0].dtype) if floats else None
    estimate = params.get("cost_estimate")
    if estimate is not None and getattr(estimate, "flops", 0):
        return Kernel(name, calls, float(estimate.flops), nbytes, dtype, "cost_estimate",
                      counted=platform == "tpu")
    attention = _ATTENTION.search(name) or _ATTENTION.search(eqn.primitive.name)
    if not attention or len(floats) < 2:
        return Kernel(name, calls, 0.0, nbytes, dtype, "unpriced")
    q, k = floats[0].shape, floats[1].shape
    seq_axis = -3 if _SEQ_THIRD_LAST.search(name) and len(k) >= 3 else -2
    qk = [i for i, a in enumerate(ins) if _floating([a])][:2]
    fraction, mask = _block_fraction(name, eqn, values, qk, seq_axis)
    role = _role(name, len([o for o in _floating(outs) if len(o.shape) == len(q)]))
    flops = (role * attention_flops(q, k, seq_axis, fraction) if role
             else 2.0 * math.prod(q))  # a product and a sum per element of o
    return Kernel(name, calls, flops, nbytes, dtype, "shapes", mask=mask if role else "")


def _is_kernel(eqn) -> bool:
    if eqn.primitive.name == "pallas_call":
        return not eqn.params.get("interpret")
    return eqn.primitive.name in _CALLS or (
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
            trips = calls * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" \
                else calls
            for value in eqn.params.values():
                for sub, consts in _closed(value):
                    inner = dict(zip(sub.constvars, consts))
                    if len(sub.invars) == len(eqn.invars):  # a call: operands bound
                        inner.update((v, values[o]) for v, o in zip(sub.invars, eqn.invars)
                                     if isinstance(o, jcore.Var) and o in values)
                    walk(sub, inner, trips)

    walk(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)), 1)
    return Priced(tuple(found))


def _closed(value):
    """The sub-jaxprs a parameter holds, as (jaxpr, consts) pairs."""
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr, value.consts
    elif isinstance(value, jcore.Jaxpr):
        yield value, [None] * len(value.constvars)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _closed(v)


__all__ = ["Kernel", "Priced", "added", "has_kernels", "attention_flops", "price", "seconds"]
