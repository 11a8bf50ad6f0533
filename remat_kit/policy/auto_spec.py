"""The `auto:budget=B` spec: a marker for the policy the planner picks for a memory budget.

`parse_auto` reads it (`remat_kit.policy.spec.parse` hands it every spec starting with "auto");
the `AutoSpec` it gives is resolved where a model and shapes are known (`remat_kit.decide.resolve`).
Docs: docs/policies.md.
"""

from __future__ import annotations

import dataclasses
import re

from remat_kit.errors import RematSpecError
from remat_kit.policy.budget import parse_budget


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """`auto:budget=B`: the policy `remat_kit.decide.plan` picks for memory budget B.

    A marker, not a policy: it depends on the model and shapes, so it is
    resolved where they are known (`remat_kit.decide.resolve.resolve`, which
    `measure`, `measure_config`, `remat-kit compare` and experiments/train.py
    call). `str()` gives the spec back.

    >>> import remat_kit as rk
    >>> spec = rk.parse("auto:budget=6GiB")
    >>> spec, str(spec)
    (AutoSpec(budget='6GiB'), 'auto:budget=6GiB')

    Attributes:
      budget: the budget as written: bytes ("6GiB", "512MiB", "6000000000B")
        or a fraction 0 < f <= 1 of the no-remat temp memory ("0.25").
    """

    budget: str
    remat = True  # a remat wrapper will be applied, with the planned policy

    def __str__(self) -> str:
        return f"auto:budget={self.budget}"

    def to_jax(self, tags=None):
        """Raises RematSpecError: an unresolved budget has no JAX policy."""
        raise RematSpecError(f"{self} must be resolved for a model before use: "
                             "remat_kit.api.configs.resolve_config(cfg, batch, seq) or "
                             "remat_kit.decide.plan(loss_fn, *args, budget=...)", token=str(self))


_AUTO = re.compile(r"^\s*auto\s*:\s*budget\s*=(?P<budget>[^@|;]*)(?P<rest>.*)$", re.S)
_AUTO_EXAMPLES = ("auto:budget=6GiB", "auto:budget=0.25")
AUTO_ALONE = ("an auto:budget= spec stands alone: the planner picks the whole policy, so it "
               "cannot be a term of a union ('|') or a clause (';')")


def parse_auto(spec: str) -> AutoSpec:
    """`AutoSpec` of an "auto..." spec.

    Raises:
      RematSpecError: not `auto:budget=B` alone (a schedule, a union or clause after it, no
        budget), the message offering the user's own value in the right form where it is one;
      BudgetError (a RematSpecError): a malformed budget.
    """
    m = _AUTO.match(spec)
    if m is None:
        # Suggest the user's own value in the right form ('auto:Budget=0.5' -> 'auto:budget=0.5'),
        # if it is a budget: never a suggestion that fails in turn ('auto:Budget=24').
        value = spec.rpartition("=")[2].strip()
        try:
            parse_budget(value)
        except RematSpecError:
            value = ""
        raise RematSpecError("an auto spec reads auto:budget=SIZE (6GiB, 512MiB, bytes) or "
                             "auto:budget=FRACTION (0 < f <= 1 of no-remat memory), alone",
                             spec=spec, token=spec.strip(), position=0,
                             choices=(f"auto:budget={value}",) if value and "=" in spec
                             else _AUTO_EXAMPLES)
    rest, budget = m.group("rest"), m.group("budget").strip()
    if rest.startswith("@"):
        raise RematSpecError("an auto:budget= spec takes no layer schedule: the planner decides "
                             "every layer's policy; remove it", spec=spec, token=rest,
                             position=m.start("rest"), choices=_AUTO_EXAMPLES)
    if rest:
        raise RematSpecError(AUTO_ALONE, spec=spec, token=rest, position=m.start("rest"),
                             choices=_AUTO_EXAMPLES)
    if not budget:
        raise RematSpecError("auto:budget= needs a budget after '=': a size (6GiB, 512MiB, "
                             "bytes) or a fraction 0 < f <= 1 of no-remat memory", spec=spec,
                             token=m.group("budget"), position=m.start("budget"),
                             choices=_AUTO_EXAMPLES)
    parse_budget(budget)  # BudgetError (a RematSpecError) names the bad value
    return AutoSpec(budget)
