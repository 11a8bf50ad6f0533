"""Policies as measured: every `auto:budget=...` spec planned into the policy it stands
for, before `remat_kit.measure` (which takes resolved policies only) measures them;
`rk.measure` (`remat_kit.api.answers`) calls it. Reference: docs/plan.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remat_kit.decide.plan import Planner
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parsed_only
from remat_kit.measure import targets


def resolve(policies: Sequence, loss_fn: Callable, *args,
            target: targets.Target, cache: "str | bool | None" = True,
            per_device=None) -> list[Policy]:
    """`policies` (parsed values: `Policy` or `AutoSpec`, as `rk.measure` parses them)
    with every `auto:budget=...` replaced by its planned Policy, planned for `target`.

    per_device: as `Planner` takes it, for args sharded over a mesh.

    Raises:
      TypeError: a spec string (parse it first: `rk.parse`). BudgetError: as `plan`.
    """
    parsed = parsed_only(policies, "resolve")
    if not any(isinstance(p, AutoSpec) for p in parsed):
        return parsed
    planner = Planner(loss_fn, *args, cache=cache, target=target, per_device=per_device)
    return [planner.plan(p.budget).policy if isinstance(p, AutoSpec) else p for p in parsed]


__all__ = ["resolve"]
