"""remat_kit: activation rematerialization (gradient checkpointing) policies for JAX and Flax.

    import remat_kit as rk
    policy = rk.parse("minimal")            # MaxText's minimal, as a Policy
    nn.remat(Block, policy=policy.to_jax())
"""

from remat_kit import estimate, report
from remat_kit.errors import BudgetError, RematSpecError, UnknownTagError
from remat_kit.fit import fit, step_memory
from remat_kit.measure import (Record, checkpointed, explain, layer_residuals, measure,
                               measure_config, residuals)
from remat_kit.names import ALIASES, TAGS, register_tag, tag
from remat_kit.policy import Policy
from remat_kit.spec import PRESETS, from_custom, parse
from remat_kit.validate import emitted_tags, validate

__all__ = [
    "ALIASES", "PRESETS", "BudgetError", "Policy", "Record", "RematSpecError", "TAGS",
    "UnknownTagError", "checkpointed", "emitted_tags", "estimate", "explain", "fit",
    "from_custom", "layer_residuals", "measure", "measure_config", "parse", "register_tag",
    "report", "residuals", "step_memory", "tag", "validate",
]
