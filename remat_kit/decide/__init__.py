"""decide: the answers that choose. The budget planner (`plan`: `Planner`, `plan`; its
MILP `cost_model`, host `offload`, the `plan_cache`), auto specs resolved before
measuring (`resolve`: `rk.measure`), the train step's memory (`step`, `floor`) and the
largest size that fits (`fit`).

May import: `remat_kit.measure` and every part below it. Takes the `Workload` it is
given and never builds a reference model (those conveniences live in
`remat_kit.models.shortcuts`).

Public names: `plan.Plan`, `plan.Planner`, `plan.plan`, `resolve.measure`,
`resolve.resolve`, `fit.fit`, `step.step_memory`.
"""
