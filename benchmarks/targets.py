"""Times `remat-kit compare --target tpu:v5e:1x1` on gpt2_small and prints CPU vs TPU.

    python benchmarks/targets.py [--target tpu:v5e:1x1] [--no-cpu]

gpt2_small, batch 8, seq 1024, bfloat16, every preset. Runs the command as a
user would (a fresh process, compile-only, ahead of time via libtpu on this
machine, no TPU needed) and prints the seconds each distinct policy took
(trace + lower + compile, from the JSON it wrote) and the wall time of the
whole command. Target (issue 8): at most 300 s on 2 CPU cores. Then, unless
--no-cpu, runs the same command with `--target cpu` and prints, for every
preset, temp memory on both compilers and as a share of no remat, as a
Markdown table (the README's). The load average is printed at the start and
the end: other processes on the machine slow the compiles.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_SECONDS = 300.0


def compare(target: str, out: Path) -> tuple[list[dict], float]:
    """Runs `remat-kit compare` for `target`: (records, wall seconds)."""
    cmd = [sys.executable, "-m", "remat_kit.cli", "compare", "--config", "gpt2_small",
           "--batch", "8", "--seq", "1024", "--dtype", "bfloat16", "--target", target,
           "--json", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(out.read_text())["records"], wall


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def share(r: dict) -> str:
    return "-" if r.get("temp_ratio_to_none") is None else f"{100 * r['temp_ratio_to_none']:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU run and the table")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory() as tmp:
        records, wall = compare(args.target, Path(tmp) / "target.json")
        print(f"\n{'policy':<60} {'seconds':>8}")
        for r in sorted(records, key=lambda r: -(r["compile_seconds"] or 0)):
            seconds = "error" if r["error"] else f"{r['compile_seconds']:.1f}"
            print(f"{', '.join(r['names'])[:60]:<60} {seconds:>8}")
        measured = sum(r["compile_seconds"] or 0 for r in records)
        print(f"\n{args.target}: {len(records)} distinct policies, {measured:.1f} s measuring, "
              f"{wall:.1f} s wall for the whole command (target <= {TARGET_SECONDS:.0f} s)")
        if not args.no_cpu:
            cpu, cpu_wall = compare("cpu", Path(tmp) / "cpu.json")
            print(f"cpu: {cpu_wall:.1f} s wall\n")
            by_policy = {r["policy"]: r for r in cpu}
            print(f"| policy | CPU temp | CPU % of none | {args.target} temp | "
                  f"{args.target} % of none | FLOPs {args.target} / CPU |")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            for r in records:  # sorted by the target's temp memory
                c = by_policy.get(r["policy"], {})
                flops = (f"{r['flops'] / c['flops']:.3f}" if r.get("flops") and c.get("flops")
                         else "-")
                names = ", ".join(f"`{n}`" for n in r["names"][:3])
                more = f" (+{len(r['names']) - 3})" if len(r["names"]) > 3 else ""
                print(f"| {names}{more} | {gib(c.get('temp_size_in_bytes'))} | {share(c)} | "
                      f"{gib(r['temp_size_in_bytes'])} | {share(r)} | {flops} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0 if wall <= TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
