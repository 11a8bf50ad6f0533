"""cli: the `remat-kit` command. The model's source (`sources`) and inputs checked before
anything compiles (`inputs`, `common`), one module per command (`compare`, `explain`,
`plan`, `fit`), the parser and entry point (`commands`), tables, JSON, CSV and plots
(`report`).

May import: every part of remat_kit. Nothing imports it but the entry point.

Public names: `main` (the `remat-kit` entry point).
"""

from remat_kit.cli.commands import main

__all__ = ["main"]
