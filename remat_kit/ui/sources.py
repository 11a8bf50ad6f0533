"""Where a command's model comes from: --config (a reference transformer by name, or a
.py file whose get_config() returns an ml_collections ConfigDict) or --model (the
user's model or Workload function), as a `Source` that builds the workload at any
sizes. Each failure raises `BadInput`, one line naming the file or flag;
`experiments/` load their config files the same way.
Docs: docs/models.md ("From the command line"), docs/training.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import os
import sys

from remat_kit import mesh as rk_mesh
from remat_kit.ui.inputs import BadInput, check_int
from remat_kit.flax.from_model import OUR_LOSS
from remat_kit.models import TransformerConfig, from_config_dict, get_config


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
      make: (batch, seq, mesh) -> Workload, mesh a Mesh (--mesh), a `rk_mesh.Fallback`
        (a TPU target's chips, which a model's own mesh replaces) or None; raises
        BadInput for a bad model.
      loss: the words naming the loss measured, for the tables' titles: remat-kit's
        (`from_model.OUR_LOSS`), "your my_loss" for a (model, batch, loss) FUNCTION, or
        a Workload's own.
    """

    label: str
    cfg: TransformerConfig | None
    defaults: dict
    make: object
    loss: str = OUR_LOSS

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
        from remat_kit.ui import labels
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
        return Source(label, None, getattr(make, "defaults", {}), _placed(make, args),
                      getattr(make, "loss_words", OUR_LOSS))
    for flag in ("rules", "batch_axes"):
        if getattr(args, flag, None):
            raise BadInput(f"--{flag.replace('_', '-')} is for a --model; --config models "
                           "place themselves by remat_kit's rules (--mesh)")
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
                  lambda batch, seq, mesh=None: config_workload(cfg, batch, seq,
                                                                mesh=rk_mesh.plain(mesh)))


def _placed(make, args):
    """`make` under the --rules and --batch-axes given (`placement.given`); `make` where
    neither is. A rules file that does not read is BadInput now; --batch-axes naming
    an axis the mesh lacks, when the workload is made."""
    from remat_kit.errors import MeshError
    from remat_kit.flax import placement
    path, axes = getattr(args, "rules", None), getattr(args, "batch_axes", None)
    if not path and not axes:
        return make
    try:
        rules = placement.read_rules(path) if path else None
    except MeshError as e:
        raise BadInput(f"--rules: {e}") from None
    axes = tuple(a.strip() for a in axes.split(",") if a.strip()) if axes else None

    @functools.wraps(make)
    def made(*a, **kw):
        with placement.given(rules, axes):
            return make(*a, **kw)
    return made


def rechunked(args, chunks: int) -> Source:
    """The Source of `args` with --vocab-chunks `chunks` (the remedy a below-the-minimum
    line names, compiled to give its figure)."""
    return load_source(argparse.Namespace(**{**vars(args), "vocab_chunks": chunks}))


__all__ = ["Source", "config_from_dict", "load_config", "load_config_file", "load_source",
           "rechunked"]
