"""api: the front floor, where every public answer is. Specs and targets are parsed here once
and only values go below: `answers` (`rk.measure`, `explain`, `plan`, `remat_model`), `configs`
(the same for a `TransformerConfig`): answers only; what the CLI reads and prints is `ui/`.
May import: every part below it; imported by `ui`, `cli`, the package root and `experiments/`.
Public names: `measure`, `explain`, `plan`, `remat_model`, `fit`, `step_memory`,
`measure_config`, `layer_residuals`, `parse`, `from_custom`, `tag`, `register_tag`, `validate`,
`emitted_tags`, `residuals`, `checkpointed`. The walk to a `Record`: docs/architecture.md.
"""

from remat_kit import mesh, models
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
           "mesh", "models", "nnx", "parse", "plan", "register_tag", "remat_model",
           "residuals", "roles", "step_memory", "tag", "targets", "validate"]
