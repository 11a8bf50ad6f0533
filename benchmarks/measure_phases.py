"""Where `rk.measure`'s time goes, per phase, cold and with the caches of a first run.

    PYTHONPATH=. python benchmarks/measure_phases.py                       # gpt2_small, CPU
    PYTHONPATH=. python benchmarks/measure_phases.py --target tpu:v5e:1x1 --policies none,full

Runs `measure_config` twice in one process on an empty compile cache (a
temporary folder): the first run compiles everything, the second reads back
what the first kept (`figure_cache`, JAX's persistent cache). Each phase is
timed where measure calls it (wall seconds, summed over policies):

  staging    the value-and-grad traced with its residuals (`residuals.stage`)
  lowering   the staged program lowered to StableHLO (`lowering.lower`)
  compile    XLA's compile, on measure's worker threads (overlaps the above)
  figures    memory, FLOPs and the time model read from the compile
  layer      the per-layer residual column (`explain.stack_stored_bytes`)

Prints one row per run, the load average before and after.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from remat_kit.measure import lowering  # noqa: E402
from remat_kit.models import get_config  # noqa: E402

measure = importlib.import_module("remat_kit.measure.measure")  # rk.measure is the function
from remat_kit.api import configs  # noqa: E402
PHASES = {"staging": (measure, "stage"), "lowering": (lowering, "lower"),
          "compile": (measure._Compiles, "_compile"), "figures": (measure, "_figures"),
          "layer": (measure, "stack_stored_bytes")}


def _timed(spent: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return wrapper


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="gpt2_small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--policies", default="none,full,selective,minimal")
    parser.add_argument("--target", default="cpu")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    spent = collections.defaultdict(float)
    for name, (owner, attr) in PHASES.items():
        setattr(owner, attr, _timed(spent, name, getattr(owner, attr)))
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="phases_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cfg = get_config(args.config)
    print(f"{args.config} batch {args.batch} seq {args.seq}, {len(policies)} policies, "
          f"target {args.target}; seconds summed over policies")
    print(f"{'run':6s} {'total':>7s} " + " ".join(f"{p:>9s}" for p in PHASES) + "  load")
    for run in ("cold", "cached"):
        spent.clear()
        load, start = os.getloadavg()[0], time.perf_counter()
        records = configs.measure_config(cfg, args.batch, args.seq, policies,
                                         target=args.target)
        total = time.perf_counter() - start
        bad = [r.error for r in records if r.error]
        if bad:
            print(f"{run}: {bad[0]}")
            return 1
        print(f"{run:6s} {total:7.1f} " + " ".join(f"{spent[p]:9.2f}" for p in PHASES)
              + f"  {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
