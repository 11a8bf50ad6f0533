"""How long remat-kit's own commands take, against an earlier commit, in one run.

    .venv/bin/python benchmarks/tool_speed.py                     # every part
    .venv/bin/python benchmarks/tool_speed.py --parts plan,fit --base dc9de24

Each part runs the same command in a `git worktree` of `--base` and in this
tree, one after the other, and prints wall seconds, CPU seconds (user + sys
of the command and its children) and base / this ratios, with the load
average before and after each. This tree runs twice: cold (an empty JAX
persistent compilation cache) and warm (the cache the cold run filled), as a
repeated run would. Where a command writes --json, the figures of both trees
are compared (everything but timings) and a difference is printed: a speed-up
must not change a reported figure.

Parts:
  compare_cpu   compare --config gpt2_small (CPU, every preset)
  compare_tpu   compare --config gpt2_small --target tpu:v5e:1x1 --policies none,full,selective,minimal
  plan          plan --config gpt2_small with 6 budgets
  fit           fit --config gpt2_small --budget 16GiB
  suite         both passes of `make test` (2 processes; then JAX_REMAT3=1 on -m remat_modes)

On a loaded machine wall time mostly measures the load; CPU seconds and the
ratios of one run are what compare.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "remat_kit.cli.commands"]
# As `make test` runs it, in both trees.
_PYTEST = (f"PYTHONDONTWRITEBYTECODE= {sys.executable} -m pytest tests -q -p no:cacheprovider "
           "-n 2 --dist loadscope")
PARTS = {
    "compare_cpu": CLI + ["compare", "--config", "{config}", "--json", "{out}"],
    "compare_tpu": CLI + ["compare", "--config", "{config}", "--target", "tpu:v5e:1x1",
                          "--policies", "none,full,selective,minimal", "--json", "{out}"],
    "plan": CLI + ["plan", "--config", "{config}", "--budgets",
                   "0.1,0.15,0.2,0.3,0.4,0.6", "--cache", "", "--json", "{out}"],
    "fit": CLI + ["fit", "--config", "{config}", "--budget", "16GiB", "--json", "{out}"],
    "suite": ["sh", "-c", f"{_PYTEST} && JAX_REMAT3=1 {_PYTEST} -m remat_modes"],
}
TIMINGS = {"compile_seconds", "plan_seconds", "seconds", "wall_seconds", "step_time",
           "time_ratio", "notes", "status"}


def _load() -> float:
    return os.getloadavg()[0]


def _run(argv: list[str], cwd: str, env: dict) -> dict:
    """Runs argv in cwd; wall and CPU seconds, exit code, load before and after."""
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), _load()
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "rc": done.returncode, "load": (load, _load()),
            "tail": done.stdout[-2000:]}


def _figures(doc):
    """doc without its timings, for comparing what two runs report."""
    if isinstance(doc, dict):
        return {k: _figures(v) for k, v in doc.items() if k not in TIMINGS}
    if isinstance(doc, list):
        return [_figures(v) for v in doc]
    return doc


def _changes(new, base, path: str = "") -> list[str]:
    """Where `new` does not report what `base` reports, as "path: base -> new":
    fields added since base (a new column) are not a change, any other
    difference is."""
    if isinstance(new, dict) and isinstance(base, dict):
        return [c for k, v in base.items()
                for c in (_changes(new[k], v, f"{path}.{k}") if k in new
                          else [f"{path}.{k}: missing"])]
    if isinstance(new, list) and isinstance(base, list) and len(new) == len(base):
        return [c for i, (n, b) in enumerate(zip(new, base)) for c in _changes(n, b, f"{path}[{i}]")]
    return [] if new == base else [f"{path}: {base!r:.60} -> {new!r:.60}"]


def _env(tree: str, cache: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["PYTHONPATH"] = tree  # each tree's remat_kit, whatever is installed
    if cache is not None:  # every compile cached, as tests/conftest.py does
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="dc9de24", help="the commit to compare against")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument("--config", default="gpt2_small",
                        help="the model of compare, plan and fit (tiny for a quick run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",")]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        parser.error(f"unknown part(s) {bad}; choose from {list(PARTS)}")
    work = tempfile.mkdtemp(prefix="tool_speed_")
    base = os.path.join(work, "base")
    subprocess.run(["git", "worktree", "add", "--detach", base, args.base], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    results = {}
    try:
        print(f"base {args.base} vs this tree, --config {args.config}; load average at start "
              f"{os.getloadavg()}",
              flush=True)
        for part in parts:
            cache = os.path.join(work, f"cache_{part}")
            runs = {}
            for name, tree, cache_dir in (("base", base, None), ("cold", ROOT, cache),
                                          ("warm", ROOT, cache)):
                out = os.path.join(work, f"{part}_{name}.json")
                cmd = [a.replace("{out}", out).replace("{config}", args.config)
                       for a in PARTS[part]]
                runs[name] = _run(cmd, tree, _env(tree, cache_dir))
                if os.path.exists(out):
                    with open(out) as f:
                        runs[name]["figures"] = _figures(json.load(f))
                r = runs[name]
                print(f"{part:12s} {name:5s} wall {r['wall']:8.1f} s  cpu {r['cpu']:8.1f} s  "
                      f"rc {r['rc']}  load {r['load'][0]:.1f} -> {r['load'][1]:.1f}", flush=True)
                if r["rc"] != 0:
                    print(r["tail"], flush=True)
            changes = {n: _changes(runs[n].get("figures"), runs["base"].get("figures"))
                       for n in ("cold", "warm")} if "figures" in runs["base"] else {}
            for n, found in changes.items():
                for line in found[:8]:
                    print(f"{part:12s} {n:5s} changed {line}", flush=True)
                if len(found) > 8:
                    print(f"{part:12s} {n:5s} ... and {len(found) - 8} more", flush=True)
            same = {n: not found for n, found in changes.items()} or None
            results[part] = {n: {k: v for k, v in r.items() if k not in ("figures", "tail")}
                             for n, r in runs.items()} | {"figures_unchanged": same,
                                                          "changes": changes}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'part':12s} {'base s':>9s} {'cold s':>9s} {'x':>6s} {'warm s':>9s} {'x':>7s}"
          f"  {'cpu x cold':>10s}  figures unchanged")
    for part, r in results.items():
        b, c, w = r["base"], r["cold"], r["warm"]
        print(f"{part:12s} {b['wall']:9.1f} {c['wall']:9.1f} {b['wall'] / c['wall']:6.2f} "
              f"{w['wall']:9.1f} {b['wall'] / w['wall']:7.2f}  {b['cpu'] / c['cpu']:10.2f}  "
              f"{r['figures_unchanged']}")
    print(f"load average at end {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
