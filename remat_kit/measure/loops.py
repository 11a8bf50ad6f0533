"""How many times each while loop of a compiled program runs.

XLA's CPU and GPU compilers write a loop's trip count into its backend config; XLA:TPU drops it,
so `trip_count` reads it, else the loop's own constants (`i = start; while i < bound; i += step`,
a shape XLA's optimizations keep), as XLA's `ComputeWhileLoopTripCount` does.
Why it matters for FLOPs and time: docs/targets.md ("FLOPs").
"""

from __future__ import annotations

import math
import re

_KNOWN = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%([\w.\-]+)")
_BODY = re.compile(r"body=%([\w.\-]+)")
_INDEX = re.compile(r"index=(\d+)")
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_DIRECTION = re.compile(r"direction=(\w+)")
# Ops that pass a scalar through unchanged (a copy into another memory space).
_PASS = frozenset({"kCopy", "kBitcast", "kConvert"})


def _through(instr):
    """`instr` with copies, bitcasts and converts of one operand looked through."""
    while instr.opcode.name in _PASS and len(instr.operands()) == 1:
        instr = instr.operands()[0]
    return instr


def _constant(instr) -> int | None:
    """The integer value of a scalar constant (through copies); else None."""
    instr = _through(instr)
    if instr.opcode.name != "kConstant":
        return None
    found = _CONSTANT.search(instr.to_string())
    return int(found.group(1)) if found else None


def _tuple_index(instr) -> int | None:
    """k where `instr` is (through copies) element k of its computation's parameter."""
    instr = _through(instr)
    if instr.opcode.name != "kGetTupleElement" or \
            _through(instr.operands()[0]).opcode.name != "kParameter":
        return None
    return int(_INDEX.search(instr.to_string()).group(1))


def _root(comp):
    """A computation's root: the one instruction no other one uses (the last
    listed where several are unused)."""
    unused = [i for i in comp.instructions() if not i.users()]
    return unused[-1] if unused else None


def _bound(cond) -> tuple[int, int, str] | None:
    """(induction variable's tuple index, bound, direction as `i <op> bound`) of a
    loop condition `compare(get-tuple-element(param, k), constant)`; else None."""
    root = _root(cond)
    if root is None or root.opcode.name != "kCompare":
        return None
    lhs, rhs = root.operands()
    direction = _DIRECTION.search(root.to_string()).group(1)
    k, bound = _tuple_index(lhs), _constant(rhs)
    if k is None:  # `bound <op> i`: the same test mirrored
        k, bound = _tuple_index(rhs), _constant(lhs)
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    return None if k is None or bound is None else (k, bound, direction)


def _step(body, k: int) -> int | None:
    """The constant the body adds to element k of its tuple each trip; else None."""
    root = _root(body)
    if root is None or root.opcode.name != "kTuple" or k >= len(root.operands()):
        return None
    update = _through(root.operands()[k])
    if update.opcode.name != "kAdd":
        return None
    a, b = update.operands()
    if _tuple_index(a) == k:
        return _constant(b)
    return _constant(a) if _tuple_index(b) == k else None


def trip_count(loop, comps: dict) -> int | None:
    """How many times a while loop's body runs, or None where it cannot be read.

    Args:
      loop: a `kWhile` instruction of an optimized HLO module
        (`_jax_private.hlo_module`).
      comps: the module's computations by name.
    Returns:
      The backend config's `known_trip_count`; else, for a loop whose
      condition compares element k of its tuple with a constant bound (`<`,
      `<=`, `>` or `>=`), whose initial tuple sets k to a constant and whose
      body adds a constant step to it, the trips from start to bound: e.g.
      ceil((bound - start) / step) for `<` (0 where the loop never runs).
      None otherwise (a bound computed at run time, a loop rewritten past
      recognition).
    """
    text = loop.to_string()
    if (known := _KNOWN.search(text)):
        return int(known.group(1))
    cond, body = comps.get(_CONDITION.search(text).group(1)), comps.get(
        _BODY.search(text).group(1))
    found = _bound(cond) if cond is not None else None
    init = _through(loop.operands()[0]) if loop.operands() else None
    if found is None or body is None or init is None or init.opcode.name != "kTuple":
        return None
    k, bound, direction = found
    start, step = _constant(init.operands()[k]), _step(body, k)
    if start is None or not step:
        return None
    span = {"LT": bound - start, "LE": bound - start + 1,
            "GT": start - bound, "GE": start - bound + 1}.get(direction)
    if span is None or (step > 0) != (direction in ("LT", "LE")):
        return None
    return max(0, math.ceil(span / abs(step)))


__all__ = ["trip_count"]
