"""flax: the ways in. A policy applied to a user's linen or NNX model without editing it
(`linen`, `nnx`: class and instance forms, auto-tagging; linen's auto-tagging in
`linen_tags`), and a user's Flax model read
into a `Workload` (`from_model`, its blocks found by `blocks`, placed on a mesh as its own
partitioning says by `placement`; a model of other inputs than tokens, with a batch and a
loss, by `batch_model`; a `FILE.py:FUNCTION` loaded by `user_model`).

May import: `remat_kit.trace`, `remat_kit.policy` and the bottom modules.

Public names: `rk.linen` (`remat`, `apply_remat`, `auto_tag`, ...), `rk.nnx` (the same
for NNX), `rk.from_model.workload`, `rk.batch_model.workload`.
"""
