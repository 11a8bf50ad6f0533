"""Train a byte-level language model on real text under a chosen remat policy.

    python -m experiments.train --config=experiments/configs/tiny.py \
        --config.remat=selective --workdir=runs/x

Writes `workdir/metrics.jsonl` (one JSON line per logged step) and
`workdir/summary.json` (eval loss in nats/byte, median step time, and the
compiled train step's memory and FLOPs under the policy and under no remat).
Bad input (unknown policy or tag, malformed spec, missing, empty or binary
data, a config file that does not load, a config value of the wrong type or
out of range, an unusable workdir, sizes that do not fit in memory) exits with
code 2 and one line on stderr, before anything is compiled where it can be
found then.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import time
from collections.abc import Callable

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

from experiments import data
from experiments.common import fail, parse_flags
from remat_kit.cli import (BadInput, check_folder, check_int, check_memory, check_seq,
                           out_of_memory)
from remat_kit.errors import RematSpecError
from remat_kit.measure import loop_scaled_costs, memory_fields, platform_label
from remat_kit.models import Transformer, from_config_dict, make_loss_fn
from remat_kit.plan import resolve_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics.jsonl and summary.json.")
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


def make_train_step(model: Transformer, deterministic: bool) -> Callable:
    """step(state, inputs, targets, rng) -> (state, loss).

    inputs, targets: int32 [batch, seq]; rng: a PRNG key, folded with the step
    number for dropout; loss: float32 scalar, nats/byte, before the update.
    """
    loss_fn = make_loss_fn(model, deterministic)

    def step(state, inputs, targets, rng):
        dropout_rng = jax.random.fold_in(rng, state.step)
        loss, grads = jax.value_and_grad(loss_fn)(state.params, inputs, targets, dropout_rng)
        return state.apply_gradients(grads=grads), loss
    return step


def _compiled_stats(compiled) -> dict:
    """The summary's figures of a compiled train step: temp_size_in_bytes and
    peak_memory_in_bytes (`memory_fields`) and flops, loops counted per
    trip (`loop_scaled_costs`); None where the backend reports none."""
    memory = memory_fields(compiled)
    costs, _ = loop_scaled_costs(compiled)
    return {"temp_size_in_bytes": memory.get("temp_size_in_bytes"),
            "peak_memory_in_bytes": memory.get("peak_memory_in_bytes"),
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
              "eval_every", "eval_batches", "warmup_steps", "seed",
              *(field[0] for field in _REAL_FIELDS))
    missing = [name for name in needed if name not in config]
    if missing:
        raise BadInput(f"the config lacks the field(s) train needs: {', '.join(missing)}")
    for name in ("num_steps", "batch_size", "seq_len", "log_every", "eval_every",
                 "eval_batches"):
        check_int(f"config.{name}", config[name])
    for name in ("warmup_steps", "seed"):
        check_int(f"config.{name}", config[name], minimum=0)
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


def _setup(config: ml_collections.ConfigDict, workdir: str):
    """Validates the config and the workdir (created here) and loads the data,
    all before anything compiles; every user error becomes BadInput."""
    _check_fields(config)
    check_folder(workdir, "--workdir", create=True)
    try:
        cfg = from_config_dict(config)
        if cfg.vocab_size < data.VOCAB_SIZE:
            raise ValueError(f"config.vocab_size must be at least {data.VOCAB_SIZE} (one token "
                             f"per byte value), got {cfg.vocab_size}")
        check_seq(cfg, config.seq_len, "config.seq_len")
        check_memory(cfg, config.batch_size, config.seq_len, _sizes(config))
        corpus = data.load_corpus(config.data)
        batches = data.train_batches(corpus.train, config.batch_size, config.seq_len,
                                     config.seed)
        evals = data.eval_batches(corpus.eval, config.batch_size, config.seq_len,
                                  config.eval_batches)
        # auto:budget=... is planned for these shapes; the plan is cached in the
        # workdir, so a restarted run does not plan again.
        cfg = resolve_config(cfg, config.batch_size, config.seq_len,
                             cache=os.path.join(workdir, "plans.json"))
    except KeyError as e:
        raise BadInput(e.args[0]) from e
    except (RematSpecError, TypeError, ValueError, OSError) as e:
        raise BadInput(str(e)) from e
    return cfg, corpus, batches, evals


def _sizes(config: ml_collections.ConfigDict) -> str:
    return (f"config.model={config.model}, batch_size={config.batch_size}, "
            f"seq_len={config.seq_len}")


def _format_bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _format_ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _print_summary(console: Console, summary: dict) -> None:
    run = Table(title=f"Run: {summary['model']} under remat={summary['remat']}")
    run.add_column("metric")
    run.add_column("value", justify="right")
    run.add_row("eval loss (nats/byte)", f"{summary['eval_loss']:.4f}")
    run.add_row("eval bits/byte", f"{summary['eval_bits_per_byte']:.4f}")
    run.add_row("train loss, last step (nats/byte)", f"{summary['final_train_loss']:.4f}")
    run.add_row("median step (s)", f"{summary['median_step_seconds']:.4f}")
    run.add_row("median tokens/s", f"{summary['median_tokens_per_second']:,.0f}")
    run.add_row("wall time (s)", f"{summary['wall_seconds']:.1f}")
    console.print(run)

    compiled = summary["compiled"]
    policy, none = compiled["policy"], compiled["none"]
    mem = Table(title=f"Compiled train step ({compiled['label']})")
    mem.add_column("")
    mem.add_column(f"remat={summary['remat']}", justify="right")
    mem.add_column("remat=none", justify="right")
    mem.add_column("ratio", justify="right")
    for key, fmt in (("temp_size_in_bytes", _format_bytes), ("peak_memory_in_bytes", _format_bytes),
                     ("flops", lambda f: "n/a" if f is None else f"{f:.3e}")):
        mem.add_row(key, fmt(policy[key]), fmt(none[key]), _format_ratio(policy[key], none[key]))
    console.print(mem)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains per `config`, logs to `workdir`, and returns the summary dict.

    Writes workdir/metrics.jsonl (one line per step that is a multiple of
    log_every or eval_every, and the last: step, train_loss (mean since the
    last line, nats/byte), lr, tokens_per_second, step_seconds (mean since the
    last line), and eval_loss (nats/byte) at eval steps) and
    workdir/summary.json.

    Raises:
      BadInput: unknown model, policy or tag; malformed spec; bad field value;
        a workdir that cannot be written; missing, empty, binary or too short
        data; sizes that do not fit in memory (found before compiling where the
        attention scores alone are too big, else when XLA runs out).
    """
    start = time.perf_counter()
    cfg, corpus, batches, evals = _setup(config, workdir)
    try:
        return _train(config, pathlib.Path(workdir), cfg, corpus, batches, evals, start)
    except Exception as e:  # noqa: BLE001 - XLA's out-of-memory, at compile or at run
        error = out_of_memory(e, _sizes(config))
        if error is None:
            raise
        raise error from e


def _train(config, workdir: pathlib.Path, cfg, corpus, batches, evals, start: float) -> dict:
    console = Console(soft_wrap=True)  # long paths stay on one line in logs
    console.print(f"data: {corpus.source}: {corpus.files} files, "
                  f"{len(corpus.train):,} train / {len(corpus.eval):,} eval bytes")
    console.print(f"model: {config.model} {cfg.family} L={cfg.num_layers} d={cfg.d_model} "
                  f"heads={cfg.num_heads} mlp={cfg.mlp_dim}; remat={config.remat} "
                  f"(policy {cfg.policy})")

    model = Transformer(cfg)
    deterministic = cfg.dropout_rate == 0
    tx, schedule = make_optimizer(config)
    init_rng, train_rng = jax.random.split(jax.random.key(config.seed))
    sample = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)
    # Parameters do not depend on the batch: initialize on one sequence.
    params = jax.jit(model.init)(init_rng, sample[:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    num_params = sum(p.size for p in jax.tree.leaves(params))

    # Compile ahead of time once: the executable that trains is the one measured.
    # Both compile alike (state donated), so the figures differ only by the policy.
    def compile_step(step_model):
        step = jax.jit(make_train_step(step_model, deterministic), donate_argnums=0)
        return step.lower(state, sample, sample, train_rng).compile()

    step_fn = compile_step(model)
    stats = {"label": platform_label(), "policy": _compiled_stats(step_fn)}
    if cfg.policy.remat:
        none_model = Transformer(from_config_dict(config, remat="none"))
        stats["none"] = _compiled_stats(compile_step(none_model))
    else:
        stats["none"] = stats["policy"]
    eval_fn = jax.jit(make_loss_fn(model, deterministic=True)).lower(
        state.params, sample, sample, train_rng).compile()
    console.print(f"{num_params:,} parameters; compiled in {time.perf_counter() - start:.1f} s")

    def evaluate(params) -> float:
        return float(np.mean([eval_fn(params, x, y, train_rng) for x, y in evals]))

    tokens_per_step = config.batch_size * config.seq_len
    step_seconds, window_loss, window_time, eval_loss, loss = [], [], [], None, float("nan")
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.3f}"),
                        TextColumn("{task.fields[tok_s]:,.0f} tok/s"), TimeRemainingColumn(),
                        console=console)
    with progress, (workdir / "metrics.jsonl").open("w") as metrics:
        task = progress.add_task("train", total=config.num_steps, loss=float("nan"), tok_s=0.0)
        for step in range(1, config.num_steps + 1):
            inputs, targets = next(batches)
            t0 = time.perf_counter()
            state, loss = step_fn(state, inputs, targets, train_rng)
            loss = float(loss)  # waits for the step, so the time below is the step's
            seconds = time.perf_counter() - t0
            step_seconds.append(seconds)
            window_loss.append(loss)
            window_time.append(seconds)
            progress.update(task, advance=1, loss=loss, tok_s=tokens_per_step / seconds)
            is_eval = step % config.eval_every == 0 or step == config.num_steps
            if is_eval or step % config.log_every == 0:
                line = {"step": step, "train_loss": float(np.mean(window_loss)),
                        "lr": float(schedule(step - 1)),
                        "tokens_per_second": tokens_per_step / float(np.mean(window_time)),
                        "step_seconds": float(np.mean(window_time))}
                if is_eval:
                    eval_loss = line["eval_loss"] = evaluate(state.params)
                    progress.console.print(f"step {step}: train {line['train_loss']:.4f}, "
                                           f"eval {eval_loss:.4f} nats/byte")
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
                window_loss, window_time = [], []

    # The first step's time holds one-off runtime warm-up; leave it out when there are others.
    timed = step_seconds[1:] or step_seconds
    median_step = statistics.median(timed)
    summary = {
        "model": config.model, "remat": config.remat, "policy": str(cfg.policy),
        "num_params": num_params, "num_steps": config.num_steps,
        "batch_size": config.batch_size, "seq_len": config.seq_len,
        "eval_loss": eval_loss, "eval_bits_per_byte": eval_loss / np.log(2),
        "final_train_loss": loss, "median_step_seconds": median_step,
        "median_tokens_per_second": tokens_per_step / median_step,
        "wall_seconds": time.perf_counter() - start, "compiled": stats,
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(console, summary)
    return summary


def main(argv: list[str]) -> None:
    del argv  # parse_flags has rejected extra arguments
    try:
        train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except BadInput as e:
        fail(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
