"""Mixture of experts priced and planned: a Mixtral-8x7B-shaped decoder, its experts over chips.

    flock /tmp/heavy.lock python benchmarks/moe.py [--target tpu:v5p:2x2x1] [--chips 4]
        [--seq 4096] [--batch 4] [--layers 4] [--scale 1] [--budgets 0.5,0.35,0.25]
        [--policies "none full ..."] [--json out.json]

The model is `tests/zoo/moe_ep_nnx.py` (experts split over a mesh axis `expert` of `--chips`,
dispatch and combine by all-to-all; `--chips 1`: `tests/zoo/moe_nnx.py` on one chip) at
Mixtral 8x7B's widths (d 4096, 32 heads of 128, 8 experts of MLP 14336, top-2, vocab 32000,
bf16 activations), `--layers` layers; `--scale k` divides d, the heads and the MLP by k where
the full width compiles too slowly here. Grouped matmuls: megablox `gmm` on a TPU,
`jax.lax.ragged_dot` elsewhere. Per policy: FLOPs and the kernels' share, the peak per chip,
the predicted step and the all-to-alls' share of it, compile seconds; then `rk.plan` at
`--budgets`, each a point between `full`'s peak (0) and `none`'s (1), beside the presets.
Compile-only.
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("none", "full", "maxtext:minimal", "maxtext:save_dot_except_mlp",
            "save:moe_dispatch,moe_combine")
MIXTRAL_8X7B = {"vocab": 32000, "dim": 4096, "heads": 32, "head_dim": 128, "experts": 8,
                "top_k": 2, "hidden": 14336, "dtype": "bfloat16"}


def build(args, rk):
    """The Workload of the benchmark's model on `args.target`."""
    from tests.zoo import moe_ep_nnx, moe_nnx
    shape = dict(MIXTRAL_8X7B, layers=args.layers, dim=MIXTRAL_8X7B["dim"] // args.scale,
                 heads=MIXTRAL_8X7B["heads"] // args.scale,
                 hidden=MIXTRAL_8X7B["hidden"] // args.scale,
                 matmul="gmm" if args.target.startswith("tpu") else "ragged_dot")
    if args.chips > 1:
        model, _, _ = moe_ep_nnx.make(args.batch, args.seq, abstract=True, chips=args.chips,
                                      devices=rk.targets.devices(args.target), **shape)
    else:
        model, _, _ = moe_nnx.make(args.batch, args.seq, abstract=True, **shape)
    return rk.from_model.workload(model, args.batch, args.seq)


def _line(row: dict) -> str:
    return (f"{row['policy']:34s} {row['flops'] / 1e12:8.2f} TFLOP (kernels "
            f"{row['kernel_flops'] / 1e12:6.2f}) peak {row['peak_bytes'] / 2**30:7.2f} GiB "
            f"step {row['predicted_s'] * 1e3:8.2f} ms (all-to-all "
            f"{row['all_to_all_s'] * 1e3:6.2f} ms) compile {row['compile_s']:6.1f} s "
            f"{row['error'] or ''}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="tpu:v5p:2x2x1")
    parser.add_argument("--chips", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--budgets", default="0.75,0.5,0.25")
    parser.add_argument("--policies", default=" ".join(POLICIES))  # specs hold commas
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import remat_kit as rk

    work = build(args, rk)
    print(f"{args.target}, experts over {args.chips} chip(s), width 1/{args.scale}, "
          f"{work.placement or 'one device'}", flush=True)
    rows = []
    for r in rk.measure(work, policies=args.policies.split(), target=args.target):
        terms = (r.audit or {}).get("step_terms") or {}
        rows.append({"policy": r.names[0], "flops": r.flops or 0.0,
                     "kernel_flops": r.kernel_flops or 0.0, "peak_bytes": r.memory_bytes or 0,
                     "predicted_s": r.predicted_seconds or 0.0,
                     "all_to_all_s": terms.get("all_to_all_seconds", 0.0),
                     "compile_s": r.compile_seconds or 0.0, "error": r.error})
        print(_line(rows[-1]), flush=True)
    peak = {row["policy"]: row["peak_bytes"] for row in rows}
    for point in args.budgets.split(","):
        budget = int(peak["full"] + float(point) * (peak["none"] - peak["full"]))
        start = time.perf_counter()
        try:
            p = rk.plan(work, budget=budget, target=args.target, cache=False)
        except ValueError as e:  # a BudgetError: the budget below what any policy reaches
            print(f"plan {point}: {e}", flush=True)
            continue
        row = {"policy": f"plan {point}: {p.spec}", "flops": p.measured_flops,
               "kernel_flops": 0.0, "peak_bytes": p.measured_bytes,
               "predicted_s": p.predicted_seconds or 0.0, "all_to_all_s": 0.0,
               "compile_s": time.perf_counter() - start, "error": None,
               "iterations": p.iterations}
        rows.append(row)
        print(_line(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
