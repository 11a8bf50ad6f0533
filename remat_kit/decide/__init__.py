"""decide: the answers that choose. The budget planner (`plan`: `Planner`, `plan`; its
MILP `cost_model`, host `offload`, the `plan_cache`), auto specs resolved before
measuring (`resolve`, for `rk.measure`), the train step's memory (`step`, `floor`) and the
largest size that fits (`fit`).

May import: `remat_kit.measure` and every part below it (`remat_kit.models` too, beside
`flax`). Takes the `Workload` it is
given and never builds a reference model (those conveniences live in
`remat_kit.api.configs`).

Public names: `plan.Plan`, `plan.Planner`, `plan.plan`,
`resolve.resolve`, `fit.fit`, `step.step_memory`.
"""
