"""Renders the default outputs of compare, plan and fit at 100 and 120 columns into
docs/compare.md, so that the page shows what a terminal of that width shows.

    PYTHONPATH=. python scripts/screenshots.py          # rewrites the blocks in place

Each block sits between `<!-- screenshot NAME -->` and `<!-- /screenshot -->` in
docs/compare.md and holds the command and its stdout (progress on stderr is left
out), run with COLUMNS=<width> (`report.terminal_console`). tests/test_docs.py checks
that each block is there and that no line is wider than its width.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "compare.md"
MODEL = ["--model", "tests/zoo/gpt_linen.py:model", "--batch", "8", "--seq", "32"]
PRESETS = "none,full,minimal,selective,dots"
# name -> (columns, the command's arguments)
SHOTS = {
    "compare-100": (100, ["compare", *MODEL, "--policies", PRESETS]),
    "compare-120": (120, ["compare", *MODEL, "--policies", PRESETS]),
    "plan-100": (100, ["plan", *MODEL, "--budgets", "0.5", "--presets", PRESETS,
                       "--cache", ""]),
    "fit-100": (100, ["fit", "--model", "tests/zoo/gpt_linen.py:model", "--vary", "batch",
                      "--seq", "32", "--budget", "16MiB", "--policies", "none,full,minimal"]),
}
BLOCK = re.compile(r"<!-- screenshot (?P<name>\S+) -->\n.*?<!-- /screenshot -->", re.S)


def render(columns: int, argv: list[str]) -> str:
    """The command's stdout at `columns` columns, with its command line first."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "remat_kit.cli", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    command = " ".join(a if a and " " not in a else repr(a) for a in argv)
    lines = [line.rstrip() for line in out.splitlines()]
    return f"$ COLUMNS={columns} .venv/bin/remat-kit {command}\n" + "\n".join(lines)


def main() -> None:
    text = PAGE.read_text()

    def shot(m):
        columns, argv = SHOTS[m["name"]]
        print(f"{m['name']}: {columns} columns", file=sys.stderr, flush=True)
        return (f"<!-- screenshot {m['name']} -->\n"
                f"```text\n{render(columns, argv)}\n```\n<!-- /screenshot -->")

    PAGE.write_text(BLOCK.sub(shot, text))


if __name__ == "__main__":
    main()
