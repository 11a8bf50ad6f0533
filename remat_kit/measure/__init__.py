"""measure: programs and figures. A `Workload` under resolved policies lowered and
compiled per target (`targets`: the target as a value, parsed once at the edge;
`lowering`: one compile site), residuals by tag, memory and FLOPs (`costs`), what
holds the peak (`peak`), predicted time (`time_model`, at the peaks of `chip_peaks`),
timed steps (`step_times`), the kept figures (`figure_cache`), one `Record` per
program (`record`), what one block saves (`explain`), and the analytic estimate
(`estimate`).

May import: `remat_kit.flax`, `remat_kit.trace`, `remat_kit.policy` and the bottom
modules. Never the planner (`decide`) nor the reference models (`models`): a config
becomes a `Workload` before it reaches this part.

Public names: `measure.measure`, `explain.explain_policy`, `residuals.residuals`,
`record.Record`, `targets.Target` / `parse_target`, `lowering.compile_for`.
"""
