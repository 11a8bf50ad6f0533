"""decide: the answers that choose. The budget planner (`plan`: `Planner`; `cost_model`, `milp`,
`offload`, `plan_cache`), auto specs resolved (`resolve`), the train step's memory (`step`,
`floor`) and the largest size that fits (`fit`). Takes the `Workload` it is given and never
builds a reference model (that is `remat_kit.api.configs`).
May import: `remat_kit.measure` and every part below it (`models` too, beside `flax`).
Public names: `plan.Plan`, `plan.Planner`, `plan.plan`, `resolve.resolve`, `fit.fit`,
`step.step_memory`. Where it sits: docs/architecture.md ("The planner's parts").
"""
