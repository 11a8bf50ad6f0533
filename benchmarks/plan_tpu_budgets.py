"""`plan` on tpu:v5e:1x1 at 0.5-0.8 of no remat's peak, by FLOPs and by predicted time.

    python benchmarks/plan_tpu_budgets.py [--config gpt2_small] [--layers N] [--batch 8]
        [--seq 1024] [--budgets 0.5,0.6,0.7,0.8] [--target tpu:v5e:1x1] [--presets a,b]
        [--vocab-chunks N]

The planner's performance check: the planner on a TPU target never returns
`full` where a cheaper preset fits (before the time model's fix, docs/plan.md,
it returned `full` at every budget from 0.5 to 0.8 by predicted time). For each
objective ("flops", "time") one `Planner` compiles the presets (`PRESETS`), then
plans every budget (`Planner.frontier`); per budget it prints the chosen
policy, its compiled peak, its FLOPs and predicted step time over no remat's,
and the best preset that fits, and checks:

- the plan's compiled peak is within the budget;
- the plan is not `full` where a preset with fewer FLOPs fits.

bf16 activations, compile-only (deviceless TPU compiles through libtpu);
compiled figures are kept in the commands' figure cache, so the second
objective (and a rerun) compiles only what it did not before. gpt2_small at
batch 8, seq 1024 unrolled takes ~3 minutes a compile on this 2-core machine
(docs/plan.md), so `--layers` cuts the stack for a run of minutes; the run
says which shape it planned. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from remat_kit.cli import commands as cli
from remat_kit.models import get_config
from remat_kit.api.configs import config_planner
from remat_kit.policy.spec import parse

PRESETS = "none,full,dots_no_batch,selective,minimal,save_dot_with_context_except_mlp,save_qkv_proj"
BUDGETS = "0.5,0.6,0.7,0.8"


def run(cfg, batch: int, seq: int, budgets: list[float], target: str, presets: list[str],
        objective: str) -> list[str]:
    """Plans every budget by `objective`; prints the table; returns the failed checks."""
    planner = config_planner(cfg, batch, seq, dtype="bfloat16", cache=None, target=target,
                             objective=objective)
    records = planner.measure_all([parse(p) for p in presets], names=presets)
    none = planner.none()
    start = time.perf_counter()
    fits = [b for b in budgets if b * none.memory_bytes >= planner.minimum()[0]]
    plans = dict(zip(fits, planner.frontier(fits)))
    seconds = time.perf_counter() - start
    print(f"\nobjective {objective}: no remat {none.memory_bytes / 2**30:.2f} GiB peak, "
          f"{none.flops:.4g} FLOPs, predicted {planner.seconds(parse('none')) * 1e3:.3g} ms; "
          f"full {planner.measure(parse('full')).memory_bytes / none.memory_bytes:.3f} of its peak; "
          f"planned in {seconds:.0f} s")
    print(f"{'budget':>6} {'planned policy':<44} {'peak x none':>11} {'FLOPs +':>8} "
          f"{'time +':>7}  {'best preset that fits':<34} {'FLOPs +':>8}")
    failures = []
    for b in budgets:
        limit = b * none.memory_bytes
        fitting = [r for r in records if r.error is None and r.memory_bytes is not None
                   and r.memory_bytes <= limit]
        best = min(fitting, key=planner.score, default=None)
        preset = (f"{best.names[0]:<34} {best.flops / none.flops - 1:+8.2%}" if best
                  else "no preset fits")
        p = plans.get(b)
        if p is None:
            print(f"{b:>6} {'below the minimum':<44} {'':>11} {'':>8} {'':>7}  {preset}")
            continue
        print(f"{b:>6} {p.spec[:44]:<44} {p.memory_fraction:>11.3f} {p.flops_overhead:+8.2%} "
              f"{p.time_overhead:+7.2%}  {preset}")
        if p.measured_bytes > p.budget_bytes:
            failures.append(f"{objective} {b}: the plan's peak is over the budget")
        cheaper = [r.names[0] for r in fitting if r.flops < p.measured_flops * (1 - 1e-6)]
        if p.spec == "full" and cheaper:
            failures.append(f"{objective} {b}: full, where {', '.join(cheaper)} fit(s) with "
                            "fewer FLOPs")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt2_small")
    parser.add_argument("--layers", type=int, default=None, help="default: the config's")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--vocab-chunks", type=int, default=None,
                        help="the loss over this many vocabulary chunks (docs/models.md)")
    args = parser.parse_args(argv)
    cli.use_compile_cache()
    cfg = get_config(args.config)
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    if args.vocab_chunks is not None:
        cfg = cfg.replace(vocab_chunks=args.vocab_chunks)
    print(f"{args.config} ({cfg.num_layers} layers, d_model {cfg.d_model}, vocab "
          f"{cfg.vocab_size} in {cfg.vocab_chunks or 1} loss chunk(s)), batch {args.batch}, seq {args.seq}, bf16, {args.target}")
    budgets = [float(b) for b in args.budgets.split(",")]
    failures = []
    for objective in ("flops", "time"):
        failures += run(cfg, args.batch, args.seq, budgets, args.target,
                        args.presets.split(","), objective)
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    for f in failures:
        print("FAIL", f)
    print("never full where a cheaper preset fits, by FLOPs and by predicted time: "
          + ("no" if failures else "yes"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
