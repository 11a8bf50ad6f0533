"""The time model against the CPU's own step times: the issue-16 truth check.

    python benchmarks/time_model_cpu.py [--config tiny] [--batch 8] [--seq 128] [--time 5]
        [--budgets 0.55,0.65,0.8] [--out runs/time_model]

In one run:

1. `remat-kit compare --config C --time N --json` over every preset: each
   preset's predicted step-time ratio to `none` (`Record.predicted_seconds`, a
   roofline per compiled op, `remat_kit.measure.time_model`) against its measured one
   (the median over N rounds, every policy one step per round, of its step
   over `none`'s step of the same round). Check: within 10% for every preset.
2. At each budget, the planner's plan for objective `flops` and for objective
   `time` (one decision per tag, not cached), both timed beside `none` in one
   `measure` call. Check: the time plan's measured step time is at most the
   FLOP plan's (equal where both objectives choose one policy).

Prints the predicted-versus-measured table (markdown), the plans' table, a line
per check and the load average before and after, since the CPU may be shared:
timings under load are noisy, which the rounds and per-round ratios only
damp. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from remat_kit.cli import commands as cli
from remat_kit.measure import targets
from remat_kit.api.answers import measure
from remat_kit.models import CONFIGS
from remat_kit.models.program import workload
from remat_kit.api.configs import config_planner

TOLERANCE = 0.10  # predicted ratio to none within 10% of the measured one


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def preset_table(doc: dict) -> tuple[list[str], list[str]]:
    """(markdown lines, failures) of a `compare --time --json` document."""
    lines = ["| policy | FLOPs × none | predicted × none | measured × none | predicted / measured |",
             "| --- | ---: | ---: | ---: | ---: |"]
    failures = []
    for r in doc["records"]:
        if r["error"] or not r["step_time"] or r["predicted_ratio_to_none"] is None:
            continue
        measured, predicted = r["step_time"]["ratio_to_none"], r["predicted_ratio_to_none"]
        off = predicted / measured - 1
        lines.append(f"| {', '.join(r['names'][:2])} | {r['flops_ratio_to_none']:.3f} | "
                     f"{predicted:.3f} | {measured:.3f} | {off:+.1%} |")
        if abs(off) > TOLERANCE:
            failures.append(f"{r['names'][0]}: predicted {predicted:.3f} x none, measured "
                            f"{measured:.3f} ({off:+.1%})")
    return lines, failures


def plan_table(config: str, batch: int, seq: int, budgets: list[str],
               steps: int) -> tuple[list[str], list[str]]:
    """(markdown lines, failures): each budget's FLOP and time plans, timed in one run."""
    cfg = CONFIGS[config]
    specs, predicted = {}, {}
    for objective in ("flops", "time"):
        # One decision per tag: a plan is then one spec string, timed as the presets are.
        planner = config_planner(cfg, batch, seq, cache=None, objective=objective, groups=1)
        for b in budgets:
            plan = planner.plan(b)
            specs[(b, objective)] = plan.spec
            predicted[plan.spec] = 1 + plan.time_overhead
    policies = ["none", *dict.fromkeys(specs.values())]
    records = measure(workload(cfg, batch, seq), policies=policies, names=policies,
                      time_steps=steps, target=targets.parse_target("cpu"))
    ratio = {name: r.step_time.ratio_to_none for r in records for name in r.names}
    lines = ["| budget | FLOP plan | predicted × none | measured × none | time plan | "
             "predicted × none | measured × none |", "| --- | --- | ---: | ---: | --- | ---: | ---: |"]
    failures = []
    for b in budgets:
        f, t = specs[(b, "flops")], specs[(b, "time")]
        lines.append(f"| {b} | `{f}` | {predicted[f]:.3f} | {ratio[f]:.3f} | `{t}` | "
                     f"{predicted[t]:.3f} | {ratio[t]:.3f} |")
        if ratio[t] > ratio[f]:
            failures.append(f"budget {b}: the time plan's step ({ratio[t]:.3f} x none) is "
                            f"slower than the FLOP plan's ({ratio[f]:.3f})")
    return lines, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--time", type=int, default=5, help="timed rounds (compare --time)")
    ap.add_argument("--budgets", default="0.55,0.65,0.8")
    ap.add_argument("--out", default="runs/time_model")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"compare_{args.config}.json")
    print(f"before: {_load()}", flush=True)
    command = ["compare", "--config", args.config, "--batch", str(args.batch), "--seq",
               str(args.seq), "--time", str(args.time), "--json", path]
    if cli.main(command) != 0:
        return 1
    with open(path) as f:
        presets, failures = preset_table(json.load(f))
    plans, plan_failures = plan_table(args.config, args.batch, args.seq,
                                      args.budgets.split(","), args.time)
    print(f"\n`remat-kit {' '.join(command)}` ({os.cpu_count()} CPUs):\n")
    print("\n".join(presets))
    print(f"\nplans at budgets {args.budgets} (x none temp), timed in one run, {args.time} "
          "rounds:\n")
    print("\n".join(plans))
    print(f"\nafter: {_load()}")
    for failure in failures + plan_failures:
        print(f"FAIL {failure}")
    print(f"predicted within {TOLERANCE:.0%} of measured: "
          f"{'pass' if not failures else f'{len(failures)} presets off'}; time plan at most "
          f"the FLOP plan: {'pass' if not plan_failures else 'fail'}")
    return 1 if failures or plan_failures else 0


if __name__ == "__main__":
    sys.exit(main())
