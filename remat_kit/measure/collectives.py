"""What one chip sends over the ICI for a collective of a compiled program, per call.

Ring algorithms over the n chips of a replica group (Patarasuk & Yuan 2009; the scaling book's
"How to think about TPUs", collectives): all-gather (n - 1)/n of its output, reduce-scatter and
all-to-all (n - 1)/n of their operands (all-to-all keeps one chunk of n), all-reduce twice that,
a `ragged-all-to-all` its input at its static bound, a collective-permute its operand. The
time model prices them at the chip's `ici_bandwidth`: docs/targets.md ("Expert parallelism").
"""

from __future__ import annotations

import math
import re

# HLO opcode -> (which shapes are sent: "operands" or "output", factor of (n - 1)/n or None:
# the whole of it). Asynchronous starts move the bytes; their -done waits.
_KINDS = {"kAllToAll": ("operands", 1), "kRaggedAllToAll": ("input", 1),
          "kAllGather": ("output", 1), "kAllGatherStart": ("output", 1),
          "kReduceScatter": ("operands", 1), "kAllReduce": ("operands", 2),
          "kAllReduceStart": ("operands", 2),
          "kCollectivePermute": ("input", None), "kCollectivePermuteStart": ("input", None)}
ALL_TO_ALL = ("kAllToAll", "kRaggedAllToAll")
_LISTED = re.compile(r"replica_groups=\{\{([\d,\s]*)\}")
_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def group_size(text: str) -> int | None:
    """Chips in each replica group of an HLO collective's text: listed
    (`{{0,1,2,3}}`), as an iota (`[2,4]<=[8]`), or by mesh axes
    (`mesh['expert'=4] {'expert'}`); None where it names none."""
    if (found := _LISTED.search(text)):
        return len([t for t in found.group(1).split(",") if t.strip()]) or None
    if (found := _IOTA.search(text)):
        return int(found.group(1))
    if (found := _MESH.search(text)):
        sizes = {k.strip(" '\""): int(v) for k, v in
                 (kv.split("=") for kv in found.group(1).split(",") if "=" in kv)}
        named = [a.strip(" '\"") for a in found.group(2).split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in named)
    return None


def ici_bytes(instr, size) -> float:
    """Bytes one chip sends over the ICI for the HLO instruction `instr` (a
    collective, per the module docstring); 0 for any other op, or a group of one.
    `size(shape)` -> (elements, bytes) of an HLO shape (tuples summed)."""
    kind = _KINDS.get(instr.opcode.name)
    if kind is None:
        return 0.0
    sent, factor = kind
    operands = instr.operands()
    out = instr.shape.tuple_shapes()[-1] if instr.shape.is_tuple() else instr.shape
    nbytes = (size(out)[1] if sent == "output" else
              size(operands[0].shape)[1] if sent == "input" else
              sum(size(o.shape)[1] for o in operands))
    if factor is None:
        return float(nbytes)
    n = group_size(instr.to_string())
    if n is None and instr.opcode.name == "kAllToAll" and len(operands) > 1:
        n = len(operands)  # the tuple form: one operand a chip
    if n is None:
        return float(nbytes * factor)
    return nbytes * factor * (n - 1) / n


__all__ = ["ALL_TO_ALL", "group_size", "ici_bytes"]
