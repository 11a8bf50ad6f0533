"""The audit's share of `compare --policies all`'s wall time: the seconds its three steps
(`audit.recomputed`, `audit.compiled_facts`, `audit.audit`) take, timed inside one run of
every preset on the reference tiny config, over that run's wall time. The audit reads only what
the compile produced (no second compile), so this share is its whole cost; the goal is <= 5%.

    PYTHONPATH=$PWD python benchmarks/audit_cost.py [--config tiny] [--batch 8] [--seq 128]
"""

import argparse
import functools
import time

import remat_kit as rk
from remat_kit.ui.inputs import preset_policies
from remat_kit.measure import audit

spent = [0.0]


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.perf_counter() - start
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    for name in ("recomputed", "compiled_facts", "audit"):
        setattr(audit, name, timed(getattr(audit, name)))
    work = rk.models.workload(rk.models.get_config(a.config), batch=a.batch, seq=a.seq)
    start = time.perf_counter()
    rows = rk.measure(work, policies=preset_policies())
    wall = time.perf_counter() - start
    print(f"{a.config} b{a.batch} s{a.seq}, {len(rows)} programs: wall {wall:.1f} s, audit "
          f"{spent[0]:.3f} s ({100 * spent[0] / wall:.2f}% of the wall)")


if __name__ == "__main__":
    main()
