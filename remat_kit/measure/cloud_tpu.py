"""Cloud TPU accelerator types ("v5p-8", "v5litepod-16", "v6e-8") as the topologies they name
("v5p:2x2x1", "v5e:4x4", "v6e:2x4"), so `--target tpu:v5p-8` means what Google's console
calls it. Main name: `cloud_topology`. Docs: docs/targets.md.
"""

from __future__ import annotations

import math
import re

# A type's generation as its topology names it, how many TensorCores a chip has where the
# type's number counts cores (v2, v3, v4 and v5p types count cores, two per chip; v5e and
# v6e types count chips: cloud.google.com/tpu/docs/v5p, /v5e, /v6e), and how many axes
# the generation's topology has.
_CLOUD_NAME = re.compile(r"(v2|v3|v4|v5p|v5e|v5litepod|v6e)-(\d+)")
_CLOUD_TYPES = {"v2": ("v2", 2, 2), "v3": ("v3", 2, 2), "v4": ("v4", 2, 3),
                "v5p": ("v5p", 2, 3), "v5e": ("v5e", 1, 2), "v5litepod": ("v5e", 1, 2),
                "v6e": ("v6e", 1, 2)}


def cloud_topology(text: str) -> str:
    """A Cloud TPU accelerator type as the topology it names, the rest kept:
    'v5p-8' -> 'v5p:2x2x1' (8 cores, 4 chips), 'v5litepod-16' -> 'v5e:4x4', 'v6e-8' ->
    'v6e:2x4', 'v5p-128:slices=2' -> 'v5p:4x4x4:slices=2'; anything else unchanged.
    The shape doubles the shortest axis (the last of equals) from 1x1, or from 2x2x1 (the
    smallest v4 and v5p slice), as Google's tables of the slice shapes list them.

    Raises:
      ValueError: a count that is not a power of two, odd cores, or a v4 or v5p
        slice of fewer than 4 chips (one line naming the rule).
    """
    head, sep, rest = text.partition(":")
    found = _CLOUD_NAME.fullmatch(head)
    if not found:
        return text
    generation, per_chip, axes = _CLOUD_TYPES[found.group(1)]
    count = int(found.group(2))
    chips = count // per_chip
    if chips < (4 if axes == 3 else 1) or count % per_chip or chips & (chips - 1):
        kind, least = found.group(1), 4 * per_chip if axes == 3 else 1
        counts = "cores, two per chip," if per_chip == 2 else "chips"
        raise ValueError(f"TPU type {head!r} names no slice: {kind} types count {counts} "
                         f"in powers of two from {kind}-{least}; or give a topology, e.g. "
                         f"tpu:{generation}:2x2{'x1' if axes == 3 else ''}")
    shape = [2, 2, 1] if axes == 3 else [1, 1]
    while math.prod(shape) < chips:
        shortest = min(shape)
        shape[max(i for i, n in enumerate(shape) if n == shortest)] *= 2
    return f"{generation}:{'x'.join(map(str, shape))}" + (sep + rest if sep else "")


__all__ = ["cloud_topology"]
