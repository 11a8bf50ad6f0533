"""Spec strings (for flags and configs) <-> `Policy`, and the named presets.

`parse("minimal;save:context@every:2")` gives a `Policy` (its schedule: `remat_kit.policy.schedule`;
its presets: `remat_kit.policy.presets`); `auto:budget=...` gives an `AutoSpec`
(`remat_kit.policy.auto_spec`), which only a model turns into a Policy. Main names: `parse`,
`from_custom`, `reference_table`, `layer_policies`. The grammar and the presets: docs/policies.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from remat_kit.policy import names
from remat_kit.policy.auto_spec import AUTO_ALONE, AutoSpec, parse_auto
from remat_kit.errors import RematSpecError, UnknownTagError
from remat_kit.policy.policy import BASES, DECISIONS, MEMORY_KINDS, Policy
from remat_kit.policy.presets import (BARE_NAMES, CODEBASES, JAX_NAME_FUNCTIONS, PRESET_TABLE,
                                      PRESETS)
from remat_kit.policy.schedule import Schedule, parse_schedule


_CLAUSE = re.compile(r"^(?P<head>[A-Za-z_][\w]*)(?:\[(?P<kinds>[^\]]*)\])?:(?P<body>.*)$")


def valid_words() -> tuple[str, ...]:
    """Every word a clause may start with, for error messages."""
    return (tuple(BARE_NAMES) + tuple(f"{cb}:{n}" for cb, n in PRESETS) + DECISIONS
            + tuple(JAX_NAME_FUNCTIONS) + ("auto:budget=",))


def parse(spec: "str | Policy | AutoSpec") -> "Policy | AutoSpec":
    """Parses a policy spec string into a `Policy` (a `Policy` passes through).

    "auto:budget=..." gives an `AutoSpec` instead (it passes through too).

    Examples: "none", "full", "selective", "minimal", "maxtext:minimal",
    "save:query_proj,key_proj,value_proj", "save:mlp*",
    "save:query_proj;offload:mlpwo", "recompute:core_attn,mlp", "dots|save:context",
    "full@every:2", "selective@first:4", "nested", "nested:4", "minimal@nested:4".

    >>> import remat_kit as rk
    >>> str(rk.parse("save:query_proj;offload:mlpwo"))
    'save:query_proj;offload:mlpwo'
    >>> "query_proj" in rk.parse("minimal").save  # MaxText's minimal saves the projections
    True

    Raises:
      RematSpecError: malformed spec; the message names the bad token, its
        character position, the valid choices and the closest match.
      UnknownTagError: a pattern that names no known tag (a subclass of
        RematSpecError).
    """
    if isinstance(spec, (Policy, AutoSpec)):
        return spec
    if isinstance(spec, str) and re.match(r"\s*auto\b", spec):
        return parse_auto(spec)
    if not isinstance(spec, str):
        raise RematSpecError("a policy spec must be a string or a Policy",
                             token=repr(spec), choices=valid_words())
    if not spec.strip():
        raise RematSpecError("empty policy spec", spec=spec, token=spec, position=0,
                             choices=valid_words())
    body, at_sign, sched_text = spec.partition("@")
    sched_at = len(body) + 1
    if at_sign and not body.strip():
        example = sched_text.partition("@")[0].strip() or "every:2"
        raise RematSpecError("no policy before '@': a layer schedule follows a policy, e.g. "
                             f"full@{example}", spec=spec, token=body, position=0,
                             choices=valid_words())
    if "@" in sched_text or (at_sign and re.fullmatch(r"\s*nested\s*:.*", body)):
        first, _, second = sched_text.partition("@") if "@" in sched_text else (
            "", "", sched_text)
        given = [re.split(r"[|;]", s)[0].strip() for s in (first or body, second)]
        raise RematSpecError(f"a spec takes one layer schedule, at its end: got {given[0]!r} "
                             f"and {given[1]!r}; for other layer patterns give one policy per "
                             "layer (TransformerConfig.layer_remat)", spec=spec,
                             token="@" + second, position=len(spec) - len(second) - 1)
    if not at_sign and re.fullmatch(r"\s*nested\s*:.*", spec):  # nested:g = full@nested:g
        body, sched_text, sched_at = "full", spec, 0
    _check_nothing_follows(spec, body, sched_text, sched_at)
    result, offset = None, 0
    for term in body.split("|"):
        policy = _parse_term(term, spec, offset)
        result = policy if result is None else result.union(policy)
        offset += len(term) + 1
    if not (at_sign or sched_text):
        return result
    schedule = parse_schedule(sched_text, spec, sched_at)
    if not result.remat and schedule != Schedule():
        raise RematSpecError("'none' runs no layer under remat; it takes no layer schedule",
                             spec=spec, token=sched_text, position=sched_at)
    if result.schedule not in (Schedule(), schedule):
        raise RematSpecError(f"two layer schedules: {result.schedule} (from the preset) and "
                             f"{schedule}", spec=spec, token=sched_text, position=sched_at)
    return dataclasses.replace(result, schedule=schedule)


def _check_nothing_follows(spec: str, body: str, sched_text: str, sched_at: int) -> None:
    """Raises RematSpecError for clauses or terms after the layer schedule
    (`full@first:2|dots`, or tags: `save:a@every:2,b`): the schedule ends the
    spec and applies to all of it."""
    m = re.search(r"[|;,]", sched_text)
    if m is None:
        return
    sched, rest = sched_text[:m.start()].strip(), sched_text[m.start():]
    if sched_at == 0:  # nested:g alone is shorthand for full@nested:g
        body, what = "full", f"{sched!r} is the whole spec 'full@{sched}', so"
    else:
        what = f"the layer schedule '@{sched}' applies to the whole spec, so"
    raise RematSpecError(f"{what} nothing may follow it; write the schedule once, at the end"
                         + _fix(f"{body.strip() + rest.rstrip()}@{sched}"), spec=spec,
                         token=rest, position=sched_at + m.start())


def _fix(spec: str) -> str:
    """': SPEC' to end an error message with, if `spec` parses; else ''."""
    try:
        parse(spec)
    except RematSpecError:
        return ""
    return f": {spec}"


def _parse_term(term: str, spec: str, offset: int) -> Policy:
    fields = {d: set() for d in DECISIONS}
    base, kinds, remat, explicit_base = "nothing", None, True, False
    schedule = Schedule()
    pos = offset
    for raw in term.split(";"):
        clause, at = raw.strip(), pos + len(raw) - len(raw.lstrip())
        pos += len(raw) + 1
        if not clause:
            raise RematSpecError("empty clause", spec=spec, token=raw, position=at,
                                 choices=valid_words())
        sub = _preset_policy(clause, spec, at)
        if sub is None:
            sub_fields, sub_kinds = _parse_decision_clause(clause, spec, at)
            for d, pats in sub_fields.items():
                fields[d] |= pats
            if sub_kinds is not None:
                if kinds is not None and kinds != sub_kinds:
                    raise RematSpecError("two offload clauses with different memory kinds",
                                         spec=spec, token=clause, position=at)
                kinds = sub_kinds
            continue
        if not sub.remat:
            if term.strip() != clause:
                raise RematSpecError("'none' (no remat wrapper) cannot be combined with "
                                     "other clauses; use it alone", spec=spec, token=clause,
                                     position=at)
            remat = False
            continue
        explicit_base = True
        if sub.schedule != Schedule():
            if "|" in spec:  # a union's terms share one schedule, written once at the end
                plain = str(dataclasses.replace(sub, schedule=Schedule()))
                raise RematSpecError(
                    f"preset {clause!r} is shorthand for the whole spec {str(sub)!r}; in a "
                    "union write the layer schedule once, at the end"
                    + ("" if "@" in spec else _fix(f"{spec[:at]}{plain}"
                                                   f"{spec[at + len(clause):]}@{sub.schedule}")),
                    spec=spec, token=clause, position=at)
            if schedule not in (Schedule(), sub.schedule):
                raise RematSpecError("two layer schedules in one term", spec=spec, token=clause,
                                     position=at)
            schedule = sub.schedule
        base = max(base, sub.base, key=BASES.index)
        for d in DECISIONS:
            fields[d] |= getattr(sub, d)
        if sub.offload:
            kinds = (sub.offload_src, sub.offload_dst)
    if not remat:
        return Policy(remat=False)
    if fields["recompute"] and not fields["save"] and not explicit_base and (
            "*" not in fields["recompute"]):
        fields["save"].add("*")  # Megatron --recompute-modules: keep every other tag
    src, dst = kinds or ("device", "pinned_host")
    try:
        return Policy(save=fields["save"], offload=fields["offload"],
                      recompute=fields["recompute"], base=base, offload_src=src,
                      offload_dst=dst, schedule=schedule)
    except RematSpecError as e:
        raise RematSpecError(e.message, spec=spec, token=term.strip(), position=offset,
                             choices=e.choices) from None


def _preset_policy(clause: str, spec: str, at: int) -> Policy | None:
    """The Policy of a preset clause, or None if the clause is not a preset."""
    key = None
    if clause in BARE_NAMES:
        key = BARE_NAMES[clause]
    elif ":" in clause:
        cb, _, name = clause.partition(":")
        if cb in CODEBASES:
            key = (cb, name)
            if key not in PRESETS:
                choices = tuple(n for c, n in PRESETS if c == cb)
                raise RematSpecError(f"unknown {cb} preset", spec=spec, token=name,
                                     position=at + len(cb) + 1, choices=choices)
    if key is None:
        return _jax_name_function(clause, spec, at)
    body = PRESETS[key][0]
    if body == "none":
        return Policy(remat=False)
    if body in BASES[1:]:
        return Policy(base=body)
    if body == "full":
        return Policy()
    return parse(body)


def _jax_name_function(clause: str, spec: str, at: int) -> Policy | None:
    """`save_only_these_names:a,b` and its kin, or None if the clause is not one."""
    head, sep, body = clause.partition(":")
    if not sep or head.strip() not in JAX_NAME_FUNCTIONS:
        return None
    pats = _parse_patterns(body, spec, at + len(head) + 1)
    return parse(JAX_NAME_FUNCTIONS[head.strip()].format(",".join(sorted(pats))))


def _parse_decision_clause(clause: str, spec: str, at: int):
    m = _CLAUSE.match(clause)
    head = m.group("head") if m else clause.split(":")[0].split("[")[0]
    if head in DECISIONS and not m:
        raise RematSpecError(f"{head!r} needs a tag list, e.g. {head}:query_proj,key_proj",
                             spec=spec, token=clause, position=at)
    if head == "auto":  # a spec that starts with auto went to parse_auto
        raise RematSpecError(AUTO_ALONE, spec=spec, token=clause, position=at)
    if m and head == "nested":  # nested:g is a whole spec, full@nested:g
        whole = f"full@nested:{m.group('body').strip()}"
        fix = (spec[:at] + "full" + spec[at + len(clause):]).strip() + whole[4:]
        raise RematSpecError(f"{clause!r} is shorthand for the whole spec {whole!r}; in a union "
                             "or with other clauses write the layer schedule once, at the end"
                             + ("" if "@" in spec else _fix(fix)), spec=spec, token=clause,
                             position=at)
    if m and head not in DECISIONS and (head in BARE_NAMES or head in BASES):
        raise RematSpecError(f"preset {head!r} takes no ':' arguments; write {head!r} alone",
                             spec=spec, token=clause, position=at)
    if not m and clause.strip().endswith(".json"):  # a plan file is a model's, not a spec
        raise RematSpecError(f"{clause.strip()!r} is a plan file, not a policy spec: apply it "
                             "with rk.remat_model(model, PATH.json) or train with "
                             "--config.remat=PATH.json (docs/models.md)", spec=spec,
                             token=clause, position=at)
    if not m or head not in DECISIONS:
        raise RematSpecError("unknown policy name or clause", spec=spec, token=head or clause,
                             position=at, choices=valid_words())
    pats = _parse_patterns(m.group("body"), spec, at + m.start("body"))
    kinds = None
    if m.group("kinds") is not None:
        if head != "offload":
            raise RematSpecError("memory kinds are only valid on offload clauses", spec=spec,
                                 token=f"[{m.group('kinds')}]", position=at + len(head))
        kinds = _parse_kinds(m.group("kinds"), spec, at + len(head) + 1)
    elif head == "offload":
        kinds = ("device", "pinned_host")
    return {head: pats}, kinds


def _parse_kinds(text: str, spec: str, at: int) -> tuple[str, str]:
    parts = text.split("->")
    if len(parts) != 2:
        raise RematSpecError("offload memory kinds must read [src->dst]", spec=spec,
                             token=text, position=at, choices=MEMORY_KINDS)
    for i, kind in enumerate(parts):
        if kind.strip() not in MEMORY_KINDS:
            raise RematSpecError("unknown memory kind", spec=spec, token=kind,
                                 position=at + (0 if i == 0 else len(parts[0]) + 2),
                                 choices=MEMORY_KINDS)
    src, dst = (p.strip() for p in parts)
    if src == dst:
        raise RematSpecError(f"offload from {src!r} to itself", spec=spec, token=text,
                             position=at, choices=MEMORY_KINDS)
    return src, dst


def _parse_patterns(body: str, spec: str, at: int) -> set[str]:
    if not body.strip():
        raise RematSpecError("empty tag list", spec=spec, token=body, position=at,
                             choices=names.known_tags())
    out, seen, pos = set(), set(), at
    for raw in body.split(","):
        pat, p_at = raw.strip(), pos + len(raw) - len(raw.lstrip())
        pos += len(raw) + 1
        if not pat:
            raise RematSpecError("empty tag in list", spec=spec, token=raw, position=p_at,
                                 choices=names.known_tags())
        if pat in seen:
            raise RematSpecError("duplicate tag in list", spec=spec, token=pat, position=p_at)
        seen.add(pat)
        try:
            out.update(names.expand(pat))
        except UnknownTagError as e:
            raise UnknownTagError(pat, e.choices, spec=spec, position=p_at) from None
    return out


def from_custom(mapping: Mapping[str, str]) -> Policy:
    """MaxText's `remat_policy: custom`: a {tag: "remat" | "device" | "offload"} mapping.

    "device" saves the tag, "offload" moves it to pinned host memory, "remat"
    recomputes it. Tags left out are recomputed.

    >>> import remat_kit as rk
    >>> str(rk.from_custom({"query_proj": "device", "mlpwo": "offload", "mlpwi": "remat"}))
    'save:query_proj;offload:mlpwo'

    Raises:
      RematSpecError: an unknown tag or decision.
    """
    if not isinstance(mapping, Mapping):
        raise RematSpecError("a custom policy is a mapping {tag: 'remat' | 'device' | "
                             "'offload'}", token=repr(mapping))
    meaning = {"remat": "recompute", "device": "save", "offload": "offload"}
    fields = {d: set() for d in DECISIONS}
    for tag_name, choice in mapping.items():
        if not isinstance(tag_name, str):
            raise RematSpecError("a custom policy's keys are tag names (strings)",
                                 token=repr(tag_name), choices=names.known_tags())
        if not isinstance(choice, str) or choice not in meaning:
            raise RematSpecError(f"unknown decision for tag {tag_name!r} in custom policy",
                                 token=str(choice), choices=tuple(meaning))
        fields[meaning[choice]].update(names.expand(tag_name))
    fields["recompute"] = set()  # base "nothing" already recomputes them
    return Policy(**fields)


def reference_table() -> str:
    """The README's policy reference, as Markdown: every preset name, then every tag and alias.

    Preset columns: the name as typed (the bare word, where it resolves to
    this row, and the prefixed form), its canonical spec (what it saves,
    offloads and recomputes) and its source.
    """
    rows = ["| name | canonical spec | source and meaning |", "| --- | --- | --- |"]
    for cb, name, _, doc in PRESET_TABLE:
        typed = f"`{cb}:{name}`"
        if BARE_NAMES.get(name) == (cb, name):
            typed = f"`{name}`, " + typed
        rows.append(f"| {typed} | `{parse(f'{cb}:{name}')}` | {doc} |")
    for fn, template in JAX_NAME_FUNCTIONS.items():
        rows.append(f"| `{fn}:TAGS` | `{template.format('TAGS')}` | JAX {fn} |")
    rows += ["", "| tag or alias | value (canonical tags) | source |", "| --- | --- | --- |"]
    rows += [f"| `{t}` | {doc} | vocabulary |" for t, doc in names.TAGS.items()]
    rows += [f"| `{a}` | {', '.join(f'`{t}`' for t in tags)} | {src} |"
             for a, (tags, src) in names.ALIASES.items()]
    return "\n".join(rows)


def parsed_only(policies, where: str) -> list:
    """`policies` as a list of values (`Policy`, `AutoSpec`), for a function below the
    front floor (`remat_kit.api`), which parses what the user typed.

    Raises:
      TypeError: an entry that is not a value (a spec string), naming `where`.
    """
    values = list(policies)
    if any(not isinstance(p, (Policy, AutoSpec)) for p in values):
        raise TypeError(f"{where} takes parsed policies, got {values!r:.80}: parse them "
                        "first (rk.parse), or call rk.measure, which takes specs")
    return values


_LAYER_RUN = re.compile(r"^(?P<first>\d+)(?:-(?P<last>\d+))?\s+(?P<spec>\S.*)$", re.ASCII)


def per_layer(text: str) -> tuple[str, ...] | None:
    """'0-1 save:mlpwi / 2 full' (a per-layer plan as `plan` prints it: runs of
    consecutive layers from 0, each with its spec, joined by " / ") -> one spec per
    layer, ('save:mlpwi', 'save:mlpwi', 'full'); None for text of another form (a spec).

    Raises:
      RematSpecError: runs that do not follow on from layer 0 (a gap, an overlap).
    """
    runs = [_LAYER_RUN.match(part.strip()) for part in re.split(r"\s+/\s+", text.strip())]
    if not runs or not all(runs):
        return None
    specs: list[str] = []
    for m in runs:
        first, last = int(m["first"]), int(m["last"] or m["first"])
        if first != len(specs) or last < first:
            raise RematSpecError(f"per-layer spec: layers {m.group(0).split()[0]} do not follow "
                                 f"on from layer {len(specs)}; give runs of consecutive layers "
                                 "from 0, e.g. '0-1 save:mlpwi / 2 full'", spec=text,
                                 token=m.group(0).split()[0])
        specs += [m["spec"].strip()] * (last - first + 1)
    return tuple(specs)


def layer_policies(policy, num_layers: int) -> tuple:
    """The policy each of `num_layers` layers runs under, without schedules.

    Args:
      policy: a `Policy` or spec (its schedule picks the layers; layers
        outside it get `none`), a per-layer spec ('0 save:mlpwi / 1 full',
        `per_layer`), or a sequence of num_layers specs/Policies without
        schedules, one per layer.
    Returns:
      A tuple of num_layers `Policy`s. For nested, each layer's policy
      inside its group; the groups themselves are the caller's (see
      `Schedule.group_size`).
    Raises:
      RematSpecError: a spec does not parse, or a list entry has a schedule.
      ValueError: the schedule does not fit num_layers, or the list's length
        is not num_layers.
    """
    if isinstance(policy, str) and (layers := per_layer(policy)) is not None:
        policy = layers
    elif isinstance(policy, (str, Policy)):
        policy = parse(policy)
        inner = dataclasses.replace(policy, schedule=Schedule())
        return tuple(inner if on else Policy(remat=False)
                     for on in policy.schedule.remat_mask(num_layers))
    if not isinstance(policy, Sequence):
        raise TypeError(f"layer policies must be a spec, a Policy or a list of them, got "
                        f"{type(policy).__name__} {policy!r}")
    if len(policy) != num_layers:
        raise ValueError(f"a per-layer policy list needs one entry per layer: got "
                         f"{len(policy)} entries for {num_layers} layers")
    out = tuple(parse(p) for p in policy)
    for i, p in enumerate(out):
        if not isinstance(p, Policy):  # an auto:budget= spec plans a whole model
            raise RematSpecError(f"per-layer policy {i} is {p}, which is planned for a whole "
                                 "model; give each layer a policy", token=str(p))
        if p.schedule != Schedule():
            raise RematSpecError(f"per-layer policy {i} has a layer schedule; entries of a "
                                 "per-layer list apply to one layer each", token=str(p))
    return out


