"""Times `remat-kit compare --target tpu:v5e:1x1` on gpt2_small and prints CPU vs TPU.

    python benchmarks/targets.py [--target tpu:v5e:1x1] [--no-cpu]

gpt2_small, batch 8, seq 1024, bfloat16, every preset. Runs the command as a
user would (a fresh process, compile-only, ahead of time via libtpu on this
machine, no TPU needed) and prints the seconds each distinct policy took
(trace + lower + compile, from the JSON it wrote) and the wall time of the
whole command. Target: at most 300 s on 2 CPU cores. Then, unless
--no-cpu, runs the same command with `--target cpu` and prints, for every
preset, temp memory on both compilers and as a share of no remat, and the
target's peak and its share (what compare ranks the target's rows by), as a
Markdown table (the README's). The load average is printed at the start and
the end: other processes on the machine slow the compiles.
"""

import argparse
import os
import sys

from compare_gpt2_small import compare, print_times

TARGET_SECONDS = 300.0


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def share(r: dict, key: str = "temp_ratio_to_none") -> str:
    return "-" if r.get(key) is None else f"{r[key]:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU run and the table")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    records, wall = compare("--dtype", "bfloat16", "--target", args.target)
    print_times(records, wall, TARGET_SECONDS)
    if not args.no_cpu:
        cpu, cpu_wall = compare("--dtype", "bfloat16", "--target", "cpu")
        print(f"cpu: {cpu_wall:.1f} s wall\n")
        by_policy = {r["policy"]: r for r in cpu}
        print(f"| policy | CPU temp | CPU temp × none | {args.target} temp | temp × none | "
              f"{args.target} peak | peak × none | FLOPs {args.target} / CPU |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in records:  # sorted by the target's memory figure (its peak on TPU)
            c = by_policy.get(r["policy"], {})
            flops = (f"{r['flops'] / c['flops']:.3f}" if r.get("flops") and c.get("flops")
                     else "-")
            names = ", ".join(f"`{n}`" for n in r["names"][:3])
            more = f" (+{len(r['names']) - 3})" if len(r["names"]) > 3 else ""
            print(f"| {names}{more} | {gib(c.get('temp_size_in_bytes'))} | {share(c)} | "
                  f"{gib(r['temp_size_in_bytes'])} | {share(r)} | "
                  f"{gib(r['peak_memory_in_bytes'])} | {share(r, 'memory_ratio_to_none')} | "
                  f"{flops} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0 if wall <= TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
