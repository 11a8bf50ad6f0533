"""Times `remat-kit compare` on gpt2_small, batch 8, seq 1024, float32, every preset.

    python benchmarks/compare_gpt2_small.py [--dtype bfloat16]

Runs the command as a user would (a fresh process, compile-only), then prints
the seconds each distinct policy took (trace + lower + compile, from the JSON
it wrote) and the wall time of the whole command. Target: at most
90 s on 2 CPU cores.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_SECONDS = 90.0


def compare(*flags: str) -> tuple[list[dict], float]:
    """Runs `remat-kit compare --config gpt2_small --batch 8 --seq 1024 *flags` in a fresh
    process: (its JSON records, wall seconds). Exits with its stderr if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        cmd = [sys.executable, "-m", "remat_kit.cli.commands", "compare", "--config", "gpt2_small",
               "--batch", "8", "--seq", "1024", *flags, "--json", str(out)]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
        return json.loads(out.read_text())["records"], wall


def print_times(records: list[dict], wall: float, target_seconds: float) -> None:
    """Seconds per distinct policy, slowest first, then the totals."""
    print(f"{'policy':<60} {'seconds':>8}")
    for r in sorted(records, key=lambda r: -(r["compile_seconds"] or 0)):
        seconds = "error" if r["error"] else f"{r['compile_seconds']:.1f}"
        print(f"{', '.join(r['names'])[:60]:<60} {seconds:>8}")
    measured = sum(r["compile_seconds"] or 0 for r in records)
    print(f"\n{len(records)} distinct policies: {measured:.1f} s measuring, "
          f"{wall:.1f} s wall for the whole command (target <= {target_seconds:.0f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    records, wall = compare("--dtype", args.dtype)
    print_times(records, wall, TARGET_SECONDS)
    return 0 if wall <= TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
