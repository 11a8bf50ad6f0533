"""Train a byte-level language model on real text under a chosen remat policy.

    python -m experiments.train --config=experiments/configs/tiny.py \
        --config.remat=selective --workdir=runs/x

`--model FILE.py:FUNCTION` (or config.model set to that) trains the user's own
linen or NNX model instead, as `remat-kit compare --model` measures it
(experiments/own_model.py, docs/training.md).

Writes `workdir/metrics.jsonl` (one JSON line per logged step) and
`workdir/summary.json` (eval loss in nats/byte, a (model, batch, loss) FUNCTION's in its
own loss's units; median step time, and the
compiled train step's memory and FLOPs under the policy and under no remat).
Checkpoints go to `workdir/checkpoints` every `checkpoint_every` steps and at
the end; a second start with the same workdir resumes from the latest one,
under the remat policy it is given (see experiments/checkpoint.py, runlog.py).
A non-finite loss stops the run (exit 1); SIGINT or SIGTERM writes a
checkpoint, then exits with 128 + the signal number.
On disk faults: a damaged checkpoint (a file missing, cut short or changed
since its SHA-256 was taken) is moved to checkpoints/damaged/ with one warning
line, and the run resumes from the newest intact one; when none is intact it
refuses once (exit 2), and the next start trains from step 0. A full disk is
one line naming the path and its free space (exit 2); orbax's log lines go to
workdir/orbax.log. A second run on a workdir in use refuses at once (exit 2),
naming the PID holding workdir/.lock. Damaged metrics.jsonl lines go to
metrics.jsonl.damaged, with one warning line.
Bad input (unknown policy or tag, malformed spec, missing, empty or binary
data, a config file that does not load, a config value of the wrong type or
out of range, an unusable workdir, sizes that do not fit in memory) exits with
code 2 and one line on stderr, before anything is compiled where it can be
found then.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from flax.training import train_state
from ml_collections import config_flags
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)
from rich.table import Table

from experiments import checkpoint, data, guards, own_model, runlog, synthetic
from experiments.common import fail, one_line_warnings, parse_flags, warn_line
from remat_kit.cli.inputs import (BadInput, check_folder, check_int, check_memory, check_seq,
                           out_of_memory)
from remat_kit import mesh as rk_mesh
from remat_kit.policy.budget import parse_budget
from remat_kit.decide import floor
from remat_kit.errors import BudgetError, MeshError, RematSpecError
from remat_kit.decide.step import in_use_bytes
from remat_kit.measure.costs import loop_scaled_costs, memory_fields
from remat_kit.measure.record import platform_label
from remat_kit.models import Transformer, from_config_dict, make_loss_fn
from remat_kit.models import workload as config_workload
from remat_kit.models.program import model_map_of
from remat_kit.models.shortcuts import resolve_config
from remat_kit.policy.spec import AutoSpec, parse

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics.jsonl and summary.json.")
_MODEL = flags.DEFINE_string("model", None, "The user's linen or NNX model, FILE.py:FUNCTION or "
                             "package.module:FUNCTION as remat-kit --model takes it; sets "
                             "config.model.")
flags.mark_flags_as_required(["config", "workdir"])


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


def make_train_step(model: "Transformer | Callable", deterministic: bool) -> Callable:
    """step(state, inputs, targets, rng) -> (state, loss).

    model: our Transformer, or a user's model's loss(params, inputs, targets,
    rng) (`own_model.OwnModel.loss_fn`). inputs, targets: int32 [batch, seq];
    rng: a PRNG key, folded with the step number for dropout; loss: float32
    scalar, nats/byte, before the update.
    """
    loss_fn = model if not isinstance(model, Transformer) else make_loss_fn(model, deterministic)

    def step(state, inputs, targets, rng):
        dropout_rng = jax.random.fold_in(rng, state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, inputs, targets, dropout_rng)
        return state.apply_gradients(grads=grads), loss
    return step


def _compiled_stats(compiled) -> dict:
    """The summary's figures of a compiled train step: temp_size_in_bytes and
    peak_memory_in_bytes (`memory_fields`), step_bytes (the device memory the
    whole step holds at its peak, `remat_kit.decide.step.in_use_bytes`, per device)
    and flops, loops counted per trip (`loop_scaled_costs`); None where the
    backend reports none."""
    memory = memory_fields(compiled)
    costs, _ = loop_scaled_costs(compiled)
    step_bytes, source = in_use_bytes(memory, jax.default_backend())
    return {"temp_size_in_bytes": memory.get("temp_size_in_bytes"),
            "peak_memory_in_bytes": memory.get("peak_memory_in_bytes"),
            "step_bytes": step_bytes, "step_bytes_source": source,
            "flops": costs.get("flops")}


# Optimizer fields: (name, low, high, low included, high included).
_REAL_FIELDS = (("learning_rate", 0, math.inf, False, False),
                ("end_lr_fraction", 0, 1, True, True),
                ("weight_decay", 0, math.inf, True, False),
                ("b1", 0, 1, True, False),
                ("b2", 0, 1, True, False),
                ("grad_clip_norm", 0, math.inf, False, False))


def _check_fields(config: ml_collections.ConfigDict) -> None:
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
    _budget_bytes(config)  # a bad memory_budget fails before anything compiles
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


def _setup(config: ml_collections.ConfigDict, workdir: str, stack: contextlib.ExitStack):
    """Validates the config and the workdir (created here), takes the
    workdir's lock and sends orbax's logs to its orbax.log (both held by
    `stack`), and loads the data, all before anything compiles; every user
    error becomes BadInput."""
    _check_fields(config)
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
            model = own_model.load(config, _mesh(config), os.path.join(workdir, "plans.json"))
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
        check_memory(cfg, config.batch_size, config.seq_len, _sizes(config))
        _check_floor(config, cfg)
        corpus = data.load_corpus(config.data)
        batches, evals = _batches(config, corpus)
        # auto:budget=... is planned for these shapes on the run's mesh (per-device
        # bytes); the plan is cached in the workdir, so a restarted run does not plan again.
        cfg = resolve_config(cfg, config.batch_size, config.seq_len, mesh=_mesh(config),
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


def _sizes(config: ml_collections.ConfigDict) -> str:
    return (f"config.model={config.model}, batch_size={config.batch_size}, "
            f"seq_len={config.seq_len}")


def _format_bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _format_ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _format(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_summary(console: Console, summary: dict) -> None:
    run = Table(title=f"Run: {summary['model']} under remat={summary['remat']}")
    run.add_column("metric")
    run.add_column("value", justify="right")
    text = summary["eval_bits_per_byte"] is not None  # else a (model, batch, loss) FUNCTION's
    unit, rate = ("nats/byte", "tokens") if text else ("the model's loss", "examples")
    run.add_row(f"eval loss ({unit})", f"{summary['eval_loss']:.4f}")
    if text:
        run.add_row("eval bits/byte", f"{summary['eval_bits_per_byte']:.4f}")
    run.add_row(f"train loss, last step ({unit})", _format(summary['final_train_loss'], ".4f"))
    run.add_row("median step (s)", _format(summary['median_step_seconds'], ".4f"))
    run.add_row(f"median {rate}/s", _format(summary[f"median_{rate}_per_second"], ",.0f"))
    run.add_row("wall time (s)", f"{summary['wall_seconds']:.1f}")
    run.add_row("remat policies", ", ".join(f"{p['remat']} from step {p['from_step']}"
                                            for p in summary["policies"]))
    saved = summary["checkpoint"]
    run.add_row(f"checkpoint {saved['step']}", f"{_format_bytes(saved['bytes'])}, written in "
                f"{_format(saved['write_seconds'], '.2f')} s (training blocked "
                f"{_format(saved['blocking_seconds'], '.2f')} s)")
    console.print(run)

    compiled = summary["compiled"]
    policy, none = compiled["policy"], compiled["none"]
    mem = Table(title=f"Compiled train step ({compiled['label']})")
    mem.add_column("")
    mem.add_column(f"remat={summary['remat']}", justify="right")
    mem.add_column("remat=none", justify="right")
    mem.add_column("ratio", justify="right")
    for key, fmt in (("temp_size_in_bytes", _format_bytes), ("peak_memory_in_bytes", _format_bytes),
                     ("step_bytes", _format_bytes),
                     ("flops", lambda f: "n/a" if f is None else f"{f:.3e}")):
        mem.add_row(key, fmt(policy[key]), fmt(none[key]), _format_ratio(policy[key], none[key]))
    console.print(mem)
    console.print(f"step_bytes: device memory the whole step holds at its peak "
                  f"({policy['step_bytes_source']})", style="dim")
    budget = summary["memory_budget"]
    if budget:
        console.print(f"memory budget {budget['budget']}: this run's step holds "
                      f"{_format_bytes(budget['step_bytes'])}; remat=none would hold "
                      f"{_format_bytes(budget['none_step_bytes'])} "
                      f"({'fits' if budget['none_fits'] else 'over the budget'})")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains per `config`, logs to `workdir`, and returns the summary dict.

    Writes workdir/metrics.jsonl (one line per step that is a multiple of
    log_every or eval_every, and the last: step, train_loss (mean since the
    last line or the resume, nats/byte), lr, tokens_per_second, step_seconds
    (mean since the last line), and eval_loss (nats/byte) at eval steps; a (model,
    batch, loss) FUNCTION's losses are its loss's, examples_per_second its rate),
    workdir/summary.json, workdir/config.json and config_history.jsonl (every
    start's config, `runlog.record_start`), and checkpoints in
    workdir/checkpoints (`checkpoint.Checkpoints`) every checkpoint_every
    steps and at the end, keeping the last keep_checkpoints.

    If workdir/checkpoints holds a checkpoint, training resumes from the latest
    one: parameters, optimizer state, PRNG key and data position, under this
    config's remat policy; metrics.jsonl is cut back to that step first.

    Raises:
      BadInput: unknown model, policy or tag; malformed spec; bad field value;
        a workdir that cannot be written; missing, empty, binary or too short
        data; sizes that do not fit in memory (found before compiling where the
        attention scores alone are too big, else when XLA runs out); a
        checkpoint of another model or another seed; a checkpoint write that
        fails (full disk), which leaves the previous checkpoint intact; a
        workdir another run holds (`guards.workdir_lock`); no intact
        checkpoint left (`checkpoint.Checkpoints.restore_latest`).
      NonFiniteLoss: the train loss became NaN or infinite; that state is not
        saved, the last good checkpoint stays the latest (named as suspect if
        the run resumed from it and has written none since).
      Interrupted: SIGINT or SIGTERM arrived; a checkpoint of the last
        finished step was written first.
    """
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # From the first moment: a signal during setup, a compile or the last
        # checkpoint write is acted on where the run can stop cleanly, never a traceback.
        stop = stack.enter_context(guards.stop_signals())
        cfg, corpus, batches, evals = _setup(config, workdir, stack)
        try:
            return _train(config, pathlib.Path(workdir), cfg, corpus, batches, evals, start,
                          stop)
        except (BadInput, guards.RunStopped):
            raise
        except Exception as e:  # noqa: BLE001 - a full disk; XLA's out-of-memory
            error = _disk_full(e, pathlib.Path(workdir)) or out_of_memory(e, _sizes(config))
            if error is None:
                raise
            raise error from e


def _disk_full(error: BaseException, workdir: pathlib.Path) -> BadInput | None:
    """A one-line BadInput for a write that failed with ENOSPC (metrics,
    summary, config history), naming the file, the free space and the newest
    checkpoint; None for any other error. (A failed checkpoint write is
    reported by `checkpoint.Checkpoints`.)"""
    if not checkpoint.is_disk_full(error):
        return None
    path = pathlib.Path(getattr(error, "filename", None) or workdir)
    steps = checkpoint.steps_on_disk(workdir.absolute() / "checkpoints")
    kept = f"checkpoint {steps[-1]} is intact" if steps else "no checkpoint was written"
    return BadInput(f"writing {path} failed: {checkpoint.disk_full_message(path)}; {kept}; "
                    "free some space and run the same command to resume")


def _checkpointed(state: train_state.TrainState, rng: jax.Array) -> dict:
    """The arrays a checkpoint holds: a dict for `checkpoint.Checkpoints`."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rng": jax.random.key_data(rng)}


def _resume(ckpt: checkpoint.Checkpoints, config, state, rng, warn):
    """(state, rng, step) from the newest intact checkpoint (damaged ones are
    moved aside, one `warn` line each: `Checkpoints.restore_latest`), or
    unchanged with step 0 when there is none. BadInput for another model's or
    another seed's, one past config.num_steps, or when none is intact."""
    step = ckpt.latest_step()
    if step is not None and step > config.num_steps:
        raise BadInput(f"config.num_steps={config.num_steps}, but {str(ckpt.directory)!r} holds "
                       f"a checkpoint of step {step}: give a larger num_steps or a new workdir")
    restored = ckpt.restore_latest(_checkpointed(state, rng), warn)
    if restored is None:
        return state, rng, 0
    step, saved, meta = restored
    if meta["seed"] != config.seed:
        raise BadInput(f"config.seed={config.seed}, but the checkpoint in {str(ckpt.directory)!r} "
                       f"was trained with seed {meta['seed']}, which fixes its data order and "
                       f"dropout: resume with --config.seed={meta['seed']} or use a new workdir")
    state = state.replace(step=saved["step"], params=saved["params"],
                          opt_state=saved["opt_state"])
    return state, jax.random.wrap_key_data(saved["rng"], impl=jax.random.key_impl(rng)), step


def _non_finite(loss: float, step: int, start_step: int, ckpt: checkpoint.Checkpoints) -> str:
    """The message of a non-finite loss at `step`. Before this run wrote a
    checkpoint of its own, the one it resumed from is the suspect (a damaged
    file that still loads gives wrong numbers), not the learning rate."""
    last = ckpt.latest_step()
    head = f"train loss is {loss} at step {step}: stopped without saving that state; "
    if start_step and last == start_step:
        earlier = [s for s in checkpoint.steps_on_disk(ckpt.directory) if s < start_step]
        before = f"checkpoint {earlier[-1]}" if earlier else "step 0"
        return (head + f"checkpoint {start_step} in {ckpt.directory}, which this run resumed "
                f"from, is suspect: move it into {ckpt.directory / checkpoint.DAMAGED} and run "
                f"the same command to resume from {before}")
    if last is not None:
        return (head + f"the last good checkpoint is step {last} in {ckpt.directory}. Lower "
                "config.learning_rate or change the data, then resume with the same workdir")
    return (head + "no checkpoint was written before it. Lower config.learning_rate or "
            "change the data, then start again")


def _hang(ckpt: checkpoint.Checkpoints, stop: guards.StopSignals, console: Console,
          step: int) -> None:
    """config.hang_after_step: waits for the checkpoint writes, prints a line,
    and waits for a signal; a pre-emption at a known step, for tests."""
    ckpt.wait()
    console.print(f"hang_after_step: waiting for a signal after step {step}")
    sys.stdout.flush()
    while not stop.received:
        time.sleep(0.05)


def _train(config, workdir: pathlib.Path, cfg, corpus, batches, evals, start: float,
           stop: guards.StopSignals) -> dict:
    ckpt = checkpoint.Checkpoints(workdir, config.keep_checkpoints)
    try:
        return _train_with(ckpt, config, workdir, cfg, corpus, batches, evals, start, stop)
    finally:
        ckpt.close()  # waits for the last write


def _train_with(ckpt, config, workdir, cfg, corpus, batches, evals, start: float,
                stop: guards.StopSignals) -> dict:
    # Every process trains and checkpoints (orbax coordinates them); process 0
    # alone prints and writes metrics, the config history and the summary.
    lead = jax.process_index() == 0
    console = Console(soft_wrap=True, quiet=not lead)  # long paths stay on one line in logs
    if corpus is None:  # a model of a batch and a loss (experiments.synthetic)
        console.print("data: synthetic batches of the declared shapes")
    else:
        console.print(f"data: {corpus.source}: {corpus.files} files, "
                      f"{len(corpus.train):,} train / {len(corpus.eval):,} eval bytes")
    own = isinstance(cfg, own_model.OwnModel)
    if own:
        console.print(own_model.describe(cfg, config.remat))
        model, deterministic, policy_text = cfg.loss_fn(), True, cfg.spec
        init_params = cfg.init
    else:
        console.print(f"model: {config.model} {cfg.family} L={cfg.num_layers} d={cfg.d_model} "
                      f"heads={cfg.num_heads} mlp={cfg.mlp_dim}; remat={config.remat} "
                      f"(policy {cfg.policy})")
        model, deterministic = Transformer(cfg), cfg.dropout_rate == 0
        policy_text = str(cfg.policy)
        init_params = lambda rng, tokens: model.init(rng, tokens)["params"]  # noqa: E731
    tx, schedule = make_optimizer(config)
    mesh = _mesh(config)

    def init_state():
        # Parameters do not depend on the batch: initialize on one sequence.
        init_rng = jax.random.split(jax.random.key(config.seed))[0]
        params = init_params(init_rng, jnp.zeros((1, config.seq_len), jnp.int32))
        # Boxed parameters give boxed optimizer moments: one logical spec for both.
        return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    # The state, batches and PRNG key, sharded by the model's logical axes on the mesh;
    # a user's model as its own partitioning says, on its own mesh or the run's, as its
    # prediction places them (`OwnModel.shardings`).
    placed = cfg.shardings(jax.eval_shape(lambda: nn.unbox(init_state())), tx) if own else None
    sharded = mesh is not None or placed is not None
    tracing = cfg.tracing if own else (lambda: rk_mesh.use(mesh))

    def on(*shardings) -> dict:  # jit's in/out shardings on a mesh, else none
        return dict(zip(("in_shardings", "out_shardings"), shardings)) if sharded else {}

    if placed is not None:
        state_sh, batch_sh, key_sh = placed
    else:
        state_sh = rk_mesh.shardings(jax.eval_shape(init_state), mesh) if sharded else None
        batch_sh = rk_mesh.batch_sharding(mesh) if sharded else None
        key_sh = rk_mesh.replicated(mesh) if sharded else None
    put = (lambda x: rk_mesh.put(x, batch_sh)) if sharded else (lambda x: x)
    with tracing():
        state = jax.jit(lambda: nn.unbox(init_state()), **on((), state_sh))()
    # Made inside jit: a process cannot device_put onto another's devices.
    train_rng = jax.jit(lambda: jax.random.split(jax.random.key(config.seed))[1],
                        **on((), key_sh))()
    sample = put(np.zeros((config.batch_size, config.seq_len), np.int32))
    sample_targets = sample
    if own and cfg.batch is not None:  # the batch itself; the loss reads its labels there
        sample, sample_targets = batches(0)
    num_params = sum(p.size for p in jax.tree.leaves(state.params))
    if not own:  # the user's model printed its map with its "model:" line
        console.print(f"model map: {model_map_of(cfg, state.params).line()}")
    warn = warn_line if lead else (lambda message: None)
    state, train_rng, start_step = _resume(ckpt, config, state, train_rng, warn)
    done = workdir / "summary.json"
    if start_step == config.num_steps and done.exists():
        # A finished run started again: keep its summary and metrics as they are.
        console.print(f"{workdir} already holds a finished run of {start_step} steps; nothing "
                      f"to train (raise --config.num_steps to train on, or use a new workdir)")
        return json.loads(done.read_text())
    policies, changed = (runlog.record_start(workdir, config, policy_text, start_step, warn)
                         if lead else ([], []))
    if start_step:
        console.print(f"resuming at step {start_step} from {ckpt.directory}"
                      + (f"; changed since the last start: {'; '.join(changed)}" if changed
                         else ""))

    # Compile ahead of time once: the executable that trains is the one measured.
    # Both compile alike (state donated), so the figures differ only by the policy.
    def compile_step(step_model):
        step = jax.jit(make_train_step(step_model, deterministic), donate_argnums=0,
                       **on((state_sh, batch_sh, batch_sh, key_sh), (state_sh, key_sh)))
        with tracing():
            return step.lower(state, sample, sample_targets, train_rng).compile()

    step_fn = compile_step(model)
    stats = {"label": platform_label(), "policy": _compiled_stats(step_fn)}
    if own:  # the prediction for this policy and shape, beside the compiled step
        line, stats["predicted"] = own_model.check_line(stats["policy"], cfg.predicted(tx),
                                                   start_step)
        console.print(line)
    if own and cfg.spec != "none":
        stats["none"] = _compiled_stats(compile_step(cfg.loss_fn("none")))
    elif not own and cfg.policy.remat:
        none_model = Transformer(from_config_dict(config, remat="none"))
        stats["none"] = _compiled_stats(compile_step(none_model))
    else:
        stats["none"] = stats["policy"]
    budget = _budget_bytes(config)
    if budget is not None:
        _check_budget(config, budget, stats)
    with tracing():
        eval_fn = jax.jit(model if own else make_loss_fn(model, deterministic=True),
                          **on((state_sh.params if sharded else None, batch_sh, batch_sh, key_sh),
                               key_sh)).lower(state.params, sample, sample_targets,
                                              train_rng).compile()
    console.print(f"{num_params:,} parameters; compiled in {time.perf_counter() - start:.1f} s")

    def evaluate(params) -> float:
        return float(np.mean([eval_fn(params, put(x), put(y), train_rng) for x, y in evals]))

    def save(step: int) -> None:
        ckpt.save(step, _checkpointed(state, train_rng),
                  {"step": step, "next_batch": step, "seed": config.seed,
                   "model": config.model, "remat": config.remat})

    # A (model, batch, loss) FUNCTION's loss is its own, over examples, not bytes.
    per_step, rate, unit = ((config.batch_size, "examples", "(the model's loss)")
                            if corpus is None else
                            (config.batch_size * config.seq_len, "tokens", "nats/byte"))
    step_seconds, window_loss, window_time, eval_loss, loss = [], [], [], None, None
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.3f}"),
                        TextColumn("{task.fields[tok_s]:,.0f} " + rate[:3] + "/s"), TimeRemainingColumn(),
                        console=console)
    if stop.received:  # during the compile: nothing trained, nothing new to keep
        last = ckpt.latest_step()
        raise guards.Interrupted(
            f"{stop.name} before step {start_step + 1}: nothing new was written; "
            + (f"checkpoint {last} in {ckpt.directory} is the latest" if last is not None
               else "no checkpoint was written"), stop.received)
    with (progress, runlog.MetricsLog(workdir, start_step, config.tensorboard, lead, warn)
          as metrics):
        task = progress.add_task("train", total=config.num_steps, completed=start_step,
                                 loss=float("nan"), tok_s=0.0)
        for step in range(start_step + 1, config.num_steps + 1):
            # Batch i is a pure function of (seed, i): step s trains on batch s - 1.
            inputs, targets = batches(step - 1)
            t0 = time.perf_counter()
            state, loss = step_fn(state, put(inputs), put(targets), train_rng)
            loss = float(loss)  # waits for the step, so the time below is the step's
            seconds = time.perf_counter() - t0
            if not math.isfinite(loss):
                ckpt.wait()
                raise guards.NonFiniteLoss(_non_finite(loss, step, start_step, ckpt))
            step_seconds.append(seconds)
            window_loss.append(loss)
            window_time.append(seconds)
            progress.update(task, advance=1, loss=loss, tok_s=per_step / seconds)
            is_eval = step % config.eval_every == 0 or step == config.num_steps
            if is_eval or step % config.log_every == 0:
                line = {"step": step, "train_loss": float(np.mean(window_loss)),
                        "lr": float(schedule(step - 1)),
                        f"{rate}_per_second": per_step / float(np.mean(window_time)),
                        "step_seconds": float(np.mean(window_time))}
                if is_eval:
                    eval_loss = line["eval_loss"] = evaluate(state.params)
                    progress.console.print(f"step {step}: train {line['train_loss']:.4f}, "
                                           f"eval {eval_loss:.4f} {unit}")
                metrics.write(line)
                window_loss, window_time = [], []
            if step % config.checkpoint_every == 0 or step == config.num_steps:
                save(step)
            if step == config.hang_after_step:
                _hang(ckpt, stop, progress.console, step)
            if stop.received and step < config.num_steps:  # the last step ends the run
                save(step)
                ckpt.wait()
                raise guards.Interrupted(
                    f"{stop.name} after step {step}: wrote checkpoint {step} in "
                    f"{ckpt.directory}; run the same command to resume", stop.received)
    ckpt.wait()
    last_saved = ckpt.latest_step()
    if eval_loss is None:  # resumed at num_steps: nothing left to train
        eval_loss = evaluate(state.params)

    # The first step's time holds one-off runtime warm-up; leave it out when there are others.
    timed = step_seconds[1:] or step_seconds
    median_step = statistics.median(timed) if timed else None
    summary = {
        "model": config.model, "remat": config.remat, "policy": policy_text,
        "policies": policies, "start_step": start_step,
        "num_params": num_params, "num_steps": config.num_steps,
        "batch_size": config.batch_size, "seq_len": config.seq_len,
        "eval_loss": eval_loss,
        "eval_bits_per_byte": eval_loss / np.log(2) if corpus is not None else None,
        "final_train_loss": loss, "median_step_seconds": median_step,
        f"median_{rate}_per_second": per_step / median_step if median_step else None,
        "wall_seconds": time.perf_counter() - start, "compiled": stats,
        "checkpoint": {"directory": str(ckpt.directory), "step": last_saved,
                       "bytes": ckpt.size_bytes(last_saved),
                       "write_seconds": ckpt.last_write_seconds,
                       "blocking_seconds": ckpt.last_blocking_seconds},
        "mesh": config.get("mesh") or None, "processes": jax.process_count(),
        "memory_budget": budget and {
            "budget": config.memory_budget, "bytes": budget,
            "step_bytes": stats["policy"]["step_bytes"],
            "none_step_bytes": stats["none"]["step_bytes"],
            "none_fits": stats["none"]["step_bytes"] <= budget},
    }
    if lead:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(console, summary)
    if stop.received:  # after the last step: the run is whole, the exit code still says so
        raise guards.Interrupted(
            f"{stop.name} after the last step {config.num_steps}: the run finished; "
            f"checkpoint {last_saved} and summary.json are written in {workdir}",
            stop.received)
    return summary


def _budget_bytes(config: ml_collections.ConfigDict) -> int | None:
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


def _check_floor(config: ml_collections.ConfigDict, cfg) -> None:
    """BadInput, in one line naming the floor, for a memory_budget or an
    auto:budget= below what no policy frees (`remat_kit.decide.floor`); eval_shape
    only, before the data loads and anything compiles."""
    budget, mesh, policy = _budget_bytes(config), _mesh(config), parse(cfg.remat)
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


def _check_budget(config: ml_collections.ConfigDict, budget: int, stats: dict) -> None:
    """BadInput, with the numbers, if the compiled train step holds more than
    `budget` bytes per device. Nothing enforces a budget on the CPU, so the
    run checks it before the first step."""
    used = stats["policy"]
    if used["step_bytes"] <= budget:
        return
    raise BadInput(
        f"config.memory_budget={config.memory_budget} ({budget} bytes per device): the "
        f"compiled train step under remat={config.remat} holds {used['step_bytes']} bytes "
        f"({_format_bytes(used['step_bytes'])}; {used['step_bytes_source']}, "
        f"{stats['label']}), over the budget. `remat-kit fit "
        f"{'--model' if own_model.is_own(config.model) else '--config'} {config.model} "
        f"--budget {config.memory_budget} --vary batch --seq {config.seq_len}` lists the "
        f"largest batch each policy fits at this seq_len")


def _mesh(config: ml_collections.ConfigDict):
    """The mesh of config.mesh over every process's devices, or None; BadInput
    when the devices do not match it."""
    if not config.get("mesh"):
        return None
    try:
        return rk_mesh.make(config.mesh)
    except MeshError as e:
        raise BadInput(f"config.mesh: {e}") from None


def main(argv: list[str]) -> None:
    del argv  # parse_flags has rejected extra arguments
    config = _CONFIG.value
    if _MODEL.value is not None:
        config.model = _MODEL.value
    try:
        with one_line_warnings():
            train_and_evaluate(config, _WORKDIR.value)
    except (BadInput, guards.RunStopped) as e:
        code, label = (2, "error") if isinstance(e, BadInput) else (e.exit_code, "stopped")
        try:
            fail(str(e), code, label)
        finally:
            # After a failed write, orbax's threads print tracebacks as the
            # interpreter shuts down: they go to the log, after our one line.
            runlog.divert_stderr(pathlib.Path(_WORKDIR.value))
            guards.exit_past_stuck_threads(code)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
