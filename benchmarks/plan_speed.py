"""How many compiles and how much wall time `plan` and `fit` take at real size.

    python benchmarks/plan_speed.py [--case a,b,c] [--small] [--out runs/plan_speed]

(a) MaxText's llama2 decoder on one TPU v5e chip (vs_estimator.py's setting), cold caches: `benchmarks/vs_estimator.py`
    (MaxText's estimator beside `remat-kit plan --step train --uniform --emit maxtext`,
    in one run); skipped with a line where maxtext is not installed.
(b) `remat-kit plan --config llama_1b --batch 4 --seq 2048 --dtype bfloat16` at the 6
    budgets 0.15,0.2,0.25,0.3,0.4,0.6 (the docs' frontier); goal: at most 600 s.
(c) `remat-kit fit --config experiments/configs/llama2_70b.py --batch 64 --budget 95GiB --vary seq
    --policies full --target tpu:v5p:4x4x4 --mesh fsdp:16,tensor:4`; goal: at most 4
    compiles.

--small runs (b) at batch 1, seq 256 and (c) on experiments/configs/llama_1b_v5e.py
(bf16, scanned, batch 1) on one v5e chip (budget 16GiB, the README's fit), for a machine too loaded for real sizes (each real compile is 40-160 s on 2
shared cores); --tiny runs (b) and (c) on gpt2_small at batch 1, seq 128 on the CPU, in
minutes.

--jobs 1,2 runs each case once per value (`--jobs N`: compiles at once, the compile pool;
`ray`: `--ray local`, compiles in the worker processes of a Ray cluster started here) in one run, and prints each value's wall time over the first's, and whether the answers
are the same; serial against parallel is a ratio within one run, on the same machine. Prints, per case, the command, wall seconds, compiles and the answer,
with the load average; writes each command's JSON under --out. No cache is read or
written (`--cache ''` and a fresh compile cache folder), so every compile counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS = "0.15,0.2,0.25,0.3,0.4,0.6"
LLAMA2_70B = ("--config", "experiments/configs/llama2_70b.py")


def commands(small: bool, tiny: bool = False) -> dict[str, list[str]]:
    """The CLI arguments of cases b and c."""
    if tiny:
        return {"b": ["plan", "--config", "gpt2_small", "--batch", "1", "--seq", "128",
                      "--budgets", BUDGETS, "--no-presets"],
                "c": ["fit", "--config", "gpt2_small", "--batch", "1", "--budget", "2GiB",
                      "--vary", "seq", "--policies", "full,none"]}
    if small:
        return {"b": ["plan", "--config", "llama_1b", "--batch", "1", "--seq", "256",
                      "--dtype", "bfloat16", "--budgets", BUDGETS, "--no-presets"],
                "c": ["fit", "--config", "experiments/configs/llama_1b_v5e.py", "--budget",
                      "16GiB", "--vary", "seq", "--policies", "full", "--target",
                      "tpu:v5e:1x1"]}
    return {"b": ["plan", "--config", "llama_1b", "--batch", "4", "--seq", "2048",
                  "--dtype", "bfloat16", "--budgets", BUDGETS, "--no-presets"],
            "c": ["fit", *LLAMA2_70B, "--batch", "64", "--budget", "95GiB", "--vary", "seq",
                  "--policies", "full", "--target", "tpu:v5p:4x4x4",
                  "--mesh", "fsdp:16,tensor:4"]}


def run(case: str, argv: list[str], out: str) -> dict:
    """One command, timed, its JSON read back: wall seconds, compiles, the answer."""
    path = os.path.join(out, f"{case}.json")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=tempfile.mkdtemp(prefix="plan_speed"))
    extra = ["--cache", ""] if argv[0] == "plan" else []
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "remat_kit.cli", *argv, *extra,
                           "--json", path], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    compiles, detail = done.stderr.count("compiled "), []
    answer = done.stdout.strip().splitlines()[-3:] if done.returncode == 0 else done.stderr[-400:]
    if done.returncode == 0 and argv[0] == "plan":
        answer = [f"{b['budget']}: " + (f"{b['plan']['spec']}, {b['plan']['measured_bytes']:,} "
                                         "bytes" if b["plan"] else "below the minimum")
                  for b in json.load(open(path))["budgets"]]
    if done.returncode == 0 and argv[0] == "fit":
        rows = json.load(open(path))["rows"]
        compiles = sum(r["compiles"] for r in rows)
        answer = [f"{r['policy']}: {argv[argv.index('--vary') + 1]} {r['size']}" for r in rows]
        detail = [f"{r['policy']}: probes {[p[0] for p in r['probes']]}" for r in rows]
    return {"case": case, "command": "remat-kit " + " ".join(argv), "seconds": seconds,
            "compiles": compiles, "exit": done.returncode, "answer": answer,
            "detail": detail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="a,b,c")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--jobs", default="", help="e.g. 1,2,ray: each case at each --jobs "
                    "(ray: --ray local, a Ray cluster of this machine's cores)")
    ap.add_argument("--out", default="runs/plan_speed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cases = args.case.split(",")
    status = 0
    if "a" in cases:
        a = subprocess.run([sys.executable, os.path.join(HERE, "vs_estimator.py"),
                            "--out", os.path.join(args.out, "a")])
        status = max(status, a.returncode if a.returncode != 2 else 0)
    jobs = [j for j in args.jobs.split(",") if j] or [None]
    for case, argv in commands(args.small, args.tiny).items():
        if case not in cases:
            continue
        first = None
        for j in jobs:
            flags = [] if j is None else ["--ray", "local"] if j == "ray" else ["--jobs", j]
            r = run(case if j is None else f"{case}_jobs{j}", argv + flags, args.out)
            first = first or r
            ratio = (f", {r['seconds'] / first['seconds']:.2f}x the --jobs {jobs[0]} wall "
                     f"time, answers {'the same' if r['answer'] == first['answer'] else 'DIFFER'}"
                     if r is not first else "")
            print(f"({case}) {r['command']}\n    {r['seconds']:.0f} s, {r['compiles']} compiles, "
                  f"exit {r['exit']}, load {os.getloadavg()[0]:.1f}{ratio}", flush=True)
            for line in ([r["answer"]] if isinstance(r["answer"], str)
                         else r["answer"] + r["detail"]):
                print("    " + line, flush=True)
            status = max(status, 1 if r["exit"] or r["answer"] != first["answer"] else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
