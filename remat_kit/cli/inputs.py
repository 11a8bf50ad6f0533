"""What the `remat-kit` commands take, checked before JAX starts: configs and models,
sizes, policy lists, budgets, meshes and output paths. Each check raises `BadInput`, one
line for the user; `experiments/` use the same checks for their flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import sys
import tempfile
from collections.abc import Sequence

from remat_kit import mesh as rk_mesh
from remat_kit.policy import names as tag_names
from remat_kit import files as outputs
from remat_kit.errors import RematSpecError, shorten
from remat_kit.models import TransformerConfig, from_config_dict, get_config
from remat_kit.policy.spec import BARE_NAMES, PRESET_TABLE, AutoSpec, parse
from remat_kit.measure.targets import Target


class BadInput(ValueError):
    """Input the command cannot use; the message is one line for the user."""


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
        except KeyError as e:  # the names and the closest, and what else --config takes
            names, _, hint = e.args[0].partition("; did you mean")
            raise BadInput(f"{names}, or a .py config file with get_config()"
                           + (f"; did you mean{hint}" if hint else "")) from None
    config = load_config_file(spec)
    own = config.get("model")
    if isinstance(own, str) and ":" in own:  # a training config of the user's own model
        sizes = "".join(f" --{flag} {config[key]}" for flag, key in
                        (("batch", "batch_size"), ("seq", "seq_len")) if key in config)
        raise BadInput(f"config file {spec!r}: config.model {own!r} is your own model, which "
                       f"--config does not build; give it as --model {own}{sizes}")
    cfg, defaults = config_from_dict(config, where=f"config file {spec!r}")
    return cfg, os.path.basename(spec), defaults


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a command's workload comes from: --config (a reference transformer) or
    --model (the user's model or Workload function, `remat_kit.flax.user_model`).

    Attributes:
      label: the report's name, e.g. "gpt2_small" or "models.py:build".
      cfg: the TransformerConfig for --config (dtype applied), None for --model.
      defaults: {"batch", "seq"} from a config file's batch_size / seq_len, or a
        (model, batch) FUNCTION's batch (seq None: it has no sequence axis).
      make: (batch, seq, mesh) -> Workload; raises BadInput for a bad model.
    """

    label: str
    cfg: TransformerConfig | None
    defaults: dict
    make: object

    def workload(self, batch: int, seq: int, mesh=None):
        """The workload at these sizes; BadInput for a model that cannot give one,
        or whose loss does not depend differentiably on its parameters (there
        would be no backward pass: every policy the same program, 0 residuals)."""
        from remat_kit.flax.from_model import ModelError
        from remat_kit.policy.policy import Policy
        from remat_kit.trace.workload import has_gradient_path
        try:
            work = self.make(batch, seq, mesh)
        except ModelError as e:
            raise BadInput(str(e)) from None
        if self.cfg is None and not has_gradient_path(work.loss_for_policy(Policy(remat=False)),
                                                      *work.args):  # ours always have one
            raise BadInput(f"{self.label}: the loss has no float path to the parameters "
                           "(integer or boolean logits? a stop_gradient?): its gradient is "
                           "zero, so there is no backward pass to rematerialize; return "
                           "float logits")
        return work

    def dtype(self, workload=None) -> str:
        """The dtype for titles (`labels.dtype_label`): the activations' and, where
        they differ, the parameters'; of the config, else of the model's workload."""
        from remat_kit.cli import labels
        if self.cfg is not None:
            return labels.dtype_label(self.cfg.param_dtype, self.cfg.dtype)
        if workload is None:
            return "-"
        return labels.dtype_label(labels.params_dtype(workload.params),
                                  labels.activation_dtype(workload))

    @property
    def num_layers(self) -> int | None:
        return self.cfg.num_layers if self.cfg is not None else None


def load_source(args) -> Source:
    """The Source of --config or --model (with --block and --dtype checked).

    Raises:
      BadInput: both or neither given, --block without --model, --dtype with
        --model (the model's dtypes are its own), a bad config or model, or
        --vocab-chunks not dividing a config's vocabulary (a --model's is
        checked when it is traced).
    """
    chunks = getattr(args, "vocab_chunks", None) or 1
    from remat_kit.models import workload as config_workload

    if args.model is not None:
        from remat_kit.flax import user_model
        from remat_kit.flax.from_model import ModelError
        if args.dtype:
            raise BadInput(f"--dtype is for --config; a --model keeps its own dtypes (set "
                           f"them where {args.model} builds the model)")
        # fit searches one size from --multiple up: --seq or --batch would be refused there.
        fixed = {"seq": "batch", "batch": "seq"}.get(getattr(args, "vary", None))
        sizes = (f"--{fixed} and --multiple (fit --vary {args.vary} tries multiples of it)"
                 if fixed else "--batch and --seq")
        try:
            label, make = user_model.load(args.model, args.block, chunks, sizes=sizes)
            user_model.check_axes(args.model, make, seq=args.seq, batch=args.batch,
                                  vary=getattr(args, "vary", None))
        except ModelError as e:
            raise BadInput(str(e)) from None
        # a (model, batch) FUNCTION's own sizes
        return Source(label, None, getattr(make, "defaults", {}), make)
    if args.block is not None:
        raise BadInput("--block names the repeated block class of a --model; --config models "
                       "know theirs")
    cfg, label, defaults = load_config(args.config)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    if chunks != 1:
        try:
            cfg = cfg.replace(vocab_chunks=chunks)
        except ValueError as e:
            raise BadInput(f"--vocab-chunks {chunks}: {str(e).partition(': ')[2]}") from None
    return Source(label, cfg, defaults,
                  lambda batch, seq, mesh=None: config_workload(cfg, batch, seq, mesh=mesh))


def rechunked(args, chunks: int) -> Source:
    """The Source of `args` with --vocab-chunks `chunks` (the remedy a below-the-minimum
    line names, compiled to give its figure)."""
    return load_source(argparse.Namespace(**{**vars(args), "vocab_chunks": chunks}))


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

    from remat_kit.units import fmt_bytes

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
    can be written: not a folder, FIFO or device, in a folder that exists and
    is writable (`outputs.problem`). Run before any long work."""
    if not path:
        raise BadInput(f"{flag} is empty; give a file path")
    if suffix and not path.lower().endswith(suffix):
        raise BadInput(f"{flag} {path!r} must end in {suffix}")
    why = outputs.problem(path)
    if why:
        raise BadInput(f"{flag}: {why}; give a file path")


def _starts_policy(piece: str) -> bool:
    """False where `piece` opens with a bare tag, alias or glob (query_proj,
    key_proj;recompute:x): it continues the previous spec's tag list."""
    head = re.split(r"[;|@]", piece, maxsplit=1)[0].strip()
    if head in BARE_NAMES or ":" in head:
        return True
    try:
        tag_names.expand(head)
    except RematSpecError:
        return True
    return False


def split_policies(text: str, flag: str = "--policies") -> list[str]:
    """'minimal,save:query_proj,key_proj,full' -> ['minimal', 'save:query_proj,key_proj', 'full'].

    Commas separate policies, except before a piece that opens with a tag,
    alias or glob after a spec with a tag list (one with ':'): it continues
    that list, so every spec `parse` accepts stays whole
    ('save:query_proj,key_proj;recompute:attn_probs' is one policy).

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
            raise BadInput(f"empty policy at item {i} of {shorten(text)!r}")
        if items and ":" in items[-1][1] and not _starts_policy(word):
            items[-1] = (items[-1][0], f"{items[-1][1]},{word}")
        else:
            items.append((i, word))
    for i, spec in items:
        try:
            parse(spec)
        except RematSpecError as e:
            raise BadInput(f"policy at item {i} of {shorten(text)!r}: {e}") from None
    return [spec for _, spec in items]


def check_schedules(cfg, specs: Sequence[str], flag: str) -> None:
    """BadInput, before anything compiles, for a spec the model cannot take: the
    config's own checks (`TransformerConfig`), e.g. a layer schedule that does not
    fit its layers (full@every:99 on 2 layers, nested:7) or needs a looped stack;
    for a model of the user's (cfg its Workload, or its block count), the
    schedule's own check, and with the Workload its loss built under the policy
    (a scanned stack refuses a policy per layer: one scan body takes one)."""
    from remat_kit.trace.workload import Workload
    for spec in specs:
        try:
            if isinstance(cfg, TransformerConfig):
                cfg.replace(remat=spec)
            elif cfg is not None and not isinstance(policy := parse(spec), AutoSpec):
                layers = cfg.num_layers if isinstance(cfg, Workload) else cfg
                if layers is not None:
                    policy.schedule.check(layers)
                if isinstance(cfg, Workload):
                    cfg.loss_for_policy(policy)
        except ValueError as e:  # RematSpecError is a ValueError
            raise BadInput(f"{flag} {shorten(spec)!r}: {e}") from None


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
        from remat_kit.measure import targets
        text = f"data:{len(targets.devices(target))}"
        flag = f"target {target} ({text})"
    try:
        sizes = rk_mesh.parse_spec(text)
        rk_mesh.check_fits(sizes, cfg, batch)
        if aot:
            from remat_kit.measure import targets
            return targets.make_mesh(target, sizes)
        import jax
        n = math.prod(sizes.values())
        rk_mesh.host_devices(n)
        devices = jax.devices()
        if len(devices) < n:
            raise rk_mesh.MeshError(
                f"mesh {text} needs {n} devices, found {len(devices)} {devices[0].platform}; "
                f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                "starting")
        return rk_mesh.make(sizes, devices[:n])
    except rk_mesh.MeshError as e:
        raise BadInput(f"{flag}: {e}") from None


def split_budgets(text: str) -> list[str]:
    """'0.2,0.4,6GiB' -> ['0.2', '0.4', '6GiB'], each checked (`budget.parse_budget`).

    Raises:
      BadInput: empty, an empty item, or an item that is not a budget.
    """
    from remat_kit.errors import BudgetError
    from remat_kit.policy.budget import parse_budget

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


def plan_groups(text: str | None, num_layers: int) -> "int | str":
    """--groups G checked against the model's layers: an int 1..num_layers, or
    "layers" (one group per layer) when not given."""
    if text is None:
        return "layers"
    try:
        g = int(text)
    except ValueError:
        g = None
    if g is None or not 1 <= g <= num_layers:
        raise BadInput(f"--groups {text!r}: give a whole number of layer groups from 1 to "
                       f"{num_layers} (the model's layers)")
    return g


def check_planner_floor(work, budgets: Sequence[str], target, mesh, flag: str) -> None:
    """BadInput, in one line naming the floor, for a budget in bytes below the
    parameters plus gradients where the planner's figure counts them
    (`floor.planner_floor`: TPU and GPU); eval_shape only, nothing compiles."""
    from remat_kit.decide import floor
    from remat_kit.policy.budget import parse_budget
    from remat_kit.errors import BudgetError

    sizes = [n for n in (parse_budget(b).bytes for b in budgets) if n is not None]
    if not sizes:
        return
    least = floor.planner_floor(work, target.platform)
    try:
        floor.check(min(sizes), least, "the parameters plus gradients")
    except BudgetError as e:
        raise BadInput(f"{flag}: {e}") from None
