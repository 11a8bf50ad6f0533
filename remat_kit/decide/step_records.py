"""The planner's figures of the whole train step: each policy compiled as `fit` compiles it.

A `Planner` made with `step="train"` budgets the whole training step's device memory
(`remat_kit.decide.step`: value and grad, then the update), so a budget can be the device's
memory as it is. `train_record` compiles that step under one policy (or one per layer) into a
`Record`; `default_step` and `check_step` pick and check the step.
The `--step` rule and what it changes: docs/plan.md (`--step grad|train`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from remat_kit.decide.step import TrainStep, default_optimizer, step_figures, workload_step
from remat_kit.measure import lowering, targets, time_model
from remat_kit.measure.record import Record
from remat_kit.measure.residuals import stage, split
from remat_kit.policy.policy import Policy
from remat_kit.trace.workload import Workload

# What a plan's budget covers: the value-and-grad step (`compare`'s figure), or the
# whole train step (`fit`'s).
STEPS = ("grad", "train")
STEP_WORDS = {"grad": "the value-and-grad step (compare's figure: activations and workspace)",
              "train": "the whole train step (fit's figure: parameters, gradients, optimizer "
                       "state and update, the batch, activations)"}


def default_step(target: targets.Target, budgets) -> str:
    """"train" where `target` is an accelerator (TPU, GPU) and any budget is a size in
    bytes (the device's memory as it is: a fraction beside it is then of no remat's
    train-step figure, as every figure of the run is that step's); else "grad" (only
    fractions, of no remat's value-and-grad memory, or the XLA CPU compile's temp
    figure).

    Args:
      target: a `targets.Target`.
      budgets: budgets as `remat_kit.policy.budget.parse_budget` takes them.
    """
    from remat_kit.policy.budget import parse_budget
    sized = any(parse_budget(b).bytes is not None for b in budgets)
    return "train" if target.platform != "cpu" and sized else "grad"


def check_step(step: str) -> str:
    """`step` if it is one of `STEPS`; ValueError naming it and the choices otherwise."""
    if step not in STEPS:
        raise ValueError(f"step must be one of {', '.join(STEPS)} (the step a budget covers), "
                         f"got {step!r}")
    return step


def train_record(workload: Workload, loss: Callable, name: str, key: str, *,
                 target: targets.Target, optimizer=None,
                 per_device: "tuple | None" = None) -> Record:
    """The `Record` of `workload`'s train step with `loss` as its loss.

    Args:
      workload: what the planner plans (its args, mesh and sample data).
      loss: loss(*workload.args) under the policy (`Planner.loss_of`).
      name: what the record is called (the spec, or a per-layer summary).
      key: its canonical policy string (`Record.policy`).
      target: a `targets.Target`.
      optimizer: an optax transformation; default AdamW (`step.default_optimizer`).
      per_device: (policy -> loss, args) of one device's program, for the
        residuals; None traces `loss` at the workload's args.
    Returns:
      A Record with the train step's memory (`train_step_bytes`, and its
      `memory_analysis()` figures), FLOPs and compile seconds, the value-and-grad
      residuals, and `error` set (figures None) where the step does not trace or
      compile (an out-of-memory compile among them).
    """
    versions = target.versions
    record = Record(key, (name,), target.label, str(target), versions["jax"],
                    versions["compiler"])
    try:
        made = workload_step(dataclasses.replace(workload, loss_for_policy=lambda _: loss),
                             Policy(), optimizer or default_optimizer())
        c = lowering.compile_for(made.step, *made.args, target=target,
                                 donate=TrainStep.DONATED)
        staged = (stage(per_device[0](None), per_device[1]) if per_device is not None
                  else stage(loss, workload.args))
        memory = step_figures(c, made.args)
        fields = {k: v for k, v in c.memory.items() if hasattr(record, k)}
        return dataclasses.replace(
            record, **split(staged.residuals), **fields, flops=c.flops,
            transcendentals=c.transcendentals, compile_seconds=c.seconds,
            train_step_bytes=memory.total_bytes, notes=tuple(c.notes),
            parameter_bytes_per_device=memory.parameter_bytes_per_device,
            predicted_seconds=_predicted_seconds(c))
    except Exception as e:  # noqa: BLE001 - one failing policy must not hide the others
        return dataclasses.replace(record, error=f"{type(e).__name__}: {e}")


def _predicted_seconds(c: lowering.Compiled) -> float | None:
    """The time model's seconds of the compiled train step (`time_model.compiled_seconds`,
    plus its fused kernels priced from shapes: `Compiled.kernel_seconds`);
    None where its figures were kept from an earlier compile (no executable to read) or
    its HLO cannot be read: the planner then predicts from the value-and-grad roofline."""
    if c.compiled is None:
        return None
    try:
        return time_model.compiled_seconds(c.compiled, c.target.roofline) + c.kernel_seconds
    except Exception:  # noqa: BLE001 - a prediction must not lose the measurement
        return None


__all__ = ["STEPS", "STEP_WORDS", "check_step", "default_step", "train_record"]
