"""explain lists a layer's constants apart: values that depend on
no parameter or activation of the layer (a rotary sin/cos table, the causal mask and
its fill, position ids and a mask passed in) are no residual a policy chooses, and the
compiled program holds no per-layer buffer of them."""

import glob
import importlib
import re

import pytest
from jax.extend.core import jaxpr_as_fun

from remat_kit.cli import main
from remat_kit.flax.from_model import workload as model_workload
from remat_kit.api.answers import explain
from remat_kit.measure.lowering import compile_for
from remat_kit.measure.residuals import stage
from remat_kit.models import get_config
from remat_kit.api.configs import layer_residuals
from remat_kit.policy.spec import parse

GEMMA = importlib.import_module("tests.zoo.gemma_linen")  # rotary from position ids, a mask
HF_LLAMA = importlib.import_module("tests.zoo.hf_llama_linen")  # a numpy rotary table
TABLE = importlib.import_module("tests.zoo.table_linen")  # a table passed to each block
SIN_COS = [("cos", (2, 16, 1, 4), "float32"), ("sin", (2, 16, 1, 4), "float32")] * 2
MASK = [("broadcast_in_dim", (2, 16, 4, 16), "bool"),  # the causal mask per head
        ("broadcast_in_dim", (2, 16, 4, 16), "float32")]  # and its fill


def _saved(layer):
    return {(r.kind, r.name) for r in layer.rows if r.decision == "saved"}


def _constants(layer):
    return [(r.name, r.shape, r.dtype) for r in layer.constants]


def test_gemma_constants_are_apart_from_the_saved_residuals():
    work = model_workload(GEMMA.Gemma(), 2, 16)
    none, minimal = explain("none", work), explain("minimal", work)
    # minimal: the tags it saves; the position ids and the mask every block is given are
    # constants, once for the model (640 B), not 640 B a layer.
    assert _saved(minimal) == {("tag", t) for t in (
        "decoder_layer_input", "kv_proj", "query_proj", "out_proj", "mlpwi_0", "mlpwi_1")}
    assert _constants(minimal) == [("inputs[1]", (2, 16), "int32"),
                                   ("inputs[2]", (2, 16, 16), "bool")]
    assert minimal.constant_bytes == 2 * 16 * 4 + 2 * 16 * 16
    assert minimal.saved_bytes == 32 * 1024  # 32.62 KiB with the constants counted
    # none: the sin/cos of the position ids and the mask are constants; what depends on
    # the block's input or parameters is saved, the rotated query and key included.
    assert _constants(none) == SIN_COS + MASK
    assert _saved(none) == {("tag", t) for t in (
        "attn_norm", "attn_probs", "context", "decoder_layer_input", "mlp_act", "mlp_norm",
        "mlpwi_0", "mlpwi_1")} | {("primitive", p) for p in (
        "add", "broadcast_in_dim", "concatenate", "exp", "integer_pow", "mul",
        "one_minus_square", "rsqrt", "slice", "unstack")}
    assert none.constant_bytes == 4 * 512 + 2048 + 8192
    assert none.saved_bytes == sum(r.nbytes for r in none.rows if r.decision == "saved")


def test_a_numpy_rotary_table_is_a_constant():
    """HF's Flax Llama builds its sin/cos table in numpy in each attention layer's setup:
    a constant of the traced loss, closed over by the block explain runs alone (not one
    of its inputs, which would make it a per-layer residual). 4 KiB a layer before."""
    work = model_workload(HF_LLAMA.model(), 2, 16)
    minimal = explain("minimal", work)
    assert _constants(minimal) == [("inputs[1]", (2, 16), "int32"),  # the mask
                                   ("inputs[2]", (2, 16), "int32"),  # position ids
                                   ("constant", (64, 16), "float32")]  # the table
    assert _saved(minimal) == {("tag", t) for t in (
        "decoder_layer_input", "qkv_proj", "out_proj", "mlpwi_0", "mlpwi_1")}
    assert minimal.saved_bytes == 32 * 1024  # 36.00 KiB with the table counted
    assert minimal.constant_bytes == 2 * 2 * 16 * 4 + 64 * 16 * 4


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("table", ["jnp", "numpy"])
def test_a_table_built_before_the_blocks_is_a_constant(table, scan):
    """A sin/cos table the model builds once with jnp from an iota and passes to each
    block (or nn.scan broadcasts to each trip) is a constant of the loss, as the same
    table built in numpy is: no layer's input, so neither it nor the halves of q and k
    its cotangent would need are counted per layer (154.00 KiB a layer before, with jnp,
    and scanned with either table)."""
    work = model_workload(TABLE.LM(table=table, scan=scan), 2, 16)
    none = explain("none", work)
    assert [c for c in _constants(none) if c[1] == (1, 16, 1, 4)] == [
        ("constant", (1, 16, 1, 4), "float32")] * 2
    assert not [r for r in none.rows if r.kind == "argument" and r.decision == "saved"]
    assert none.saved_bytes == 145.5 * 1024


def test_reference_llama_rotary_table_is_a_constant():
    """The reference model's rotary table comes from an iota: four [1, seq, 1, head/2]
    broadcasts, the mask and its fill, and a scalar literal under none; none under
    minimal, which recomputes every untagged value."""
    none = layer_residuals(get_config("tiny_llama"), 2, 16, "none")
    assert _constants(none) == [("broadcast_in_dim", (1, 16, 1, 8), "float32")] * 4 + [
        ("literal", (), "float32"), ("broadcast_in_dim", (2, 4, 16, 16), "bool"),
        ("broadcast_in_dim", (2, 4, 16, 16), "float32")]
    assert none.constant_bytes == 12292 and none.saved_bytes == 255488
    minimal = layer_residuals(get_config("tiny_llama"), 2, 16, "minimal")
    assert minimal.constants == () and _saved(minimal) == {("tag", t) for t in (
        "decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0",
        "mlpwi_1")}


_HLO = {"float32": "f32", "bool": "pred", "int32": "s32"}


@pytest.mark.parametrize("layers", [2, 4])
def test_the_compiled_model_holds_no_buffer_of_a_constant_per_layer(layers, tmp_path):
    """XLA CPU, the whole Gemma under none: no temp buffer has the shape of the
    sin/cos tables or the mask, at 2 layers or 4 (the fusions compute them in place);
    the position ids are one buffer, the model's argument."""
    work = model_workload(GEMMA.Gemma(GEMMA.GemmaConfig(layers=layers)), 2, 16)
    staged = stage(work.loss_for_policy(parse("none")), work.args)
    compile_for(jaxpr_as_fun(staged.program), *staged.leaves, count_flops=False,
                dump=str(tmp_path))
    [text] = glob.glob(str(tmp_path / "*after_optimizations-buffer-assignment.txt"))
    values = [v.partition("{")[0] for v in re.findall(
        r"value: <\d+ \S+ @\d+> \(size=\d+,offset=\d+\): (\S+)", open(text).read())]
    for _, shape, dtype in SIN_COS + MASK[:1]:
        assert f"{_HLO[dtype]}[{','.join(map(str, shape))}]" not in values
    assert values.count("s32[2,16]") == 1
    # What is a residual has a buffer per layer: the masked scores and their exponentials.
    assert values.count("f32[2,16,4,16]") == 2 * layers


def test_explain_prints_the_constants_in_one_line(capsys):
    assert main(["explain", "--config", "tiny_llama", "--policy", "none", "--batch", "2",
                 "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert ("constants, the same in every layer (not per-layer residuals, in no sum above): "
            "broadcast_in_dim [1, 16, 1, 8] float32 512 B x4, literal [] float32 4 B, "
            "broadcast_in_dim [2, 4, 16, 16] bool 2.00 KiB, broadcast_in_dim [2, 4, 16, 16] "
            "float32 8.00 KiB; 12.00 KiB") in " ".join(out.split())
    assert "│ per layer        │ 249.50 KiB │" in out  # 255488 B, the constants left out
