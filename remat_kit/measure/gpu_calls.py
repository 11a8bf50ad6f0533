"""The matrix products XLA:GPU hands to cuBLAS, read off the compiled HLO.

XLA:GPU rewrites most `dot`s into cuBLAS custom calls that hold no `dot`; `cublas_gemm` reads a
call's dot dimension numbers from its `backend_config` (a `Gemm`), so the time model counts its
FLOPs as XLA's `HloCostAnalysis` counts the dot, its bytes without the cuBLAS workspace, at the
product's element type's peak. The step's total then equals XLA's count (tests/test_gpu_truth.py).
How it was found on an H200: docs/gpu.md ("The time model, fixed").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_GEMM_DIMS = re.compile(r'"gemm_backend_config":\{.*?"dot_dimension_numbers":(\{[^}]*\})')


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A cuBLAS GEMM custom call, as the time model prices it.

    Attributes:
      product: the product's HLO shape (the first element of the call's
        (product, workspace) tuple): what it writes, and its element type.
      flops: 2 x product elements x the contracted size of the left operand
        (XLA's count for the dot the call replaced).
    """

    product: object
    flops: float


def cublas_gemm(instr) -> Gemm | None:
    """The `Gemm` of a cuBLAS GEMM custom call; None for any other instruction.

    Args:
      instr: a `jaxlib._hlo.HloInstruction`.
    """
    if instr.opcode.name != "kCustomCall":
        return None
    found = _GEMM_DIMS.search(instr.to_string())
    if found is None:
        return None
    dims = json.loads(found.group(1))
    product = instr.shape.tuple_shapes()[0] if instr.shape.is_tuple() else instr.shape
    lhs = instr.operands()[0].shape.dimensions()
    contracted = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    return Gemm(product, 2.0 * math.prod(product.dimensions()) * contracted)


__all__ = ["Gemm", "cublas_gemm"]
