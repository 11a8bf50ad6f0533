"""remat_kit: activation rematerialization (gradient checkpointing) policies for JAX and Flax.

    import remat_kit as rk
    policy = rk.parse("minimal")            # MaxText's minimal, as a Policy
    nn.remat(Block, policy=policy.to_jax())
"""

from remat_kit.errors import RematSpecError, UnknownTagError
from remat_kit.names import ALIASES, TAGS, register_tag, tag
from remat_kit.policy import Policy
from remat_kit.spec import PRESETS, from_custom, parse
from remat_kit.validate import emitted_tags, validate

__all__ = [
    "ALIASES", "PRESETS", "Policy", "RematSpecError", "TAGS", "UnknownTagError",
    "emitted_tags", "from_custom", "parse", "register_tag", "tag", "validate",
]
