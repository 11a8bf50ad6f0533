"""A training run's inputs, checked and made before anything compiles: the config's
fields, the devices (and other processes) its mesh needs, the workdir (its lock, orbax's
log), the data, the model config (an auto:budget= spec planned), the optimizer, and
the memory floor a budget must clear. Every user error becomes one `BadInput`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib

import jax
import ml_collections
import optax

from experiments import data, guards, own_model, runlog, synthetic
from remat_kit import mesh as rk_mesh
from remat_kit.ui.inputs import check_folder, check_int, check_memory, check_seq
from remat_kit.errors import BadInput
from remat_kit.decide import floor
from remat_kit.errors import BudgetError, MeshError, RematSpecError
from remat_kit.models import from_config_dict
from remat_kit.models import workload as config_workload
from remat_kit.api.configs import resolve_config
from remat_kit.policy.budget import parse_budget
from remat_kit.policy.spec import AutoSpec, parse


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation,
                                                               optax.Schedule]:
    """AdamW (Loshchilov & Hutter 2019) with linear warmup and cosine decay to
    end_lr_fraction * learning_rate, after global-norm gradient clipping.

    Weight decay applies to matrices (kernels, embeddings) only, not to biases
    and norm scales. Returns (optimizer, learning-rate schedule).
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=max(config.num_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_lr_fraction)
    tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
    return tx, schedule


# Optimizer fields: (name, low, high, low included, high included).
_REAL_FIELDS = (("learning_rate", 0, math.inf, False, False),
                ("end_lr_fraction", 0, 1, True, True),
                ("weight_decay", 0, math.inf, True, False),
                ("b1", 0, 1, True, False),
                ("b2", 0, 1, True, False),
                ("grad_clip_norm", 0, math.inf, False, False))


def check_fields(config: ml_collections.ConfigDict) -> None:
    """BadInput naming the field for a training field that is missing or of the
    wrong type or range."""
    needed = ("model", "remat", "data", "num_steps", "batch_size", "seq_len", "log_every",
              "eval_every", "eval_batches", "warmup_steps", "seed", "checkpoint_every",
              "keep_checkpoints", "tensorboard", "hang_after_step",
              *(field[0] for field in _REAL_FIELDS))
    missing = [name for name in needed if name not in config]
    if missing:
        raise BadInput(f"the config lacks the field(s) train needs: {', '.join(missing)}")
    for name in ("num_steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "eval_batches", "checkpoint_every", "keep_checkpoints"):
        check_int(f"config.{name}", config[name])
    for name in ("warmup_steps", "seed", "hang_after_step"):
        check_int(f"config.{name}", config[name], minimum=0)
    budget_bytes(config)  # a bad memory_budget fails before anything compiles
    if not isinstance(config.tensorboard, bool):
        raise BadInput(f"config.tensorboard must be True or False, got {config.tensorboard!r}")
    if config.warmup_steps > config.num_steps:
        raise BadInput(f"config.warmup_steps ({config.warmup_steps}) must be at most "
                       f"config.num_steps ({config.num_steps})")
    for name, low, high, low_in, high_in in _REAL_FIELDS:
        value = config[name]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or math.isnan(value) or not (low <= value if low_in else low < value)
                or not (value <= high if high_in else value < high)):
            raise BadInput(f"config.{name} must be a number in {'[' if low_in else '('}{low}, "
                           f"{high}{']' if high_in else ')'}, got {value!r}")


def _start_devices(config: ml_collections.ConfigDict, cfg) -> None:
    """Checks config.mesh against the model and batch, and, before JAX starts,
    joins the other processes (`remat_kit.mesh.initialize`) or creates the
    CPU host devices the mesh needs. Raises MeshError (the caller makes it
    BadInput)."""
    sizes = rk_mesh.parse_spec(config.mesh) if config.get("mesh") else None
    rk_mesh.check_fits(sizes, cfg, config.batch_size)
    processes = check_int("config.num_processes", config.get("num_processes", 1))
    coordinator = config.get("coordinator") or None
    if coordinator or processes > 1 or "JAX_COORDINATOR_ADDRESS" in os.environ:
        explicit = coordinator is not None or processes > 1  # else all from the environment
        rk_mesh.initialize(coordinator, processes if explicit else None,
                           config.get("process_id", 0) if explicit else None,
                           check_int("config.distributed_timeout",
                                     config.get("distributed_timeout", 300)))
    elif sizes is not None:  # on CPU, as many host devices as the mesh needs
        rk_mesh.host_devices(math.prod(sizes.values()))


def setup(config: ml_collections.ConfigDict, workdir: str, stack: contextlib.ExitStack):
    """Validates the config and the workdir (created here), takes the
    workdir's lock and sends orbax's logs to its orbax.log (both held by
    `stack`), and loads the data, all before anything compiles; every user
    error becomes BadInput."""
    check_fields(config)
    check_folder(workdir, "--workdir", create=True)
    runlog.check_files(pathlib.Path(workdir))
    own = own_model.is_own(config.model)
    try:
        cfg = None if own else from_config_dict(config)
        _start_devices(config, cfg)
        # One writer per workdir: a second run refuses here, before it touches a file.
        stack.enter_context(guards.workdir_lock(pathlib.Path(workdir), jax.process_index()))
        stack.enter_context(runlog.library_log(pathlib.Path(workdir)))
        if own:  # the user's model: loaded, checked and planned as --model is
            model = own_model.load(config, config_mesh(config),
                                   os.path.join(workdir, "plans.json"))
            if model.batch is not None:  # (model, batch, loss): batches of its shapes
                return model, None, *synthetic.batches(
                    model.batch, config.batch_size, config.seq_len, config.seed,
                    config.eval_batches, lambda i: own_model.rng_state(model, config.seed, i))
            corpus = data.load_corpus(config.data)
            return model, corpus, *_batches(config, corpus)
        if cfg.vocab_size < data.VOCAB_SIZE:
            raise ValueError(f"config.vocab_size must be at least {data.VOCAB_SIZE} (one token "
                             f"per byte value), got {cfg.vocab_size}")
        check_seq(cfg, config.seq_len, "config.seq_len")
        check_memory(cfg, config.batch_size, config.seq_len, sizes(config))
        check_floor(config, cfg)
        corpus = data.load_corpus(config.data)
        batches, evals = _batches(config, corpus)
        # auto:budget=... is planned for these shapes on the run's mesh (per-device
        # bytes); the plan is cached in the workdir, so a restarted run does not plan again.
        cfg = resolve_config(cfg, config.batch_size, config.seq_len, mesh=config_mesh(config),
                             cache=os.path.join(workdir, "plans.json"))
    except KeyError as e:
        raise BadInput(e.args[0]) from e
    except (RematSpecError, MeshError, TypeError, ValueError, OSError) as e:
        raise BadInput(str(e)) from e
    return cfg, corpus, batches, evals


def _batches(config: ml_collections.ConfigDict, corpus: data.Corpus) -> tuple:
    """(train batches, eval batches) of the corpus at the config's shapes."""
    return (data.train_batches(corpus.train, config.batch_size, config.seq_len, config.seed),
            data.eval_batches(corpus.eval, config.batch_size, config.seq_len,
                              config.eval_batches))


def sizes(config: ml_collections.ConfigDict) -> str:
    return (f"config.model={config.model}, batch_size={config.batch_size}, "
            f"seq_len={config.seq_len}")


def budget_bytes(config: ml_collections.ConfigDict) -> int | None:
    """config.memory_budget in bytes per device, or None when unset ('');
    BadInput for anything but a size."""
    text = config.get("memory_budget") or ""
    if not text:
        return None
    try:
        budget = parse_budget(text).bytes
    except RematSpecError as e:
        raise BadInput(f"config.memory_budget: {e}") from None
    if budget is None:
        raise BadInput(f"config.memory_budget must be a size such as 96MiB, got {text!r}")
    return budget


def check_floor(config: ml_collections.ConfigDict, cfg) -> None:
    """BadInput, in one line naming the floor, for a memory_budget or an
    auto:budget= below what no policy frees (`remat_kit.decide.floor`); eval_shape
    only, before the data loads and anything compiles."""
    budget, mesh, policy = budget_bytes(config), config_mesh(config), parse(cfg.remat)
    auto = isinstance(policy, AutoSpec) and parse_budget(policy.budget).bytes
    # The parameters alone matter here: the workload at the smallest size.
    work = lambda: config_workload(cfg.replace(remat="none"), rk_mesh.axis_size(mesh, "batch"), 1,
                                   mesh=mesh)  # noqa: E731
    checks = [("config.memory_budget", budget, lambda: floor.step_floor(
                   work(), make_optimizer(config)[0]), "the parameters plus optimizer state"),
              ("config.remat", auto, lambda: floor.planner_floor(work(), jax.default_backend()),
               "the parameters plus gradients")]
    for field, limit, floor_of, what in checks:
        if limit:
            try:
                floor.check(limit, floor_of(), what)
            except BudgetError as e:
                raise BadInput(f"{field}: {e}") from None


def config_mesh(config: ml_collections.ConfigDict):
    """The mesh of config.mesh over every process's devices, or None; BadInput
    when the devices do not match it."""
    if not config.get("mesh"):
        return None
    try:
        return rk_mesh.make(config.mesh)
    except MeshError as e:
        raise BadInput(f"config.mesh: {e}") from None
