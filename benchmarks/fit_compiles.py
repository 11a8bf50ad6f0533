"""fit's compiles per policy on the tiny reference configs, seq and batch.

    PYTHONPATH=. python benchmarks/fit_compiles.py [--target tpu:v5e:1x1]

Runs `rk.fit` with full, minimal and none (in that order: later rows start at the largest
size found so far) on `tiny` and `tiny_llama`, varying seq (batch 2, multiple 16) and the
batch (seq 32), and prints per row the size found, the compiles it counts (no remat at the
answer included) and the sizes probed, in order. The answer is proved by its last two
probes of that policy: the size fits, size + multiple does not. Run it in another tree
(`PYTHONPATH=/path/to/tree`) to compare searches on the same machine.
"""

from __future__ import annotations

import argparse
import os
import time

from remat_kit.models import get_config
from remat_kit.api.configs import fit

CASES = [("tiny", "seq", dict(batch=2, multiple=16), 6 * 2**20),
         ("tiny_llama", "seq", dict(batch=2, multiple=16), 5 * 2**20),
         ("tiny", "batch", dict(seq=32), 8 * 2**20),
         ("tiny_llama", "batch", dict(seq=32), 8 * 2**20)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    for name, vary, sizes, budget in CASES:
        start = time.perf_counter()
        result = fit(get_config(name), budget, vary=vary, policies=["full", "minimal", "none"],
                     target=args.target, **sizes)
        rows = "; ".join(f"{r.policy} {r.size} ({len(r.probes)} probes: "
                         f"{', '.join(str(p[0]) for p in r.probes)})" for r in result.rows)
        print(f"{name} --vary {vary}: {rows}; {time.perf_counter() - start:.0f} s, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
