"""The `remat-kit` command.

    remat-kit compare --config gpt2_small --batch 8 --seq 1024 --dtype bfloat16 \\
        [--policies a,b,c] [--mesh data:2,fsdp:2,tensor:2] [--target cpu,tpu:v5e:1x1] \\
        [--time N] [--json out.json] [--plot pareto.png]
    remat-kit explain --config tiny --policy selective [--batch B] [--seq S] [--target T]
    remat-kit plan --config gpt2_small --batch 8 --seq 1024 --budgets 0.2,0.4,6GiB \\
        [--presets a,b | --no-presets] [--json plan.json] [--plot plan.png]
    remat-kit fit --config llama_1b --budget 16GiB --vary seq [--batch 1] [--multiple 128] \\
        [--target T] [--mesh data:2,fsdp:2] [--policies a,b,auto] [--json out.json] \\
        [--plot fit.png]

`compare` measures every policy compile-only (`remat_kit.measure`) and prints
a table sorted by memory (`remat_kit.report`). `explain` lists what one
decoder layer saves, offloads and recomputes under one policy. `plan` runs
the budget planner (`remat_kit.plan`) for each budget and sets its frontier
against the best fixed preset that fits. `fit` finds the longest sequence
(or largest batch) whose whole train step fits a per-device memory budget
under each policy (`remat_kit.fit`). `--target` names the compiler
(`remat_kit.targets`): `tpu:v5e:2x2` compiles for a TPU slice ahead of time,
on a machine without one.

Bad input (unknown config or policy, a config file that does not load, a
batch or sequence length that is not a positive int or too long for the
model, a mesh that does not fit the batch or the devices, an unknown target or
topology, libtpu missing, an output path that cannot be written) prints one
line on stderr and exits with status 2, before anything is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from remat_kit import mesh as rk_mesh
from remat_kit import names as tag_names
from remat_kit.errors import RematSpecError
from remat_kit.models import CONFIGS, TransformerConfig, from_config_dict, get_config
from remat_kit.models.config import DTYPES
from remat_kit.spec import BARE_NAMES, PRESET_TABLE, AutoSpec, parse
from remat_kit.targets import Target


class BadInput(ValueError):
    """Input the command cannot use; the message is one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


# The largest size or count accepted: XLA takes shapes and seeds as 32-bit ints.
MAX_INT = 2**31 - 1


def check_int(name: str, value, minimum: int = 1) -> int:
    """`value` if it is an int in [minimum, MAX_INT], else BadInput naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise BadInput(f"{name} must be {kind} (at most {MAX_INT}), got {value!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"must be a positive int (at most {MAX_INT}), "
                                         f"got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive int (at most {MAX_INT}), "
                                         f"got {text!r}") from None


# ---------------------------------------------------------------------------
# Inputs: configs, policy lists, meshes
# ---------------------------------------------------------------------------

def config_from_dict(config, where: str | None = None) -> tuple[TransformerConfig, dict]:
    """A model from an ml_collections ConfigDict like experiments/configs/*.py.

    The model is `remat_kit.models.from_config_dict(config)`, the one
    experiments/train.py trains. `batch_size` and `seq_len`, if present,
    become the defaults for --batch and --seq.

    Args:
      where: where the config came from, e.g. "config file 'x.py'", for the
        messages; None names the fields `config.FIELD`.
    Returns:
      (TransformerConfig, {"batch": int, "seq": int} for the fields present).
    Raises:
      BadInput: no `model` field, an unknown model, or a bad field value.
    """
    defaults = {}
    for key, field in (("batch", "batch_size"), ("seq", "seq_len")):
        if field in config and config[field] is not None:
            defaults[key] = check_int(f"{field} in {where}" if where else f"config.{field}",
                                      config[field])
    try:
        cfg = from_config_dict(config)
    except (KeyError, TypeError, ValueError) as e:
        message = e.args[0] if isinstance(e, KeyError) else str(e)
        raise BadInput(f"{where}: {message}" if where else message) from None
    return cfg, defaults


def load_config_file(path: str, *args):
    """The ConfigDict that `get_config(*args)` of the .py file at `path` returns.

    Raises:
      BadInput: the file is missing, does not import (syntax error, or an
        exception while it runs), has no callable get_config taking `args`,
        or get_config raises or returns something other than a ConfigDict.
        The message names the file and the problem.
    """
    import ml_collections

    where = f"config file {path!r}"
    if not os.path.isfile(path):
        raise BadInput(f"{where} not found")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # config files import experiments.configs.*, as under -m
    module_spec = importlib.util.spec_from_file_location("_remat_kit_config", path)
    if module_spec is None:
        raise BadInput(f"{where} is not a Python (.py) file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise BadInput(f"{where} has a syntax error ({e.msg}) in {e.filename} line {e.lineno}") \
            from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure of user code is bad input
        raise BadInput(f"{where} failed to load: {type(e).__name__}: {e}") from None
    get = getattr(module, "get_config", None)
    if get is None:
        raise BadInput(f"{where} has no get_config()")
    if not callable(get):
        raise BadInput(f"{where}: get_config must be a function, got {get!r:.60}")
    try:
        signature = inspect.signature(get)
        signature.bind(*args)
    except TypeError:
        wanted = "no arguments" if not args else f"the arguments {list(args)}"
        raise BadInput(f"{where}: get_config{signature} must take {wanted}") from None
    except ValueError:
        pass  # no signature to check (a builtin); the call below tells
    try:
        config = get(*args)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise BadInput(f"{where}: get_config() raised {type(e).__name__}: {e}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        got = "None (a missing return?)" if config is None else f"a {type(config).__name__}"
        raise BadInput(f"{where}: get_config() must return an ml_collections.ConfigDict, "
                       f"it returned {got}")
    return config


def load_config(spec: str) -> tuple[TransformerConfig, str, dict]:
    """`spec` is a CONFIGS name or a path to a .py file with get_config().

    Returns:
      (config, display name, defaults for batch and seq; see `config_from_dict`).
    Raises:
      BadInput: unknown name, or a file that does not give a model
        (`load_config_file`, `config_from_dict`).
    """
    if not (spec.endswith(".py") or os.sep in spec):
        try:
            return get_config(spec), spec, {}
        except KeyError as e:
            raise BadInput(e.args[0]) from None
    config = load_config_file(spec)
    cfg, defaults = config_from_dict(config, where=f"config file {spec!r}")
    return cfg, os.path.basename(spec), defaults


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a command's workload comes from: --config (a reference transformer) or
    --model (the user's model or Workload function, `remat_kit.user_model`).

    Attributes:
      label: the report's name, e.g. "gpt2_small" or "models.py:build".
      cfg: the TransformerConfig for --config (dtype applied), None for --model.
      defaults: {"batch", "seq"} from a config file's batch_size / seq_len.
      make: (batch, seq, mesh) -> Workload; raises BadInput for a bad model.
    """

    label: str
    cfg: TransformerConfig | None
    defaults: dict
    make: object

    def workload(self, batch: int, seq: int, mesh=None):
        """The workload at these sizes; BadInput for a model that cannot give one."""
        from remat_kit.from_model import ModelError
        try:
            return self.make(batch, seq, mesh)
        except ModelError as e:
            raise BadInput(str(e)) from None

    def dtype(self, workload=None) -> str:
        """The activation dtype for titles: the config's, else the parameters'."""
        if self.cfg is not None:
            return self.cfg.dtype
        import jax
        leaves = jax.tree.leaves(workload.params) if workload is not None else []
        return str(leaves[0].dtype) if leaves else "-"

    @property
    def num_layers(self) -> int | None:
        return self.cfg.num_layers if self.cfg is not None else None


def load_source(args) -> Source:
    """The Source of --config or --model (with --block and --dtype checked).

    Raises:
      BadInput: both or neither given, --block without --model, --dtype with
        --model (the model's dtypes are its own), or a bad config or model.
    """
    from remat_kit.models import workload as config_workload

    if args.model is not None:
        from remat_kit import user_model
        from remat_kit.from_model import ModelError
        if args.dtype:
            raise BadInput(f"--dtype is for --config; a --model keeps its own dtypes (set "
                           f"them where {args.model} builds the model)")
        try:
            label, make = user_model.load(args.model, args.block)
        except ModelError as e:
            raise BadInput(str(e)) from None
        return Source(label, None, {}, make)
    if args.block is not None:
        raise BadInput("--block names the repeated block class of a --model; --config models "
                       "know theirs")
    cfg, label, defaults = load_config(args.config)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    return Source(label, cfg, defaults,
                  lambda batch, seq, mesh=None: config_workload(cfg, batch, seq, mesh=mesh))


def check_seq(cfg: TransformerConfig, seq: int, name: str = "--seq") -> None:
    """BadInput if a GPT-2 model has no position embedding for `seq` positions."""
    if cfg.family == "gpt2" and seq > cfg.max_len:
        raise BadInput(f"{name} {seq} exceeds the model's max_len {cfg.max_len} "
                       "(GPT-2 learns one position embedding per position)")


def check_memory(cfg: TransformerConfig, batch: int, seq: int, sizes: str) -> None:
    """BadInput if one layer's attention scores [batch, heads, seq, seq] alone
    outgrow the memory of the first device (host RAM on CPU): running would
    fail with out-of-memory after compiling. Starts JAX.

    Args:
      sizes: the user's names for batch and seq, e.g. "batch_size=8, seq_len=64".
    """
    import jax
    import jax.numpy as jnp

    from remat_kit.report import fmt_bytes

    need = batch * cfg.num_heads * seq * seq * jnp.dtype(cfg.dtype).itemsize
    device = jax.devices()[0]
    if device.platform == "cpu":
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        have = (device.memory_stats() or {}).get("bytes_limit")
    if have and need > have:
        raise BadInput(f"{sizes} do not fit: one layer's attention scores [{batch}, "
                       f"{cfg.num_heads}, {seq}, {seq}] {cfg.dtype} alone take "
                       f"{fmt_bytes(need)}, more than the {fmt_bytes(have)} of "
                       f"{device.platform} memory")


def out_of_memory(error: BaseException, sizes: str) -> BadInput | None:
    """A one-line BadInput for an XLA out-of-memory error (RESOURCE_EXHAUSTED),
    naming `sizes` and the bytes XLA asked for; None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    detail = text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]
    return BadInput(f"out of memory with {sizes}: {detail}")


def check_folder(path: str, flag: str, create: bool = False) -> None:
    """BadInput unless `path` is a folder a file can be written in; with
    `create`, makes it (and its parents) first. Run before any long work."""
    if not path or not path.strip():
        raise BadInput(f"{flag} is empty; give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path!r} is a file, not a folder")
    if not create and not os.path.isdir(path):
        raise BadInput(f"{flag}: folder {path!r} does not exist")
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise BadInput(f"{flag}: cannot write in folder {path!r} ({e.strerror or e})") from None


def check_output_file(path: str, flag: str, suffix: str | None = None) -> None:
    """BadInput unless `path` names a file (ending in `suffix`, if given) that
    can be written: not a folder, in a folder that exists and is writable."""
    if not path:
        raise BadInput(f"{flag} is empty; give a file path")
    if suffix and not path.lower().endswith(suffix):
        raise BadInput(f"{flag} {path!r} must end in {suffix}")
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path!r} is a folder; give a file path")
    check_folder(os.path.dirname(os.path.abspath(path)), flag)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise BadInput(f"{flag}: {path!r} is not writable")


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


def split_policies(text: str, flag: str = "--policies") -> list[str]:
    """'minimal,save:query_proj,key_proj,full' -> ['minimal', 'save:query_proj,key_proj', 'full'].

    Commas separate policies, except before a tag, alias or glob after a
    spec with a tag list (one with ':'), which continues that list.

    Raises:
      BadInput: `text` is empty, an item between commas is empty, or a
        policy does not parse (the message gives its item number).
    """
    if not text.strip():
        raise BadInput(f"{flag} is empty; give comma-separated policy specs, or leave it "
                       "out for every preset")
    items: list[tuple[int, str]] = []
    for i, piece in enumerate(text.split(","), 1):
        word = piece.strip()
        if not word:
            raise BadInput(f"empty policy at item {i} of {text!r}")
        if items and ":" in items[-1][1] and not _starts_policy(word):
            items[-1] = (items[-1][0], f"{items[-1][1]},{word}")
        else:
            items.append((i, word))
    for i, spec in items:
        try:
            parse(spec)
        except RematSpecError as e:
            raise BadInput(f"policy at item {i} of {text!r}: {e}") from None
    return [spec for _, spec in items]


def check_schedules(cfg: "TransformerConfig | int | None", specs: Sequence[str],
                    flag: str) -> None:
    """BadInput, before anything compiles, for a spec the model cannot take: the
    config's own checks (`TransformerConfig`), e.g. a layer schedule that does not
    fit its layers (full@every:99 on 2 layers, nested:7) or needs a looped stack;
    for a model of the user's (cfg its block count), the schedule's own check."""
    for spec in specs:
        try:
            if isinstance(cfg, TransformerConfig):
                cfg.replace(remat=spec)
            elif cfg is not None:
                policy = parse(spec)
                if not isinstance(policy, AutoSpec):
                    policy.schedule.check(cfg)
        except ValueError as e:
            raise BadInput(f"{flag} {spec!r}: {e}") from None


def preset_policies() -> list[str]:
    """Every row of `spec.PRESET_TABLE` as a spec that is also its display name: the
    bare word where it means this row (`spec.BARE_NAMES`), else 'codebase:name'."""
    return [name if BARE_NAMES.get(name) == (cb, name) else f"{cb}:{name}"
            for cb, name, _, _ in PRESET_TABLE]


def device_mesh(text: str | None, batch: int, cfg: TransformerConfig,
                target: Target | None = None):
    """The `Mesh` for a --mesh spec such as 'data:2,fsdp:2,tensor:2' over the
    first data x fsdp x tensor devices (`remat_kit.mesh.make`), or None.

    On CPU, that many host devices are created if JAX has not started yet
    (the `jax_num_cpu_devices` option, like
    XLA_FLAGS=--xla_force_host_platform_device_count=N). For a target
    compiled ahead of time the devices are its topology's
    (`targets.make_mesh`), and with no --mesh the mesh is data parallel over
    all of them (a TPU slice's chips).

    Raises:
      BadInput: a bad spec (unknown axis, size not a positive int, more than
        `remat_kit.mesh.MAX_DEVICES` devices), a global `batch` that does not
        split over data x fsdp, heads or mlp_dim that do not split over
        tensor, or fewer devices than the mesh needs. All but the last are
        found before JAX starts.
      TargetError: an AOT target with fewer devices than the mesh (the
        message names both numbers).
    """
    aot = target is not None and target.aot
    if text is None and not aot:
        return None
    flag = "--mesh"
    if text is None:  # a TPU slice: data parallel over all of its chips
        from remat_kit import targets
        text = f"data:{len(targets.devices(target))}"
        flag = f"target {target} ({text})"
    try:
        sizes = rk_mesh.parse_spec(text)
        rk_mesh.check_fits(sizes, cfg, batch)
        if aot:
            from remat_kit import targets
            return targets.make_mesh(target, sizes)
        import jax
        n = math.prod(sizes.values())
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # JAX already started; use the devices it has
        devices = jax.devices()
        if len(devices) < n:
            raise rk_mesh.MeshError(
                f"mesh {text} needs {n} devices, found {len(devices)} {devices[0].platform}; "
                f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                "starting")
        return rk_mesh.make(sizes, devices[:n])
    except rk_mesh.MeshError as e:
        raise BadInput(f"{flag}: {e}") from None


# ---------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------

def _sizes(args, src: Source) -> tuple[int, int]:
    """(batch, seq) from the flags, else the config file's, else the defaults (8,
    min(max_len, 1024)); BadInput if a config's model cannot take seq (`check_seq`)."""
    cfg = src.cfg
    batch = args.batch or src.defaults.get("batch", 8)
    seq = args.seq or src.defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    if cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    return batch, seq


def _targets(text: str | None) -> list:
    """The --target list, [None] (JAX's default backend) if not given. Checks that
    libtpu is there and accepts each TPU topology, before anything is measured."""
    from remat_kit import targets
    if text is None:
        return [None]
    found = targets.parse_targets(text)
    for target in found:
        if target.aot:
            targets.devices(target)
    return found


def _plot_path(path: str, target, several: bool) -> str:
    """`path`, or with several targets one file per target: pareto_tpu_v5e_1x1.png."""
    if not several:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}_{str(target).replace(':', '_')}{ext}"


def _compare(args) -> int:
    from remat_kit import report, targets
    from remat_kit.measure import measure

    # Every check comes before JAX starts measuring, so bad input costs nothing.
    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    specs = split_policies(args.policies) if args.policies is not None else preset_policies()
    check_schedules(cfg, specs, "--policies")
    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.plot is not None:
        check_output_file(args.plot, "--plot", suffix=".png")
    target_list = _targets(args.target)
    if args.time and any(t is not None and t.aot for t in target_list):
        raise BadInput("--time runs steps, which needs the devices: a target compiled ahead "
                       "of time (tpu:<topology>) cannot be timed")
    meshes = [device_mesh(args.mesh, batch, cfg, t) for t in target_list]
    works = [src.workload(batch, seq, mesh) for mesh in meshes]  # traced, not compiled
    if cfg is None:
        check_schedules(works[0].num_layers, specs, "--policies")

    def progress(i, n, record):
        status = "error" if record.error else f"{record.compile_seconds:.1f} s"
        print(f"[{i}/{n}] {record.target}: {', '.join(record.names)}: {status}",
              file=sys.stderr, flush=True)

    sections, contexts = [], []
    dtype = src.dtype(works[0])
    for target, mesh, work in zip(target_list, meshes, works):
        devices = 1 if mesh is None else mesh.size
        batch_split = 1 if mesh is None else rk_mesh.axis_size(mesh, "batch")
        tensor = 1 if mesh is None else rk_mesh.axis_size(mesh, "heads")
        if args.time and cfg is not None:
            check_memory(cfg, batch // batch_split, seq, f"--batch {batch} and --seq {seq}")
        records = measure(work, policies=specs, names=specs, time_steps=args.time,
                          progress=progress, target=target, per_layer=True)
        target = targets.parse_target(target)
        found = targets.versions(target)
        mesh_text = rk_mesh.spec_text(mesh)
        per_device = f", per device of {devices} ({mesh_text})" if devices > 1 else ""
        title = f"{label}: batch {batch}, seq {seq}, {dtype} ({target.label}{per_device})"
        sections.append((target, title, report.rows(records, cfg, batch // batch_split, seq,
                                                    tensor=tensor)))
        contexts.append({"target": str(target), "platform": target.label, "devices": devices,
                         "mesh": mesh_text if devices > 1 else args.mesh,
                         "jax_version": found["jax"], "compiler_version": found["compiler"]})
    if len(sections) == 1:
        report.print_table(sections[0][2], sections[0][1])
    else:
        report.print_side_by_side(
            [(str(t), rows) for t, _, rows in sections],
            f"{label}: batch {batch}, seq {seq}, {dtype}, per device")
    for note in dict.fromkeys(n for _, _, rows in sections for d in rows for n in d["notes"]
                              if cfg is None):
        print(f"note: {note}", file=sys.stderr)
    if args.json is not None:
        # The first target's fields stay at the top level (schema 1); "targets" has them all.
        context = {"config": label, "batch": batch, "seq": seq, "dtype": dtype,
                   **contexts[0], "targets": contexts}
        report.write_json(args.json, [d for _, _, rows in sections for d in rows], context)
    if args.plot is not None:
        for target, title, rows in sections:
            report.plot(_plot_path(args.plot, target, len(sections) > 1), rows, title)
    return 0


def _explain(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from remat_kit import report, targets
    from remat_kit.explain import layer_residuals

    from remat_kit.explain import explain

    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    if args.policy is None and cfg is None:
        raise BadInput("explain --model needs --policy (a --model has no default policy)")
    policy = parse(args.policy if args.policy is not None else cfg.remat)
    if isinstance(policy, AutoSpec):
        raise BadInput(f"explain shows one policy; {policy} is planned per model: run "
                       f"remat-kit plan --budgets {policy.budget} to see what it chooses")
    if policy.schedule.kind != "uniform":
        raise BadInput(f"explain shows one layer under one policy; {policy} runs its layers "
                       f"under different policies (schedule {policy.schedule}): explain the "
                       f"policy without '@{policy.schedule}', or compare the whole model")
    where = ""
    if args.mesh is not None and cfg is None:  # the block one device runs: its batch share
        try:
            sizes = rk_mesh.parse_spec(args.mesh)
            rk_mesh.check_fits(sizes, None, batch)
        except rk_mesh.MeshError as e:
            raise BadInput(f"--mesh: {e}") from None
        if rk_mesh.axis_size(sizes, "heads") > 1:
            raise BadInput(f"--mesh {args.mesh}: a tensor axis splits a --model's own layers, "
                           "which remat_kit cannot do; use data and fsdp axes")
        batch //= rk_mesh.axis_size(sizes, "batch")
        where = f", per device of mesh {args.mesh}"
    elif args.mesh is not None:  # the layer one device runs; no devices needed
        try:
            sizes = rk_mesh.parse_spec(args.mesh)
            rk_mesh.check_fits(sizes, cfg, batch)
            cfg = rk_mesh.per_device_config(cfg, sizes)
        except rk_mesh.MeshError as e:
            raise BadInput(f"--mesh: {e}") from None
        batch //= rk_mesh.axis_size(sizes, "batch")
        where = f", per device of mesh {args.mesh} (heads {cfg.num_heads}, mlp {cfg.mlp_dim})"
    target = None
    if args.target is not None:
        found = _targets(args.target)
        if len(found) > 1:
            raise BadInput(f"explain takes one --target, got {args.target!r}")
        target = found[0]
    if cfg is not None:
        layer, what, dtype = layer_residuals(cfg, batch, seq, policy, target=target), \
            "one decoder layer", cfg.dtype
    else:
        work = src.workload(batch, seq)
        layer, what, dtype = explain(policy, work, target=target), "one block", src.dtype(work)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(f"{label}, {what} under {args.policy or str(policy)!r} "
                  f"({policy}): batch {batch}, seq {seq}, {dtype}{where}")
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
    if layer.compiled is not None:
        c, found = layer.compiled, targets.versions(layer.compiled.target)
        flops = "-" if c.flops is None else f"{c.flops / 1e9:.3g} GFLOP"
        temp = report.fmt_bytes(c.memory.get("temp_size_in_bytes"))
        console.print(f"one layer's value-and-grad, {c.target.label} (jax {found['jax']}, "
                      f"{found['compiler']}): temp {temp}, {flops}, compiled in "
                      f"{c.seconds:.1f} s", markup=False)
        for note in c.notes:
            console.print(note, style="dim", markup=False)
    return 0


def split_budgets(text: str) -> list[str]:
    """'0.2,0.4,6GiB' -> ['0.2', '0.4', '6GiB'], each checked (`plan.parse_budget`).

    Raises:
      BadInput: empty, an empty item, or an item that is not a budget.
    """
    from remat_kit.errors import BudgetError
    from remat_kit.plan import parse_budget

    items = [b.strip() for b in text.split(",")]
    if not text.strip() or not all(items):
        raise BadInput(f"--budgets must be comma-separated sizes or fractions, e.g. "
                       f"0.2,0.4,6GiB; got {text!r}")
    for b in items:
        try:
            parse_budget(b)
        except BudgetError as e:
            raise BadInput(f"--budgets: {e}") from None
    return items


def _plan(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from remat_kit import report
    from remat_kit.record import MEMORY_LABELS
    from remat_kit.plan import Planner, parse_budget, read_cache

    src = load_source(args)
    cfg, label = src.cfg, src.label
    batch, seq = _sizes(args, src)
    budgets = split_budgets(args.budgets)
    presets = ([] if args.no_presets else split_policies(args.presets, "--presets")
               if args.presets is not None else preset_policies())
    check_schedules(cfg, presets, "--presets")
    auto = [p for p in presets if p.strip().startswith("auto")]
    if auto:
        raise BadInput(f"--presets: {auto[0]!r} is a budget for the planner, not a preset; "
                       "give its budget in --budgets")
    for path, flag, suffix in ((args.json, "--json", None), (args.plot, "--plot", ".png")):
        if path is not None:
            check_output_file(path, flag, suffix=suffix)
    if args.cache and (os.path.isdir(args.cache) or read_cache(args.cache) is None):
        raise BadInput(f"--cache {args.cache!r} is not a plan cache (a JSON object written by "
                       f"remat-kit plan); give a new file, or '' for none")
    target_list = _targets(args.target)
    if len(target_list) > 1:
        raise BadInput(f"plan takes one --target, got {args.target!r}")
    mesh = device_mesh(args.mesh, batch, cfg, target_list[0])
    devices = 1 if mesh is None else mesh.size
    work = src.workload(batch, seq, mesh)
    if cfg is None:
        check_schedules(work.num_layers, presets, "--presets")
    dtype = src.dtype(work)

    def progress(message):
        print(message, file=sys.stderr, flush=True)

    planner = Planner(work, progress=progress,
                      cache=args.cache if args.cache is not None else True,
                      target=target_list[0])
    # Presets first: the planner takes any compiled policy that beats its own plan.
    named: dict[int, tuple] = {}
    for spec, r in zip(presets, planner.measure_all(presets)):
        named[id(r)] = (r, named.get(id(r), (r, ()))[1] + (spec,))
    records = [dataclasses.replace(r, names=names) for r, names in named.values()]
    start = time.perf_counter()
    full, none = planner.minimum()
    if none is None and any(parse_budget(b).bytes is None for b in budgets):
        raise BadInput(f"--budgets: no remat runs out of {target_list[0]}'s memory at these "
                       "shapes, so a fraction of it means nothing; give budgets in bytes")
    fits = [b for b in budgets if parse_budget(b).resolve(none) >= full]
    plans = dict(zip(fits, planner.frontier(fits)))
    plan_seconds = time.perf_counter() - start
    kind = planner.memory_kind
    memory = MEMORY_LABELS[kind]
    ok = [r for r in records if r.error is None and r.memory_bytes is not None
          and r.memory_kind == kind]
    title = (f"{label}: batch {batch}, seq {seq}, {dtype} ({planner.measure('full').platform}"
             f"{f', per device of {devices}' if devices > 1 else ''}); no remat: "
             f"{report.fmt_bytes(none) + ' ' + memory if none else 'out of device memory'}, "
             f"least compiled: {report.fmt_bytes(full)}{f' ({full / none:.3f})' if none else ''}")
    t = Table(title=title, caption=f"memory: compiled {kind}, budgets and x none of it; "
              "FLOPs: over no remat", caption_justify="left")
    for name in ("budget", "bytes", "planned policy", memory, f"{memory} x none", "FLOPs +",
                 "tries", "best preset that fits", memory, "FLOPs +"):
        t.add_column(name, justify="left" if "polic" in name or "preset" in name else "right")
    out = []
    for b in budgets:
        limit = parse_budget(b).resolve(none)
        fitting = [r for r in ok if r.memory_bytes <= limit]
        best = min(fitting, key=lambda r: (r.flops, r.memory_bytes), default=None)
        p = plans.get(b)
        preset_cells = ([", ".join(best.names), report.fmt_bytes(best.memory_bytes),
                         f"{best.flops / planner.none_flops() - 1:+.2%}"]
                        if best else ["no preset fits" if presets else "not compared", "-", "-"])
        if p is None:
            t.add_row(b, report.fmt_bytes(limit), "below the minimum"
                      + (f" ({full / none:.3f})" if none else f" ({report.fmt_bytes(full)})"),
                      "-", "-", "-", "-", *preset_cells)
        else:
            t.add_row(b, report.fmt_bytes(limit), p.spec, report.fmt_bytes(p.measured_bytes),
                      "-" if p.memory_fraction is None else f"{p.memory_fraction:.3f}",
                      f"{p.flops_overhead:+.2%}",
                      "cached" if p.cached else str(p.iterations), *preset_cells)
        out.append({"budget": b, "budget_bytes": limit, "plan": p and p.to_dict(),
                    "best_preset": best and best.to_dict()})
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(t)
    console.print(f"planned {len(fits)} budget{'' if len(fits) == 1 else 's'} in "
                  f"{plan_seconds:.1f} s"
                  + (" (the presets compiled before, not counted)" if presets else ""))
    context = {"config": label, "batch": batch, "seq": seq, "dtype": dtype,
               "devices": devices, "platform": planner.measure("full").platform,
               "memory_kind": kind, "none_bytes": none, "minimum_bytes": full,
               "plan_seconds": plan_seconds}
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump({"schema_version": 1, "context": context, "budgets": out,
                       "presets": [r.to_dict() for r in records]}, f, indent=2)
            f.write("\n")
    if args.plot is not None:
        planned = [dataclasses.replace(planner.records[p.spec], names=(f"auto:budget={b}",))
                   for b, p in plans.items()]
        report.plot(args.plot, report.rows(records + planned), title)
    return 0


def _fit(args) -> int:
    from rich.console import Console

    from remat_kit import report
    from remat_kit.errors import BudgetError
    from remat_kit.fit import DEFAULT_MAX_SIZE, DEFAULT_MULTIPLE, FIT_POLICIES, _is_auto, fit
    from remat_kit.plan import parse_budget

    src = load_source(args)
    cfg, label, defaults = src.cfg, src.label, src.defaults
    try:
        budget = parse_budget(args.budget).bytes
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    if budget is None:
        raise BadInput(f"--budget must be a size such as 16GiB, not a fraction: got "
                       f"{args.budget!r}")
    searched = {"seq": args.seq, "batch": args.batch}[args.vary]
    if searched is not None:
        other = "batch" if args.vary == "seq" else "seq"
        raise BadInput(f"--{args.vary} {searched} is what --vary {args.vary} searches; fix "
                       f"the --{other} instead, or search the {other} with --vary {other}")
    target_list = _targets(args.target)
    if len(target_list) > 1:
        raise BadInput(f"fit takes one --target, got {args.target!r}")
    try:  # the global batch splits over data x fsdp: its default and unit follow the mesh
        split = rk_mesh.axis_size(rk_mesh.parse_spec(args.mesh), "batch") if args.mesh else 1
    except rk_mesh.MeshError as e:
        raise BadInput(f"--mesh: {e}") from None
    batch = args.batch or (split if args.vary == "seq" else defaults.get("batch", 8))
    seq = args.seq or defaults.get("seq", min(cfg.max_len, 1024) if cfg else 1024)
    if args.vary == "batch" and cfg is not None:
        check_seq(cfg, seq, "--seq" if args.seq else "seq_len")
    multiple = args.multiple or DEFAULT_MULTIPLE[args.vary] * (split if args.vary == "batch"
                                                               else 1)
    if args.vary == "batch" and multiple % split:
        raise BadInput(f"--multiple {multiple} does not split over the {split} data-parallel "
                       f"devices of --mesh {args.mesh} (data x fsdp); the batch is global: "
                       f"use a multiple of {split}")
    # "auto" is fit's planner row; its budget is the fit budget.
    text = (",".join(f"auto:budget={args.budget}" if p.strip() == "auto" else p
                     for p in args.policies.split(",")) if args.policies is not None else None)
    specs = split_policies(text) if text is not None else list(FIT_POLICIES)
    check_schedules(cfg, specs, "--policies")
    if args.multiple and args.multiple > DEFAULT_MAX_SIZE[args.vary]:
        raise BadInput(f"--multiple {args.multiple} is above the largest {args.vary} fit "
                       f"searches, {DEFAULT_MAX_SIZE[args.vary]}")
    for spec in specs:
        try:
            _is_auto(spec, budget)
        except BudgetError as e:
            raise BadInput(f"--policies: {e}") from None
    for path, flag, suffix in ((args.json, "--json", None), (args.plot, "--plot", ".png")):
        if path is not None:
            check_output_file(path, flag, suffix=suffix)
    # Without --mesh the step runs on one device, of an AOT target's slice too.
    mesh = (device_mesh(args.mesh, batch if args.vary == "seq" else multiple, cfg,
                        target_list[0]) if args.mesh else None)

    def progress(i, n, row):
        status = row.error or (f"{args.vary} {row.size}, {row.compiles} compiles"
                               + (f", picked {row.picked}" if row.picked else ""))
        print(f"[{i}/{n}] {row.policy}: {status}", file=sys.stderr, flush=True)

    model, dtype = cfg, cfg and cfg.dtype
    if cfg is None:  # traced once at the smallest size: bad models fail before compiling
        first = src.workload(*((batch, multiple) if args.vary == "seq" else (multiple, seq)),
                             mesh)
        check_schedules(first.num_layers, specs, "--policies")
        model, dtype = (lambda b, s: src.workload(b, s, mesh)), src.dtype(first)
        mesh = None  # the workloads carry it
    try:
        result = fit(model, args.budget, vary=args.vary, policies=specs, batch=batch, seq=seq,
                     multiple=multiple, target=target_list[0], mesh=mesh, progress=progress)
    except BudgetError as e:
        raise BadInput(f"--budget: {e}") from None
    fixed = f"batch {batch}" if args.vary == "seq" else f"seq {seq}"
    where = (f"per device of mesh {result.mesh} ({result.devices} devices; sizes global)"
             if result.mesh else "per device")
    title = (f"{label}: longest {args.vary} within {report.fmt_bytes(budget)} {where}, {fixed}, "
             f"{dtype}, multiple {multiple} ({result.platform})")
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(report.fit_table(result, title))
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(report.fit_to_dict(result) | {"config": label}, f, indent=2)
            f.write("\n")
    if args.plot is not None:
        report.plot_fit(args.plot, result, f"{label}, {fixed}, {dtype}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat-kit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="{compare,explain,plan,fit}")

    def common(p):
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--config",
                            help=f"a model name ({', '.join(CONFIGS)}) or a .py config file "
                                 "with get_config()")
        source.add_argument("--model", metavar="FILE.py:FUNCTION",
                            help="your own model: FUNCTION() returns a linen or NNX model "
                                 "(int32 tokens [batch, seq] -> logits), or FUNCTION(batch, "
                                 "seq) returns a remat_kit.Workload; also package.module:FUNCTION")
        p.add_argument("--block", default=None, metavar="NAME",
                       help="with --model: the repeated block class to remat (default: the "
                            "class instantiated most often with one structure)")
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
    compare.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: measure sharded, per device")
    compare.add_argument("--target", default=None,
                         help="whose compiler: cpu, tpu:<topology> (ahead of time via libtpu, "
                              "e.g. tpu:v5e:2x2), tpu or gpu (this machine's); comma-separated "
                              "targets go side by side (default: JAX's default backend)")
    compare.add_argument("--time", type=_non_negative_int, default=0, metavar="N",
                         help="also time N steps per policy on random data")
    compare.add_argument("--json", default=None, metavar="PATH", help="write the records here")
    compare.add_argument("--plot", default=None, metavar="PATH",
                         help="write a memory vs FLOPs PNG here")
    compare.set_defaults(run=_compare)

    explain = sub.add_parser("explain", help="what one layer saves under one policy")
    common(explain)
    explain.add_argument("--policy", default=None, help="a policy spec (default: the config's)")
    explain.add_argument("--mesh", default=None,
                         help="e.g. data:2,fsdp:2,tensor:2: the layer one device runs")
    explain.add_argument("--target", default=None,
                         help="also compile the layer for this target (cpu, tpu:v5e:1x1, "
                              "gpu:h100, ...) and print its temp memory and FLOPs")
    explain.set_defaults(run=_explain)

    plan = sub.add_parser("plan", help="the cheapest policy for each memory budget")
    common(plan)
    plan.add_argument("--budgets", required=True,
                      help="comma-separated budgets: sizes (6GiB, 512MiB, bytes) or fractions "
                           "0 < f <= 1 of no remat's memory (temp on CPU, the compiler's "
                           "peak on TPU and GPU)")
    presets = plan.add_mutually_exclusive_group()
    presets.add_argument("--presets", default=None,
                         help="comma-separated specs to set against the plans (default: every "
                              "preset)")
    presets.add_argument("--no-presets", action="store_true", help="compare with no preset")
    plan.add_argument("--mesh", default=None,
                      help="e.g. data:2,fsdp:2,tensor:2: plan the per-device program")
    plan.add_argument("--target", default=None,
                      help="plan against this target's compiled memory (cpu, tpu:v5e:1x1, "
                           "gpu:h100, ...; default JAX's default backend)")
    plan.add_argument("--cache", default=None, metavar="PATH",
                      help="plan cache file (default: $REMAT_KIT_CACHE or "
                           "~/.cache/remat_kit/plans.json); '' for none")
    plan.add_argument("--json", default=None, metavar="PATH", help="write plans and presets here")
    plan.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of the plans over the presets' points")
    plan.set_defaults(run=_plan)

    fit = sub.add_parser("fit", help="the longest seq (or largest batch) each policy fits "
                                     "in a memory budget")
    common(fit)
    fit.add_argument("--budget", required=True,
                     help="device memory per device, e.g. 16GiB, 512MiB, 8e9 bytes (also the "
                          "budget of an auto row)")
    fit.add_argument("--vary", choices=("seq", "batch"), default="seq",
                     help="search the sequence length (global batch fixed, default 1, or "
                          "data x fsdp on a mesh) or the global batch (seq fixed)")
    fit.add_argument("--multiple", type=_positive_int, default=None,
                     help="search in multiples of this (default 128 for seq; 1 for batch, or "
                          "data x fsdp on a mesh)")
    fit.add_argument("--policies", default=None,
                     help="comma-separated policy specs, and auto for the planner's pick at "
                          "each size (default: none,full,minimal,selective,dots)")
    fit.add_argument("--mesh", default=None,
                     help="e.g. data:2,fsdp:2,tensor:2: the step sharded over a mesh; the "
                          "budget is per device, the batch global (default: one device)")
    fit.add_argument("--target", default=None,
                     help="whose compiler: cpu, tpu:<topology> (ahead of time), gpu:h100, ... "
                          "(default: JAX's default backend); the budget is per chip")
    fit.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    fit.add_argument("--plot", default=None, metavar="PATH",
                     help="write a bar chart of the sizes (PNG) here")
    fit.set_defaults(run=_fit)
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
