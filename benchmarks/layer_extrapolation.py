"""Can the planner's anchors come from a 1- and 2-layer twin?

    PYTHONPATH=. python benchmarks/layer_extrapolation.py [--cases tiny:4:128,llama_1b:16:256]
        [--batch 1] [--dtype bfloat16] [--target cpu]

For each case (a reference config, the depth L to check and the seq), the policies the planner
compiles as its anchors (none, full, its base rules, every decidable tag saved) are
compiled on the config's 1- and 2-layer twins and at L layers; a step's bytes and FLOPs
are taken as affine in the depth (f(L) = f(1) + (L - 1) (f(2) - f(1))), and the
extrapolated figure set beside the compiled one, with each compile's seconds. Prints one
line per policy and the largest errors.
"""

from __future__ import annotations

import argparse
import time

from remat_kit.decide.plan import Planner
from remat_kit.models import get_config
from remat_kit.models.program import workload
from remat_kit.policy.policy import Policy

CASES = "tiny:4:128,tiny_llama:4:128,llama_1b:16:256"


def anchors(config: str, layers: int, seq: int, args) -> dict[str, tuple]:
    """Policy -> (bytes, FLOPs, compile seconds) at `layers` layers."""
    cfg = get_config(config).replace(num_layers=layers)
    planner = Planner(workload(cfg, args.batch, seq, dtype=args.dtype), cache=None,
                      target=args.target)
    out = {}

    def timed(name, policy):
        start = time.perf_counter()
        record = planner.measure_all([policy])[0]
        out[name] = (record.memory_bytes, record.flops, time.perf_counter() - start)
    for policy in (Policy(remat=False), Policy(),
                   *(Policy(base=b) for b in planner.bases if b != "nothing")):
        timed(str(policy), policy)
    every = planner.offload_free_model()  # after full: the model reads its compile
    timed("every tag saved", Policy(save=frozenset(t for t in every.tags if t not in every.fixed)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default="cpu")
    args = ap.parse_args()
    for item in args.cases.split(","):
        config, depth, seq = item.split(":")
        one, two, whole = (anchors(config, n, int(seq), args) for n in (1, 2, int(depth)))
        print(f"{config}, {args.target}, batch {args.batch}, seq {seq}, {args.dtype}: "
              f"layers 1, 2 -> {depth}", flush=True)
        worst = [0.0, 0.0]
        for name, (b, f, s) in whole.items():
            (b1, f1, s1), (b2, f2, s2) = one[name], two[name]
            n = int(depth) - 1
            eb, ef = (b1 + n * (b2 - b1)) / b - 1, (f1 + n * (f2 - f1)) / f - 1
            worst = [max(worst[0], abs(eb)), max(worst[1], abs(ef))]
            print(f"  {name[:40]:40s} bytes {b:>14,} extrapolated {eb:+7.2%}, FLOPs {ef:+7.3%}; "
                  f"compile {s1:5.1f} + {s2:5.1f} s vs {s:6.1f} s", flush=True)
        print(f"  largest |error|: bytes {worst[0]:.2%}, FLOPs {worst[1]:.3%}", flush=True)


if __name__ == "__main__":
    main()
