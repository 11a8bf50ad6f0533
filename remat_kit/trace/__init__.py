"""trace: what a traced program holds. The `Workload` (a loss under a policy, its shapes, how it
resizes), the tags a function emits (`validate`), dataflow roles (`dataflow`, `roles`), remat
regions found (`marked`) and re-run under any policy (`regions`, `call_region`, `wrapping`),
a model's own mesh rebuilt on a target (`retarget`). Knows no reference model.
May import: `remat_kit.policy` and the bottom modules.
Public names: `Workload`, `from_loss`, `checkpointed` (`workload`); `emitted_tags`, `validate`
(`validate`); `infer_roles`, `ROLES` (`roles`). Where it sits: docs/architecture.md.
"""
