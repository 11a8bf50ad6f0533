"""A plan written out for the framework that runs it: MaxText overrides, a JAX policy, a call.

`emit(plan, "maxtext")` gives MaxText's `remat_policy=custom` overrides (`MAXTEXT_TENSORS`, from
its configs/base.yml), `emit(plan, "jax")` the `jax.checkpoint_policies` expression,
`emit(plan, "remat_kit")` the `rk.remat_model` call; a kept tag is written under each of its
names (`Plan.aliases`). A plan the framework cannot say raises `EmitError`, one line why.
The rules and an example: docs/plan.md ("The model's own tags ..."; `--emit`).
"""

from __future__ import annotations

from collections.abc import Iterable

from remat_kit.errors import RematSpecError
from remat_kit.policy.names import is_glob, is_path, known_tags
from remat_kit.policy.policy import Policy

FRAMEWORKS = ("maxtext", "jax", "remat_kit")

# MaxText's `remat_policy: custom` tensors, in its base.yml order (MaxText
# src/maxtext/configs/base.yml; configs/types.py builds tensors_on_device and
# tensors_to_offload from them). Each takes 'remat', 'device' or 'offload'.
MAXTEXT_TENSORS = (
    "decoder_layer_input", "indexer_cutoff_threshold", "context", "mlpwi", "mlpwi_0", "mlpwi_1",
    "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "query_proj", "key_proj", "value_proj",
    "kv_proj", "qkv_proj", "out_proj", "query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv",
    "attention_out", "engram")
# MaxText's word for each decision.
_MAXTEXT_WORDS = {"save": "device", "offload": "offload", "recompute": "remat"}
# The layer input is MaxText's remat start point: its setting is never 'remat'
# (base.yml: "this tensor cannot be rematerialized").
_NEVER_REMAT = "decoder_layer_input"


class EmitError(RematSpecError):
    """A plan the framework cannot run as one setting: the message says why, in one line."""


def _uniform(plan, framework: str, words: str) -> Policy:
    """The plan's one Policy; EmitError for a per-layer plan."""
    if plan.layer_specs:
        raise EmitError(f"--emit {framework}: the plan decides tags per layer ({plan.spec}); "
                        f"{words} takes one setting per tensor for every layer: plan with "
                        "--uniform (rk.plan(..., groups=1)), or --emit remat_kit")
    return plan.policy


def _decided(plan, policy: Policy) -> dict[str, str]:
    """Tag -> decision, for the vocabulary, registered tags, the tags `Plan.aliases`
    lists and the names the policy spells out (module paths)."""
    tags = (*known_tags(), *plan.aliases, *(p for p in policy.patterns() if not is_glob(p)))
    return policy.resolve(tuple(dict.fromkeys(tags)))


def _names(plan, policy: Policy) -> dict[str, str]:
    """Every name the plan decides -> its decision ("save", "offload", "recompute"): the
    tags it decides with their aliases (`Plan.aliases`)."""
    out = {}
    for tag, decision in _decided(plan, policy).items():
        for name in (tag, *plan.aliases.get(tag, ())):
            if decision != "recompute" or name not in out:
                out[name] = decision
    return out


def kept_tags(plan, policy: Policy) -> dict[str, str]:
    """Tag -> "save" or "offload", for each tag `policy` keeps (`_decided`), in
    vocabulary order."""
    return {t: d for t, d in _decided(plan, policy).items() if d != "recompute"}


# MaxText names the attention's output twice (`context` at the attention op, and
# `attention_out`, the roles' `context`): docs/plan.md says they take one setting, whether
# or not the plan's program gave the alias.
_MAXTEXT_SAME = (("context", "attention_out"),)


def maxtext(plan) -> str:
    """MaxText's overrides for `plan`: "remat_policy=custom decoder_layer_input=device
    ... engram=remat", one setting per `MAXTEXT_TENSORS` name.

    Raises:
      EmitError: a per-layer plan, no remat, a base rule other than nothing, or a
        kept tag none of whose names MaxText knows.
    """
    policy = _uniform(plan, "maxtext", "MaxText's remat_policy=custom")
    if not policy.remat:
        raise EmitError("--emit maxtext: the plan is no remat; every MaxText remat_policy "
                        "rematerializes what it does not name: run MaxText with the "
                        "tensors it names on 'device', or plan a smaller budget")
    if policy.base != "nothing":
        raise EmitError(f"--emit maxtext: the plan's base rule {policy.base} saves every "
                        f"matmul output, which MaxText's custom policy cannot say (one "
                        f"setting per named tensor): plan with --emit maxtext, which keeps "
                        f"to its tensors")
    names = _names(plan, policy)
    for tag in kept_tags(plan, policy):
        if not {tag, *plan.aliases.get(tag, ())} & set(MAXTEXT_TENSORS):
            raise EmitError(f"--emit maxtext: the plan keeps {tag}, which MaxText's custom "
                            f"policy has no tensor name for (it names "
                            f"{', '.join(MAXTEXT_TENSORS)}): plan with --emit maxtext, which "
                            f"keeps to them")
    for one, other in _MAXTEXT_SAME:  # one tensor under two names: one setting for both
        kept = [names[n] for n in (one, other) if names.get(n, "recompute") != "recompute"]
        if kept:
            names[one] = names[other] = kept[0]
    settings = []
    for tensor in MAXTEXT_TENSORS:
        word = _MAXTEXT_WORDS[names.get(tensor, "recompute")]
        settings.append(f"{tensor}={'device' if tensor == _NEVER_REMAT and word == 'remat' else word}")
    return " ".join(["remat_policy=custom", *settings])


def maxtext_taggable(planned_names: dict[str, str]) -> frozenset[str]:
    """The tags a plan may keep for MaxText to run it: those of `planned_names` (a
    program's name -> the tag it is planned as, `Program.planned_names`) that MaxText
    names, under the tag itself or a name on the same values."""
    return frozenset(tag for name, tag in planned_names.items() if name in MAXTEXT_TENSORS)


def _quoted(names: Iterable[str]) -> str:
    return "[" + ", ".join(f'"{n}"' for n in names) + "]"


def jax_policy(plan, own: frozenset | None = None) -> str:
    """The `jax.checkpoint_policies` expression of `plan`, for a model that tags its
    values with these names itself, e.g. `jax.checkpoint_policies.save_and_offload_
    only_these_names(names_which_can_be_saved=["mlpwi"], names_which_can_be_offloaded=[],
    offload_src="device", offload_dst="pinned_host")`.

    Args:
      own: the names the model emits itself (`user_model.own_tags`); None where not
        known, then every name of a kept tag but a module path is taken for one.
    Raises:
      EmitError: a per-layer plan, a base rule with offload, or a kept tag the
        model does not name itself (a module path, or a role remat_kit infers and
        tags only under `rk.remat_model`): under `jax.checkpoint` the policy would
        save nothing of it. The line gives the `--emit remat_kit` form.
    """
    policy = _uniform(plan, "jax", "a jax.checkpoint policy")
    cp = "jax.checkpoint_policies"
    if not policy.remat:
        return f"{cp}.everything_saveable"
    lists = {"save": [], "offload": []}
    for tag, decision in kept_tags(plan, policy).items():
        names = [n for n in (tag, *plan.aliases.get(tag, ()))
                 if not is_path(n) and (own is None or n in own)]
        if not names:
            what = ("a module path remat_kit tags" if is_path(tag) else
                    "a name remat_kit infers and tags only under rk.remat_model")
            raise EmitError(f"--emit jax: the plan keeps {tag}, {what}, not a name the model "
                            "gives its values (as a jax.checkpoint policy it would save "
                            f"nothing): --emit remat_kit runs it, {remat_kit_call(plan)}")
        lists[decision] += names
    names = (f"{cp}.save_and_offload_only_these_names(names_which_can_be_saved="
             f"{_quoted(lists['save'])}, names_which_can_be_offloaded="
             f"{_quoted(lists['offload'])}, offload_src=\"{policy.offload_src}\", "
             f"offload_dst=\"{policy.offload_dst}\")")
    if policy.base == "nothing":
        return names
    base = {"dots": "dots_saveable", "dots_no_batch": "dots_with_no_batch_dims_saveable"}
    if not lists["save"] and not lists["offload"]:
        return f"{cp}.{base[policy.base]}"
    if lists["offload"]:
        raise EmitError(f"--emit jax: the plan offloads above base rule {policy.base}, which "
                        "no jax.checkpoint_policies built-in combines: --emit remat_kit runs it")
    return f"{cp}.save_from_both_policies({cp}.{base[policy.base]}, {names})"


def remat_kit_call(plan) -> str:
    """The `rk.remat_model` call that runs `plan` on a Flax model (per layer or not)."""
    if plan.layer_specs:
        return f"rk.remat_model(model, ({', '.join(repr(s) for s in plan.layer_specs)},))"
    return f"rk.remat_model(model, {plan.spec!r})"


def emit(plan, framework: str, own: frozenset | None = None) -> str:
    """`plan` written for `framework` ("maxtext", "jax" or "remat_kit"); `own`: the
    names the model emits itself, for "jax" (`jax_policy`).

    Raises:
      EmitError: the framework cannot run the plan (the message says why).
      ValueError: an unknown framework (the message lists `FRAMEWORKS`).
    """
    makers = {"maxtext": maxtext, "jax": lambda p: jax_policy(p, own),
              "remat_kit": remat_kit_call}
    if framework not in makers:
        raise ValueError(f"--emit {framework!r}: give one of {', '.join(FRAMEWORKS)}")
    return makers[framework](plan)


def emit_entry(plan, framework: str, own: frozenset | None = None) -> dict:
    """What `--json` writes under "emit": {"framework", "text" (None where refused),
    "refused" (the one line, or None)}; `own` as `emit`'s."""
    try:
        return {"framework": framework, "text": emit(plan, framework, own), "refused": None}
    except EmitError as e:
        return {"framework": framework, "text": None, "refused": str(e)}


__all__ = ["EmitError", "FRAMEWORKS", "MAXTEXT_TENSORS", "emit", "emit_entry", "jax_policy",
           "kept_tags", "maxtext", "maxtext_taggable", "remat_kit_call"]
