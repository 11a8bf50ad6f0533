"""The planner against every fixed preset, compile-only: the issue-7 benchmark.

    python benchmarks/plan_frontier.py [--configs gpt2_small,llama_1b] [--out runs/plan]

For each model (gpt2_small at batch 8, seq 1024; llama_1b at batch 4, seq
2048; bf16) runs `remat-kit plan` at budgets 0.1, 0.15, 0.2, 0.3, 0.4, 0.6 of
the no-remat temp memory, with every preset, and checks on the JSON it writes:

- the planner's verified temp memory never exceeds the budget;
- its verified FLOP overhead is at most that of the best preset that fits
  the same budget, and strictly lower at two or more budgets;
- the frontier is monotone (a larger budget never gives more FLOPs);
- planning gpt2_small at the 6 budgets takes at most 120 s (timed in a run
  without presets, so nothing is compiled before it).

With presets, they are compiled first and the planner may keep one that
beats its own plan (`Planner.plan` takes any policy it has compiled); the
table's "planned policy" is then that preset's spec.

Prints one table per model (the command's) and a summary line per check,
with the load average, since the CPU may be shared. Exit status 1 if a check
fails. Plans are not cached (a cache hit would time nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from remat_kit import cli

SHAPES = {"gpt2_small": (8, 1024), "llama_1b": (4, 2048)}
BUDGETS = "0.1,0.15,0.2,0.3,0.4,0.6"
PLAN_SECONDS_LIMIT = {"gpt2_small": 120.0}


def check(doc: dict, name: str) -> list[str]:
    """Failed checks of one `remat-kit plan --json` document (empty: all pass)."""
    failures, strictly_lower, last = [], 0, None
    for row in sorted(doc["budgets"], key=lambda r: r["budget_bytes"]):
        p, preset = row["plan"], row["best_preset"]
        if p is None:
            if preset is not None:
                failures.append(f"{row['budget']}: a preset fits but the planner found no plan")
            continue
        if p["measured_bytes"] > row["budget_bytes"]:
            failures.append(f"{row['budget']}: verified memory over budget")
        if preset is not None:
            if p["measured_flops"] > preset["flops"]:
                failures.append(f"{row['budget']}: more FLOPs than preset {preset['names'][0]}")
            strictly_lower += p["measured_flops"] < preset["flops"]
        if last is not None and p["measured_flops"] > last:
            failures.append(f"{row['budget']}: more FLOPs than a smaller budget (not monotone)")
        last = p["measured_flops"]
    if strictly_lower < 2:
        failures.append(f"strictly fewer FLOPs than the best fitting preset at only "
                        f"{strictly_lower} budget(s)")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(SHAPES))
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--presets", default=None,
                        help="specs to compare with (default: every preset)")
    parser.add_argument("--out", default="runs/plan_frontier", help="folder for JSON and PNG")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    failed = False
    for name in args.configs.split(","):
        batch, seq = SHAPES[name]
        path = os.path.join(args.out, f"{name}.json")
        common = ["plan", "--config", name, "--batch", str(batch), "--seq", str(seq),
                  "--dtype", "bfloat16", "--budgets", args.budgets, "--cache", ""]
        failures = []
        if name in PLAN_SECONDS_LIMIT:  # planning alone, from nothing compiled
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
