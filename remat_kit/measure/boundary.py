"""What a compiled grad step keeps across its forward/backward boundary, read from its
optimized HLO: each value a forward op computes that a backward op (a transpose, or the
backward's recomputation) reads, named by the tag `peak.marked` wrote on its producer,
sized by XLA's buffer assignment where the backend serializes one, else by its HLO shape;
the all-gathers the backward runs again. The audit's compiled side.
Docs: docs/compare.md ("The audit").
"""

from __future__ import annotations

import math
import re

from remat_kit.measure import buffers

_OPCODE = re.compile(r" ([a-z][\w\-]*)\(")
_HEAD = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|body)=%([\w.\-]+)")
_INDEX = re.compile(r"index=(\d+)")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\dm\d\w*)?)\[([\d,]*)\](?:\{([^}]*)\})?")
_RES, _ROLE = re.compile(r"rk_res:tag:([^/)]+)"), re.compile(r"rk_role:(\w+)")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
          "c128": 16}
_HOST = "S(5)"
# Ops that hand a value on unchanged (or bundle it): its readers are the value's readers.
_PASS = ("tuple", "get-tuple-element", "bitcast", "copy", "copy-start", "copy-done",
         "reshape", "optimization-barrier", "convert", "transpose")
_GATHERS = ("all-gather", "all-gather-start")
_UPDATES = ("dynamic-update-slice", "dynamic-update-slice-start")
# Ops whose output is their first operand's value (a view, a copy): named by it.
_VIEWS = ("get-tuple-element", "bitcast", "copy", "copy-done", "reshape", "transpose",
          "dynamic-update-slice-done", "optimization-barrier")


def _phase(op_name: str) -> str | None:
    """"backward" (a transpose, or the backward's recomputation), "forward" (a jvp),
    or None (an op XLA added, which names no phase)."""
    if "transpose(" in op_name or "rematted_computation" in op_name:
        return "backward"
    return "forward" if "jvp(" in op_name else None


def _bytes(shape: str) -> tuple[int, int, int]:
    """(device bytes, host bytes, elements) of an HLO shape's text; tuples summed."""
    device = host = elements = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        count = math.prod(int(d) for d in dims.split(",") if d)
        elements += count
        if _HOST in (layout or ""):
            host += count * _BYTES.get(dtype, 1)
        else:
            device += count * _BYTES.get(dtype, 1)
    return device, host, elements


class _Module:
    """The instructions of an optimized HLO module's text: {name: (shape, opcode, operands,
    op_name, called, gte index)}, each computation's names and its ROOT."""

    def __init__(self, text: str):
        self.instrs, self.comps, self.roots, self.entry = {}, {}, {}, None
        current = comp = None
        for line in text.splitlines():
            if m := _HEAD.match(line):
                comp = m.group(1)
                current = self.comps.setdefault(comp, [])
                self.entry = m.group(1) if line.startswith("ENTRY") else self.entry
                continue
            head, _, tail = line.partition(" = ")
            if current is None or not tail or not (m := _OPCODE.search(tail)):
                continue
            name = head.strip().removeprefix("ROOT ").lstrip("%")
            shape, opcode, rest = tail[:m.start()], m.group(1), tail[m.end():]
            args = rest.split(")", 1)[0] if opcode != "tuple" else rest.rsplit(")", 1)[0]
            op_name = _OP_NAME.search(rest)
            index = _INDEX.search(rest) if opcode == "get-tuple-element" else None
            self.instrs[name] = (shape, opcode, re.findall(r"%([\w.\-]+)", args),
                                 op_name.group(1) if op_name else "", _CALLED.findall(rest),
                                 int(index.group(1)) if index else 0)
            current.append(name)
            if line.lstrip().startswith("ROOT "):
                self.roots[comp] = name
        self.users: dict[str, list[str]] = {}
        for name, (_, _, operands, *_rest) in self.instrs.items():
            for o in operands:
                self.users.setdefault(o, []).append(name)

    def names(self, instr: str, index: int, pattern, depth: int = 0) -> list[str]:
        """What `pattern` finds in the op metadata of the value `instr`{index}: its own,
        else the one its fused computation computes, else (a loop or a fusion's tuple)
        its ROOT's operand `index`."""
        if instr not in self.instrs or depth > 8:
            return []
        _, opcode, operands, op_name, called, _ = self.instrs[instr]
        if own := pattern.findall(op_name):
            return own[-1:]
        if opcode in _UPDATES and len(operands) > 1:  # a stacked residual: the update's
            return self.names(operands[1], 0, pattern, depth + 1)
        if (opcode in _VIEWS or opcode == "convert" and not op_name) and operands:
            return self.names(operands[0], index, pattern, depth + 1)
        if opcode not in ("fusion", "while") or not called:
            return []
        root = self.roots.get(called[-1], "")
        if self.instrs.get(root, ("", ""))[1] == "tuple":  # a loop's or fusion's outputs
            operands = self.instrs[root][2]
            return self.names(operands[index], 0, pattern, depth + 1) \
                if index < len(operands) else []
        return self.names(root, 0, pattern, depth + 1) if opcode == "fusion" else []

    def read_in_backward(self, name: str, depth: int = 0) -> bool:
        """Whether a backward op reads `name`, directly or through ops that hand it on."""
        for user in self.users.get(name, ()):
            _, opcode, _, op_name, _, _ = self.instrs[user]
            phase = _phase(op_name)
            if phase == "backward":
                return True
            if (phase is None or opcode in _PASS) and depth < 8 and \
                    self.read_in_backward(user, depth + 1):
                return True
        return False


def kept(text: str, serialized: bytes | None = None, ids: dict | None = None) -> dict:
    """What the compiled program of optimized HLO `text` keeps across its forward/backward
    boundary, JSON-ready: {"tags": {tag: [device bytes, host bytes, elements]} of the
    values `peak.marked` named residuals of that tag, "roles": {tag: the same} of the
    other values computing a tag (`rk_role:`: one asked to be recomputed, kept), "total":
    [device bytes, host bytes] of every value kept (by HLO shape, tagged or not),
    "sized": "buffer assignment" where `serialized` (`buffers.sizes`, with `ids`: name ->
    XLA's instruction id) sized every value found, else "hlo shapes", "gathers": [the
    argument of each all-gather the backward runs again (`_gathers`)]}.

    A value is kept across the boundary where a forward op (a `jvp`) in the entry
    computation computes it (a scanned stack: the forward loop's output) and a backward op
    (a `transpose`, or the recomputation) reads it."""
    module = _Module(text)
    sizes = buffers.sizes(serialized, ids) if serialized and ids else None
    tags: dict[str, list[int]] = {}
    roles: dict[str, list[int]] = {}
    total = [0, 0]
    sized = sizes is not None
    for name in module.comps.get(module.entry, ()):
        shape, opcode, operands, op_name, _, index = module.instrs[name]
        if opcode in ("tuple", "while", "parameter") or _phase(op_name) != "forward" or \
                not module.read_in_backward(name):
            continue
        device, host, elements = _bytes(shape)
        total[0] += device
        total[1] += host
        source = (operands[0], index) if opcode == "get-tuple-element" else (name, 0)
        found = module.names(*source, _RES)
        into, found = (tags, found) if found else (roles, module.names(*source, _ROLE))
        key = (source[0], (index,)) if opcode == "get-tuple-element" else (name, ())
        if not found:
            continue
        if sizes is not None:
            allocated = sizes.get(key)
            sized &= allocated is not None
            device = allocated if allocated is not None and not host else device
        got = into.setdefault(found[0], [0, 0, 0])
        for i, n in enumerate((device, host, elements)):
            got[i] += n
    return {"tags": tags, "roles": roles, "total": total, "gathers": _gathers(module),
            "sized": "buffer assignment" if sized else "hlo shapes"}


def _gathers(module: _Module) -> list[str]:
    """The all-gathers the partitioner added that the backward runs again: one entry per
    all-gather in the backward of a program argument (its op metadata name, e.g.
    "args[2]": FSDP's weight) that the forward gathers too."""
    found: dict[str, set] = {"forward": set(), "backward": set()}
    again = []
    for name, (_, opcode, operands, op_name, _, _) in module.instrs.items():
        phase = _phase(op_name) or "forward"  # the partitioner names a gather by its argument
        if opcode in _GATHERS and operands:
            argument = _argument(module, operands[0])
            if argument is not None:
                found[phase].add(argument)
                again += [argument] if phase == "backward" else []
    return [a for a in again if a in found["forward"]]


def _argument(module: _Module, name: str, depth: int = 0) -> str | None:
    """The program argument (its op metadata name) a gathered operand is, through ops that
    hand it on; None where it is computed."""
    instr = module.instrs.get(name)
    if instr is None or depth > 6:
        return None
    if instr[1] == "parameter":
        return instr[3] or name
    if instr[1] in (*_VIEWS, "convert") and instr[2]:
        return _argument(module, instr[2][0], depth + 1)
    return None


__all__ = ["kept"]
