"""What a multi-slice TPU program sends across its slices, over the data-center network.

On several TPU slices (`tpu:v5p:4x4x4:slices=2`) the chips of one slice talk over
their inter-chip links and the slices over the data-center network (DCN), an
order of magnitude slower per chip (`chip_peaks.PEAKS`' dcn_bandwidth). XLA:TPU
compiles a multi-slice job as one program per slice (`num_partitions` the chips
of a slice): a collective over a mesh axis across the slices (the gradient
all-reduce of a data-parallel axis) is split into its part within the slice
(ICI collectives) and a host transfer to the Megascale runtime, a `send` with
`is_host_transfer=true` and `_xla_megascale_transfer_type` ALL_REDUCE,
ALL_GATHER, REDUCE_SCATTER, ... (seen in libtpu 0.0.52's compiles). Each chip
sends its buffer of B bytes to its peers in the other k - 1 slices; over a ring
of k slices, per chip:

* ALL_REDUCE: 2 (k - 1) / k x B (a reduce-scatter, then an all-gather);
* REDUCE_SCATTER: (k - 1) / k x B; ALL_GATHER (B its own piece): (k - 1) x B;
* any other transfer: B.
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
