"""`compare` and `plan` on a model that is not ours, beside our own, in one run.

    python benchmarks/any_model.py [--batch 8] [--seq 1024] [--budgets 0.2,0.3,0.4,0.6]

The model is `tests/zoo/gpt_linen.py`'s GPT (fused qkv `c_attn`, `nn.share_scope`, a raw
`h @ param`) at GPT-2 small's shapes (12 layers, d 768, 12 heads, vocab 50257), taken
through `--model`; our own is `--config gpt2_small`. Prints, with the load average:

* the wall seconds of `compare` on each, every preset, and their ratio (target: the
  model within 1.5x of the config);
* per budget, the planned policy's FLOP overhead on the model beside the best preset or
  base rule that fits from the same run (target: never worse).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "benchmarks/any_model.py:gpt2_small_shaped"


def gpt2_small_shaped():
    """The zoo's GPT at GPT-2 small's shapes, for `--model`."""
    sys.path.insert(0, str(ROOT))
    from tests.zoo.gpt_linen import GPT, GPTConfig
    return GPT(GPTConfig(vocab=50257, layers=12, embed=768, heads=12, max_len=1024))


def run(*argv: str) -> tuple[dict, float, float]:
    """`remat-kit *argv --json` in a fresh process, no persistent cache: (its JSON, wall
    seconds, CPU seconds of the process and its children)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["REMAT_KIT_COMPILE_CACHE"] = ""  # cold: every program compiled
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "remat_kit.cli.commands", *argv, "--json", str(out)],
                              capture_output=True, text=True, cwd=ROOT, env=env)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return json.loads(out.read_text()), seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="8")
    parser.add_argument("--seq", default="1024")
    parser.add_argument("--budgets", default="0.2,0.3,0.4,0.6")
    parser.add_argument("--repeats", type=int, default=2, help="compare runs of each")
    args = parser.parse_args()
    sizes = ["--batch", args.batch, "--seq", args.seq]
    print(f"load average before: {os.getloadavg()}")
    # Alternated, twice each, so a change of load falls on both alike.
    seconds = {"config": [0.0, 0.0], "model": [0.0, 0.0]}
    for _ in range(args.repeats):
        for name, source in (("config", ("--config", "gpt2_small")), ("model", ("--model", MODEL))):
            _, wall, cpu = run("compare", *source, *sizes)
            seconds[name][0] += wall
            seconds[name][1] += cpu
            print(f"compare {' '.join(source)}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    (cw, cc), (mw, mc) = seconds["config"], seconds["model"]
    print(f"compare, every preset, {args.repeats} runs each: --model / --config gpt2_small = "
          f"{mw / cw:.2f} wall, {mc / cc:.2f} CPU (target <= 1.5)")
    plan, _, _ = run("plan", "--model", MODEL, *sizes, "--budgets", args.budgets, "--cache", "")
    print("budget  plan FLOPs+  best preset that fits (FLOPs+)")
    none = next(r for r in plan["presets"] if r["policy"] == "none")["flops"]
    for row in plan["budgets"]:
        p, best = row["plan"], row["best_preset"]
        planned = "-" if p is None else f"{p['measured_flops'] / none - 1:+.2%}"
        preset = ("-" if best is None
                  else f"{', '.join(best['names'])} ({best['flops'] / none - 1:+.2%})")
        print(f"{row['budget']:>6}  {planned:>11}  {preset}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
