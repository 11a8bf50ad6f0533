"""api: the front floor, where every public answer is. What the user typed is parsed
here once (policy specs into `Policy`, targets into `Target`) and only values go
below: `answers` (`rk.measure`, `rk.explain`, `rk.plan`, `rk.remat_model` for any
`Workload`), `configs` (the same for a reference `TransformerConfig`: `rk.measure_config`,
`rk.fit`, `rk.step_memory`, ...), the checks of what a command or script takes
(`inputs`, `sources`) and the reports (`report`, `labels`, `plots`). The walk from
`rk.measure` to a `Record`: docs/architecture.md.

May import: every part but `cli`. Nothing imports it but `cli`, the package root and
the research scripts (`experiments/`).

Public names: `measure`, `explain`, `plan`, `remat_model`, `fit`, `step_memory`,
`measure_config`, `layer_residuals`, and the namespaces `rk` shows (`report`, `linen`,
`nnx`, `from_model`, `batch_model`, `models`, `mesh`, `targets`, `estimate`, `roles`).
"""

from remat_kit import mesh, models
from remat_kit.api import report
from remat_kit.api.answers import explain, measure, plan, remat_model
from remat_kit.api.configs import fit, layer_residuals, measure_config, step_memory
from remat_kit.flax import batch_model, from_model, linen, nnx
from remat_kit.measure import estimate, targets
from remat_kit.trace import roles

__all__ = ["batch_model", "estimate", "explain", "fit", "from_model", "layer_residuals",
           "linen", "measure", "measure_config", "mesh", "models", "nnx", "plan",
           "remat_model", "report", "roles", "step_memory", "targets"]
