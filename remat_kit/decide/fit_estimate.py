"""What a train step holds beyond its state, estimated from one trace: no compile.

`fit` compiles a size only to verify; where to compile first, and how memory bends between
compiled sizes, come from this estimate: the residuals the policy's value-and-grad saves plus the
largest other value it computes, per device, scaled through compiled sizes (`Estimate`). Also
`traced_flops` (FLOPs of the traced program), `compiler_capacity` (the HBM a compile may use) and
`gpu_own_remat` (where XLA:GPU would rematerialize on its own).
The estimate, its scales as measured and the search: docs/fit.md (the search's paragraphs).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit import mesh as rk_mesh
from remat_kit.decide.floor import train_state
from remat_kit.decide.step import workload_step
from remat_kit.measure import chip_memory, lowering
from remat_kit.units import fmt_bytes
from remat_kit.measure.residuals import aval_bytes, stage
from remat_kit.policy.policy import Policy
from remat_kit.trace.marked import sub_jaxprs


def _values(jaxpr, skip: set) -> list[int]:
    """Bytes of every value the equations of `jaxpr` (and the bodies they call, at one
    trip's shapes) compute, in program order, those in `skip` left out."""
    found = []
    for eqn in jaxpr.eqns:
        found += [aval_bytes(v.aval) for v in eqn.outvars
                  if v not in skip and hasattr(v.aval, "shape")]
        for body in sub_jaxprs(eqn):
            found += _values(body, skip)
    return found


def _parts(workload, policy: Policy, optimizer) -> tuple[float, float, list[int]]:
    """(residual bytes per device, 1 / devices, every other value's bytes) of one trace."""
    params, _, rest = train_state(workload, optimizer)
    staged = stage(workload.loss_for_policy(policy), (params, *rest))
    saved = sum(r.nbytes for r in staged.residuals if r.kind != "argument")
    # Per device: the residuals by the share of the batch's tokens one device holds (that
    # of the largest input); the largest value, attention scores or logits, over every
    # device (batch over data and fsdp, heads or vocabulary over tensor).
    tokens = max((x for x in jax.tree.leaves(rest) if hasattr(x, "shape")),
                 key=lambda x: math.prod(x.shape), default=None)
    share = (1.0 if tokens is None or not math.prod(tokens.shape) else
             math.prod(rk_mesh.local_shape(tokens).shape) / math.prod(tokens.shape))
    devices = 1 if workload.mesh is None else workload.mesh.size
    # A residual may be a literal (no remat keeps constants): not a value the program makes.
    skip = {v for v in staged.residual_vars if isinstance(v, Hashable)}
    return saved * share, 1 / devices, _values(staged.program.jaxpr, skip)


def activation_bytes(workload, policy: Policy, optimizer) -> int:
    """The estimate of what a train step of `workload` under `policy` holds beyond
    its parameters, gradients and optimizer state, bytes per device (see the module).

    Raises: whatever tracing the workload's loss raises (e.g. a size it refuses).
    """
    saved, per_device, values = _parts(workload, policy, optimizer)
    return int(saved + max(values, default=0) * per_device)


def _quadratic(parts: list) -> Callable[[int], int] | None:
    """units -> the estimate, from `_parts` traced at units 1 to 4: every figure a
    quadratic in the size through units 1, 2, 3 (shapes are linear in it, attention
    scores square), checked at 4; None where one is not (a program whose values change
    with the size otherwise), so each size is traced."""
    if any(p is None for p in parts) or len({len(p[2]) for p in parts}) != 1:
        return None
    ys = np.array([[p[0], *p[2]] for p in parts], dtype=float)  # [unit 1..4, figure]
    c = (ys[2] - 2 * ys[1] + ys[0]) / 2
    b = ys[1] - ys[0] - 3 * c
    a = ys[0] - b - c
    if not np.allclose(a + 4 * b + 16 * c, ys[3], rtol=1e-9, atol=1.0):
        return None
    per_device = parts[0][1]

    def at(units: int) -> int:
        f = a + b * units + c * units * units
        return int(f[0] + (f[1:].max(initial=0.0)) * per_device)
    return at


def estimator(at_size: Callable[[int], object], policy: Policy, optimizer,
              multiple: int) -> Callable[[int], int | None]:
    """units -> `activation_bytes` of the workload at units x multiple (`at_size`:
    size -> workload); None where the trace fails. Four traces (units 1 to 4) give every
    size where the program's values are quadratics in it (`_quadratic`); else each size
    is traced, once."""
    cache: dict[int, int | None] = {}
    fitted: list = []

    def parts(units: int):
        try:
            return _parts(at_size(units * multiple), policy, optimizer)
        except Exception:  # noqa: BLE001 - no estimate: the search predicts without
            return None

    def at(units: int) -> int | None:
        if not fitted:
            fitted.append(_quadratic([parts(u) for u in (1, 2, 3, 4)]))
        if fitted[0] is not None:
            return fitted[0](units)
        if units not in cache:
            found = parts(units)
            cache[units] = None if found is None else int(
                found[0] + max(found[2], default=0) * found[1])
        return cache[units]
    return at


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a row's search knows of a policy's step before compiling it.

    Attributes:
      at: units -> `activation_bytes` at that size (bytes per device), None
        where the trace fails; each size traced once.
      state: parameters + gradients + optimizer state, bytes per device: the estimate's
        point at size 0.
      capacity: () -> the device memory an out-of-memory compile reported
        (`capacity`), None before one did: the budget the compiler holds to.
    """

    at: Callable[[int], int | None]
    state: int
    capacity: Callable[[], int | None] = lambda: None

    # The first probe takes the estimate as MARGIN times the step's own growth: the
    # compiled steps measured grow by 0.4x (llama_1b, XLA:TPU v5e) to 1.09x (70B on a
    # v5p mesh) of it, so the first compile lands below the answer, where it gives bytes.
    MARGIN = 1.25
    # Scaled through one size and the state, the estimate's curve is off by the step's
    # constant (XLA:TPU held 0.5 GB less than llama_1b's gradients at seq 128): the jump
    # aims ONE_SIZE of the way short, so it lands below the answer, where a compile gives
    # bytes, rather than out of memory, where it gives none.
    ONE_SIZE = 0.25

    def first(self, budget: int, max_units: int) -> int | None:
        """The first unit to compile: where state + MARGIN x estimate meets the budget."""
        return _largest_within(lambda k: self._scaled(k, self.state, self.MARGIN),
                               budget, 1, max_units)

    def guess(self, real: dict[int, int], budget: int, lo: int, hi: int | None,
              max_units: int) -> int | None:
        """The largest unit in (lo, hi) where the estimate, scaled through the compiled
        sizes (`real`: bytes by unit), stays within the budget: through the two nearest
        the bracket that are not neighbours (the answer's pair is within XLA's noise),
        else through the one and the state. None where it cannot say."""
        near = sorted(real, key=lambda k: min(abs(k - lo), abs(k - (hi or lo))))
        a, far = near[0], [k for k in near[1:] if abs(k - near[0]) > 1]
        if not far and hi is not None and hi not in real:
            return (lo + hi) // 2  # one size's curve ran out of memory: how far over, unknown
        ea, eb = self.at(a), self.at(far[0]) if far else 0
        if not ea or eb is None:
            return None
        b_bytes = real[far[0]] if far else self.state
        if ea == eb:
            return None
        scale = (real[a] - b_bytes) / (ea - eb)
        if scale <= 0:
            return None
        base, room = real[a] - scale * ea, min(budget, self.capacity() or budget)
        if not far:  # one size: aim short of the budget (`ONE_SIZE`)
            room -= self.ONE_SIZE * max(0, room - real[a])
        return _largest_within(lambda k: self._scaled(k, base, scale), room, lo + 1,
                               max_units if hi is None else hi - 1)

    def _scaled(self, k: int, base: float, scale: float) -> float | None:
        e = self.at(k)
        return None if e is None else base + scale * e


def _largest_within(f: Callable[[int], float | None], budget: float, a: int,
                    b: int) -> int | None:
    """The largest k in [a, b] with f(k) <= budget, f non-decreasing; a where none is; None
    where f gives None. Galloping from a, then bisection: f (a trace) is asked only at
    sizes up to twice the answer's distance from a, never at b's (2**19 tokens) unless the
    answer is near it."""
    if b < a:
        return None
    at_a = f(a)
    if at_a is None or at_a > budget:
        return None if at_a is None else a
    step = 1
    while a < b:  # a fits: gallop up to the first size over, or b
        nxt = min(a + step, b)
        y = f(nxt)
        if y is None:
            return None
        if y > budget:
            b = nxt - 1
            break
        a, step = nxt, 2 * step
    while a < b:
        mid = (a + b + 1) // 2
        y = f(mid)
        if y is None:
            return None
        a, b = (mid, b) if y <= budget else (a, mid - 1)
    return a


def _flops(jaxpr) -> float:
    """FLOPs of a jaxpr: 2 x multiply-adds of each dot_general, one per output element
    of every other float op; a scan's body times its length."""
    total = 0.0
    for eqn in jaxpr.eqns:
        bodies = list(sub_jaxprs(eqn))
        if bodies:
            inner = [_flops(b) for b in bodies]
            times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            total += times * (max(inner) if eqn.primitive.name == "cond" else sum(inner))
            continue
        out = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(out[0].shape) * math.prod(lhs[d] for d in lhs_contract)
        else:
            total += sum(math.prod(a.shape) for a in out
                         if jnp.issubdtype(a.dtype, jnp.floating))
    return total


def traced_flops(workload, policy: Policy, optimizer) -> float:
    """FLOPs of one train step of `workload` under `policy` per device, counted on its
    traced program (`_flops`, no compile) and split evenly over the mesh's devices.
    On the tiny configs (XLA CPU) no remat's count is within 0.6% of the compiled one,
    remat's 1% over it (the compiler simplifies part of the recompute).

    Raises: whatever tracing the workload's loss raises.
    """
    made = workload_step(workload, policy, optimizer)
    devices = 1 if workload.mesh is None else workload.mesh.size
    return _flops(jax.make_jaxpr(made.step)(*made.args).jaxpr) / devices


# No remat is taken not to fit, uncompiled, where its estimate at the least measured
# scale (0.4x, llama_1b on XLA:TPU v5e) puts it over FAR x the budget.
FAR, LEAST_SCALE = 2.0, 0.4


def far_over(estimate: int | None, state: int, budget: int) -> bool:
    """Whether a step whose `activation_bytes` is `estimate` (None: no estimate) is far
    over `budget` (`FAR`), state (parameters + gradients + optimizer state) included."""
    return estimate is not None and state + LEAST_SCALE * estimate > FAR * budget


_AVAILABLE = re.compile(r"available HBM \(([0-9.]+)G\)")


def capacity(error: BaseException | str) -> int | None:
    """The device memory an out-of-memory compile says there is, bytes (XLA:TPU's
    CompileTimeHbmOom: "... exceeds available HBM (15.75G)"); None where it says none."""
    found = _AVAILABLE.search(str(error))
    return None if found is None else int(float(found.group(1)) * 2**30)


# Where the estimate is used: compilers whose step is minutes at real size and close to
# it (XLA:TPU's peak grew by 0.5x to 1.09x of it). XLA CPU's step grew by 3.4x of it, and
# the sizes run there (tests, the tiny configs) compile in seconds, where four traces a
# row cost as much as a compile: the floor's line did as well there (docs/speed.md).
PLATFORMS = ("tpu", "gpu")


def for_row(at_size: Callable[[int], object], policy: Policy | None, optimizer, unit: int,
            state: int, budget: int, capacity: Callable[[], int | None], platform: str):
    """(a fit row's `Estimate`, its none_far for `fit_search.fit_one`); (None, None) for
    the auto row (policy None) and off `PLATFORMS` (`platform`: the target's). at_size:
    size -> the workload; unit: the search's multiple; state, capacity: as `Estimate`'s.
    none_far(size): the ratio of no remat's
    traced FLOPs to the policy's where no remat's estimate is far over `budget`
    (`far_over`), else None (no remat is then compiled there)."""
    if policy is None or platform not in PLATFORMS:
        return None, None
    estimate = Estimate(estimator(at_size, policy, optimizer, unit), state, capacity)
    none = Policy(remat=False)

    def none_far(size: int) -> float | None:
        try:  # one trace at the answer, two more where no remat is far over
            work = at_size(size)
            if not far_over(activation_bytes(work, none, optimizer), state, budget):
                return None
            return traced_flops(work, none, optimizer) / traced_flops(work, policy, optimizer)
        except Exception:  # noqa: BLE001 - no count: no remat is compiled instead
            return None
    return estimate, none_far


def compiler_capacity(target) -> int | None:
    """The device memory the target's compiler holds a program to, bytes per device, where
    it says (XLA:TPU: 15.75 GiB on a v5e chip, 95.73 GiB on v5p): read from the
    out-of-memory error of a one-op program over a 256 GiB argument, a compile of under a
    second. None elsewhere (XLA CPU, GPU) or where that compile does not fail so.

    target: a parsed `targets.Target`.
    """
    if target.platform != "tpu":
        return None
    try:
        lowering.compile_for(lambda x: x * 2, jax.ShapeDtypeStruct((2**38,), jnp.int8),
                             target=target, count_flops=False)
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        return capacity(e)
    return None


def gpu_own_remat(size: int, m, target) -> str | None:
    """The line saying XLA would rematerialize on its own at `size` on `target`'s GPU, where
    the step there (`m`, a `StepMemory`; None: no step) is over what XLA:GPU holds a program
    to (`chip_memory.gpu_remat_limit` of `Target.memory`, the memory JAX takes, less the
    step's arguments and outputs); else None (and off a GPU, or its memory unknown)."""
    memory = target.memory if target.platform == "gpu" else None
    if m is None or memory is None:
        return None
    io = (m.argument_size_in_bytes or 0) + (m.output_size_in_bytes or 0) - (
        m.alias_size_in_bytes or 0)
    limit = chip_memory.gpu_remat_limit(memory.usable, io)
    if m.total_bytes <= limit:
        return None
    return (f"XLA would rematerialize on its own at {size}: the step's "
            f"{fmt_bytes(m.total_bytes)} is over the {fmt_bytes(limit)} XLA:GPU holds a program "
            f"to ({chip_memory.gpu_slop()}% of {fmt_bytes(memory.usable)} JAX takes, less "
            f"{fmt_bytes(io)} of arguments and outputs; XLA_FLAGS="
            "--xla_gpu_memory_limit_slop_factor): recompute beyond the policy, not counted here")


__all__ = ["PLATFORMS", "Estimate", "activation_bytes", "capacity", "compiler_capacity",
           "estimator", "far_over", "for_row", "gpu_own_remat", "traced_flops"]
