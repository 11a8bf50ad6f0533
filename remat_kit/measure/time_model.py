"""Predicted time: a roofline per op, max(FLOPs / peak FLOP/s, bytes / bandwidth).

Source: Williams et al. 2009, "Roofline: an insightful visual performance model".
Main names: `compiled_seconds` (a compiled program, op by op from its fused HLO: `compiled_ops`),
`segment_seconds` (a recomputed forward segment, as one fusion), `program_seconds` (a jaxpr, no
fusion), `eqn_costs`, `OpCost`. What an op's bytes are (TPU VMEM, DMAs):
docs/targets.md ("The time model").
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from remat_kit.measure import collectives, dcn, kernels, loops
from remat_kit.measure.gpu_calls import cublas_gemm
from remat_kit._jax_private import hlo_module
# Re-exported: tests, scripts and the planner read the peaks as time_model.roofline(target)
# and type them as time_model.Roofline.
from remat_kit.measure.chip_peaks import Roofline
from remat_kit.measure.targets import roofline

OBJECTIVES = ("flops", "time")


def _eqn_key(eqn) -> tuple:
    return (eqn.primitive.name, tuple(str(v.aval) for v in eqn.invars),
            tuple(sorted((k, str(v)) for k, v in eqn.params.items())))


def eqn_costs(eqn, cache: dict) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of one jaxpr equation, XLA's HloCostAnalysis of it
    lowered alone (no compile); a kernel (Pallas, custom call), to which XLA gives no
    FLOPs, as `kernels.eqn_figures` prices it. An equation XLA cannot lower alone
    costs (0, 0).

    cache: figures already measured, keyed by primitive, input types and params.
    """
    key = _eqn_key(eqn)
    if key not in cache and (priced := kernels.eqn_figures(eqn)) is not None:
        cache[key] = priced
    if key not in cache:
        invars = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, Literal)))
        structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
        try:
            with warnings.catch_warnings():  # a hand-built Jaxpr has no DebugInfo; harmless
                warnings.simplefilter("ignore", DeprecationWarning)
                closed = ClosedJaxpr(Jaxpr([], invars, list(eqn.outvars), [eqn]), [])
                costs = jax.jit(jaxpr_as_fun(closed)).lower(*structs).cost_analysis()
            costs = (costs[0] if isinstance(costs, (list, tuple)) else costs) or {}
            cache[key] = (float(costs.get("flops", 0.0)), float(costs.get("bytes accessed", 0.0)))
        except Exception:  # noqa: BLE001 - an equation XLA cannot lower alone costs nothing here
            cache[key] = (0.0, 0.0)
    return cache[key]


# ---------------------------------------------------------------------------
# The compiled program: one roofline per op XLA runs (a fusion is one op)
# ---------------------------------------------------------------------------

# Ops that move no data: they name, view or group buffers.
_FREE = frozenset({"kParameter", "kConstant", "kGetTupleElement", "kTuple", "kBitcast",
                   "kAfterAll", "kPartitionId", "kReplicaId", "kAddDependency",
                   "kOptimizationBarrier", "kDomain",
                   # the done half of an asynchronous op waits; its start moved the bytes
                   "kCopyDone", "kAsyncDone", "kAsyncUpdate"})
# HloCostAnalysis counts these per element as transcendentals, not FLOPs.
_TRANSCENDENTAL = frozenset({"kExp", "kExp2", "kExpm1", "kLog", "kLog1p", "kLog2", "kTanh",
                             "kLogistic", "kSqrt", "kRsqrt", "kCbrt", "kSin", "kCos", "kTan",
                             "kErf", "kPower", "kAtan2", "kAcos", "kAsin", "kAtanh", "kAsinh",
                             "kAcosh", "kCosh", "kSinh"})
# Per-element arithmetic: one FLOP per output element (HloCostAnalysis's count).
_ELEMENTWISE = frozenset({"kAdd", "kSubtract", "kMultiply", "kDivide", "kMaximum", "kMinimum",
                          "kNegate", "kAbs", "kCompare", "kSelect", "kClamp", "kSign",
                          "kRemainder", "kFloor", "kCeil", "kRoundNearestEven",
                          "kRoundNearestAfz", "kAnd", "kOr", "kXor", "kNot", "kIsFinite",
                          "kConvert", "kReducePrecision", "kShiftLeft",
                          "kShiftRightArithmetic", "kShiftRightLogical", "kPopulationCount",
                          "kClz", "kReal", "kImag", "kMulhi"})
# Ops that read only part of their first operand: the bytes read are their output's.
_PARTIAL_READ = frozenset({"kSlice", "kDynamicSlice", "kGather"})
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([^_\s]+)_([^-\s]+)->(\S+?)[,}\s]")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_ENTRY = re.compile(r"^ENTRY %([\w.\-]+) ", re.M)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op a compiled program runs (a fusion counts as one), for the roofline.

    Attributes:
      name, opcode: the HLO instruction's name and opcode ("kFusion", "kDot", ...).
      flops: FLOPs of the op (of every instruction fused into it): 2 per
        multiply-add of a dot, 1 per element of element-wise math and reductions.
      transcendentals: elements of exp, tanh, log, ... (not in flops).
      nbytes: device-memory (HBM) bytes read and written at the op's boundary: its
        operands and its outputs, not the values inside a fusion (those stay in
        registers or cache). Operands only sliced read the slice; an in-place
        dynamic-update-slice writes the update only.
      dtype: the output's element type, which picks the peak (bf16 or f32).
      trips: how many times the op runs (the trip counts of the loops around it).
      dcn_bytes: bytes the op sends across slices over the data-center network, per
        chip (`remat_kit.measure.dcn`; 0 on one slice).
      ici_bytes: bytes a collective sends to other chips over the ICI, per chip
        (`collectives.ici_bytes`: all-to-all, all-gather, reduce-scatter, all-reduce,
        collective-permute); 0 for any other op.
    """

    name: str
    opcode: str
    flops: float
    transcendentals: float
    nbytes: float
    dtype: object
    trips: int = 1
    dcn_bytes: float = 0.0
    ici_bytes: float = 0.0
    vmem_bytes: float = 0.0  # as nbytes, of the operands and outputs in TPU VMEM (S(1))


_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HBM, _VMEM = "0", "1"


def _device_bytes(shape, space: str = _HBM) -> int:
    """Bytes of `shape` held in memory space `space`: by default device memory (HBM),
    array leaves in the default space; `_VMEM` ("1"): TPU VMEM. Leaves in any other
    (S(2): TPU SMEM and DMA semaphores; S(5): host memory) are neither."""
    if shape.is_tuple():
        return sum(_device_bytes(s, space) for s in shape.tuple_shapes())
    if not shape.is_array():
        return 0
    found = _MEMORY_SPACE.search(shape.layout().to_string()) if shape.has_layout() else None
    return _size(shape)[1] if (found.group(1) if found else _HBM) == space else 0


def _size(shape) -> tuple[int, int]:
    """(elements, bytes) of an HLO shape; tuples summed, tokens nothing."""
    if shape.is_tuple():
        parts = [_size(s) for s in shape.tuple_shapes()]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if not shape.is_array():
        return 0, 0
    n = math.prod(shape.dimensions())
    return n, n * np.dtype(shape.numpy_dtype()).itemsize


def _convolution_flops(instr) -> float:
    """2 x the multiply-adds of an HLO convolution that touch its input, as XLA's
    cost analysis counts them: XLA:TPU writes dots as convolutions whose
    windows (a batch dimension as a size-8 window, heads as a padded or
    dilated window) would be counted many times over by kernel size alone.

    MACs = batch x output features x kernel input features x, per spatial
    dimension, the (output position, window tap) pairs that land on an input
    element: not on padding, nor between the elements of a dilated input
    (`lhs_dilate`, how transposed dots come out).
    """
    text = instr.to_string()
    labels, window = _DIM_LABELS.search(text), _WINDOW.search(text)
    lhs, rhs = (o.shape.dimensions() for o in instr.operands()[:2])
    out = instr.shape.dimensions()
    if labels is None:
        return 2.0 * math.prod(out) * math.prod(rhs) / max(rhs[-1], 1)
    lhs_l, rhs_l, out_l = labels.groups()
    fields = dict(f.split("=", 1) for f in (window.group(1).split() if window else ()))
    spatial = [c for c in out_l if c.isdigit()]

    def per_dim(name: str, default):
        if name not in fields:
            return [default] * len(spatial)
        return [tuple(int(v) for v in p.split("_")) if "_" in p else int(p)
                for p in fields[name].split("x")]

    size, stride, pads = per_dim("size", 1), per_dim("stride", 1), per_dim("pad", (0, 0))
    lhs_dilate, rhs_dilate = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pairs = 1
    for d, c in enumerate(spatial):
        n, k, lo = lhs[lhs_l.index(c)], size[d], pads[d][0]
        start = np.arange(out[out_l.index(c)]) * stride[d] - lo  # each window's first index
        if lhs_dilate[d] == 1 and rhs_dilate[d] == 1:
            pairs *= int(np.clip(np.minimum(start + k, n) - np.maximum(start, 0), 0, None).sum())
        else:  # only taps on the dilated input's elements
            x = start[:, None] + np.arange(k)[None, :] * rhs_dilate[d]
            pairs *= int(((x >= 0) & (x <= (n - 1) * lhs_dilate[d])
                          & (x % lhs_dilate[d] == 0)).sum())
    macs = out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * pairs
    return 2.0 * macs


def _math(instr, comps) -> tuple[float, float]:
    """(FLOPs, transcendentals) of one instruction, fused computations walked into."""
    op = instr.opcode.name
    out = _size(instr.shape)[0]
    if op == "kDot":
        lhs = instr.operands()[0].shape.dimensions()
        found = _CONTRACTING.search(instr.to_string())
        dims = [int(d) for d in (found.group(1) if found else "").split(",") if d]
        return 2.0 * out * math.prod(lhs[d] for d in dims), 0.0
    if op == "kConvolution":  # XLA:TPU emits dots as convolutions
        return _convolution_flops(instr), 0.0
    if op == "kFusion":
        flops = trans = 0.0
        for name in _CALLED.findall(instr.to_string()):
            for inner in comps[name].instructions():
                f, t = _math(inner, comps)
                flops, trans = flops + f, trans + t
        return flops, trans
    if op in ("kReduce", "kReduceWindow"):
        return float(_size(instr.operands()[0].shape)[0] - out), 0.0
    if op in _TRANSCENDENTAL:
        return 0.0, float(out)
    if op in _ELEMENTWISE:
        return float(out), 0.0
    return 0.0, 0.0


def _unviewed(instr):
    """The value `instr` views: through bitcasts used once (a scan's stacked
    residual is bitcast before each layer's slice is read from it)."""
    while instr.opcode.name == "kBitcast" and len(instr.users()) == 1:
        instr = instr.operands()[0]
    return instr


def _parameter_number(instr) -> int:
    return int(instr.to_string().split("parameter(")[1].split(")")[0])


def _sliced_read(body, index: int, comps) -> float | None:
    """Bytes fused computation `body` reads of its parameter `index` where it only
    slices it: its one user (through bitcasts used once) a slice, or a nested fusion
    that only slices it (XLA:TPU reads one layer of a scan's stacked residual so); None
    where the parameter is read whole."""
    value = next((i for i in body.instructions() if i.opcode.name == "kParameter"
                  and _parameter_number(i) == index), None)
    while value is not None and len(value.users()) == 1 and \
            value.users()[0].opcode.name == "kBitcast":
        value = value.users()[0]
    if value is None or len(value.users()) != 1:
        return None
    user = value.users()[0]
    at = [o.name for o in user.operands()]
    if user.opcode.name in _PARTIAL_READ and at[0] == value.name:
        return float(_size(user.shape)[1])
    called = _CALLED.findall(user.to_string())
    if user.opcode.name == "kFusion" and at.count(value.name) == 1 and called[0] in comps:
        return _sliced_read(comps[called[0]], at.index(value.name), comps)
    return None


def _boundary_bytes(instr, comps, space: str = _HBM) -> float:
    """Bytes an op reads and writes at its boundary in memory space `space` (see
    `OpCost.nbytes`, `OpCost.vmem_bytes`)."""
    op = instr.opcode.name
    operands = [_device_bytes(o.shape, space) for o in instr.operands()]
    written = _device_bytes(instr.shape, space)
    if op == "kCopyStart":  # a DMA, (destination, source, context): each end in `space`
        return float(sum(_device_bytes(s, space) for s in instr.shape.tuple_shapes()[:2]))
    if op == "kAsyncStart":  # a sliced DMA, ((source), destination, context)
        dest = instr.shape.tuple_shapes()[1]
        return float(_device_bytes(dest, space) + (_size(dest)[1] if any(operands) else 0))
    if op in _PARTIAL_READ:  # the slice read from the source, if in HBM, and written
        return written + (_size(instr.shape)[1] if operands[0] else 0.0) + sum(operands[1:])
    if op == "kDynamicUpdateSlice":  # in place: the update is read and written
        return 2.0 * operands[1] + sum(operands[2:])
    if op == "kCustomCall" and 'custom_call_target="AllocateBuffer"' in instr.to_string():
        return 0.0  # XLA:TPU's allocation of a buffer a loop then fills: nothing moves
    if op != "kFusion":
        return float(sum(operands) + written)
    [name] = _CALLED.findall(instr.to_string())[:1] or [None]
    body = comps.get(name)
    if body is None:
        return float(sum(operands) + written)
    params = {inner.name: _parameter_number(inner) for inner in body.instructions()
              if inner.opcode.name == "kParameter"}
    read = [float(n) if not n or (part := _sliced_read(body, i, comps)) is None else part
            for i, n in enumerate(operands)]
    for inner in body.instructions():
        if inner.opcode.name == "kDynamicUpdateSlice" and inner.operands():
            src = _unviewed(inner.operands()[0])
            if src.name in params and len(src.users()) == 1 and read[params[src.name]]:
                read[params[src.name]] = 0.0
                written -= _size(src.shape)[1] - _size(inner.operands()[1].shape)[1]
    return sum(read) + max(written, 0)


def _gemm_cost(instr, gemm, trips: int) -> OpCost:
    """A cuBLAS call's `OpCost`: its operands read and its product written (the
    workspace is scratch), priced at the product's element type."""
    nbytes = sum(_device_bytes(o.shape) for o in instr.operands()) + _device_bytes(gemm.product)
    return OpCost(instr.name, "kCustomCall", gemm.flops, 0.0, float(nbytes),
                  np.dtype(gemm.product.numpy_dtype()), trips)


def compiled_ops(compiled, slices: int | None = None) -> list[OpCost]:
    """The ops a compiled program runs, each with its FLOPs and boundary bytes (in HBM,
    and on a TPU in VMEM: XLA:TPU's memory-space assignment keeps small buffers there).

    Walks the optimized HLO (`compiled.runtime_executable().hlo_modules()`, or
    the text of `compiled.as_text()` where there is no runtime executable, as
    for a target compiled ahead of time) from its entry computation: a fusion
    is one op (what XLA emits as one kernel), while loop bodies are walked
    once per trip (`loops.trip_count`: XLA:TPU drops `known_trip_count`, so
    the condition's bound is read; once where no count is found), calls
    walked into, and every branch of a conditional counted (an upper bound:
    one runs).
    On the programs checked (a matmul and a softmax exactly; the tiny and
    tiny_llama value-and-grad under every preset within 0.02% of FLOPs and 0.6%
    of bytes) the figures add up to XLA's own `cost_analysis()` of the module.

    Args:
      compiled: a JAX `Compiled` (`jax.jit(f).lower(...).compile()`).
      slices: on a multi-slice target, how many slices: what the program sends
        across them is counted (`OpCost.dcn_bytes`).
    Returns:
      `OpCost`s in the order the module lists them, free ops (parameters,
      tuples, bitcasts) left out.
    """
    module = hlo_module(compiled)
    comps = {c.name: c for c in module.computations()}
    entry = _ENTRY.search(module.to_string()).group(1)
    ops: list[OpCost] = []

    def walk(comp, trips):
        for instr in comp.instructions():
            op = instr.opcode.name
            if op in _FREE:
                continue
            if op in ("kWhile", "kCall", "kConditional") or (
                    op == "kAsyncStart" and _CALLED.search(instr.to_string())):
                text = instr.to_string()
                found = loops.trip_count(instr, comps) if op == "kWhile" else 1
                n = trips * (1 if found is None else found)
                names = _CALLED.findall(text)
                if (b := _BRANCHES.search(text)):
                    names += [s.strip().lstrip("%") for s in b.group(1).split(",")]
                for name in names:
                    if name in comps:
                        walk(comps[name], n)
                continue
            if (gemm := cublas_gemm(instr)) is not None:  # XLA:GPU's dots, mostly
                ops.append(_gemm_cost(instr, gemm, trips))
                continue
            flops, trans = _math(instr, comps)
            shape = instr.shape
            dtype = None if shape.is_tuple() or not shape.is_array() else \
                np.dtype(shape.numpy_dtype())
            sent = (dcn.dcn_bytes(instr, slices, _size(instr.operands()[0].shape)[1])
                    if slices and op == "kSend" else 0.0)
            ici = collectives.ici_bytes(instr, _size)
            ops.append(OpCost(instr.name, op, flops, trans, _boundary_bytes(instr, comps),
                              dtype, trips, sent, ici, _boundary_bytes(instr, comps, _VMEM)))

    walk(comps[entry], 1)
    return ops


def compiled_seconds(compiled, line: Roofline) -> float:
    """Predicted seconds of one run of a compiled program: the roofline of each
    op it runs (`compiled_ops`; its HBM and VMEM bytes each at their bandwidth),
    summed, loop bodies once per trip; on several slices (`line.slices`) with what
    the program sends across them at `line.dcn_bandwidth`, and what its collectives
    (a pipeline's `ppermute` to the next stage, an expert layer's all-to-all
    dispatch and combine, all-gathers and reduce-scatters) send at
    `line.ici_bandwidth` (`collectives.ici_bytes`; neither overlapped with compute:
    an upper bound)."""
    return step_terms(compiled, line)["seconds"]


def step_terms(compiled, line: Roofline) -> dict:
    """`compiled_seconds` and the terms it sums, JSON-ready: {"seconds", "bytes_bound_seconds"
    (the ops whose HBM bytes bound them: their bytes / bandwidth), "flops_bound_seconds" (the
    ops whose FLOPs bound them), "f32_flops_bound_seconds" (of those, the ops priced at the f32
    peak), "hbm_bytes" (bytes every op reads and writes, per trip), "vmem_bytes" (those in
    TPU VMEM, at `line.vmem_bandwidth`), "flops", "dcn_seconds", "ici_seconds" (of which
    "all_to_all_seconds": the all-to-alls', an expert layer's dispatch and combine)}. What
    makes one program's prediction faster than another's (`audit.faster_than_none`)."""
    ops = compiled_ops(compiled, line.slices)
    sent = sum(op.trips * op.dcn_bytes for op in ops)
    passed = sum(op.trips * op.ici_bytes for op in ops)
    swapped = sum(op.trips * op.ici_bytes for op in ops if op.opcode in collectives.ALL_TO_ALL)
    ici = line.ici_bandwidth or 0.0
    terms = {"bytes_bound_seconds": 0.0, "flops_bound_seconds": 0.0,
             "f32_flops_bound_seconds": 0.0, "hbm_bytes": 0.0, "vmem_bytes": 0.0, "flops": 0.0,
             "dcn_seconds": sent / line.dcn_bandwidth if sent and line.dcn_bandwidth else 0.0,
             "ici_seconds": passed / ici if ici else 0.0,
             "all_to_all_seconds": swapped / ici if ici else 0.0}
    for op in ops:
        seconds = op.trips * line.seconds(op.flops, op.nbytes, op.dtype, op.vmem_bytes)
        by_bytes = line.memory_seconds(op.nbytes, op.vmem_bytes) >= seconds / op.trips
        terms["bytes_bound_seconds" if by_bytes else "flops_bound_seconds"] += seconds
        if not by_bytes and getattr(op.dtype, "itemsize", 4) > 2:
            terms["f32_flops_bound_seconds"] += seconds
        terms["hbm_bytes"] += op.trips * op.nbytes
        terms["vmem_bytes"] += op.trips * op.vmem_bytes
        terms["flops"] += op.trips * op.flops
    terms["seconds"] = (terms["bytes_bound_seconds"] + terms["flops_bound_seconds"]
                        + terms["dcn_seconds"] + terms["ici_seconds"])
    return terms


def segment_seconds(nodes, out_aval, line: Roofline, cache: dict) -> float:
    """Predicted seconds of recomputing a segment of forward equations, priced as
    one fusion: max(FLOPs of them all / peak, bytes at the segment's boundary /
    bandwidth), each node's figures times its scale.

    Args:
      nodes: the segment's equations, objects with `eqn` (a jaxpr equation),
        `ins` and `outs` (keys of its input and output values, None for a
        literal) and `scale` (trips of the loops around it), as
        `cost_model.Program` holds them.
      out_aval: the recomputed value's type (written once).
      line: the target's peaks. cache: as `eqn_costs`.
    Returns:
      Seconds; 0 for an empty segment.
    """
    if not nodes:
        return 0.0
    inside = {k for n in nodes for k in n.outs if k is not None}
    flops, read = 0.0, {}
    for n in nodes:
        flops += n.scale * eqn_costs(n.eqn, cache)[0]
        for k, v in zip(n.ins, n.eqn.invars):
            if k is not None and k not in inside and hasattr(v.aval, "shape"):
                read[k] = n.scale * math.prod(v.aval.shape) * v.aval.dtype.itemsize
    scale = max(n.scale for n in nodes)
    written = scale * math.prod(out_aval.shape) * out_aval.dtype.itemsize
    return line.seconds(flops, sum(read.values()) + written, out_aval.dtype)


def _bodies(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        if hasattr(body, "eqns"):
            yield body


def program_seconds(jaxpr, line: Roofline, cache: dict, scale: int = 1) -> float:
    """Predicted seconds of a whole program: the roofline of each equation, call
    bodies (jit, remat, custom calls) walked into, scan bodies once per trip."""
    total = 0.0
    for eqn in jaxpr.eqns:
        bodies = list(_bodies(eqn))
        if bodies:
            trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += sum(program_seconds(b, line, cache, scale * trips) for b in bodies[:1])
            continue
        f, b = eqn_costs(eqn, cache)
        dtype = getattr(eqn.outvars[0].aval, "dtype", None) if eqn.outvars else None
        total += scale * line.seconds(f, b, dtype)
    return total


__all__ = ["OBJECTIVES", "OpCost", "Roofline", "compiled_ops",
           "compiled_seconds", "eqn_costs", "program_seconds", "roofline",
           "segment_seconds"]
