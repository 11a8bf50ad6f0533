"""A training codebase's own sharding, wherever its model keeps it: `NamedSharding`s on the
abstract parameter arrays (as MaxText's `create_nnx_abstract_model` leaves them), logical
names whose rules live on the model's config, the batch over the data axes those rules name;
the caption says which, and claims no sharding the compiled program lacks. Bad input is one
line. tests/zoo/sharded_nnx.py is the twin; MaxText itself is checked by
benchmarks/codebase_mesh.py."""

import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import remat_kit as rk
from remat_kit import cli
from remat_kit.errors import MeshError
from remat_kit.flax import placement
from tests.test_targets import needs_libtpu
from tests.test_compile_cache import empty_cache  # noqa: F401 - a fixture
from tests.zoo import sharded_nnx

BATCH, SEQ = 8, 16
needs_4 = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def one_device():
    (rec,) = rk.measure(rk.from_model.workload(sharded_nnx.plain(), BATCH, SEQ),
                        policies=["full"])
    return rec


def check_quarter(rec, work, one):
    """Per chip: a quarter of every parameter and of the tokens, and a quarter of the
    one-device step's FLOPs (within 2%)."""
    params, tokens = nbytes(work.args[0]), nbytes(work.args[1])
    assert rec.argument_size_in_bytes == (params + tokens) // 4
    assert rec.parameter_bytes_per_device == params // 4
    assert rec.flops / one.flops == pytest.approx(0.25, rel=0.02)


@needs_4
def test_named_shardings_on_abstract_parameters_place_them(one_device):
    work = rk.from_model.workload(sharded_nnx.model(), BATCH, SEQ)
    specs = {spec for spec in jax.tree.leaves(
        jax.tree.map(lambda x: x.sharding.spec, work.args[0]),
        is_leaf=lambda x: isinstance(x, PartitionSpec))}
    fsdp = ("fsdp", "fsdp_transpose", "expert")
    assert specs == {PartitionSpec(fsdp, "tensor"), PartitionSpec("tensor", fsdp)}
    assert work.args[1].sharding.spec == PartitionSpec(("data", "fsdp", "fsdp_transpose",
                                                        "expert"))
    assert work.placement == ("parameters by their own NamedShardings; batch 8 over fsdp "
                              "(the model's rules): 2 per device")
    (rec,) = rk.measure(work, policies=["full"])
    check_quarter(rec, work, one_device)


@needs_4
def test_logical_names_with_the_rules_on_the_model_s_config_place_them(one_device):
    """The same model without shardings on its arrays: its `out_sharding` names, mapped by
    its `config.logical_axis_rules`, give the same per-chip figures."""
    bare = sharded_nnx.abstract(None)
    work = rk.from_model.workload(bare, BATCH, SEQ, mesh=sharded_nnx.mesh())
    assert work.placement.startswith("parameters by their logical names and the rules of "
                                     "the model's config; batch 8 over fsdp")
    (rec,) = rk.measure(work, policies=["full"])
    check_quarter(rec, work, one_device)


@needs_4
@needs_libtpu
def test_on_a_tpu_slice_the_model_s_own_shardings_give_a_quarter():
    """Batch 32 x seq 128: each chip's tokens [8, 128] a whole TPU tile, as every
    parameter shard is, so the chip's argument bytes are exactly a quarter."""
    target = "tpu:v5p:2x2x1"
    work = rk.from_model.workload(sharded_nnx.model(), 32, 128)
    (rec,) = rk.measure(work, policies=["full"], target=target)
    plain = rk.from_model.workload(sharded_nnx.plain(), 32, 128)
    (one,) = rk.measure(plain, policies=["full"], target="tpu:v5p:1x1x1")
    check_quarter(rec, work, one)


@needs_4
def test_the_caption_says_how_it_was_placed_and_claims_only_what_compiled(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert cli.main(["compare", "--model", "tests/zoo/sharded_nnx.py:model", "--batch", "8",
                     "--seq", "16", "--policies", "full", "--json", str(out)]) == 0
    context = json.loads(out.read_text())["context"]
    assert context["step"].startswith("value-and-grad; gradients sharded like the parameters")
    assert context["placement"] == ("parameters by their own NamedShardings; batch 8 over "
                                    "fsdp (the model's rules): 2 per device")
    assert context["placement"] in capsys.readouterr().out.replace("\n", "")
    # Data parallel: every parameter whole on every device, and the caption says so.
    assert cli.main(["compare", "--config", "tiny", "--batch", "4", "--seq", "16", "--mesh",
                     "data:4", "--policies", "full", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["context"]["step"] == (
        "value-and-grad; parameters and gradients whole on every device of data:4")


@needs_4
def test_the_sources_of_a_parameter_s_placement_in_order_of_trust():
    mesh = sharded_nnx.mesh()
    x = jax.ShapeDtypeStruct((8, 4), np.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    found = placement.annotations({"w": x, "b": jax.ShapeDtypeStruct((4,), np.float32)})
    assert (found.names["w"], found.sources["w"], found.mesh) == (("fsdp", None), "sharding",
                                                                  mesh)
    assert found.sources["b"] is None
    text, notes = placement.described(found, mesh)
    assert text == "parameters by their own NamedShardings (1 of 2)"
    assert notes == ("1 parameter the model gives no sharding, whole on every device of "
                     "diloco:1,data:1,stage:1,fsdp:4,fsdp_transpose:1,context:1,"
                     "context_autoregressive:1,tensor:1,tensor_transpose:1,tensor_sequence:1,"
                     "expert:1,autoregressive:1: b",)
    assert placement.model_rules(sharded_nnx.plain()) == sharded_nnx.RULES


@needs_4
def test_parameters_on_two_meshes_are_refused_in_one_line():
    devices = jax.devices()[:4]
    a = Mesh(np.array(devices).reshape(4), ("fsdp",))
    b = Mesh(np.array(devices).reshape(2, 2), ("data", "fsdp"))
    shaped = lambda m: jax.ShapeDtypeStruct((8, 4), np.float32,  # noqa: E731
                                            sharding=NamedSharding(m, PartitionSpec("fsdp")))
    with pytest.raises(MeshError, match=r"^the model's parameters name 2 different meshes"):
        placement.annotations({"w": shaped(a), "v": shaped(b)})


@needs_4
def test_bad_batch_axes_and_rules_are_one_line(tmp_path, capsys):
    common = ["compare", "--model", "tests/zoo/logical_nnx.py:model", "--batch", "8", "--seq",
              "16", "--mesh", "fsdp:4", "--policies", "full"]
    assert cli.main([*common, "--batch-axes", "replica"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(
        "--batch-axes names mesh axis 'replica', which mesh fsdp:4 lacks; its axes: ['fsdp']")
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["embed", "fsdp"], ["mlp", None], ["embed", "data"]]))
    assert cli.main([*common, "--rules", str(rules)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --rules: rules file {str(rules)!r}: logical axis 'embed' "
        "is mapped twice ('fsdp' and 'data'); map each logical name once"]


@needs_4
def test_batch_axes_split_the_batch_where_the_model_names_none():
    work = rk.from_model.workload(rk_zoo_logical(), BATCH, SEQ,
                                  mesh=rk.mesh.make("data:2,fsdp:2", jax.devices()[:4]),
                                  batch_axes=("fsdp",))
    assert work.args[1].sharding.spec == PartitionSpec("fsdp")
    assert work.placement.endswith("batch 8 over fsdp (--batch-axes): 4 per device")


def rk_zoo_logical():
    from tests.zoo import logical_nnx
    return logical_nnx.model()


@needs_4
def test_maxtext_s_own_decoder_is_placed_by_its_own_shardings():
    """MaxText itself (skipped where it is not installed): its abstract llama2 decoder over
    its own 12-axis mesh, each parameter placed as its own NamedSharding says (the norms'
    scales whole, as MaxText keeps them), the batch over its data axes."""
    pytest.importorskip("maxtext")
    from flax import nnx
    from benchmarks import codebase_mesh
    size = dict(codebase_mesh.DEFAULTS, emb=256, layers=1, seq=128)
    model = codebase_mesh.build(size, jax.devices()[:4])
    work = rk.from_model.workload(model, 8, 128)
    assert work.placement == ("parameters by their own NamedShardings; batch 8 over fsdp "
                              "(the model's rules): 2 per device")
    own = [x.sharding.spec for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert [x.sharding.spec for x in jax.tree.leaves(work.args[0])] == own
    assert work.args[1].sharding.spec == PartitionSpec(("data", "stage", "fsdp",
                                                        "fsdp_transpose", "expert"))


@needs_4
def test_every_caption_claims_only_the_sharding_the_compiled_program_takes():
    """compare's, plan's and fit's captions (`common.step_caption`): the compiled argument
    shardings (a record's or a train step's `parameter_bytes_per_device`) win over what the
    placed parameters say; without them, the placed parameters' shards."""
    import types
    from remat_kit.cli.common import step_caption
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    params = {"w": jax.ShapeDtypeStruct((8, 4), np.float32,
                                        sharding=NamedSharding(mesh, PartitionSpec("fsdp")))}
    compiled = lambda n: [types.SimpleNamespace(parameter_bytes_per_device=n)]  # noqa: E731
    assert step_caption("train step", mesh, params, compiled(128)) == (
        "train step; parameters and gradients and optimizer state whole on every device of "
        "fsdp:4")
    sharded = "value-and-grad; gradients sharded like the parameters over fsdp:4"
    assert step_caption("value-and-grad", mesh, params, compiled(32)) == sharded
    assert step_caption("value-and-grad", mesh, params, []) == sharded


@needs_4
def test_plan_s_caption_is_checked_against_its_compiles(tmp_path):
    """Data parallel: every parameter whole on every device of the plan's compiles, and the
    caption says so (it claimed them sharded like the parameters)."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", "tiny", "--batch", "4", "--seq", "16", "--mesh",
                     "data:4", "--budgets", "64MiB", "--no-presets", "--groups", "1",
                     "--step", "grad", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["context"]["step"] == (
        "value-and-grad; parameters and gradients whole on every device of data:4; on "
        "--mesh (1 axis data:4)")


@needs_4
def test_a_model_that_asserts_its_batch_splits_over_its_mesh_is_measured_whole():
    """A codebase's code may assert that its batch splits over its mesh (MaxText's flash
    attention does): one chip's share traced alone fails there, so the residuals are read
    from the whole program, as where its own shard_map splits the batch."""
    work = rk.from_model.workload(sharded_nnx.checked(), 4, SEQ)
    assert work.placement.endswith("batch 4 over fsdp (the model's rules): 1 per device")
    assert work.per_device[1] is work.args


@needs_4
@needs_libtpu
def test_named_shardings_on_a_mesh_larger_than_the_target_are_one_line(capsys):
    """The parameters' own NamedShardings (no constraint names the mesh) over 4 devices, on
    a 1-chip target: one line naming both."""
    assert cli.main(["compare", "--model", "tests/zoo/sharded_nnx.py:model", "--batch", "8",
                     "--seq", "16", "--policies", "full", "--target", "tpu:v5e:1x1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "remat-kit compare: error: the model builds its own mesh (diloco: 1, data: 1, stage: 1, "
        "fsdp: 4, fsdp_transpose: 1, context: 1, context_autoregressive: 1, tensor: 1, "
        "tensor_transpose: 1, tensor_sequence: 1, expert: 1, autoregressive: 1 over 4 cpu "
        "devices) and target tpu:v5e:1x1 has 1 device: name a target with at least 4, or "
        "build the model's mesh over at most 1"]


@needs_4
@needs_libtpu
@pytest.mark.parametrize("target", ["tpu:v5p:2x2x1", "tpu:v5p:1x1x1"])
def test_maxtext_s_own_flash_attention_is_priced_at_the_causal_count(target):
    """MaxText itself (skipped where it is not installed), `attention=flash` built over the
    target's chips as its ahead-of-time compile builds it: splash made inside its own jit-ed
    wrapper, its mask constrained to its mesh and handed to a shard_map, each kernel priced
    at the causal block count (10 of 4 x 4 blocks of 512), on its fsdp mesh and on one chip.
    Traced only; benchmarks/codebase_flash.py compiles it."""
    pytest.importorskip("maxtext")
    import re
    from benchmarks import codebase_flash, codebase_mesh
    from remat_kit.measure import kernels, targets
    from remat_kit.policy.spec import parse
    chips = targets.devices(target)
    size = dict(codebase_mesh.DEFAULTS, emb=256, layers=1, seq=2048, per_device_batch=1,
                fsdp=len(chips), attention="flash", scan=True)
    work = rk.from_model.workload(codebase_mesh.build(size, chips), len(chips), 2048)
    program = jax.make_jaxpr(jax.value_and_grad(work.loss_for_policy(parse("none"))))(
        *work.args)
    found = kernels.price(program, "tpu").kernels
    once = codebase_flash.causal_forward(1, 2, 2048, 128)
    kind = lambda k: re.match(r"splash_mha_(fwd|dq|dkv)", k.name).group(1)  # noqa: E731
    assert {kind(k) for k in found} == {"dkv", "dq", "fwd"}  # the forward again: own remat
    assert all(k.flops == codebase_flash.ROLES[kind(k)] * once and not k.mask for k in found)


@needs_4
def test_a_compile_read_back_keeps_the_bytes_each_argument_takes(empty_cache):  # noqa: F811
    """fit's and plan's captions are checked against `Compiled.argument_bytes`: read back
    from the figure cache (no executable), a program keeps them."""
    from remat_kit.measure import lowering
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    w = jax.ShapeDtypeStruct((64, 32), np.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    x = jax.ShapeDtypeStruct((8, 32), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    fn = lambda w, x: jax.numpy.sum((x @ w.T) ** 2)  # noqa: E731
    fresh, again = (lowering.compile_for(fn, w, x, target="cpu") for _ in range(2))
    assert fresh.compiled is not None and again.compiled is None
    assert fresh.argument_bytes == again.argument_bytes == (64 * 32, 8 * 32 * 4)


@needs_4
def test_maxtext_s_scanned_decoder_has_its_layers_found():
    """MaxText itself (skipped where it is not installed): its scanned stack holds each
    parameter with the layer axis at 1 ([embed, layers, mlp]); the map finds its two
    layers and takes its own remat over (traced only)."""
    pytest.importorskip("maxtext")
    from benchmarks import codebase_mesh
    size = dict(codebase_mesh.DEFAULTS, emb=512, layers=2, seq=128)
    work = rk.from_model.workload(codebase_mesh.build(size, jax.devices()[:4]), 8, 128)
    assert work.model_map.line() == (
        "2 x LlamaDecoderLayer, scanned: yes; own remat: 2 x jax.checkpoint(nothing_saveable) "
        "around each layer, taken over; outside: inner/decoder/decoder_norm, "
        "inner/decoder/logits_dense, inner/token_embedder, loss")


@needs_libtpu
@pytest.mark.xfail(reason="at emb 256, seq 256 the peak is 122,264,224 B against MaxText's "
                   "126,273,792 (0.968): the difference is not yet found", strict=False)
def test_maxtext_s_own_compile_is_matched_per_chip(tmp_path):
    """MaxText itself (skipped where it is not installed; minutes, so a benchmark target):
    `benchmarks/codebase_mesh.py` at emb 256, seq 256, scanned, fsdp:4 on tpu:v5p:2x2x1;
    `full`'s per-chip arguments, FLOPs and peak within 2% of MaxText's own train_compile
    (MaxText's own `none` recomputes everything in a scanned stack: not remat-kit's none)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("maxtext")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "codebase_mesh.py"),
                    "--emb", "256", "--seq", "256", "--policies", "full",
                    "--out", str(tmp_path)], check=True, capture_output=True, cwd=root,
                   env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": root})
    [found] = tmp_path.glob("*.json")
    for row in json.loads(found.read_text())["rows"]:
        for key in ("arguments", "flops", "peak"):
            assert row["ours"][key] == pytest.approx(row["maxtext"][key], rel=0.02), (
                row["policy"], key)
