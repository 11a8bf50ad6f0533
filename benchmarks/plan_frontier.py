"""The planner against every fixed preset, compile-only: the issue-7 and issue-16 benchmark.

    python benchmarks/plan_frontier.py [--configs gpt2_small,llama_1b] [--out runs/plan]
        [--target cpu] [--groups G] [--objective flops|time] [--presets a,b] [--no-timing]

For each model (gpt2_small at batch 8, seq 1024; llama_1b at batch 4, seq
2048; bf16) runs `remat-kit plan` at budgets 0.15, 0.2, 0.25, 0.3, 0.4, 0.6 of
no remat's memory, with every preset (or --presets), in one run, and checks on
the JSON it writes:

- the planner's verified memory never exceeds the budget;
- it is never worse than the best preset that fits the same budget, in
  measured FLOPs and in the objective (predicted step time for --objective
  time), and strictly better at 4 or more of the 6 budgets;
- the frontier is monotone (a larger budget never scores worse);
- planning gpt2_small at the 6 budgets takes at most 120 s (timed in a run
  without presets, so nothing is compiled before it; --no-timing skips it).

The planner decides each tag per layer (one group per layer, `--groups`) and
chooses the base rule (nothing, dots_no_batch, dots) itself, compiling each
base alone; with presets, they are compiled first and the planner may keep
one that beats its own plan (`Planner.plan` takes any policy it has
compiled); the table's "planned policy" is then that preset's spec.

Prints one table per model (the command's: FLOPs and predicted time over no
remat, for the plan and the best preset) and a summary line per check, with
the load average, since the CPU may be shared. Exit status 1 if a check
fails. Plans are not cached (a cache hit would time nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from remat_kit.cli import commands as cli

SHAPES = {"gpt2_small": (8, 1024), "llama_1b": (4, 2048)}
BUDGETS = "0.15,0.2,0.25,0.3,0.4,0.6"
STRICTLY_BETTER = 4  # budgets of the 6 where the plan must beat the best preset
PLAN_SECONDS_LIMIT = {"gpt2_small": 120.0}


def check(doc: dict, name: str) -> list[str]:
    """Failed checks of one `remat-kit plan --json` document (empty: all pass)."""
    failures, strictly, last = [], 0, None
    for row in sorted(doc["budgets"], key=lambda r: r["budget_bytes"]):
        p, preset = row["plan"], row["best_preset"]
        if p is None:
            if preset is not None:
                failures.append(f"{row['budget']}: a preset fits but the planner found no plan")
            continue
        by_time = p["objective"] == "time"
        score = p["predicted_seconds"] if by_time else p["measured_flops"]
        if p["measured_bytes"] > row["budget_bytes"]:
            failures.append(f"{row['budget']}: verified memory over budget")
        if preset is not None:
            preset_score = preset["predicted_seconds"] if by_time else preset["flops"]
            if score > preset_score * (1 + 1e-9):
                failures.append(f"{row['budget']}: worse than preset {preset['names'][0]} in "
                                f"{p['objective']}")
            if p["measured_flops"] > preset["flops"] and not by_time:
                failures.append(f"{row['budget']}: more FLOPs than preset {preset['names'][0]}")
            strictly += score < preset_score * (1 - 1e-6)
        if last is not None and score > last * (1 + 1e-9):
            failures.append(f"{row['budget']}: scores worse than a smaller budget (not monotone)")
        last = score
    if strictly < STRICTLY_BETTER:
        failures.append(f"strictly better than the best fitting preset at only {strictly} "
                        f"budget(s) (want {STRICTLY_BETTER})")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(SHAPES))
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--presets", default=None,
                        help="specs to compare with (default: every preset)")
    parser.add_argument("--out", default="runs/plan_frontier", help="folder for JSON and PNG")
    parser.add_argument("--target", default=None, help="e.g. tpu:v5e:1x1 (default: this CPU)")
    parser.add_argument("--groups", default=None, help="layer groups (default: one per layer)")
    parser.add_argument("--objective", default=None, help="flops or time")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed planning run")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    failed = False
    for name in args.configs.split(","):
        batch, seq = SHAPES[name]
        path = os.path.join(args.out, f"{name}.json")
        common = ["plan", "--config", name, "--batch", str(batch), "--seq", str(seq),
                  "--dtype", "bfloat16", "--budgets", args.budgets, "--cache", ""]
        for flag in ("target", "groups", "objective"):
            if getattr(args, flag):
                common += [f"--{flag}", getattr(args, flag)]
        failures = []
        if name in PLAN_SECONDS_LIMIT and not args.no_timing:  # planning alone, from nothing
            alone = os.path.join(args.out, f"{name}_alone.json")
            print(f"load average before planning {name}: {os.getloadavg()[0]:.1f} "
                  f"({os.cpu_count()} CPUs)")
            if cli.main([*common, "--no-presets", "--json", alone]):
                return 2
            with open(alone) as f:
                seconds = json.load(f)["context"]["plan_seconds"]
            print(f"load average after planning {name}: {os.getloadavg()[0]:.1f}")
            if seconds > PLAN_SECONDS_LIMIT[name]:
                failures.append(f"planning took {seconds:.0f} s > {PLAN_SECONDS_LIMIT[name]:.0f} s")
        print(f"load average before {name} with presets: {os.getloadavg()[0]:.1f}")
        code = cli.main([*common, "--json", path, "--plot", os.path.join(args.out, f"{name}.png"),
                         *(["--presets", args.presets] if args.presets else [])])
        if code:
            return code
        with open(path) as f:
            failures += check(json.load(f), name)
        print(f"load average after {name}: {os.getloadavg()[0]:.1f}")
        print(f"{name}: " + ("all checks pass" if not failures else "; ".join(failures)))
        failed |= bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
