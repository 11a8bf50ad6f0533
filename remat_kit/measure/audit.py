"""What the compiler did to the policy: each tag as asked (the traced program) against the
program as compiled (its optimized HLO, read from the compile already made), in one line
where they differ; `faster_than_none` names the time-model term that makes a remat row
faster than no remat.
Docs: docs/compare.md ("The audit").
"""

from __future__ import annotations

import dataclasses
import math
import re

from remat_kit.measure import boundary, buffers
from remat_kit.measure.peak import SCORES
from remat_kit.measure.residuals import aval_bytes
from remat_kit.policy.names import TAGS
from remat_kit.trace.marked import region, sub_jaxprs
from remat_kit.trace.validate import tag_of
from remat_kit.units import fmt_bytes, fmt_seconds

# A difference counts where it is more than this share of the bytes asked, or more than
# `_ABSOLUTE` bytes, whichever is smaller (a categorical finding moves all of a tag's bytes).
_SHARE, _ABSOLUTE = 0.05, 1 << 20
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ROLE = re.compile(r"rk_role:(\w+)")
# XLA's own rematerialization (memory pressure) names each clone it adds `<name>.remat<n>`.
_XLA_REMAT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+\.remat\d*(?:\.\d+)? = ", re.M)
_HOST_SPACE = "S(5)"
_ENTRY = re.compile(r"^ENTRY %([\w.\-]+) ", re.M)
# A term accounts for a faster step where it gives at least this share of the time saved.
_ACCOUNTED = 0.9
# Primitives that compute a value (XLA emits an op for each, which keeps their metadata): a
# tag whose producer is one of these is checked in the compiled backward. Any other producer
# (a view, a cast, another name, a sharding constraint, a call) may compile to no op of its own.
_COMPUTES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general",
                       "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs",
                       "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt",
                       "rsqrt", "integer_pow", "pow", "square", "erf", "sin", "cos",
                       "select_n", "reduce_sum", "reduce_max"})


def differs(asked: int, compiled: int) -> bool:
    """Whether `compiled` bytes differ from `asked` by more than 5% of asked or 1 MiB,
    whichever is smaller (`_SHARE`, `_ABSOLUTE`)."""
    return abs(asked - compiled) > min(_SHARE * max(asked, compiled), _ABSOLUTE)


def recomputed(jaxpr) -> dict[str, dict]:
    """The tags a traced value-and-grad program recomputes in its backward: {tag: {"bytes":
    the bytes of its values recomputed, a scan's body once per trip, "elements": their
    elements, "checkable": whether an
    op computes it (`_COMPUTES`: not a view, cast, name or constraint of another value)
    and it is a vocabulary tag, which
    `peak.marked` names in the compiled ops' metadata (a module path is not), "prevent_cse": False
    where a region recomputing it outside every loop lets XLA merge it (`prevent_cse=False`)}}.

    A remat region in the staged program is the backward's recomputation: the forward's is
    inlined by JAX's partial evaluation. A tag on a region's input (`decoder_layer_input`)
    is saved, not recomputed."""
    found: dict[str, dict] = {}

    def walk(jaxpr, trips: int, in_region: bool, in_loop: bool, cse_free: bool) -> None:
        producers = {v: e for e in jaxpr.eqns for v in e.outvars}
        for eqn in jaxpr.eqns:
            tag = tag_of(eqn) if in_region else None
            src = producers.get(eqn.invars[0]) if tag is not None else None
            if src is not None:  # a region's input (decoder_layer_input) is not recomputed
                entry = found.setdefault(tag, {"bytes": 0, "elements": 0, "checkable": False,
                                               "prevent_cse": True})
                entry["bytes"] += trips * aval_bytes(eqn.outvars[0].aval)
                entry["elements"] += trips * math.prod(eqn.outvars[0].aval.shape)
                entry["checkable"] |= tag in TAGS and src.primitive.name in _COMPUTES
                entry["prevent_cse"] &= not (cse_free and not in_loop)
            r = region(eqn)
            k = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            loop = in_loop or eqn.primitive.name in ("scan", "while")
            for sub in sub_jaxprs(eqn):
                walk(sub, trips * k, in_region or r is not None, loop,
                     cse_free or (r is not None and not r[3]))

    walk(jaxpr, 1, False, False, False)
    return found


def compiled_facts(compiled, memory: dict, platform: str) -> dict:
    """What the audit reads of a compile, JSON-ready: {"text": whether the backend gave
    its optimized HLO text, "marked": whether its ops carry the tags' names (not where the
    executable was read back from JAX's compilation cache, compiled there from the same
    program unnamed: JAX leaves op metadata out of its cache key), "recomputed_roles": the tags (`peak.marked` roles) some op
    of the backward's recomputation (`rematted_computation` in its op metadata)
    computes, sorted, "host_bytes": host memory the program holds (its host temp,
    arguments and outputs) or None where not reported, "host_ops": ops placed in
    host memory (S(5)), "xla_remat": ops XLA's own rematerialization added,
    "platform"}."""
    try:
        text = compiled.as_text() or ""
    except Exception:  # noqa: BLE001 - a backend without HLO text: the audit says so
        text = ""
    roles: set[str] = set()
    for name in _OP_NAME.findall(text):
        if "rematted_computation" in name:
            roles.update(_ROLE.findall(name))
    host = [memory.get(k) for k in ("host_temp_size_in_bytes", "host_argument_size_in_bytes",
                                    "host_output_size_in_bytes")]
    try:
        serialized = compiled.memory_analysis().serialized_buffer_assignment_proto
    except Exception:  # noqa: BLE001 - a backend that serializes no buffer assignment
        serialized = None
    entry = _ENTRY.search(text) if serialized else None  # the boundary's values are its
    kept = boundary.kept(text, serialized, buffers.instruction_ids(compiled, entry.group(1))
                         if entry else None) if text else None
    return {"text": bool(text), "marked": _ROLE.search(text) is not None, "boundary": kept,
            "recomputed_roles": sorted(roles),
            "host_bytes": None if all(h is None for h in host) else sum(h or 0 for h in host),
            "host_ops": text.count(_HOST_SPACE), "xla_remat": len(_XLA_REMAT.findall(text)),
            "platform": platform}


def _row(tag, asked, asked_bytes, compiled, compiled_bytes, line=None) -> dict:
    return {"tag": tag, "asked": asked, "asked_bytes": asked_bytes, "compiled": compiled,
            "compiled_bytes": compiled_bytes, "line": line}


def audit(policy, residuals, recompute: dict, facts: dict,
          outside: set[str] = frozenset(), arguments: dict | None = None) -> dict:
    """One compiled row's audit: per tag, as asked against as compiled.

    Args:
      policy: the row's `Policy`.
      residuals: its traced `residuals.Residual`s (per device).
      recompute: `recomputed` of its traced program.
      facts: `compiled_facts` of its compile, with the time model's "step_terms" (kept
        with the figures: a figure-cache entry without them is a miss).
      outside: the tags the model emits only outside every remat region.
      arguments: {"args[i]": the path of the program's i-th argument leaf}, to name an
        all-gather the backward runs again.
    Returns:
      {"tags": [{"tag", "asked": "save" | "offload" | "recompute", "asked_bytes",
      "compiled": "kept" | "host" | "recomputed" | "merged" | "kept in HBM" | "outside the
      remat" | "unchecked", "compiled_bytes", "line": the difference in one line or None}],
      "findings": [one line per difference], "unchecked": [what could not be checked,
      and why], "as_asked": True where no difference was found, "step_terms": the time
      model's terms of its predicted step (`time_model.step_terms`) or None, "step": what
      makes it predicted faster than no remat (`faster_than_none`) or None} (JSON-ready).
    """
    saved: dict[str, int] = {}
    host: dict[str, int] = {}
    for r in residuals:
        if r.kind == "tag":
            into = host if r.memory == "host" else saved
            into[r.name] = into.get(r.name, 0) + r.nbytes
    kept, rows, unchecked = _kept(facts), [], []
    named = {*policy.save, *policy.offload} if policy.remat else set()
    for tag in sorted(outside):
        if tag in named:  # named as such, not by a glob that also covers every other tag
            nbytes = saved.get(tag, 0) + host.get(tag, 0)
            rows.append(_row(tag, "save", nbytes, "outside the remat", nbytes,
                             f"`{tag}` is never emitted inside the remat: saving it saves "
                             "nothing (it is kept as with no remat)"))
    rows += [_saved(tag, nbytes, kept) for tag, nbytes in saved.items() if tag not in outside]
    rows += _offloads(host, facts, unchecked, kept)
    rows += _recomputes(recompute, facts, unchecked, kept)
    rows += _gathers(facts, arguments or {})
    if not facts["text"]:
        unchecked.append("recompute, host placement and the bytes kept across the "
                         "forward/backward boundary: the backend gives no optimized HLO text")
    elif facts["xla_remat"]:
        rows.append(_row("*", "save", sum(saved.values()), "recomputed by XLA", None,
                         f"XLA's own rematerialization (memory pressure) recomputes "
                         f"{facts['xla_remat']} value(s) in the backward beyond the policy"))
    unnamed = sorted(r["tag"] for r in rows if r["asked"] == "save" and kept is not None
                     and r["compiled"] == "unchecked")
    if unnamed:
        unchecked.append(f"bytes of {', '.join(unnamed)} kept across the forward/backward "
                         "boundary: no compiled value carries the name (a scanned loop's "
                         "carry, a module path, or a value fused into another)")
    if kept is not None and facts["boundary"]["sized"] != "buffer assignment":
        unchecked.append("the allocated size of the bytes kept across the forward/backward "
                         "boundary: the backend serializes no buffer assignment (each is "
                         "sized by its HLO shape: padding and shared buffers not seen)")
    findings = [r["line"] for r in rows if r["line"]]
    return {"tags": rows, "findings": findings, "unchecked": unchecked,
            "as_asked": not findings, "step_terms": facts["step_terms"],
            "step": None}


def _kept(facts: dict) -> dict | None:
    """{tag: [device bytes, host bytes, elements]} the compiled program keeps across its
    forward/backward boundary (`boundary.kept`: residuals and other values of the tag
    alike), or None where that cannot be read (no HLO text, no tag names in it)."""
    found = facts.get("boundary")
    if not facts["text"] or not facts["marked"] or not found:
        return None
    out: dict[str, list[int]] = {}
    for part in (found["tags"], found["roles"]):
        for tag, counts in part.items():
            got = out.setdefault(tag, [0, 0, 0])
            for i, n in enumerate(counts):
                got[i] += n
    return out


def _saved(tag: str, nbytes: int, kept: dict | None) -> dict:
    """A saved tag's row, with the bytes of its values the compiled program keeps across
    the boundary. Fewer is no finding: XLA keeps an equivalent value in a tagged one's
    place where it fuses a cheap op into both passes (a bias add: the matmul's output is
    kept), and may keep it in a narrower type (XLA:TPU keeps a bf16 copy for its matmuls);
    XLA's own rematerialization is found by its clones."""
    if kept is None or tag not in TAGS:  # a module path is not named in the compiled ops
        return _row(tag, "save", nbytes, "unchecked", None)
    if tag not in kept:  # a loop's carry, or fused into another value
        return _row(tag, "save", nbytes, "unchecked", None)
    return _row(tag, "save", nbytes, "kept", kept[tag][0] + kept[tag][1])


def _offloads(host: dict, facts: dict, unchecked: list, kept: dict | None) -> list[dict]:
    """The offloaded tags' rows: per tag, the host memory its kept values are placed in
    (`kept`, where a compiled value carries its name), else the host memory the program
    holds (its padded buffers: more than asked is no finding), against the bytes asked."""
    if not host:
        return []
    if not facts["text"]:
        return [_row(t, "offload", b, "unchecked", None) for t, b in host.items()]
    if facts["platform"] == "cpu":
        unchecked.append("offload: XLA CPU has no host memory space (offloaded values stay "
                         "in device memory, and its temp counts them)")
        return [_row(t, "offload", b, "unchecked", None) for t, b in host.items()]
    rows = [_offload(t, b, kept[t][1]) for t, b in host.items() if kept and t in kept]
    host = {t: b for t, b in host.items() if not kept or t not in kept}  # not named: totals
    if not host:
        return rows
    asked = sum(host.values())
    placed = facts["host_bytes"]
    if placed is None:
        placed = asked if facts["host_ops"] else 0
    if not differs(asked, placed) or placed > asked:
        return rows + [_row(t, "offload", b, "host", b) for t, b in host.items()]
    return rows + [_offload(",".join(host), asked, placed)]


def _offload(tag: str, asked: int, placed: int) -> dict:
    """An offload's row: `placed` of the `asked` bytes compiled into host memory."""
    if not differs(asked, placed):
        return _row(tag, "offload", asked, "host", placed)
    names = ", ".join(f"`{t}`" for t in tag.split(","))
    if placed == 0:
        return _row(tag, "offload", asked, "kept in HBM", 0,
                    f"offload of {names} not compiled: kept in HBM")
    return _row(tag, "offload", asked, "host", placed,
                f"offload of {names}: {fmt_bytes(placed)} of {fmt_bytes(asked)} compiled "
                "into host memory, the rest kept in HBM")


def _gathers(facts: dict, arguments: dict) -> list[dict]:
    """One row where the backward runs the partitioner's all-gathers of arguments again
    (`boundary.kept`'s "gathers", named by `arguments`: "args[2]" -> a parameter's
    path): communication no policy asked to recompute."""
    found = (facts.get("boundary") or {}).get("gathers") or []
    if not found:
        return []
    named = ", ".join(f"`{arguments.get(a, a)}`" for a in dict.fromkeys(found))
    return [_row("*", "recompute", None, "all-gather recomputed", None,
                 f"the partitioner's all-gather of {named} is recomputed in the backward "
                 f"({len(found)} all-gather(s) the forward ran: what the recompute reads "
                 "is gathered again)")]


def _recomputes(recompute: dict, facts: dict, unchecked: list,
                kept: dict | None) -> list[dict]:
    """The recomputed tags' rows: whether the backward still computes each, and whether
    the compiled program keeps part of it across the boundary all the same (`kept`: XLA
    merged the recompute of some layers with the forward)."""
    rows = []
    found = set(facts["recomputed_roles"]) if facts["text"] and facts["marked"] else None
    if facts["text"] and not facts["marked"] and recompute:
        unchecked.append("recompute: the compiled program carries no tag names (read back "
                         "from JAX's compilation cache, compiled there from the same program "
                         "unnamed: JAX leaves op metadata out of its cache key)")
    views = []
    for tag, entry in recompute.items():
        if found is None:
            rows.append(_row(tag, "recompute", entry["bytes"], "unchecked", None))
        elif not entry["checkable"]:
            views.append(tag)
            rows.append(_row(tag, "recompute", entry["bytes"], "unchecked", None))
        else:
            rows.append(_recompute(tag, entry, tag in found, kept))
    if views:
        unchecked.append(f"recompute of {', '.join(sorted(views))}: a view, cast, name or "
                         "sharding constraint of another value, which XLA may emit no op for, "
                         "or a name outside the tag vocabulary, which the compiled ops do not "
                         "carry")
    return rows


def _recompute(tag: str, entry: dict, present: bool, kept: dict | None) -> dict:
    """A checkable recomputed tag's row: recomputed; merged with the forward (CSE) where
    no op of the backward's recomputation computes it; merged in part where it is
    recomputed but some of its elements are also kept across the boundary."""
    asked = entry["bytes"]
    # A score's role is also on its untagged same-shape inputs (`peak.marked`: a mask,
    # which is kept), so its kept elements say nothing of a merge.
    count = 0 if tag in SCORES else (kept or {}).get(tag, (0, 0, 0))[2]
    merged = asked * min(count, entry["elements"]) // max(entry["elements"], 1)
    why = ("" if entry["prevent_cse"] else " (its jax.checkpoint has prevent_cse=False "
           "outside a loop: set prevent_cse=True, or scan the layers)")
    if not present:
        return _row(tag, "recompute", asked, "merged", 0,
                    f"XLA merged the recompute of `{tag}` with the forward (CSE): saved as "
                    f"if `none`{why}")
    if not differs(asked, asked - merged):
        return _row(tag, "recompute", asked, "recomputed", asked)
    return _row(tag, "recompute", asked, "merged in part", asked - merged,
                f"XLA merged part of the recompute of `{tag}` with the forward (CSE): "
                f"{fmt_bytes(merged)} of its {fmt_bytes(asked)} kept across the "
                f"forward/backward boundary{why}")


def faster_than_none(records: list) -> list:
    """`records` with each remat row predicted faster than the `none` row among them
    told why, in its audit's "step" and its notes: the time-model term that falls (the
    HBM traffic of the residuals it no longer writes and reads, with bytes and seconds);
    where no term does (its bandwidth-bound time does not fall), it says the prediction
    is not accounted for, naming the terms. Records without `none` come back as they are.

    Recompute adds FLOPs: a remat program can be faster only by moving fewer bytes."""
    base = next((r for r in records if r.policy == "none" and r.predicted_seconds
                 and r.audit and r.audit.get("step_terms")), None)
    if base is None:
        return records
    out = []
    for r in records:
        terms = (r.audit or {}).get("step_terms")
        if r is base or not terms or not r.predicted_seconds or \
                r.predicted_seconds >= base.predicted_seconds:
            out.append(r)
            continue
        line = _faster_line(r.predicted_seconds, base.predicted_seconds, terms,
                            base.audit["step_terms"])
        out.append(dataclasses.replace(r, audit={**r.audit, "step": line},
                                       notes=r.notes + (line,)))
    return out


def _faster_line(seconds: float, none_seconds: float, terms: dict, none: dict) -> str:
    """One line: what makes a step of `seconds` faster than none's `none_seconds`."""
    pct = 100 * (1 - seconds / none_seconds)
    traffic = none["hbm_bytes"] - terms["hbm_bytes"]
    by_bytes = none["bytes_bound_seconds"] - terms["bytes_bound_seconds"]
    by_flops = terms["flops_bound_seconds"] - none["flops_bound_seconds"]
    head = f"predicted {pct:.1f}% faster than none"
    change = terms["flops"] / max(none["flops"], 1) - 1
    flops = f"FLOPs {change:+.1%}"
    fewer = -by_flops if change < 0 < -by_flops else 0.0  # fewer FLOPs, less compute time
    if max(by_bytes, 0.0) + fewer >= _ACCOUNTED * (none_seconds - seconds):
        said = []
        if by_bytes > 0:
            vmem = terms.get("vmem_bytes", 0.0) - none.get("vmem_bytes", 0.0)  # TPU on-chip
            on_chip = (f" and {fmt_bytes(abs(vmem))} {'more' if vmem > 0 else 'less'} VMEM "
                       "traffic" if vmem else "")
            said.append(f"its ops move {fmt_bytes(max(traffic, 0))} less HBM traffic (the "
                        f"residuals it no longer writes and reads){on_chip}, "
                        f"{fmt_seconds(by_bytes)} less bandwidth-bound time")
        if fewer:
            said.append(f"XLA compiled it to fewer FLOPs than no remat's ({flops}), "
                        f"{fmt_seconds(fewer)} less compute-bound time")
        else:
            said.append(f"against {flops} ({_signed(by_flops)} compute-bound time)")
        return f"{head}: " + ", ".join(said)
    f32 = terms["f32_flops_bound_seconds"] - none["f32_flops_bound_seconds"]
    return (f"{head}, which no term of the time model accounts for: bandwidth-bound time "
            f"{_signed(-by_bytes)} ({_signed(-traffic, fmt_bytes)} HBM traffic), compute-bound "
            f"{_signed(by_flops)} ({flops}; at the f32 peak {_signed(f32)}): the prediction "
            "is suspect here")


def _signed(x: float, fmt=fmt_seconds) -> str:
    return ("-" if x < 0 else "+") + fmt(abs(x))


def column(found: dict | None) -> str:
    """The "as asked" cell of a row: ✓, or the first difference; "?" where not audited."""
    if not found:
        return "?"
    return "✓" if found["as_asked"] else found["findings"][0]


__all__ = ["audit", "column", "compiled_facts", "differs", "faster_than_none", "recomputed"]
