"""The `remat-kit` command.

    remat-kit compare --config gpt2_small --batch 8 --seq 1024 --dtype bfloat16 \\
        [--policies a,b,c] [--mesh data:8] [--time N] [--json out.json] [--plot pareto.png]
    remat-kit explain --config tiny --policy selective [--batch B] [--seq S]

`compare` measures every policy compile-only (`remat_kit.measure`) and prints
a table sorted by memory (`remat_kit.report`). `explain` lists what one
decoder layer saves, offloads and recomputes under one policy.

Bad input (unknown config or policy, a batch or sequence length that is not a
positive int, a mesh with too few devices) prints one line on stderr and
exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from remat_kit import names as tag_names
from remat_kit.errors import RematSpecError
from remat_kit.models import CONFIGS, TransformerConfig, from_config_dict, get_config
from remat_kit.models.config import DTYPES
from remat_kit.spec import BARE_NAMES, PRESET_TABLE


class BadInput(ValueError):
    """Input the command cannot use; the message is one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


# ---------------------------------------------------------------------------
# Inputs: configs, policy lists, meshes
# ---------------------------------------------------------------------------

def config_from_dict(config) -> tuple[TransformerConfig, dict]:
    """A model from an ml_collections ConfigDict like experiments/configs/*.py.

    The model is `remat_kit.models.from_config_dict(config)`, the one
    experiments/train.py trains. `batch_size` and `seq_len`, if present,
    become the defaults for --batch and --seq.

    Returns:
      (TransformerConfig, {"batch": int, "seq": int} for the fields present).
    Raises:
      BadInput: no `model` field, an unknown model, or a bad field value.
    """
    try:
        cfg = from_config_dict(config)
    except KeyError as e:
        raise BadInput(e.args[0]) from None
    except (TypeError, ValueError) as e:
        raise BadInput(str(e)) from None
    defaults = {k: config[f] for k, f in (("batch", "batch_size"), ("seq", "seq_len"))
                if f in config and config[f] is not None}
    return cfg, defaults


def load_config(spec: str) -> tuple[TransformerConfig, str, dict]:
    """`spec` is a CONFIGS name or a path to a .py file with get_config().

    Returns:
      (config, display name, defaults for batch and seq; see `config_from_dict`).
    Raises:
      BadInput: unknown name, missing file, or a file without get_config().
    """
    if not (spec.endswith(".py") or os.sep in spec):
        try:
            return get_config(spec), spec, {}
        except KeyError as e:
            raise BadInput(e.args[0]) from None
    if not os.path.isfile(spec):
        raise BadInput(f"config file {spec!r} not found")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # config files import experiments.configs.*, as under -m
    module_spec = importlib.util.spec_from_file_location("_remat_kit_config", spec)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise BadInput(f"config file {spec!r} has no get_config()")
    cfg, defaults = config_from_dict(module.get_config())
    return cfg, os.path.basename(spec), defaults


def _starts_policy(piece: str) -> bool:
    """False for a bare tag, alias or glob: it continues the previous tag list."""
    word = piece.strip()
    if word in BARE_NAMES or any(c in word for c in ":;|"):
        return True
    try:
        tag_names.expand(word)
    except RematSpecError:
        return True
    return False


def split_policies(text: str) -> list[str]:
    """'minimal,save:query_proj,key_proj,full' -> ['minimal', 'save:query_proj,key_proj', 'full'].

    Commas separate policies, except before a tag, alias or glob, which
    continues the previous spec's tag list.
    """
    out: list[str] = []
    for piece in text.split(","):
        if out and not _starts_policy(piece):
            out[-1] += "," + piece.strip()
        elif piece.strip():
            out.append(piece.strip())
    return out


def preset_policies() -> tuple[list[str], list[str]]:
    """(specs, names) of every row of `spec.PRESET_TABLE`; a name is bare where the
    bare word means this row (`spec.BARE_NAMES`), else 'codebase:name'."""
    specs, shown = [], []
    for cb, name, _, _ in PRESET_TABLE:
        label = name if BARE_NAMES.get(name) == (cb, name) else f"{cb}:{name}"
        specs.append(label)
        shown.append(label)
    return specs, shown


def data_mesh(text: str | None):
    """A 1-D `Mesh` over the first N devices for 'data:N', or None.

    On CPU, N host devices are created if JAX has not started yet (the
    `jax_num_cpu_devices` option, like XLA_FLAGS=--xla_force_host_platform_device_count=N).

    Raises:
      BadInput: not 'data:N', or fewer than N devices.
    """
    if text is None:
        return None
    axis, _, count = text.partition(":")
    if axis != "data" or not count.isdigit() or int(count) <= 0:
        raise BadInput(f"--mesh must be data:N with N a positive int (data parallelism only "
                       f"for now), got {text!r}")
    n = int(count)
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # JAX already started; use the devices it has
    devices = jax.devices()
    if len(devices) < n:
        raise BadInput(f"--mesh data:{n} needs {n} devices, found {len(devices)} "
                       f"{devices[0].platform}; on CPU set "
                       f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting")
    return jax.sharding.Mesh(devices[:n], ("data",))


# ---------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------

def _sizes(args, cfg: TransformerConfig, defaults: dict) -> tuple[int, int]:
    batch = args.batch or defaults.get("batch", 8)
    seq = args.seq or defaults.get("seq", min(cfg.max_len, 1024))
    for flag, value in (("--batch", batch), ("--seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise BadInput(f"{flag} must be a positive int, got {value!r}")
    return batch, seq


def _compare(args) -> int:
    from remat_kit import report
    from remat_kit.measure import measure_config, platform_label

    cfg, label, defaults = load_config(args.config)
    batch, seq = _sizes(args, cfg, defaults)
    if args.policies:
        specs = split_policies(args.policies)
        shown = specs
    else:
        specs, shown = preset_policies()
    mesh = data_mesh(args.mesh)
    devices = 1 if mesh is None else mesh.shape["data"]

    def progress(i, n, record):
        status = "error" if record.error else f"{record.compile_seconds:.1f} s"
        print(f"[{i}/{n}] {', '.join(record.names)}: {status}", file=sys.stderr, flush=True)

    records = measure_config(cfg, batch, seq, specs, names=shown, dtype=args.dtype,
                                     time_steps=args.time, mesh=mesh, progress=progress)
    cfg = cfg.replace(dtype=args.dtype) if args.dtype else cfg
    rows = report.rows(records, cfg, batch // devices, seq)
    platform = platform_label()
    per_device = f", per device of {devices}" if devices > 1 else ""
    title = f"{label}: batch {batch}, seq {seq}, {cfg.dtype} ({platform}{per_device})"
    report.print_table(rows, title)
    context = {"config": label, "batch": batch, "seq": seq, "dtype": cfg.dtype,
               "devices": devices, "platform": platform}
    if args.json:
        report.write_json(args.json, rows, context)
    if args.plot:
        report.plot(args.plot, rows, title)
    return 0


def _explain(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from remat_kit import report
    from remat_kit.measure import layer_residuals
    from remat_kit.spec import parse

    cfg, label, defaults = load_config(args.config)
    batch, seq = _sizes(args, cfg, defaults)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    policy = parse(args.policy if args.policy is not None else cfg.remat)
    layer = layer_residuals(cfg, batch, seq, policy)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(f"{label}, one decoder layer under {args.policy or str(policy)!r} "
                  f"({policy}): batch {batch}, seq {seq}, {cfg.dtype}")
    t = Table()
    for name, justify in (("value", "left"), ("kind", "left"), ("shape", "left"),
                          ("dtype", "left"), ("bytes", "right"), ("decision", "left")):
        t.add_column(name, justify=justify)
    for r in layer.rows:
        t.add_row(r.name, r.kind, str(list(r.shape)), r.dtype, report.fmt_bytes(r.nbytes),
                  r.decision)
    console.print(t)
    n = layer.num_layers
    totals = Table(title="totals")
    for name in ("", "saved", "offloaded", "recomputed (not stored)"):
        totals.add_column(name, justify="right" if name else "left")
    totals.add_row("per layer", report.fmt_bytes(layer.saved_bytes),
                   report.fmt_bytes(layer.offloaded_bytes), report.fmt_bytes(layer.recomputed_bytes))
    totals.add_row(f"model ({n} layers)", report.fmt_bytes(n * layer.saved_bytes),
                   report.fmt_bytes(n * layer.offloaded_bytes),
                   report.fmt_bytes(n * layer.recomputed_bytes))
    console.print(totals)
    console.print(f"parameters read by the backward pass (not extra memory): "
                  f"{report.fmt_bytes(layer.parameter_bytes)} per layer")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat-kit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="{compare,explain}")

    def common(p):
        p.add_argument("--config", required=True,
                       help=f"a model name ({', '.join(CONFIGS)}) or a .py config file "
                            "with get_config()")
        p.add_argument("--batch", type=_positive_int, default=None,
                       help="global batch size (default: the config file's batch_size, or 8)")
        p.add_argument("--seq", type=_positive_int, default=None,
                       help="sequence length (default: the config file's seq_len, or "
                            "min(max_len, 1024))")
        p.add_argument("--dtype", choices=DTYPES, default=None,
                       help="activation dtype (default: the config's)")

    compare = sub.add_parser("compare", help="measure every policy: memory, FLOPs, time")
    common(compare)
    compare.add_argument("--policies", default=None,
                         help="comma-separated policy specs (default: every preset)")
    compare.add_argument("--mesh", default=None, help="data:N, split the batch over N devices")
    compare.add_argument("--time", type=_non_negative_int, default=0, metavar="N",
                         help="also time N steps per policy on random data")
    compare.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    compare.add_argument("--plot", default=None, metavar="PATH",
                         help="write a memory vs FLOPs PNG here")
    compare.set_defaults(run=_compare)

    explain = sub.add_parser("explain", help="what one layer saves under one policy")
    common(explain)
    explain.add_argument("--policy", default=None, help="a policy spec (default: the config's)")
    explain.set_defaults(run=_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed
        return e.code
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except (BadInput, RematSpecError, ValueError) as e:
        # RematSpecError is a ValueError; other ValueErrors here come from
        # validating sizes and dtypes before anything is measured.
        print(f"remat-kit: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
