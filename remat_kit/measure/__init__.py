"""measure: programs and figures. A `Workload` under resolved policies lowered and compiled per
target (`targets`, `lowering`), residuals by tag, memory and FLOPs (`costs`), the peak (`peak`),
predicted time (`time_model`), the kept figures (`figure_cache`), one `Record` per program.
May import: `flax`, `trace`, `policy` and the bottom modules; never `decide` nor `models`.
Public names: `measure.measure`, `explain.explain_policy`, `residuals.residuals`,
`record.Record`, `targets.Target` / `parse_target`, `lowering.compile_for`.
Where it sits: docs/architecture.md ("The data flow").
"""
