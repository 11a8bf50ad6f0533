"""What a multi-slice TPU program sends across its slices, over the data-center network.

XLA:TPU compiles a multi-slice job one program per slice; a collective across slices becomes a
Megascale host transfer (`_xla_megascale_transfer_type`, seen in libtpu 0.0.52). `dcn_bytes`
gives what one chip sends over the DCN for it, ring-reduced over k slices (all-reduce
2 (k - 1) / k x B), for the time model at `chip_peaks.PEAKS`' dcn_bandwidth.
The formulas and the measured 70B case: docs/meshes.md ("Several slices").
"""

from __future__ import annotations

import re

_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def dcn_bytes(instr, slices: int | None, nbytes: float) -> float:
    """Bytes one chip sends over the DCN for the HLO instruction `instr`: a Megascale
    host-transfer `send` of `nbytes` (its buffer) on a target of `slices` slices; 0
    for any other instruction, or on one slice."""
    if not slices or slices < 2 or instr.opcode.name != "kSend":
        return 0.0
    found = _TYPE.search(instr.to_string())
    if found is None:
        return 0.0
    k = slices
    return nbytes * {"ALL_REDUCE": 2 * (k - 1) / k, "REDUCE_SCATTER": (k - 1) / k,
                     "ALL_GATHER": k - 1}.get(found.group(1), 1.0)


__all__ = ["dcn_bytes"]
