"""What holds a compiled program's peak: the buffers live at its peak, grouped by what they are.

XLA dumps its buffer assignment (`dump_options`: `xla_dump_to`); `breakdown` reads it back and
groups the values live at the peak (parameters, inputs, outputs, `residual <tag>`, logits and
their gradient, recomputed values, temporaries, program code, compiler's own), naming values by
the tags `marked` writes into the op metadata. Also `summary`, `scores_note`, `held_line`.
The groups and how they are found: docs/compare.md (`--peak`, in "Flags").
"""

from __future__ import annotations

import glob
import math
import os
import re

from jax.extend.core import ClosedJaxpr, Literal

from remat_kit.measure.residuals import call_body
from remat_kit.policy.names import TAGS
from remat_kit.trace.validate import tag_of
from remat_kit.units import fmt_bytes

LOGITS = "logits and their gradient"
# A vocabulary chunk narrower than this makes the chunked loss's scan long for little
# memory: `vocab_chunks_for` suggests no count above vocab / MIN_CHUNK_WIDTH.
MIN_CHUNK_WIDTH = 128
# A chunk count is named only where it lowers the figure by at least this fraction.
CHUNKS_WORTH = 0.05
_MARK = "rk_res:"  # name-stack entry of a residual's producer: rk_res:<kind>:<name>
_ROLE = "rk_role:"  # name-stack entry of a tagged value's producer: rk_role:<tag>
# The attention scores, [batch, heads, q_len, kv_len]: quadratic in the sequence.
SCORES = ("attn_logits", "attn_probs")
# Groups whose roles are told: temporaries, which a remat policy does not save.
_TEMPORARIES = ("recomputed values", "backward temporaries", "other temporaries")
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+),(.*)")
_VALUE = re.compile(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_DIMS = re.compile(r"\[([\d,]*)\]")


def dump_options(options: dict | None, folder: str) -> dict:
    """`options` (XLA compile options, or None) with XLA's dump into `folder`: the
    optimized HLO, its buffer assignment and live ranges."""
    return {**(options or {}), "xla_dump_to": folder}


def marked(program: ClosedJaxpr, residual_vars, residuals) -> ClosedJaxpr:
    """`program` (a `residuals.stage` program) with each residual's producing
    equation named ``rk_res:<kind>:<name>`` in its name stack. A residual that a
    call-like equation returns (a scanned layer stack, a jit, a remat region) is
    marked where its body computes it. The producers of tagged values are
    named too (`_mark_roles`), for `breakdown`'s roles. Only metadata changes: the lowered
    program's text (`Lowered.as_text()`, the figure cache's key) and its buffers
    are the same."""
    names = {v: f"{r.kind}:{r.name}" for v, r in zip(residual_vars, residuals)
             if not isinstance(v, Literal)}
    return ClosedJaxpr(_mark_roles(_mark(program.jaxpr, names), {}), program.consts)


def _mark_roles(jaxpr, memo: dict):
    """`jaxpr` and the jaxprs nested in it (a remat region's recomputation too) with
    the producer of each value a vocabulary tag names (`TAGS`, not a module path)
    named ``rk_role:<tag>`` in its name stack, and so the ops of any call it is;
    a score's untagged same-shape inputs (a softmax's exp, a mask) take its tag.
    A sub-jaxpr held twice is rewritten once (`memo`: id -> (old, new))."""
    if id(jaxpr) in memo:
        return memo[id(jaxpr)][1]
    tagged = {e.invars[0]: t for e in jaxpr.eqns
              if (t := tag_of(e)) in TAGS and not isinstance(e.invars[0], Literal)}
    for eqn in reversed(jaxpr.eqns):  # a score's untagged same-shape inputs (a softmax's exp)
        found = {tagged[v] for v in eqn.outvars if tagged.get(v) in SCORES}
        if len(found) == 1 and tag_of(eqn) is None:
            tag = found.pop()
            tagged.update({v: tag for v in eqn.invars if not isinstance(v, Literal)
                           and v not in tagged and v.aval.shape == eqn.outvars[0].aval.shape})
    eqns = []
    for eqn in jaxpr.eqns:
        params = {k: _roles_in(v, memo) for k, v in eqn.params.items()}
        if any(params[k] is not eqn.params[k] for k in params):
            eqn = eqn.replace(params=params)
        tags = {tagged[v] for v in eqn.outvars if v in tagged}
        if len(tags) == 1:
            info = eqn.source_info
            eqn = eqn.replace(source_info=info.replace(
                name_stack=info.name_stack.extend(_ROLE + tags.pop())))
        eqns.append(eqn)
    memo[id(jaxpr)] = (jaxpr, jaxpr.replace(eqns=eqns))  # the old kept alive: ids stay its own
    return memo[id(jaxpr)][1]


def _roles_in(value, memo: dict):
    """An equation's param with the jaxprs it holds (`_mark_roles`) rewritten."""
    if isinstance(value, ClosedJaxpr):
        return ClosedJaxpr(_mark_roles(value.jaxpr, memo), value.consts)
    if hasattr(value, "eqns"):
        return _mark_roles(value, memo)
    if isinstance(value, tuple) and any(isinstance(v, ClosedJaxpr) or hasattr(v, "eqns")
                                        for v in value):
        return tuple(_roles_in(v, memo) for v in value)
    return value


def _mark(jaxpr, names: dict):
    """`jaxpr` with the producers of the values in `names` (var -> mark) marked."""
    eqns = []
    for eqn in jaxpr.eqns:
        found = {i: names[v] for i, v in enumerate(eqn.outvars) if v in names}
        body = call_body(eqn) if found else None
        if body is not None:  # mark inside: the body's outputs are the equation's
            key = "jaxpr" if body is _unwrap(eqn.params.get("jaxpr")) else "call_jaxpr"
            inner = _mark(body, {body.outvars[i]: m for i, m in found.items()
                                 if not isinstance(body.outvars[i], Literal)})
            held = eqn.params[key]
            eqn = eqn.replace(params={**eqn.params, key: ClosedJaxpr(inner, held.consts)
                                      if isinstance(held, ClosedJaxpr) else inner})
        elif len(set(found.values())) == 1:
            info = eqn.source_info
            eqn = eqn.replace(source_info=info.replace(name_stack=info.name_stack.extend(
                _MARK + next(iter(found.values())))))
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns)


def _unwrap(body):
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body


def _read(folder: str, suffix: str) -> str:
    found = sorted(glob.glob(os.path.join(folder, f"*{suffix}")))
    if not found:
        raise FileNotFoundError(f"XLA wrote no *{suffix} in {folder}")
    with open(found[-1]) as f:
        return f.read()


def _values(text: str) -> dict:
    """value name ('fusion.3{}') -> (memory color, allocation kind, parameter number or
    None, bytes, shape text) from XLA's buffer-assignment dump."""
    out, where = {}, None
    for line in text.splitlines():
        if m := _ALLOCATION.match(line):
            rest = m.group(3)
            color = re.search(r"color (\d+)", rest)
            number = re.search(r"parameter (\d+)", rest)
            kind = ("parameter" if number else "output" if "live-out" in rest
                    else "temp" if "temp" in rest else "other")
            where = (int(color.group(1)) if color else 0, kind,
                     int(number.group(1)) if number else None)
        elif where and (m := _VALUE.match(line)):
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            out[name] = (*where, int(m.group(2)), m.group(3))
    return out


def _instructions(hlo: str) -> tuple[dict, dict]:
    """({instruction name: (opcode, op_name, called computations, operand names)},
    {computation name: [its instruction names]}, {computation name: its ROOT}) of
    optimized HLO text."""
    instrs, comps, roots, current, current_name = {}, {}, {}, None, None
    for line in hlo.splitlines():
        if m := re.match(r"^(?:ENTRY )?%(\S+) \(", line):
            current_name = m.group(1)
            current = comps.setdefault(current_name, [])
            continue
        if " = " not in line or current is None:
            continue
        head, _, tail = line.strip().removeprefix("ROOT ").partition(" = ")
        op = re.search(r"\s([a-z][\w-]*)\(([^)]*)\)", " " + tail)
        if op is None:
            continue
        name = head.lstrip("%")
        op_name = re.search(r'op_name="([^"]*)"', tail)
        called = re.findall(r"(?:calls|body)=%([\w.-]+)", tail)
        operands = re.findall(r"%([\w.-]+)", op.group(2))
        instrs[name] = (op.group(1), op_name.group(1) if op_name else "", called, operands)
        current.append(name)
        if line.strip().startswith("ROOT "):
            roots[current_name] = name
    return instrs, comps, roots


def _marks(name: str, index: int, instrs: dict, comps: dict, roots: dict, depth: int = 0) -> list[str]:
    """The residual marks (`marked`) of the value `name`{index}: in its own op
    metadata, else in the computation it fuses, else (a while loop) in the loop
    body's output `index`."""
    if name not in instrs or depth > 3:
        return []
    opcode, op_name, called, _ = instrs[name]
    own = re.findall(re.escape(_MARK) + r"([^/]+)", op_name)
    if own:
        return own
    if opcode == "fusion" and called:
        inner = {m for n in comps.get(called[0], ()) for m in
                 re.findall(re.escape(_MARK) + r"([^/]+)", instrs.get(n, ("", ""))[1])}
        return sorted(inner) if len(inner) == 1 else []
    if opcode == "while" and called and called[-1] in roots:
        operands = instrs.get(roots[called[-1]], ("", "", [], []))[3]
        if index < len(operands):
            return _marks(operands[index], 0, instrs, comps, roots, depth + 1)
    return []


class _Program:
    """What grouping reads of one dump: its HLO, arguments, logits and residuals."""

    def __init__(self, hlo: str, arg_groups, logits_shape, residuals):
        self.instrs, self.comps, self.roots = _instructions(hlo)
        self.arg_groups = arg_groups
        # (rows of the loss's logits, the most rows a value holding them has, vocab): a
        # model's own logits [batch, seq, vocab] have a row per sequence more than the
        # next-token loss's slice [batch, seq - 1, vocab] (`from_model.next_token_loss`).
        self.logits = None if logits_shape is None else (
            math.prod(logits_shape[:-1]),
            math.prod(logits_shape[:-1]) + (logits_shape[0] if len(logits_shape) > 2 else 0),
            logits_shape[-1])
        self.tagged = [r for r in residuals if r.kind == "tag"]

    def marks(self, instr: str, index: int) -> list[str]:
        return _marks(instr, index, self.instrs, self.comps, self.roots)

    def role(self, instr: str) -> str | None:
        """The tag whose value `instr` computes (`_mark_roles`): its own op's
        innermost, else the one tag its fused computation computes, else (several)
        its root's; None where none is marked."""
        def tags(name):
            return re.findall(re.escape(_ROLE) + r"(\w+)", self.instrs.get(name, ("", ""))[1])
        if own := tags(instr):
            return own[-1]
        opcode, _, called, _ = self.instrs.get(instr, ("", "", [], []))
        if opcode != "fusion" or not called:
            return None
        inner = {t for n in self.comps.get(called[0], ()) for t in tags(n)}
        if len(inner) == 1:
            return inner.pop()
        root = tags(self.roots.get(called[0], ""))
        return root[-1] if root else None

    def loop_tag(self, instr: str, index: int, size: int, dims: tuple) -> str | None:
        """The tag of a scanned stack's loop state `instr`{index} that no op
        computes (a layer's input, carried and stacked), by its shape: the one
        tagged residual of that shape and size not found by mark on the loop's
        other outputs."""
        if self.instrs.get(instr, ("",))[0] != "while":
            return None
        called = self.instrs[instr][2]
        width = len(self.instrs.get(self.roots.get(called[-1] if called else ""),
                                    ("", "", [], []))[3])
        found = {m[4:] for i in range(width) if i != index for m in self.marks(instr, i)[:1]
                 if m.startswith("tag:")}
        names = {r.name for r in self.tagged if r.nbytes == size and r.shape == dims} - found
        return names.pop() if len(names) == 1 else None

    def group(self, name: str, value: tuple) -> str:
        color, kind, number, size, shape = value
        if kind == "parameter":
            for label, count in self.arg_groups:
                if number < count:
                    return label
                number -= count
            return "inputs"
        if kind == "output":
            return "outputs (loss, gradients)"
        instr, _, index = name.partition("{")
        index = int(index.rstrip("}").split(",")[0] or 0)
        marks = self.marks(instr, index)
        if marks and marks[0].startswith("tag:"):
            return f"residual {marks[0][4:]}"
        found = _DIMS.search(shape)
        dims = tuple(int(d) for d in found.group(1).split(",") if d) if found else ()
        # The logits may be reshaped ([batch * seq, vocab]): same rows, same last axis.
        if self.logits is not None and dims and dims[-1] == self.logits[2] and (
                self.logits[0] <= math.prod(dims[:-1]) <= self.logits[1]):
            return LOGITS
        if marks:
            return "residuals, untagged"
        if (tag := self.loop_tag(instr, index, size, dims)) is not None:
            return f"residual {tag}"
        op_name = self.instrs.get(instr, ("", ""))[1]
        if "rematted_computation" in op_name:
            return "recomputed values"
        if "transpose(" in op_name:
            return "backward temporaries"
        return "other temporaries"


def breakdown(folder: str, memory: dict, *, figure: str, arg_groups=(),
              logits_shape: tuple | None = None, residuals=(), code_bytes: int = 0,
              total: int | None = None) -> dict:
    """The device buffers live at the peak of the program XLA dumped into `folder`.

    Args:
      folder: where the compile wrote its dump (`dump_options`).
      memory: the compile's `costs.memory_fields`.
      figure: the figure broken down, "temp_size_in_bytes" (XLA CPU: temp
        buffers only) or "peak_memory_in_bytes" (TPU, GPU: everything live).
      arg_groups: (label, number of leaves) for the program's leading
        arguments, e.g. (("parameters", 16),); the rest are "inputs".
      logits_shape: the loss head's logits shape (`logits_shape`), whose
        values (or a reshape of them keeping the last axis) are grouped as
        "logits and their gradient".
      residuals: the program's `residuals.Residual`s; a scanned stack's loop
        state that no op computes is named by its shape among them.
      code_bytes: the program's own size (`generated_code_size_in_bytes`),
        which the TPU peak counts; "program code" where figure is the peak and
        the buffers live at its step leave room for it.
      total: the figure's bytes where `memory` has none of that name, e.g. a
        CPU train step's argument + temp + output - alias
        (`decide.step.in_use_bytes`); every device buffer is then counted,
        as for a peak.
    Returns:
      {"figure": figure, "bytes": its value, "step": the schedule step of the
      peak, "parts": {group: bytes}, largest first, "roles": {temporaries'
      group: {tag: bytes of its values that compute it}}, largest first (a
      group absent where none of its values is tagged), "logits_shape":
      logits_shape as a list or None} (JSON-ready), the parts summing to the
      figure: "program code" and "compiler's own" (packing, padding, what the
      dump does not show) are parts too.
    Raises:
      FileNotFoundError: the folder holds no dump.
    """
    values = _values(_read(folder, "after_optimizations-buffer-assignment.txt"))
    ranges = [(n, int(a), int(b)) for n, a, b in _RANGE.findall(
        _read(folder, "after_optimizations-live-range.txt"))]
    program = _Program(_read(folder, "after_optimizations.txt"), arg_groups, logits_shape,
                       residuals)
    temp_only = figure == "temp_size_in_bytes" and total is None
    counted = ("temp",) if temp_only else ("temp", "parameter", "output")
    live = [(n, a, b) for n, a, b in ranges
            if n in values and values[n][0] == 0 and values[n][1] in counted]
    # Device bytes live at each step: a value from its definition up to its last use
    # (that step's output may take its buffer).
    delta: dict[int, int] = {}
    for n, a, b in live:
        delta[a] = delta.get(a, 0) + values[n][3]
        delta[b] = delta.get(b, 0) - values[n][3]
    live_now, best, step = 0, -1, 0
    for t in sorted(delta):
        live_now += delta[t]
        if live_now > best:
            best, step = live_now, t
    parts: dict[str, int] = {}
    roles: dict[str, dict[str, int]] = {}
    for n, a, b in live:
        if a <= step < b:
            g = program.group(n, values[n])
            parts[g] = parts.get(g, 0) + values[n][3]
            role = program.role(n.partition("{")[0]) if g in _TEMPORARIES else None
            if role is not None:
                held = roles.setdefault(g, {})
                held[role] = held.get(role, 0) + values[n][3]
    whole = total if total is not None else memory.get(figure) or 0
    # The TPU peak holds the program's code (about 2% left unexplained at GPT-2 size), but a
    # small program's code can outgrow the whole peak (2.42 MiB beside a 1.57 MiB peak on
    # tpu:v5e): there the peak cannot hold it, so it is not a part, never a negative rest.
    if not temp_only and code_bytes and code_bytes <= whole - sum(parts.values()):
        parts["program code"] = code_bytes
    parts["compiler's own"] = whole - sum(parts.values())
    return {"figure": figure, "bytes": whole, "step": step,
            "parts": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "roles": {g: dict(sorted(r.items(), key=lambda kv: -kv[1])) for g, r in roles.items()},
            "logits_shape": None if logits_shape is None else list(logits_shape)}


def summary(found: dict, top: int = 4, roles: int = 3) -> str:
    """One line of a `breakdown`: '9.13 MiB: recomputed values 6.38 MiB (attn_probs,
    mlpwi_0, mlpwi_1), backward temporaries 1.75 MiB (mlpwi_0), ..., other 128.00
    KiB' (its `top` largest parts, each with its `roles` largest roles, the rest
    summed as "other")."""
    parts, held = list(found["parts"].items()), found.get("roles", {})

    def part(group, size):
        names = list(held.get(group, {}))[:roles]
        return f"{group} {fmt_bytes(size)}" + (f" ({', '.join(names)})" if names else "")
    shown = ", ".join(part(g, b) for g, b in parts[:top])
    rest = sum(b for _, b in parts[top:])
    return f"{fmt_bytes(found['bytes'])}: {shown}" + (f", other {fmt_bytes(rest)}" if rest else "")


def scores_note(found: dict) -> str | None:
    """Where the attention scores (`SCORES` among a `breakdown`'s temporaries) hold
    more than any part does without them, one line naming them and what lowers
    them: "the s x s attention scores hold the most of it (attn_probs 4.00 MiB of
    9.13 MiB), which no remat policy removes: ..."; else None. A policy that saves
    the scores makes them ``residual attn_probs``, which a policy does remove:
    those are not counted."""
    held = found.get("roles", {})
    scores = {t: sum(r.get(t, 0) for r in held.values()) for t in SCORES}
    total = sum(scores.values())
    rest = [b - sum(held.get(g, {}).get(t, 0) for t in SCORES)
            for g, b in found["parts"].items()]
    if not total or total < max(rest, default=0):
        return None
    largest = sorted(scores.items(), key=lambda kv: -kv[1])
    named = ", ".join(f"{t} {fmt_bytes(b)}" for t, b in largest if b)
    return (f"the s x s attention scores hold the most of it ({named} of "
            f"{fmt_bytes(found['bytes'])}), which no remat policy removes: a fused attention "
            f"kernel (splash, cuDNN, jax.nn.dot_product_attention) never stores them")


def vocab_chunks_for(found: dict) -> int | None:
    """The vocabulary chunk count (`remat_kit.flax.chunked_loss`) that lowers a
    `breakdown` whose largest part is the logits and their gradient: the
    smallest count dividing the vocabulary that leaves the logits' share at most
    an eighth of the rest of the figure, else the largest count at most
    vocab / `MIN_CHUNK_WIDTH`; None where the logits are not the largest part,
    their shape is unknown, or no count from 2 to vocab / `MIN_CHUNK_WIDTH`
    divides the vocabulary (e.g. GPT-2's 50257 = 29 x 1733 gives 29)."""
    shape, parts = found.get("logits_shape"), found["parts"]
    if not shape or next(iter(parts), None) != LOGITS:
        return None
    vocab, held = shape[-1], parts[LOGITS]
    counts = [d for d in range(2, vocab // MIN_CHUNK_WIDTH + 1) if vocab % d == 0]
    if not counts:
        return None
    return next((d for d in counts if 8 * held <= d * (found["bytes"] - held)), counts[-1])


def held_line(found: dict, what: str, chunked_bytes: "int | None" = None) -> str:
    """What holds a figure no layer policy goes below, in one line: "full remat's
    peak 3.38 GiB: logits and their gradient 2.30 GiB, ...; no layer policy lowers
    the logits and their gradient; --vocab-chunks 29 (the loss over 29 vocabulary
    chunks) lowers them, to 1.02 GiB".

    Args:
      found: a `breakdown`.
      what: what it breaks down, e.g. "full remat's peak".
      chunked_bytes: the same figure compiled with `vocab_chunks_for(found)`
        chunks, where that was compiled; else the line names the count only.
    The "no layer policy" clause is said where the largest part is none a layer
    policy changes (not a residual, nor a recomputed value); `scores_note` where
    the attention scores hold the most; the chunk count
    where the logits are that part (`vocab_chunks_for`), unless its compile
    lowers the figure by less than `CHUNKS_WORTH` of it (on a small vocabulary
    the chunked loss's own temporaries take what the logits gave back)."""
    top = next(iter(found["parts"]))
    line = f"{what} {summary(found)}"
    if not top.startswith(("residual", "recomputed")):
        line += f"; no layer policy lowers the {top}"
    chunks = vocab_chunks_for(found)
    if chunked_bytes is not None and chunked_bytes > (1 - CHUNKS_WORTH) * found["bytes"]:
        chunks = None
    if note := scores_note(found):
        line += f"; {note}"
    if chunks is not None:
        line += (f"; --vocab-chunks {chunks} (the loss over {chunks} vocabulary chunks) "
                 f"lowers them" + (f", to {fmt_bytes(chunked_bytes)}"
                                   if chunked_bytes is not None else ""))
    return line


def logits_shape(program: ClosedJaxpr) -> tuple | None:
    """The shape of the loss head's logits in a `residuals.stage` program: the
    operand of the forward pass's last `reduce_max` of rank >= 2 (a softmax's or
    log-sum-exp's stabilizer), found before the loss value is computed; None if
    there is none (a loss without a softmax over its last axis)."""
    eqns = program.jaxpr.eqns
    loss = program.jaxpr.outvars[0]
    end = next((i for i, e in enumerate(eqns) if loss in e.outvars), len(eqns))
    found = None
    for eqn in eqns[:end]:
        if eqn.primitive.name == "reduce_max" and len(eqn.invars[0].aval.shape) >= 2:
            found = tuple(eqn.invars[0].aval.shape)
    return found
