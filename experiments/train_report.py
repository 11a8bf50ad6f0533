"""What a training run reports: its summary (summary.json and the two tables printed at
the end) and the check of its compiled step against config.memory_budget.

The summary's fields are listed in `summary`; experiments/train.py writes and prints it.
"""

from __future__ import annotations

import statistics
import time

import jax
import ml_collections
import numpy as np
from rich.console import Console
from rich.table import Table

from experiments import checkpoint, own_model
from remat_kit.errors import BadInput


def summary(config: ml_collections.ConfigDict, policy_text: str, policies: list,
            start_step: int, num_params: int, trained, text: bool, rate: str, per_step: int,
            start: float, stats: dict, ckpt: checkpoint.Checkpoints, last_saved: int | None,
            budget: int | None) -> dict:
    """The run's summary.json, a dict: its config (model, remat, sizes, mesh, processes),
    `policy_text` and the `policies` of each start (`runlog.record_start`), eval and final
    train loss (nats/byte; a (model, batch, loss) FUNCTION's, not `text`, in its own
    units, without bits/byte), the median step time (s) and `rate` per second leaving out
    the first step's warm-up, wall seconds since `start` (`time.perf_counter`), the
    compiled figures `stats`, the checkpoint `last_saved` (bytes, write seconds) and the
    memory budget check (bytes per device), or None without a budget."""
    # The first step's time holds one-off runtime warm-up; leave it out when there are others.
    timed = trained.step_seconds[1:] or trained.step_seconds
    median_step = statistics.median(timed) if timed else None
    eval_loss = trained.eval_loss
    return {
        "model": config.model, "remat": config.remat, "policy": policy_text,
        "policies": policies, "start_step": start_step,
        "num_params": num_params, "num_steps": config.num_steps,
        "batch_size": config.batch_size, "seq_len": config.seq_len,
        "eval_loss": eval_loss,
        "eval_bits_per_byte": eval_loss / np.log(2) if text else None,
        "final_train_loss": trained.loss, "median_step_seconds": median_step,
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


def _format_bytes(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _format_ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _format(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_summary(console: Console, summary: dict) -> None:
    """The run's two tables: the run (losses, step time, rate, checkpoint) and the
    compiled train step under its policy against no remat (bytes, FLOPs, ratios)."""
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
    # XLA CPU's peak figure leaves its temp buffers out: alike under every policy, it would
    # read as remat saving nothing.
    on_cpu = "CPU" in compiled["label"]
    for key, fmt in (("temp_size_in_bytes", _format_bytes), ("peak_memory_in_bytes", _format_bytes),
                     ("step_bytes", _format_bytes),
                     ("flops", lambda f: "n/a" if f is None else f"{f:.3e}")):
        if not (on_cpu and key == "peak_memory_in_bytes"):
            mem.add_row(key, fmt(policy[key]), fmt(none[key]),
                        _format_ratio(policy[key], none[key]))
    console.print(mem)
    console.print(f"step_bytes: device memory the whole step holds at its peak "
                  f"({policy['step_bytes_source']})"
                  + ("; XLA CPU's peak_memory_in_bytes, which leaves temp buffers out, is not "
                     "shown" if on_cpu else ""), style="dim")
    budget = summary["memory_budget"]
    if budget:
        console.print(f"memory budget {budget['budget']}: this run's step holds "
                      f"{_format_bytes(budget['step_bytes'])}; remat=none would hold "
                      f"{_format_bytes(budget['none_step_bytes'])} "
                      f"({'fits' if budget['none_fits'] else 'over the budget'})")


def check_budget(config: ml_collections.ConfigDict, budget: int, stats: dict) -> None:
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
