"""remat_kit: activation rematerialization (gradient checkpointing) policies for JAX and Flax.

    import remat_kit as rk
    policy = rk.parse("minimal")            # MaxText's minimal, as a Policy
    rk.plan(loss_fn, *args, budget="6GiB")  # the cheapest policy that fits, verified

Every answer (`measure`, `explain`, `plan`, `fit`) takes a `Workload` and is defined in
`remat_kit.api`, the front floor. Start at README.md; the parts: docs/architecture.md.
"""

# The answers, functions and namespaces from the front floor (`remat_kit.api`); the value
# types (and the constants of the vocabulary) from their own modules; nothing from the CLI.
from remat_kit.api import (batch_model, checkpointed, emitted_tags, estimate, explain, fit,
                           from_custom, from_model, layer_residuals, linen, measure,
                           measure_config, mesh, models, nnx, parse, plan, register_tag,
                           remat_model, residuals, roles, step_memory, tag, targets,
                           validate)
from remat_kit.decide.plan import Planner
from remat_kit.decide.plan_cache import Plan
from remat_kit.errors import (BudgetError, MeshError, RematSpecError, UnknownModuleError,
                              UnknownTagError)
from remat_kit.measure.record import Record
from remat_kit.policy.names import ALIASES, TAGS
from remat_kit.policy.policy import Policy
from remat_kit.policy.presets import PRESETS
from remat_kit.policy.spec import AutoSpec
from remat_kit.trace.workload import Workload

# The one place the version is written (pyproject.toml reads it); CHANGELOG.md says what each holds.
__version__ = "0.2.0"

__all__ = [
    "ALIASES", "AutoSpec", "BudgetError", "MeshError", "PRESETS", "Plan", "Planner", "Policy",
    "Record", "RematSpecError", "TAGS", "UnknownModuleError", "UnknownTagError", "Workload",
    "batch_model", "checkpointed", "emitted_tags", "estimate", "explain", "fit", "from_custom", "from_model",
    "layer_residuals", "linen", "measure", "measure_config", "mesh", "models", "nnx", "parse",
    "plan", "register_tag", "remat_model", "residuals", "roles", "step_memory", "tag", "targets", "validate",
]
