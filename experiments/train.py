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
import dataclasses
import json
import pathlib
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

from experiments import (checkpoint, data, guards, own_model, runlog, train_loop, train_report,
                         train_setup)
from experiments.common import fail, one_line_warnings, parse_flags, warn_line
from remat_kit.ui.inputs import out_of_memory
from remat_kit.errors import BadInput
from remat_kit.decide.step import in_use_bytes
from remat_kit.measure.costs import loop_scaled_costs, memory_fields
from remat_kit.measure.record import platform_label
from remat_kit import mesh as rk_mesh
from remat_kit.models import Transformer, from_config_dict, make_loss_fn
from remat_kit.models.program import model_map_of

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics.jsonl and summary.json.")
_MODEL = flags.DEFINE_string("model", None, "The user's linen or NNX model, FILE.py:FUNCTION or "
                             "package.module:FUNCTION as remat-kit --model takes it; sets "
                             "config.model.")
flags.mark_flags_as_required(["config", "workdir"])


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
        cfg, corpus, batches, evals = train_setup.setup(config, workdir, stack)
        try:
            return _train(config, pathlib.Path(workdir), cfg, corpus, batches, evals, start,
                          stop)
        except (BadInput, guards.RunStopped):
            raise
        except Exception as e:  # noqa: BLE001 - a full disk; XLA's out-of-memory
            error = (_disk_full(e, pathlib.Path(workdir))
                     or out_of_memory(e, train_setup.sizes(config)))
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
    _print_data(console, corpus)
    own = isinstance(cfg, own_model.OwnModel)
    model, deterministic, policy_text, init_params = _model(config, cfg, console)
    tx, schedule = train_setup.make_optimizer(config)
    init_state = _state_maker(config, init_params, tx)
    at = _placement(cfg, own, train_setup.config_mesh(config), init_state, tx)
    state, train_rng, sample, sample_targets = _initial(config, cfg, own, at, init_state,
                                                        batches)
    num_params = sum(p.size for p in jax.tree.leaves(state.params))
    if not own:  # the user's model printed its map with its "model:" line
        console.print(f"model map: {model_map_of(cfg, state.params).line()}")
    warn = warn_line if lead else (lambda message: None)
    state, train_rng, start_step = train_loop.resume(ckpt, config, state, train_rng, warn)
    done = workdir / "summary.json"
    if start_step == config.num_steps and done.exists():
        # A finished run started again: keep its summary and metrics as they are.
        console.print(f"{workdir} already holds a finished run of {start_step} steps; nothing "
                      f"to train (raise --config.num_steps to train on, or use a new workdir)")
        return json.loads(done.read_text())
    policies = _record_start(workdir, config, policy_text, start_step, warn, lead, console,
                             ckpt)
    args = (state, sample, sample_targets, train_rng)
    step_fn, stats = _compile_steps(config, cfg, model, deterministic, at, args, tx, console,
                                    start_step)
    budget = train_setup.budget_bytes(config)
    if budget is not None:
        train_report.check_budget(config, budget, stats)
    eval_fn = _compile_eval(model, own, at, args)
    console.print(f"{num_params:,} parameters; compiled in {time.perf_counter() - start:.1f} s")
    run = train_loop.Compiled(step_fn, eval_fn, at.put, train_rng)
    trained = train_loop.train(config, workdir, ckpt, stop, run, batches, evals, schedule,
                               state, start_step, corpus is not None, lead, warn, console)
    last_saved = ckpt.latest_step()
    per_step, rate, _ = train_loop.units(config, corpus is not None)
    summary = train_report.summary(config, policy_text, policies, start_step, num_params,
                                   trained, corpus is not None, rate, per_step, start, stats,
                                   ckpt, last_saved, budget)
    if lead:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    train_report.print_summary(console, summary)
    if stop.received:  # after the last step: the run is whole, the exit code still says so
        raise guards.Interrupted(
            f"{stop.name} after the last step {config.num_steps}: the run finished; "
            f"checkpoint {last_saved} and summary.json are written in {workdir}",
            stop.received)
    return summary


def _print_data(console: Console, corpus: data.Corpus | None) -> None:
    """The run's "data:" line: the corpus's source and sizes, or synthetic batches."""
    if corpus is None:  # a model of a batch and a loss (experiments.synthetic)
        console.print("data: synthetic batches of the declared shapes")
    else:
        console.print(f"data: {corpus.source}: {corpus.files} files, "
                      f"{len(corpus.train):,} train / {len(corpus.eval):,} eval bytes")


def _model(config: ml_collections.ConfigDict, cfg, console: Console) -> tuple:
    """(model, deterministic, policy text, init_params(rng, tokens) -> params) of the run,
    its "model:" line printed. The model is our `Transformer`, or a user's model's loss
    (`own_model.OwnModel.loss_fn`)."""
    if isinstance(cfg, own_model.OwnModel):
        console.print(own_model.describe(cfg, config.remat))
        return cfg.loss_fn(), True, cfg.spec, cfg.init
    console.print(f"model: {config.model} {cfg.family} L={cfg.num_layers} d={cfg.d_model} "
                  f"heads={cfg.num_heads} mlp={cfg.mlp_dim}; remat={config.remat} "
                  f"(policy {cfg.policy})")
    model = Transformer(cfg)
    init_params = lambda rng, tokens: model.init(rng, tokens)["params"]  # noqa: E731
    return model, cfg.dropout_rate == 0, str(cfg.policy), init_params


def _state_maker(config: ml_collections.ConfigDict, init_params: Callable,
                 tx: optax.GradientTransformation) -> Callable[[], train_state.TrainState]:
    """init_state() -> the run's first `TrainState` (boxed parameters, seeded by
    config.seed)."""
    def init_state():
        # Parameters do not depend on the batch: initialize on one sequence.
        init_rng = jax.random.split(jax.random.key(config.seed))[0]
        params = init_params(init_rng, jnp.zeros((1, config.seq_len), jnp.int32))
        # Boxed parameters give boxed optimizer moments: one logical spec for both.
        return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    return init_state


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where the run's arrays live: jit's shardings of the train state, a batch and the
    PRNG key (None each without a mesh), and the context the run's traces go in."""

    sharded: bool
    state: object
    batch: object
    key: object
    tracing: Callable

    def on(self, *shardings) -> dict:
        """jit's in/out shardings on a mesh, else none."""
        return dict(zip(("in_shardings", "out_shardings"), shardings)) if self.sharded else {}

    def put(self, x):
        """A host batch `x` placed as a batch is (split over the mesh), else as is."""
        return rk_mesh.put(x, self.batch) if self.sharded else x


def _placement(cfg, own: bool, mesh, init_state: Callable,
               tx: optax.GradientTransformation) -> _Placement:
    """The state, batches and PRNG key, sharded by the model's logical axes on the mesh;
    a user's model as its own partitioning says, on its own mesh or the run's, as its
    prediction places them (`OwnModel.shardings`)."""
    placed = cfg.shardings(jax.eval_shape(lambda: nn.unbox(init_state())), tx) if own else None
    sharded = mesh is not None or placed is not None
    tracing = cfg.tracing if own else (lambda: rk_mesh.use(mesh))
    if placed is not None:
        return _Placement(sharded, *placed, tracing)
    return _Placement(sharded,
                      rk_mesh.shardings(jax.eval_shape(init_state), mesh) if sharded else None,
                      rk_mesh.batch_sharding(mesh) if sharded else None,
                      rk_mesh.replicated(mesh) if sharded else None, tracing)


def _initial(config: ml_collections.ConfigDict, cfg, own: bool, at: _Placement,
             init_state: Callable, batches: Callable) -> tuple:
    """(the first state, the run's PRNG key, sample inputs, sample targets), placed: what
    the steps compile for."""
    with at.tracing():
        state = jax.jit(lambda: nn.unbox(init_state()), **at.on((), at.state))()
    # Made inside jit: a process cannot device_put onto another's devices.
    train_rng = jax.jit(lambda: jax.random.split(jax.random.key(config.seed))[1],
                        **at.on((), at.key))()
    sample = at.put(np.zeros((config.batch_size, config.seq_len), np.int32))
    sample_targets = sample
    if own and cfg.batch is not None:  # the batch itself; the loss reads its labels there
        sample, sample_targets = batches(0)
    return state, train_rng, sample, sample_targets


def _record_start(workdir: pathlib.Path, config: ml_collections.ConfigDict, policy_text: str,
                  start_step: int, warn, lead: bool, console: Console,
                  ckpt: checkpoint.Checkpoints) -> list:
    """The policies of each start (`runlog.record_start`, process 0 alone), with a line
    saying where a resumed run resumes and what changed since its last start."""
    policies, changed = (runlog.record_start(workdir, config, policy_text, start_step, warn)
                         if lead else ([], []))
    if start_step:
        console.print(f"resuming at step {start_step} from {ckpt.directory}"
                      + (f"; changed since the last start: {'; '.join(changed)}" if changed
                         else ""))
    return policies


def _compile_steps(config: ml_collections.ConfigDict, cfg, model, deterministic: bool,
                   at: _Placement, args: tuple, tx: optax.GradientTransformation,
                   console: Console, start_step: int) -> tuple[Callable, dict]:
    """(the compiled train step, its figures and no remat's, `_compiled_stats`).

    Compiled ahead of time once: the executable that trains is the one measured. Both
    compile alike (state donated), so the figures differ only by the policy. `args`:
    (state, inputs, targets, rng) to compile for.
    """
    own = isinstance(cfg, own_model.OwnModel)

    def compile_step(step_model):
        step = jax.jit(make_train_step(step_model, deterministic), donate_argnums=0,
                       **at.on((at.state, at.batch, at.batch, at.key), (at.state, at.key)))
        with at.tracing():
            return step.lower(*args).compile()

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
    return step_fn, stats


def _compile_eval(model, own: bool, at: _Placement, args: tuple) -> Callable:
    """The compiled eval loss, (params, inputs, targets, rng) -> loss; ours without
    dropout."""
    state, *rest = args
    with at.tracing():
        return jax.jit(model if own else make_loss_fn(model, deterministic=True),
                       **at.on((at.state.params if at.sharded else None, at.batch, at.batch,
                                at.key), at.key)).lower(state.params, *rest).compile()


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
