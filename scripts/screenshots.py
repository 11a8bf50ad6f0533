"""Renders the outputs of compare, plan and fit into the docs: the defaults at 100 and
120 columns into docs/compare.md, so that the page shows what a terminal of that width
shows, and the --wide tables of docs/models.md at 200.

    PYTHONPATH=. python scripts/screenshots.py          # rewrites the blocks in place

Each block sits between `<!-- screenshot NAME -->` and `<!-- /screenshot -->` in its
page and holds the command and its stdout (progress on stderr is left
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
GPT = "tests/zoo/gpt_linen.py:model"
MODEL = ["--model", GPT, "--batch", "8", "--seq", "32"]
PRESETS = "none,full,minimal,selective,dots"
# name -> (page, columns, the command's arguments)
SHOTS = {
    "compare-100": ("compare.md", 100, ["compare", *MODEL, "--policies", PRESETS]),
    "compare-120": ("compare.md", 120, ["compare", *MODEL, "--policies", PRESETS]),
    "plan-100": ("compare.md", 100, ["plan", *MODEL, "--budgets", "0.5", "--presets", PRESETS,
                                     "--cache", ""]),
    "fit-100": ("compare.md", 100, ["fit", "--model", GPT, "--vary", "batch", "--seq", "32",
                                    "--budget", "16MiB", "--policies", "none,full,minimal"]),
    # docs/models.md: every column (--wide), at 200.
    "models-compare-gpt": ("models.md", 200, [
        "compare", *MODEL, "--policies", "none,full,minimal,selective,save_qkv_proj,dots",
        "--wide"]),
    "models-plan-gpt": ("models.md", 200, ["plan", *MODEL, "--budgets", "0.5,0.7", "--presets",
                                           PRESETS, "--cache", "", "--wide"]),
    "models-fit-gpt": ("models.md", 200, [
        "fit", "--model", GPT, "--vary", "batch", "--seq", "32", "--budget", "16MiB",
        "--policies", "none,full,minimal,selective", "--wide"]),
    "models-compare-vit": ("models.md", 200, ["compare", "--model", "tests/zoo/vit_nnx.py:build",
                                              "--policies", PRESETS, "--wide"]),
    "models-plan-dit": ("models.md", 200, ["plan", "--model", "tests/zoo/dit_linen.py:build",
                                           "--budgets", "0.5,0.7", "--presets", PRESETS,
                                           "--cache", "", "--wide"]),
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
    for page in sorted({page for page, _, _ in SHOTS.values()}):
        path = ROOT / "docs" / page

        def shot(m):
            _, columns, argv = SHOTS[m["name"]]
            print(f"{m['name']}: {columns} columns", file=sys.stderr, flush=True)
            return (f"<!-- screenshot {m['name']} -->\n"
                    f"```text\n{render(columns, argv)}\n```\n<!-- /screenshot -->")

        path.write_text(BLOCK.sub(shot, path.read_text()))


if __name__ == "__main__":
    main()
