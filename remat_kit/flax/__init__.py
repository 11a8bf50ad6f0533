"""flax: the ways in. A policy applied to a user's linen or NNX model without editing it (`linen`,
`nnx`, `linen_tags`), and a user's Flax model read into a `Workload` (`from_model`, `blocks`,
`placement`; other inputs than tokens: `batch_model`; `FILE.py:FUNCTION`: `user_model`).
May import: `remat_kit.trace`, `remat_kit.policy` and the bottom modules.
Public names: `rk.linen` (`remat`, `apply_remat`, `auto_tag`, ...), `rk.nnx` (the same for
NNX), `rk.from_model.workload`, `rk.batch_model.workload`.
Docs: docs/wrappers.md, docs/models.md.
"""
