"""The matrix products XLA:GPU hands to cuBLAS, read off the compiled HLO.

XLA:GPU rewrites most `dot`s into custom calls (`__cublas$lt$matmul`,
`__cublas$gemm`) whose HLO holds no `dot` instruction: the product's
dimension numbers live in the call's `backend_config` JSON
(`gemm_backend_config.dot_dimension_numbers`), and the call returns a tuple of
(product, workspace), the workspace being cuBLAS scratch (`s8[bytes]`). The
time model (`time_model.compiled_ops`) counts such a call's FLOPs from those
dimension numbers, as XLA's `HloCostAnalysis` counts the dot it replaced, its
bytes without the workspace, and prices it at the product's element type's
peak (a bf16 product at bf16's, not float32's).

Checked on the programs `benchmarks/gpu_truth.py` compiled on an H200: with
these FLOPs the time model's total equals XLA's count of the same step
(tests/test_gpu_truth.py).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

_GEMM_DIMS = re.compile(r'"gemm_backend_config":\{.*?"dot_dimension_numbers":(\{[^}]*\})')


def gemm_product(instr):
    """The product's HLO shape of a cuBLAS GEMM custom call (the first element of its
    (product, workspace) tuple); None for any other instruction.

    Args:
      instr: a `jaxlib._hlo.HloInstruction`.
    """
    if instr.opcode.name != "kCustomCall" or _GEMM_DIMS.search(instr.to_string()) is None:
        return None
    return instr.shape.tuple_shapes()[0] if instr.shape.is_tuple() else instr.shape


def gpu_gemm_flops(instr) -> float | None:
    """FLOPs of a cuBLAS GEMM custom call: 2 x product elements x the contracted
    size of the left operand (XLA's count for a dot); None for any other op."""
    product = gemm_product(instr)
    if product is None:
        return None
    dims = json.loads(_GEMM_DIMS.search(instr.to_string()).group(1))
    lhs = instr.operands()[0].shape.dimensions()
    contracted = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(product.dimensions()) * contracted


def gpu_gemm_written_bytes(instr) -> int:
    """Bytes a cuBLAS GEMM call writes to device memory: its product, not its workspace."""
    shape = gemm_product(instr)
    return math.prod(shape.dimensions()) * np.dtype(shape.numpy_dtype()).itemsize


__all__ = ["gemm_product", "gpu_gemm_flops", "gpu_gemm_written_bytes"]
