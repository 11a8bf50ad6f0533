"""NNX models written as `dantinox` (PyPI) writes its backbone (tests/zoo/graph_nnx.py).

Each test failed before its fix: a block returning a constant (`0.0`) broke the
region interpreter (an unhashable jaxpr Literal) and `explain`'s block sum; a rope
written with `.at[].set` (a scatter) hid the fused qkv matmul from the query and key,
so it was named `value_proj`.
"""

import remat_kit as rk
import remat_kit.trace.roles
from tests.zoo import graph_nnx

B, T = 2, 8
# Bytes of one block's stored values under minimal, float32: decoder_layer_input and
# out_proj [2, 8, 32], qkv_proj [2, 8, 32 + 2 * 2 * 8], mlpwi [2, 8, 128].
MINIMAL_LAYER_BYTES = 4 * (B * T * 32 * 2 + B * T * 64 + B * T * 128)


def test_a_block_with_a_constant_output_measures_and_names_its_roles():
    work = rk.from_model.workload(graph_nnx.model(), B, T)
    (rec,) = rk.measure(work, policies=["minimal"], per_layer=True)
    assert rec.error is None
    assert rec.layer_residual_bytes == MINIMAL_LAYER_BYTES
    # The fused qkv matmul feeds the scores (through the scatter rope) and the context.
    assert set(rec.residual_bytes_by_tag) & set(rk.roles.ROLES) == {
        "qkv_proj", "out_proj", "mlpwi"}
