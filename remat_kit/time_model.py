"""Predicted time: each equation costs max(FLOPs / peak FLOP/s, bytes accessed / bandwidth).

The figures of one equation come from XLA's cost analysis of that equation
lowered alone (`HloCostAnalysis` of the unoptimized HLO: "flops" and "bytes
accessed", its operands read and its outputs written, before any fusion). The
peaks are the target's (`remat_kit.targets.peaks`, from vendor pages); on the
CPU target they are measured once on this machine (`calibrate_cpu`: a matmul and
a copy, a fraction of a second) and cached in a small JSON file.

This is a roofline per equation (Williams et al. 2009, "Roofline: an insightful
visual performance model"). Fusion is left out, so element-wise chains are
charged one read and one write per equation: memory-bound recompute is
predicted high rather than low.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from remat_kit import targets

OBJECTIVES = ("flops", "time")


def _eqn_key(eqn) -> tuple:
    return (eqn.primitive.name, tuple(str(v.aval) for v in eqn.invars),
            tuple(sorted((k, str(v)) for k, v in eqn.params.items())))


def eqn_costs(eqn, cache: dict) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of one jaxpr equation, XLA's HloCostAnalysis of it
    lowered alone (no compile). An equation XLA cannot lower alone costs (0, 0).

    cache: figures already measured, keyed by primitive, input types and params.
    """
    key = _eqn_key(eqn)
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


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A target's peaks, for `seconds`.

    Attributes:
      bf16_flops, f32_flops: peak FLOP/s of 16-bit and 32-bit math.
      bandwidth: device memory bandwidth, bytes/s.
      host_bandwidth: device <-> host bytes/s per direction (None: no host memory).
      source: where the figures come from (a vendor page, or "measured on this machine").
    """

    bf16_flops: float
    f32_flops: float
    bandwidth: float
    host_bandwidth: float | None = None
    source: str = ""

    def seconds(self, flops: float, nbytes: float, dtype=None) -> float:
        """max(flops / peak of `dtype`, nbytes / bandwidth); 16-bit dtypes take bf16's peak."""
        peak = self.bf16_flops if getattr(dtype, "itemsize", 4) <= 2 else self.f32_flops
        return max(flops / peak, nbytes / self.bandwidth)


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remat_kit", "cpu_roofline.json")


def calibrate_cpu(path: str | None = None) -> Roofline:
    """This machine's CPU peaks, measured once and cached at `path` (default
    $XDG_CACHE_HOME/remat_kit/cpu_roofline.json).

    A 1024x1024 f32 matmul (2 * 1024**3 FLOPs) and a copy of 64 MiB (read and
    written: 128 MiB accessed), each the best of 5 runs after a warm-up, with
    XLA CPU. bf16 math on XLA CPU runs no faster than f32: both peaks are the
    matmul's.
    """
    path = path or _cache_path()
    try:
        with open(path) as f:
            d = json.load(f)
        return Roofline(d["f32_flops"], d["f32_flops"], d["bandwidth"], None, d["source"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cpu = jax.devices("cpu")[0]

    def best(f, *xs):
        jax.block_until_ready(f(*xs))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(f(*xs))
            times.append(time.perf_counter() - start)
        return min(times)

    n = 1024
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    flops = 2 * n**3 / best(jax.jit(lambda x: x @ x), a)
    x = jax.device_put(jnp.ones((16 * 2**20,), jnp.float32), cpu)  # 64 MiB
    bandwidth = 2 * x.nbytes / best(jax.jit(lambda v: v * 1.0001), x)
    source = (f"measured on this machine ({os.cpu_count()} CPUs): a {n}x{n} f32 matmul and a "
              "64 MiB copy, best of 5")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"f32_flops": flops, "bandwidth": bandwidth, "source": source}, f)
    except OSError:
        pass  # uncached: measured again next time
    return Roofline(flops, flops, bandwidth, None, source)


def roofline(target: "str | targets.Target | None" = None) -> Roofline:
    """The `Roofline` of `target`: its listed peaks (`targets.peaks`), or for the
    CPU (and a GPU or TPU with no listed figures) a measurement of this CPU."""
    target = targets.parse_target(target)
    found = targets.peaks(target)
    if found is None:
        return calibrate_cpu()
    return Roofline(found["bf16_flops"], found["f32_flops"], found["bandwidth"],
                    found.get("host_bandwidth"), found["source"])


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


__all__ = ["OBJECTIVES", "Roofline", "calibrate_cpu", "eqn_costs", "program_seconds",
           "roofline"]
