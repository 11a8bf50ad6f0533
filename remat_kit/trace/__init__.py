"""trace: what a traced program holds. The `Workload` (a loss under a policy, its
argument shapes, how it resizes), the tags a function emits (`validate`), dataflow
roles inferred on any transformer's jaxpr (`dataflow`, `roles`), remat regions
found and counted (`marked`) and re-run under any policy (`regions`), one block call run that way with its roles
tagged (`call_region`, for the wrappers), a model's own mesh rebuilt on a target's
devices (`retarget`), and the pieces every way of applying a
policy shares (`wrapping`: markers, static arguments, output tags, `RoleCall`).

May import: `remat_kit.policy` and the bottom modules (errors, mesh, files, units,
_jax_private). Knows no reference model.

Public names: `Workload`, `from_loss`, `checkpointed` (`workload`); `emitted_tags`,
`validate` (`validate`); `infer_roles`, `ROLES` (`roles`).
"""
