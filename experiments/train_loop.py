"""A training run's steps: resuming from a checkpoint, the loop that trains, logs,
evaluates and checkpoints, and how it stops (the last step, a signal, a non-finite loss).

Batch i is a pure function of (seed, i), so a resumed run trains on the batches an
uninterrupted one would; experiments/train.py compiles the step and calls `train`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from flax.training import train_state
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)

from experiments import checkpoint, guards, runlog
from remat_kit.errors import BadInput


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the loop runs: the compiled train step, (state, inputs, targets, rng) ->
    (state, loss); the compiled eval loss, (params, inputs, targets, rng) -> loss; `put`,
    a host batch placed on the devices; the run's PRNG key."""

    step: Callable
    eval: Callable
    put: Callable
    rng: jax.Array


@dataclasses.dataclass
class Trained:
    """Where the loop ended: the state, the last train loss and eval loss (None where no
    step ran; the eval loss is then filled in by `train`), each step's seconds."""

    state: train_state.TrainState
    loss: float | None = None
    eval_loss: float | None = None
    step_seconds: list = dataclasses.field(default_factory=list)


def units(config: ml_collections.ConfigDict, text: bool) -> tuple[int, str, str]:
    """(items per step, their name, the loss's unit): tokens and nats/byte for text, a
    (model, batch, loss) FUNCTION's examples and its own loss otherwise."""
    return ((config.batch_size * config.seq_len, "tokens", "nats/byte") if text else
            (config.batch_size, "examples", "(the model's loss)"))


def train(config: ml_collections.ConfigDict, workdir, ckpt: checkpoint.Checkpoints,
          stop: guards.StopSignals, run: Compiled, batches: Callable, evals, schedule,
          state: train_state.TrainState, start_step: int, text: bool, lead: bool, warn,
          console: Console) -> Trained:
    """Trains from `start_step` to config.num_steps, writing metrics.jsonl lines and
    checkpoints as `experiments.train.train_and_evaluate` says, and evaluates at the end
    if no step did.

    Raises:
      Interrupted: a signal before the first step (nothing written) or after a step
        (a checkpoint of it written first).
      NonFiniteLoss: a step's loss is NaN or infinite (`_non_finite`).
    """
    trained = Trained(state)
    per_step, rate, unit = units(config, text)
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
        window = _Window()
        for step in range(start_step + 1, config.num_steps + 1):
            seconds = _one_step(trained, run, batches, step, start_step, ckpt)
            window.add(trained.loss, seconds)
            progress.update(task, advance=1, loss=trained.loss, tok_s=per_step / seconds)
            is_eval = step % config.eval_every == 0 or step == config.num_steps
            if is_eval or step % config.log_every == 0:
                line = window.line(step, schedule, rate, per_step)
                if is_eval:
                    trained.eval_loss = line["eval_loss"] = evaluate(run, trained.state, evals)
                    progress.console.print(f"step {step}: train {line['train_loss']:.4f}, "
                                           f"eval {trained.eval_loss:.4f} {unit}")
                metrics.write(line)
            if step % config.checkpoint_every == 0 or step == config.num_steps:
                _save(ckpt, config, trained.state, run.rng, step)
            if step == config.hang_after_step:
                _hang(ckpt, stop, progress.console, step)
            if stop.received and step < config.num_steps:  # the last step ends the run
                _save(ckpt, config, trained.state, run.rng, step)
                ckpt.wait()
                raise guards.Interrupted(
                    f"{stop.name} after step {step}: wrote checkpoint {step} in "
                    f"{ckpt.directory}; run the same command to resume", stop.received)
    ckpt.wait()
    if trained.eval_loss is None:  # resumed at num_steps: nothing left to train
        trained.eval_loss = evaluate(run, trained.state, evals)
    return trained


def _one_step(trained: Trained, run: Compiled, batches: Callable, step: int, start_step: int,
              ckpt: checkpoint.Checkpoints) -> float:
    """Trains step `step` on batch step - 1 (batch i is a pure function of (seed, i)),
    updating `trained`; returns its seconds. NonFiniteLoss for a NaN or infinite loss."""
    inputs, targets = batches(step - 1)
    t0 = time.perf_counter()
    trained.state, loss = run.step(trained.state, run.put(inputs), run.put(targets), run.rng)
    loss = float(loss)  # waits for the step, so the time below is the step's
    seconds = time.perf_counter() - t0
    if not math.isfinite(loss):
        ckpt.wait()
        raise guards.NonFiniteLoss(_non_finite(loss, step, start_step, ckpt))
    trained.loss = loss
    trained.step_seconds.append(seconds)
    return seconds


@dataclasses.dataclass
class _Window:
    """Losses and seconds of the steps since the last metrics line."""

    losses: list = dataclasses.field(default_factory=list)
    seconds: list = dataclasses.field(default_factory=list)

    def add(self, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        self.seconds.append(seconds)

    def line(self, step: int, schedule, rate: str, per_step: int) -> dict:
        """The metrics line at `step` (means over the window), emptying the window."""
        line = {"step": step, "train_loss": float(np.mean(self.losses)),
                "lr": float(schedule(step - 1)),
                f"{rate}_per_second": per_step / float(np.mean(self.seconds)),
                "step_seconds": float(np.mean(self.seconds))}
        self.losses, self.seconds = [], []
        return line


def evaluate(run: Compiled, state: train_state.TrainState, evals) -> float:
    """The mean eval loss of `state`'s parameters over the eval batches."""
    return float(np.mean([run.eval(state.params, run.put(x), run.put(y), run.rng)
                          for x, y in evals]))


def _save(ckpt: checkpoint.Checkpoints, config: ml_collections.ConfigDict,
          state: train_state.TrainState, rng: jax.Array, step: int) -> None:
    """Writes checkpoint `step` (asynchronously) with the run's data position and seed."""
    ckpt.save(step, checkpointed(state, rng),
              {"step": step, "next_batch": step, "seed": config.seed,
               "model": config.model, "remat": config.remat})


def checkpointed(state: train_state.TrainState, rng: jax.Array) -> dict:
    """The arrays a checkpoint holds: a dict for `checkpoint.Checkpoints`."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rng": jax.random.key_data(rng)}


def resume(ckpt: checkpoint.Checkpoints, config, state, rng, warn):
    """(state, rng, step) from the newest intact checkpoint (damaged ones are
    moved aside, one `warn` line each: `Checkpoints.restore_latest`), or
    unchanged with step 0 when there is none. BadInput for another model's or
    another seed's, one past config.num_steps, or when none is intact."""
    step = ckpt.latest_step()
    if step is not None and step > config.num_steps:
        raise BadInput(f"config.num_steps={config.num_steps}, but {str(ckpt.directory)!r} holds "
                       f"a checkpoint of step {step}: give a larger num_steps or a new workdir")
    restored = ckpt.restore_latest(checkpointed(state, rng), warn)
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
