"""ui: what the `remat-kit` command reads and prints, apart from the answers. Its inputs:
argparse types and checks (`inputs`), models and configs from files and flags (`sources`);
its outputs: the tables, JSON and CSV (`report`), the plot (`plots`), names of dtypes and
models (`labels`).

May import: every part below it (`api` first). Imported by `cli` and `experiments/`.

Public names: the modules `inputs`, `sources`, `report`, `plots`, `labels`. Docs: docs/compare.md.
"""
