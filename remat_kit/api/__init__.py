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
`measure_config`, `layer_residuals`, the policy language's `parse`, `from_custom`, `tag`,
`register_tag`, the checks `validate`, `emitted_tags`, `residuals`, `checkpointed`, and the
namespaces `rk` shows (`report`, `linen`,
`nnx`, `from_model`, `batch_model`, `models`, `mesh`, `targets`, `estimate`, `roles`).
"""

from remat_kit import mesh, models
from remat_kit.api import report
from remat_kit.api.answers import explain, measure, plan, remat_model, validate
from remat_kit.api.configs import fit, layer_residuals, measure_config, step_memory
from remat_kit.flax import batch_model, from_model, linen, nnx
from remat_kit.measure import estimate, targets
from remat_kit.measure.residuals import residuals
from remat_kit.policy.names import register_tag, tag
from remat_kit.policy.spec import from_custom, parse
from remat_kit.trace import roles
from remat_kit.trace.validate import emitted_tags
from remat_kit.trace.workload import checkpointed

__all__ = ["batch_model", "checkpointed", "emitted_tags", "estimate", "explain", "fit",
           "from_custom", "from_model", "layer_residuals", "linen", "measure", "measure_config",
           "mesh", "models", "nnx", "parse", "plan", "register_tag", "remat_model", "report",
           "residuals", "roles", "step_memory", "tag", "targets", "validate"]
