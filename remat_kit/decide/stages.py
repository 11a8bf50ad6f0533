"""A plan per pipeline stage: each stage's budget read as the budget of the one program
every chip compiles, by the microbatch passes it holds in flight (`Pipeline.in_flight`),
planned and verified by the planner; MaxText's pipeline settings for `--emit maxtext`.
Docs: docs/plan.md ("Pipelines: a plan per stage").
"""

from __future__ import annotations

import dataclasses

from remat_kit.policy.policy import Policy


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's plan.

    Attributes:
      stage: 0 the first.
      in_flight: microbatch passes the stage holds at once (`Pipeline.in_flight`); the
        compiled program's count where the schedule is not told.
      budget: bytes of the compiled program (the planner's `memory_kind`) that the
        stage's budget stands for (`program_budget`).
      plan: the planner's `Plan` for `budget`, verified by compiling; None where even
        full remat's program is over it.
      stage_bytes: the stage's memory under `plan`, bytes: `stage_bytes`.
    """

    stage: int
    in_flight: int
    budget: int
    plan: object
    stage_bytes: int | None

    def said(self) -> str:
        """E.g. "full, 1.2 MiB" (the plan and the stage's memory)."""
        from remat_kit.units import fmt_bytes
        return (f"{self.plan.spec}, {fmt_bytes(self.stage_bytes)}" if self.plan is not None
                else "no policy fits (full remat's program is over the budget)")

    def to_dict(self) -> dict:
        return {"stage": self.stage, "in_flight": self.in_flight, "budget": self.budget,
                "spec": self.plan.spec if self.plan is not None else None,
                "stage_bytes": self.stage_bytes}


def program_budget(budget: int, fixed: int, held: int, passes: int) -> int:
    """The compiled program's memory that a stage's `budget` allows, bytes: the program
    holds `passes` microbatch passes' residuals, the stage `held` of them, so a stage at
    fixed + (M - fixed) x held / passes fits where M <= fixed + (budget - fixed) x
    passes / held (`fixed`: what no microbatch in flight changes: parameters, their
    gradients, workspace). ValueError for held or passes < 1."""
    if held < 1 or passes < 1:
        raise ValueError(f"microbatch passes in flight must be >= 1, got {held} of {passes}")
    return fixed + (budget - fixed) * passes // held


def stage_bytes(compiled: int, fixed: int, held: int, passes: int) -> int:
    """A stage's memory, bytes, from the compiled program's `compiled` bytes: fixed +
    (compiled - fixed) x held / passes (`program_budget`'s inverse)."""
    return fixed + (compiled - fixed) * held // passes


def fixed_bytes(planner) -> int:
    """What no microbatch in flight changes, bytes of the planner's `memory_kind`: full
    remat's compiled memory less the residuals its trace stores (every microbatch pass's
    layer inputs), at least 0."""
    full = planner.measure(Policy())
    return max(full.memory_bytes - sum(full.residual_bytes_by_tag.values()), 0)


def per_stage(planner, pipe, budget: int) -> list[StagePlan]:
    """A plan per stage of `pipe` (`remat_kit.trace.pipeline.Pipeline`) for a chip's
    `budget` (bytes of the planner's `memory_kind`): each stage's `program_budget`,
    planned once per distinct budget by `planner.frontier` (so verified by compiling);
    the first stage's is the tightest (it holds the most in flight). Under GPipe, or a
    schedule not told, every stage holds what the program holds: one plan for all."""
    passes = pipe.passes
    held = [pipe.in_flight(s) or passes for s in range(pipe.stages)]
    fixed = fixed_bytes(planner)
    budgets = [program_budget(budget, fixed, k, passes) for k in held]
    least = planner.minimum()[0]
    fits = sorted({b for b in budgets if b >= least})
    plans = dict(zip(fits, planner.frontier(fits))) if fits else {}
    out = []
    for s, (k, b) in enumerate(zip(held, budgets)):
        p = plans.get(b)
        out.append(StagePlan(s, k, b, p, None if p is None else
                             stage_bytes(p.measured_bytes, fixed, k, passes)))
    return out


def lines(stage_plans: list[StagePlan]) -> list[str]:
    """One line per run of stages with the same plan and passes in flight, e.g.
    "stages 0-3 (4 microbatch passes in flight each): full, 189.16 KiB"."""
    out, i = [], 0
    while i < len(stage_plans):
        sp, j = stage_plans[i], i
        while j + 1 < len(stage_plans) and (stage_plans[j + 1].in_flight, stage_plans[
                j + 1].said()) == (sp.in_flight, sp.said()):
            j += 1
        which = f"stage {i}" if i == j else f"stages {i}-{j}"
        out.append(f"{which} ({sp.in_flight} microbatch pass{'' if sp.in_flight == 1 else 'es'}"
                   f" in flight{'' if i == j else ' each'}): {sp.said()}")
        i = j + 1
    return out


def fit_line(pipe, rows, vary: str) -> str:
    """fit's line for a pipelined model: each row's global batch as microbatches of a
    size (the tightest stage's, the first, is the figure compiled), e.g. "pipeline:
    largest batch in microbatches: none 32 = 4 x 8, full 76 = 4 x 19; GPipe: every
    stage holds every microbatch, the compiled figure is each stage's"."""
    m = pipe.microbatches
    if vary == "batch":
        sizes = ", ".join(f"{r.policy} {r.size} = {m} x {r.size // m}" for r in rows
                          if r.size)
        said = f"largest batch in microbatches: {sizes}"
    else:
        said = f"each sequence runs as {m} microbatches"
    held = {"GPipe": "every stage holds every microbatch, so the compiled figure is each "
                     "stage's, the first's included",
            "1F1B": f"the first stage, the tightest, holds {pipe.in_flight(0)} of {m}: the "
                    f"compiled figure (all {pipe.passes} passes) bounds it from above",
            "unknown": "the schedule is not told: the compiled program's figure"}
    return f"pipeline: {said}; {pipe.schedule}: {held[pipe.schedule]}"


def maxtext_settings(pipe) -> str:
    """The settings MaxText reads for this pipeline, e.g. "ici_pipeline_parallelism=4
    num_pipeline_microbatches=4 num_pipeline_repeats=1" (its configs/base.yml; the
    repeats only where told apart from the microbatches); MaxText runs one remat_policy
    on every stage, so a plan per stage is run as the first stage's."""
    out = [f"ici_pipeline_parallelism={pipe.stages}",
           f"num_pipeline_microbatches={pipe.microbatches}"]
    if pipe.repeats is not None:
        out.append(f"num_pipeline_repeats={pipe.repeats}")
    return " ".join(out)


__all__ = ["StagePlan", "fit_line", "fixed_bytes", "lines", "maxtext_settings", "per_stage", "program_budget",
           "stage_bytes"]
