"""Policies as measured: every `auto:budget=...` spec planned into the policy it stands for.

`remat_kit.measure` measures resolved policies only; `measure` here is the
public `rk.measure`, which plans each auto spec with a `Planner` first and
then measures the whole list, the planned policy named by its auto spec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remat_kit.decide.plan import Planner
from remat_kit.measure import lowering, targets
from remat_kit.measure import measure as measuring
from remat_kit.measure.record import Record
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.trace.workload import Workload, from_loss


def resolve(policies: Sequence, loss_fn: Callable, *args,
            target: targets.Target, cache: "str | bool | None" = True,
            per_device=None) -> list[Policy]:
    """`policies` with every `auto:budget=...` replaced by its planned Policy, planned
    for `target`.

    per_device: as `Planner` takes it, for args sharded over a mesh.

    Raises:
      RematSpecError: a spec does not parse. BudgetError: as `plan`.
    """
    parsed = [parse(p) for p in policies]
    if not any(isinstance(p, AutoSpec) for p in parsed):
        return parsed
    planner = Planner(loss_fn, *args, cache=cache, target=target, per_device=per_device)
    return [planner.plan(p.budget).policy if isinstance(p, AutoSpec) else p for p in parsed]


def measure(workload: "Workload | Callable", *args, policies: Sequence, names=None,
            target: "str | targets.Target | None" = None, **kwargs) -> list[Record]:
    """`remat_kit.measure.measure.measure` (see it for every argument), with
    `target` given as text ("tpu:v5e:1x1", parsed once here; default JAX's
    default backend) or a `Target`, and each "auto:budget=..." spec planned
    first (`resolve`, the plan cache on) and its record named by the auto
    spec. `policies` is a list of specs or Policies, or one of them (one record).

    Raises:
      RematSpecError: a spec does not parse (before anything is traced).
      TargetError: a bad target (`targets.parse_target`), or as `measure`.
      BudgetError: an auto budget below full remat's memory.
      TypeError: a workload and args both given.
    """
    if isinstance(policies, (str, Policy)):  # one spec, as rk.fit takes it: not its letters
        policies = [policies]
    parsed = [parse(p) for p in policies]
    target = targets.parse_target(target)  # the one parse: below here a Target is handed on
    if not any(isinstance(p, AutoSpec) for p in parsed):
        return measuring.measure(workload, *args, policies=policies, names=names, target=target,
                                 **kwargs)
    if isinstance(workload, Workload) and args:
        raise TypeError("measure takes a Workload or a loss and its args, not both")
    work = workload if isinstance(workload, Workload) else from_loss(workload, *args)
    per_device = kwargs.get("per_device") or work.per_device
    resolved = resolve(parsed, work.loss_for_policy, *lowering.place(work.args, target),
                       target=target, per_device=per_device)
    return measuring.measure(work, policies=resolved,
                             names=names if names is not None else [str(p) for p in policies],
                             target=target, **kwargs)


__all__ = ["measure", "resolve"]
