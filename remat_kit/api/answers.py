"""The public answers for any `Workload`: `rk.measure`, `rk.explain`, `rk.plan` and
`rk.remat_model`. What the user typed (policy specs, targets) is parsed here once;
the parts below take the values. Reference: docs/models.md, docs/compare.md, docs/plan.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remat_kit.decide import plan as planning
from remat_kit.decide.plan_cache import Plan
from remat_kit.decide.resolve import resolve
from remat_kit.flax.measured import remat_model
from remat_kit.measure import explain as explaining
from remat_kit.measure import lowering, targets
from remat_kit.measure import measure as measuring
from remat_kit.measure.explain import LayerBreakdown
from remat_kit.measure.record import Record
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.trace.validate import check_policy
from remat_kit.trace.workload import Workload, from_loss


def measure(workload: "Workload | Callable", *args, policies: Sequence, names=None,
            target: "str | targets.Target | None" = None, **kwargs) -> list[Record]:
    """One compiled `Record` per policy: memory (bytes), FLOPs, predicted time.

    `remat_kit.measure.measure.measure` (see it for every argument), with
    `target` given as text ("tpu:v5e:1x1", parsed once here; default JAX's
    default backend) or a `Target`, and each "auto:budget=..." spec planned
    first (`decide.resolve.resolve`, the plan cache on) and its record named by
    the auto spec. `policies` is a list of specs or Policies, or one of them
    (one record).

    >>> import jax, jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    >>> [r.policy for r in rk.measure(loss, w, x, policies=["none", "full"])]
    ['none', 'full']

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
        return measuring.measure(workload, *args, policies=parsed,
                                 names=names if names is not None else [str(p) for p in policies],
                                 target=target, **kwargs)
    if isinstance(workload, Workload) and args:
        raise TypeError("measure takes a Workload or a loss and its args, not both")
    work = workload if isinstance(workload, Workload) else from_loss(workload, *args)
    per_device = kwargs.get("per_device") or work.per_device
    resolved = resolve(parsed, work.loss_for_policy, *lowering.place(work.args, target),
                       target=target, per_device=per_device)
    return measuring.measure(work, policies=resolved,
                             names=names if names is not None else [str(p) for p in policies],
                             target=target, **kwargs)


def explain(policy: "str | Policy", fn: "Callable | Workload", *args,
            target: "str | targets.Target | None" = None) -> LayerBreakdown:
    """What `fn` saves, offloads and recomputes under `policy`: one row per residual.

    For a `Workload`, its first block alone under the policy, as the workload
    wraps it (`Workload.block`); its input is a row, its parameters are
    `parameter_bytes`. A function is wrapped in one remat region (`checkpointed`).
    Either is traced under `jax.vjp`; nothing is computed or allocated.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> layer = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    >>> rk.explain("full", layer, jnp.ones((8, 8)), jnp.ones((4, 8))).saved_bytes
    0

    Args:
      policy: a spec string or Policy (parsed here once).
      fn: a `Workload` with blocks, or a function of arrays returning a scalar,
        without remat of its own (e.g. one layer and a sum).
      args: for a function, arrays or `jax.ShapeDtypeStruct`s.
      target: if given (e.g. "tpu:v5e:1x1", `remat_kit.measure.targets`), also
        compile `fn`'s value-and-grad (w.r.t. the first argument) for it:
        `LayerBreakdown.compiled`.
    Returns:
      A `LayerBreakdown` (num_layers=1): rows of (tag or primitive, shape, dtype,
      bytes, decision) for every stored residual, then a row for each emitted tag
      the policy recomputes ("recomputed") or keeps but the backward pass never
      reads ("not needed"); values that depend on no parameter or activation are
      `constants`, apart. Arguments are not rows: they are kept by reference, and
      their bytes are `parameter_bytes`.
    Raises:
      RematSpecError: the policy does not parse.
      TargetError: a bad target, or libtpu / the CUDA plugin missing.
      TypeError: the workload given first, or `fn` not returning a scalar.
      ValueError: a workload without blocks.
    """
    if isinstance(policy, Workload):  # rk.measure takes the workload first; explain does not
        raise TypeError(f"rk.explain takes (policy, workload): got the workload "
                        f"{policy.name!r} first; write rk.explain({fn!r:.40}, workload)")
    return explaining.explain_policy(
        parse(policy), fn, *args, target=None if target is None else targets.parse_target(target))


def validate(policy: "str | Policy", fn, *args) -> Policy:
    """`policy` parsed here once and checked against the tags `fn(*args)` emits
    (`trace.validate.check_policy`, which says what is refused and warned).

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> layer = lambda x: jnp.sum(rk.tag(jnp.tanh(x), "mlpwi") ** 2)
    >>> str(rk.validate("save:mlpwi", layer, jnp.ones((4, 8))))
    'save:mlpwi'

    Raises:
      RematSpecError: the spec does not parse. UnknownTagError: a pattern matches no
        emitted tag (the tags present and the closest match in the message).
    """
    return check_policy(parse(policy), fn, *args)


def plan(loss_fn: Callable, *args, budget, target=None, **kwargs) -> Plan:
    """The cheapest policy (fewest FLOPs) whose compiled memory fits `budget` (bytes,
    "6GiB", or a fraction of no remat's memory), verified by compiling.

    `remat_kit.decide.plan.plan` (see it for every argument), the target parsed
    here once.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> p = rk.plan(loss, jnp.ones((8, 8)), jnp.ones((4, 8)), budget=1.0, cache=None)
    >>> p.measured_bytes <= p.budget_bytes
    True

    Raises:
      BudgetError: a malformed budget, or one below full remat's memory.
      TargetError: a bad target; ValueError: nothing to differentiate.
    """
    return planning.plan(loss_fn, *args, budget=budget, target=targets.parse_target(target),
                         **kwargs)


__all__ = ["explain", "measure", "plan", "remat_model", "validate"]
