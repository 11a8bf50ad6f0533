"""Compare remat policies on one config: memory, FLOPs and measured step time.

    python -m experiments.sweep --config=experiments/configs/tiny.py \\
        --policies=none,full,selective,minimal --workdir=runs/sweep [--steps=5]

For each policy, `remat_kit.api.configs.measure_config` compiles the model's
value-and-grad step, then runs one warm-up and --steps timed steps on random
tokens. The model, batch_size and seq_len come from the config file (see
`remat_kit.ui.sources.config_from_dict`). `--model FILE.py:FUNCTION` (or
config.model set to that) sweeps the user's own model instead, measured as
`remat-kit compare --model` measures it (`remat_kit.flax.user_model`), at the
config's batch_size and seq_len. Writes into --workdir:

    records.json   the `remat_kit.ui.report` JSON schema, one object per policy
    records.csv    one line per policy (`remat_kit.ui.report.CSV_FIELDS`)
    pareto.png     memory (temp on CPU, peak on TPU/GPU) against FLOP overhead, Pareto front marked

and prints the table. Without --policies, every preset is swept.

Bad input (flags, config file or fields, policies, an unusable workdir, sizes
that do not fit in memory) exits with code 2 and one line on stderr before
anything compiles; so does a policy that fails to measure (out of memory, say),
after the other policies' results are written.
"""

import pathlib

import jax
from absl import app, flags
from ml_collections import config_flags

from experiments.common import SIZE_FIELDS, fail, one_line_warnings, parse_flags
from remat_kit.ui import plots, report
from remat_kit.ui.report import map_context, print_map
from remat_kit.ui.inputs import (check_folder, check_int, check_memory, check_seq,
                                  preset_policies, split_policies)
from remat_kit.ui.sources import config_from_dict
from remat_kit.errors import BadInput, RematSpecError, UnknownModuleError
from remat_kit.flax import user_model
from remat_kit.flax.from_model import ModelError
from remat_kit.api.answers import measure
from remat_kit.models.program import config_map
from remat_kit.api.configs import measure_config
from remat_kit.measure.record import platform_label


def _define_flags() -> None:
    # Defined only when run as a script, so importing sweep() next to
    # experiments.train (which defines --config and --workdir too) works.
    config_flags.DEFINE_config_file(
        "config", None, "ml_collections config file (e.g. experiments/configs/tiny.py).",
        lock_config=True)
    flags.DEFINE_string("policies", None, "Comma-separated policy specs; unset sweeps every "
                        "preset.")
    flags.DEFINE_string("workdir", None, "Folder for records.json, records.csv, pareto.png.")
    flags.DEFINE_integer("steps", 5, "Timed steps per policy, after one warm-up step.")
    flags.DEFINE_string("model", None, "The user's model, FILE.py:FUNCTION or "
                        "package.module:FUNCTION as remat-kit --model takes it; sets "
                        "config.model.")
    flags.mark_flags_as_required(["config", "workdir"])


def sweep(config, workdir: str, policies: str | None = None, steps: int = 5) -> list[dict]:
    """Measures and times every policy in `policies` (default: every preset) on `config`.

    Returns:
      The report rows (`remat_kit.ui.report.rows`), also written to `workdir`.
    Raises:
      BadInput: steps < 1; the config names no known model or has a bad
        field; an empty or bad policy list; a workdir that cannot be written;
        sizes the model or the memory cannot take. All before compiling.
    """
    check_int("--steps", steps)
    if ":" in config.model:  # the user's model (a config name holds no ':')
        return _sweep_own(config, workdir, policies, steps)
    cfg, sizes = config_from_dict(config)
    batch, seq = sizes.get("batch", 8), sizes.get("seq", min(cfg.max_len, 1024))
    check_seq(cfg, seq, "config.seq_len")
    specs = split_policies(policies) if policies is not None else preset_policies()
    check_folder(workdir, "--workdir", create=True)
    check_memory(cfg, batch, seq, f"batch_size={batch}, seq_len={seq}")
    records = measure_config(cfg, batch, seq, specs, names=specs, time_steps=steps)
    return _write(config, workdir, report.rows(records, cfg, batch, seq), batch, seq, cfg.dtype,
                  steps, config_map(cfg))


def _sweep_own(config, workdir: str, policies: str | None, steps: int) -> list[dict]:
    """`sweep` of the user's model config.model at config.batch_size and seq_len:
    `measure` of `rk.from_model.workload`, as `remat-kit compare --model`."""
    batch = check_int("config.batch_size", config.get("batch_size", 8))
    seq = check_int("config.seq_len", config.get("seq_len", 64))
    specs = split_policies(policies) if policies is not None else preset_policies()
    check_folder(workdir, "--workdir", create=True)
    try:
        _, make = user_model.load(config.model, config.get("block") or None,
                                  sizes=SIZE_FIELDS)
        work = make(batch, seq)
    except ModelError as e:
        raise BadInput(str(e)) from None
    except UnknownModuleError as e:
        raise BadInput(f"--model {config.model!r}: {e}") from None
    records = measure(work, policies=specs, names=specs, time_steps=steps, per_layer=True)
    leaves = jax.tree.leaves(work.params)
    dtype = str(leaves[0].dtype) if leaves else "-"  # the parameters', as compare titles it
    return _write(config, workdir, report.rows(records, None, batch, seq), batch, seq, dtype,
                  steps, work)


def _write(config, workdir: str, rows: list[dict], batch: int, seq: int, dtype: str,
           steps: int, work) -> list[dict]:
    """Writes records.json, records.csv and pareto.png, prints the table after the model
    map's line (`work`: the Workload or the config's ModelMap); returns rows."""
    out = pathlib.Path(workdir)
    platform = platform_label()
    title = f"{config.model}: batch {batch}, seq {seq}, {dtype} ({platform}, {steps} steps)"
    report.write_json(out / "records.json", rows,
                      {"config": config.model, "batch": batch, "seq": seq, "dtype": dtype,
                       "devices": 1, "platform": platform,
                       **map_context(work)})
    report.write_csv(out / "records.csv", rows)
    plots.plot(out / "pareto.png", rows, title)
    print_map(work)
    report.print_table(rows, title)
    return rows


def main(argv: list[str]) -> None:
    del argv  # parse_flags has rejected extra arguments
    f = flags.FLAGS
    if f.model is not None:
        f.config.model = f.model
    try:
        with one_line_warnings():
            rows = sweep(f.config, f.workdir, f.policies, f.steps)
    except (BadInput, RematSpecError) as e:
        fail(str(e))
    failed = [r for r in rows if r["error"] is not None]
    if failed:
        first = failed[0]
        rest = "" if len(failed) == len(rows) else f" (the others' results are in {f.workdir})"
        fail(f"{len(failed)} of {len(rows)} policies failed{rest}; "
             f"{', '.join(first['names'])}: {first['error']}")


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=parse_flags)
