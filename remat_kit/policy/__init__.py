"""policy: the language. Tag names and aliases, the `Policy` value, spec strings and presets,
layer schedules, memory budgets.

May import: `remat_kit.errors`, `remat_kit._jax_private` (nothing else of ours).

Public names: `Policy`, `TagPolicy` (`policy`); `PRESETS` (`presets`); `parse`,
`from_custom`, `layer_policies` (`spec`); `AutoSpec` (`auto_spec`); `TAGS`, `ALIASES`, `tag`,
`register_tag` (`names`); `Schedule` (`schedule`); `parse_budget`, `Budget` (`budget`). Docs: docs/policies.md.
"""

from remat_kit.policy.policy import Policy, TagPolicy
from remat_kit.policy.presets import PRESETS
from remat_kit.policy.auto_spec import AutoSpec
from remat_kit.policy.spec import from_custom, layer_policies, parse

__all__ = ["AutoSpec", "PRESETS", "Policy", "TagPolicy", "from_custom", "layer_policies", "parse"]
