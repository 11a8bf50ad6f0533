"""remat_kit: activation rematerialization (gradient checkpointing) policies for JAX and Flax.

    import remat_kit as rk
    policy = rk.parse("minimal")            # MaxText's minimal, as a Policy
    nn.remat(Block, policy=policy.to_jax())
    rk.plan(loss_fn, *args, budget="6GiB")  # the cheapest policy that fits, verified

Every answer (`measure`, `explain`, `plan`, `fit`) takes a `Workload`, the
value that says what to measure: `rk.models.workload(cfg, batch, seq)` for
the reference transformers, `rk.from_model.workload(model, batch, seq)` for
any linen or NNX language model, `rk.batch_model.workload(model, batch, loss)` for
a model of other inputs (images, latents and timesteps, a dict batch), or one of
the user's own.

`rk.plan` is the planner function; its module is `remat_kit.decide.plan` (import
`Planner` and friends with `from remat_kit.decide.plan import ...`).
"""

from remat_kit import mesh, models
from remat_kit.measure import estimate
from remat_kit.flax import batch_model, from_model
from remat_kit.flax.measured import remat_model
from remat_kit.trace import roles
from remat_kit.cli import report
from remat_kit.measure import targets
from remat_kit.flax import linen
from remat_kit.flax import nnx
from remat_kit.errors import (BudgetError, MeshError, RematSpecError, UnknownModuleError,
                              UnknownTagError)
from remat_kit.decide.resolve import measure
from remat_kit.measure.explain import explain
from remat_kit.models.shortcuts import fit, layer_residuals, measure_config, step_memory
from remat_kit.policy.names import ALIASES, TAGS, register_tag, tag
from remat_kit.decide.plan import Plan, Planner, plan
from remat_kit.measure.record import Record
from remat_kit.measure.residuals import residuals
from remat_kit.policy.policy import Policy
from remat_kit.policy.presets import PRESETS
from remat_kit.policy.spec import AutoSpec, from_custom, parse
from remat_kit.trace.validate import emitted_tags, validate
from remat_kit.trace.workload import Workload, checkpointed

__all__ = [
    "ALIASES", "AutoSpec", "BudgetError", "MeshError", "PRESETS", "Plan", "Planner", "Policy",
    "Record", "RematSpecError", "TAGS", "UnknownModuleError", "UnknownTagError", "Workload",
    "batch_model", "checkpointed", "emitted_tags", "estimate", "explain", "fit", "from_custom", "from_model",
    "layer_residuals", "linen", "measure", "measure_config", "mesh", "models", "nnx", "parse",
    "plan", "register_tag", "remat_model", "report", "residuals", "roles", "step_memory", "tag", "targets", "validate",
]
