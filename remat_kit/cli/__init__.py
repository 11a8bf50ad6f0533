"""cli: the `remat-kit` command. The flags every command shares (`common`), one module per command
(`compare`, `explain`, `plan`, `fit`), the verdict line (`verdict`), the parser and entry point
(`commands`); input checks and reports are the front floor's (`remat_kit.api`).

May import: every part of remat_kit (`api` first). Nothing imports it but the entry point.

Public names: `main` (the `remat-kit` entry point). Docs: docs/compare.md, plan.md, fit.md.
"""

from remat_kit.cli.commands import main

__all__ = ["main"]
