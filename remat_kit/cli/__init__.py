"""cli: the `remat-kit` command. The flags every command shares (`common`), one module per command
(`compare`, `explain`, `plan`, `fit`), the verdict line (`verdict`), the parser and entry point
(`commands`); what it reads and prints is `remat_kit.ui`'s, the answers `remat_kit.api`'s.

May import: every part of remat_kit (`ui` and `api` first). Nothing imports it but the entry point.

Public names: `main` (the `remat-kit` entry point). Docs: docs/compare.md, plan.md, fit.md.
"""

from remat_kit.cli.commands import main

__all__ = ["main"]
