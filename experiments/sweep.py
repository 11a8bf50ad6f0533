"""Compare remat policies on one config: memory, FLOPs and measured step time.

    python -m experiments.sweep --config=experiments/configs/tiny.py \\
        --policies=none,full,selective,minimal --workdir=runs/sweep [--steps=5]

For each policy, `remat_kit.measure.measure_config` compiles the model's
value-and-grad step, then runs one warm-up and --steps timed steps on random
tokens. The model, batch_size and seq_len come from the config file (see
`remat_kit.cli.config_from_dict`). Writes into --workdir:

    records.json   the `remat_kit.report` JSON schema, one object per policy
    records.csv    one line per policy (`remat_kit.report.CSV_FIELDS`)
    pareto.png     temp memory against FLOP overhead, Pareto front marked

and prints the table. Without --policies, every preset is swept.
"""

import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from remat_kit import report
from remat_kit.measure import measure_config, platform_label
from remat_kit.cli import BadInput, config_from_dict, preset_policies, split_policies
from remat_kit.errors import RematSpecError


def _define_flags() -> None:
    # Defined only when run as a script, so importing sweep() next to
    # experiments.train (which defines --config and --workdir too) works.
    config_flags.DEFINE_config_file(
        "config", None, "ml_collections config file (e.g. experiments/configs/tiny.py).",
        lock_config=True)
    flags.DEFINE_string("policies", "", "Comma-separated policy specs; empty sweeps every preset.")
    flags.DEFINE_string("workdir", None, "Folder for records.json, records.csv, pareto.png.")
    flags.DEFINE_integer("steps", 5, "Timed steps per policy, after one warm-up step.")
    flags.mark_flags_as_required(["config", "workdir"])


def sweep(config, workdir: str, policies: str = "", steps: int = 5) -> list[dict]:
    """Measures and times every policy in `policies` (default: every preset) on `config`.

    Returns:
      The report rows (`remat_kit.report.rows`), also written to `workdir`.
    Raises:
      BadInput: the config names no known model or has a bad field.
      RematSpecError: a policy spec does not parse.
      ValueError: steps < 1, or sizes the model cannot take.
    """
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    cfg, sizes = config_from_dict(config)
    batch, seq = sizes.get("batch", 8), sizes.get("seq", min(cfg.max_len, 1024))
    specs, names = (split_policies(policies),) * 2 if policies else preset_policies()
    records = measure_config(cfg, batch, seq, specs, names=names, time_steps=steps)
    rows = report.rows(records, cfg, batch, seq)
    out = pathlib.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    platform = platform_label()
    title = f"{config.model}: batch {batch}, seq {seq}, {cfg.dtype} ({platform}, {steps} steps)"
    report.write_json(out / "records.json", rows,
                      {"config": config.model, "batch": batch, "seq": seq, "dtype": cfg.dtype,
                       "devices": 1, "platform": platform})
    report.write_csv(out / "records.csv", rows)
    report.plot(out / "pareto.png", rows, title)
    report.print_table(rows, title)
    return rows


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # app.run's INFO floods with JAX backend probing
    f = flags.FLAGS
    try:
        sweep(f.config, f.workdir, f.policies, f.steps)
    except (BadInput, RematSpecError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
