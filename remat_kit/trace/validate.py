"""Checking a policy against the tags a real function emits.

Every codebase that selects residuals by name (MaxText, Praxis, Levanter)
treats a name the model never emits as a silent no-op. Here it is an error.
Docs: docs/policies.md (`rk.validate`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
import warnings

import jax
from jax.extend.core import Literal

from remat_kit.policy import names
from remat_kit._jax_private import name_p, saved_residuals
from remat_kit.errors import UnknownTagError
from remat_kit.policy.policy import Policy

# Ops that keep a value's bytes: a tag on their output names their input's value.
_LAYOUT = ("reshape", "transpose", "squeeze", "expand_dims", "copy")
# Under jax_remat3, checkpoint_name stages as a hi-primitive of these types.
_NAME_PRIMS = ("CheckpointName", "CheckpointNameFwd")


def _sub_jaxprs(value):
    """Jaxprs held in an equation parameter (scan/cond/remat/pjit bodies)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def tag_of(eqn) -> str | None:
    """The tag a jaxpr equation applies (`checkpoint_name`), under either remat mode, or None."""
    if eqn.primitive is name_p:
        return eqn.params["name"]
    prim = eqn.params.get("_prim")  # jax_remat3 stages names as hi-primitives
    if prim is not None and type(prim).__name__ in _NAME_PRIMS:
        return prim.params["name"]
    return None


def all_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (scan, cond, remat, jit
    bodies, jax_remat3 hi-primitives), in trace order."""
    for eqn in jaxpr.eqns:
        yield eqn
        prim = eqn.params.get("_prim")  # jax_remat3 hi-primitives hold their jaxprs
        params = getattr(prim, "params", {}) if prim is not None else eqn.params
        for value in params.values():
            for sub in _sub_jaxprs(value):
                yield from all_eqns(sub)


def _traced(fn, args, kwargs):
    """fn's jaxpr, traced with `jax.make_jaxpr` (no FLOPs run); its outputs may hold
    plain dataclasses or strings, which are dropped."""
    def arrays_only(*a):
        return [x for x in jax.tree.leaves(fn(*a, **kwargs)) if isinstance(x, jax.Array)]
    return jax.make_jaxpr(arrays_only)(*args).jaxpr


def emitted_tags(fn, *args, **kwargs) -> dict[str, jax.core.ShapedArray]:
    """The `checkpoint_name` tags `fn(*args, **kwargs)` emits, with their abstract values.

    Traces `fn` with `jax.make_jaxpr` (no FLOPs run) and walks every nested
    jaxpr (scan, cond, remat, jit bodies). Args may be arrays or
    `jax.ShapeDtypeStruct`s; `fn` may return any Python value. A tag emitted several times (one per layer) is
    listed once, with the first shape seen. Returns {tag: ShapedArray}, in
    trace order.
    >>> import jax, jax.numpy as jnp, remat_kit as rk
    >>> f = lambda x: jnp.sum(rk.tag(x * 2, "mlpwi"))
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)  # traced only
    >>> {tag: value.shape for tag, value in rk.emitted_tags(f, x).items()}
    {'mlpwi': (4, 8)}

    """
    found: dict = {}
    for eqn in all_eqns(_traced(fn, args, kwargs)):
        if (tag := tag_of(eqn)) is not None:
            found.setdefault(tag, eqn.outvars[0].aval)
    return found


def tag_aliases(fn, *args, **kwargs) -> dict[str, tuple[str, ...]]:
    """Tags that name one value twice: {tag: the other tags of that value}.

    A value tagged by path (`auto_tag`, e.g. "h_0/attn/c_attn") and by its
    role (`remat_kit.trace.roles`, e.g. "qkv_proj") is one `checkpoint_name` applied
    to the other's output, or to a reshape or transpose of it (the same bytes:
    a role such as query_proj is often named on the heads' layout). Traced as `emitted_tags` traces; a tag naming a
    value of its own is absent. Returns {tag: (other tags, in trace order)}.
    """
    group_of, groups = {}, []  # a tag's output var -> the tags of its value
    for eqn in all_eqns(_traced(fn, args, kwargs)):
        if (tag := tag_of(eqn)) is None:
            if (eqn.primitive.name in _LAYOUT and eqn.invars
                    and not isinstance(eqn.invars[0], Literal) and eqn.invars[0] in group_of):
                group_of[eqn.outvars[0]] = group_of[eqn.invars[0]]  # same bytes, reshaped
            continue
        group = group_of.get(eqn.invars[0]) if eqn.invars else None
        if group is None:
            group = []
            groups.append(group)
        if tag not in group:
            group.append(tag)
        group_of[eqn.outvars[0]] = group
    aliases: dict[str, list[str]] = {}
    for group in groups:
        for tag in group:
            others = aliases.setdefault(tag, [])
            others += [t for t in group if t != tag and t not in others]
    return {t: tuple(o) for t, o in aliases.items() if o}


def check_names(policy: Policy, emitted, where: str = "the function") -> None:
    """Raises UnknownTagError if a pattern of `policy` matches none of the `emitted` names.

    A variant tag (`names.VARIANTS`, e.g. kv_proj beside key_proj) that is
    missing is accepted when the policy names another variant that is emitted.
    `where` names the checked code in the message.
    """
    emitted = tuple(emitted)
    matched = {p for p in policy.patterns() if fnmatch.filter(emitted, p)}
    for pat in policy.patterns():
        siblings = next((g for g in names.VARIANTS if pat in g), frozenset())
        if pat not in matched and not siblings & matched:
            raise UnknownTagError(pat, emitted, message=(
                f"policy {str(policy)!r} names {pat!r}, which {where} never emits; "
                f"tags present: {list(emitted) or 'none'}"))


def check_policy(policy: Policy, fn, *args) -> Policy:
    """Checks `policy` against the tags `fn(*args)` emits, and returns it (`rk.validate`
    parses a spec first).

    `fn` is the function a remat wrapper would cover (for example one decoder
    layer without remat), taking array or ShapeDtypeStruct arguments.

    Raises:
      UnknownTagError: a pattern of the policy matches no emitted tag; the
        message lists the tags present and the closest match. A variant tag
        (`names.VARIANTS`, e.g. kv_proj beside key_proj) the function lacks
        is accepted when the policy names another variant it emits.
    Warns:
      UserWarning: a saved or offloaded tag is never a residual of `fn`
        (for example a layer's output, which the next layer consumes), so
        saving it changes nothing.
    """
    emitted = tuple(emitted_tags(fn, *args))
    check_names(policy, emitted)
    if not policy.remat:
        return policy
    # Only tags named literally: `save:*` covering a layer output is not a mistake.
    kept = {t for t in emitted
            if t in policy.patterns() and policy.decide(t) in ("save", "offload")}
    if kept:
        # Probe with every kept tag saved: offloaded residuals show only as
        # device_put outputs, so a save-only probe names them all.
        probe = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*kept))
        residual_tags = {d.split("'")[1] for _, d in saved_residuals(probe, *args)
                         if d.startswith("named '")}
        for t in sorted(kept - residual_tags):
            warnings.warn(f"policy {str(policy)!r} {policy.decide(t)}s {t!r}, but {t!r} is "
                          "never a residual of this function (nothing in its backward pass "
                          "needs it), so that decision does nothing", stacklevel=2)
    return policy


def lacking(policy: Policy, emitted: Sequence[str]) -> list[str]:
    """The patterns `policy` saves or offloads that match no tag in `emitted`,
    sorted, leaving out those the policy names an emitted alternative of
    (`names.VARIANTS`: `minimal`'s kv_proj beside key_proj/value_proj, moe_mlpwo
    beside mlpwo): what the model lacks of what the policy means to keep."""
    kept = {*policy.save, *policy.offload}
    matched = {p for p in kept if any(fnmatch.fnmatchcase(t, p) for t in emitted)}
    return sorted(p for p in kept - matched
                  if not next((f for f in names.VARIANTS if p in f), frozenset()) & matched)


def policy_notes(policy: Policy, emitted: Sequence[str], missing: Sequence[str]) -> tuple:
    """Lines saying where a policy's names select nothing the loss emits.

    A name-based preset on a model that lacks a role (fused attention has no
    attn_logits) or a path glob that matches no path is named, never
    silently compiled as its base rule. `missing` are the workload's notes on
    roles it lacks ("attn_logits: fused attention ...").
    """
    if not policy.remat:
        return ()
    wanted = [p for p in (*policy.save, *policy.offload)]
    out = []
    unmatched = [p for p in wanted if not any(fnmatch.fnmatchcase(t, p) for t in emitted)]
    if wanted and len(unmatched) == len(wanted):
        out.append(f"none of the tags this policy keeps ({', '.join(sorted(wanted))}) is "
                   f"emitted by the model: it compiles as its base rule '{policy.base}'")
    for line in missing:
        tag = line.split(":", 1)[0]
        family = next((f for f in names.VARIANTS if tag in f), {tag})
        # kv_proj missing beside key_proj/value_proj is the same values under other names.
        if tag in unmatched and not family & set(emitted):
            out.append(line)
    # Scores a fused kernel never stores (selective's core_attn) are not recomputed.
    fused = [line for line in missing if line.split(":", 1)[0] in policy.recompute
             and "fused attention" in line]
    if fused:
        out.append(f"recomputing {', '.join(line.split(':', 1)[0] for line in fused)} finds "
                   f"no such values here: {fused[0].split(': ', 1)[1]}, and the kernel's "
                   "backward already recomputes its probabilities; any FLOPs this row adds "
                   "are the rest of what it recomputes")
    globs = [p for p in unmatched if names.is_glob(p) or "/" in p]
    if globs and len(unmatched) < len(wanted):
        out.append(f"pattern(s) {', '.join(sorted(globs))} match no tag the model emits")
    return tuple(out)


__all__ = ["all_eqns", "check_names", "check_policy", "emitted_tags", "lacking", "policy_notes",
           "tag_aliases", "tag_of"]
