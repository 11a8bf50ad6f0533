"""Timed steps: each compiled program run on the same data, in rounds.

`measure(..., time_steps=N)` runs every policy's compiled value-and-grad on one batch of sample
data (`sample_data`, `random_like`), one step per policy per round (`time_rounds`), so load that
comes and goes falls on every policy alike; each record gets a `StepTime` whose ratio to no remat
is taken within each round (`with_step_times`). Docs: docs/compare.md (`--time N`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from remat_kit.measure.record import Record, StepTime


def random_like(structs, key):
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


def sample_data(structs, sample_args: "Callable | None") -> list:
    """The leaves of one batch for timed steps: sample_args(key 0), or where it is
    None `random_like(structs)`, each leaf put where its struct is sharded."""
    data = (sample_args or (lambda k: random_like(structs, k)))(jax.random.key(0))
    return [jax.device_put(x, s.sharding) if getattr(s, "sharding", None) else x
            for x, s in zip(jax.tree.leaves(data), jax.tree.leaves(structs))]


def time_rounds(compiled: dict, leaves, steps: int) -> tuple[dict, dict]:
    """Step seconds of each compiled program, in `steps` rounds of one step each.

    After one warm-up step each (first-run allocation and caches), every round
    runs each program once in turn, so load that comes and goes on a shared
    machine falls on all of them alike, and a ratio between two programs can be
    taken within each round.

    Args:
      compiled: key -> an executable called on `leaves`.
    Returns:
      ({key: [seconds per round]}, {key: "TypeName: message"} of the programs
      that failed to run, which are then left out of the rounds).
    """
    times, errors = {k: [] for k in compiled}, {}

    def run(key, timed):
        start = time.perf_counter()
        try:
            jax.block_until_ready(compiled[key](*leaves))
        except Exception as e:  # noqa: BLE001 - one failing policy must not hide the others
            errors[key] = f"{type(e).__name__}: {e}"
            return
        if timed:
            times[key].append(time.perf_counter() - start)

    for key in compiled:
        run(key, False)
    for _ in range(steps):
        for key in compiled:
            if key not in errors:
                run(key, True)
    return {k: v for k, v in times.items() if k not in errors}, errors


def step_time(times: list[float], none: list[float] | None) -> StepTime:
    """A `StepTime` of per-round seconds; its ratio to none is the median of the
    per-round ratios to `none`'s step of the same round."""
    q1, _, q3 = (statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1
                 else (times[0],) * 3)
    ratio = statistics.median(t / n for t, n in zip(times, none)) if none else None
    return StepTime(statistics.median(times), min(times), max(times), q1, q3, len(times),
                    ratio)


def with_step_times(records: list[Record], timed: dict, data, steps: int) -> list[Record]:
    """`records` with the step times of the `timed` programs (`time_rounds`), or the
    error one raised when run."""
    times, errors = time_rounds(timed, data, steps)
    none = next((times.get(i) for i, r in enumerate(records) if r.policy == "none"), None)
    return [dataclasses.replace(r, error=errors[i]) if i in errors
            else dataclasses.replace(r, step_time=step_time(times[i], none))
            if i in times else r for i, r in enumerate(records)]


__all__ = ["random_like", "sample_data", "step_time", "time_rounds", "with_step_times"]
