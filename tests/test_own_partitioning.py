"""A model's own partitioning: parameters placed by their annotations (linen logical axes
and rules, a DenseGeneral kernel by its 3 names, NNX mesh-axis metadata, a scanned stack),
the batch over the data axes, on the model's own mesh in its own device order; per-device
figures those of the sharded step, equal to hand-written `jax.jit(...)` compiles; bad
meshes refused in one line.

Runs on the 8 host devices tests/conftest.py creates (4 of them for the meshes).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import remat_kit as rk
from remat_kit import cli
from remat_kit import mesh as rk_mesh
from remat_kit.decide import step as rk_step
from remat_kit.errors import MeshError
from remat_kit.measure import lowering, targets
from tests.test_sharded_step import (check_value_and_grad, hand_train_step, memory,
                                     shard_bytes)
from tests.test_targets import needs_libtpu
from tests.zoo import dense_general_linen, logical_linen, logical_nnx

BATCH, SEQ = 8, 16
pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 host devices")


def whole_flops(model) -> float:
    """The step's FLOPs on one device (no mesh)."""
    (one,) = rk.measure(rk.from_model.workload(model, BATCH, SEQ), policies=["full"])
    return one.flops


def specs(work) -> dict:
    return {jax.tree_util.keystr(k): x.sharding.spec
            for k, x in jax.tree_util.tree_flatten_with_path(work.args[0])[0]}


@pytest.mark.parametrize("make, spec, expected", [
    (logical_linen.model, "fsdp:4", {"['layers_0']['wi_0']": PartitionSpec("fsdp", None),
                                     "['layers_0']['out']": PartitionSpec(None, None, "fsdp")}),
    (logical_linen.scanned, "data:2,fsdp:2", {
        "['layers']['wi_0']": PartitionSpec(None, "fsdp", None),  # [layers, embed, mlp]
        "['layers']['query']": PartitionSpec(None, "fsdp", None, None)}),
])
def test_linen_logical_axes_place_the_parameters_by_the_model_s_rules(make, spec, expected):
    mesh = rk_mesh.make(spec, jax.devices()[:4])
    with nn.logical_axis_rules(logical_linen.RULES):  # where a training script sets them
        work = rk.from_model.workload(make(), BATCH, SEQ, mesh=mesh)
    found = specs(work)
    assert {k: found[k] for k in expected} == expected
    assert work.args[1].sharding.spec == PartitionSpec(("data", "fsdp") if "data" in spec
                                                       else "fsdp")
    check_value_and_grad(work, whole_flops(make()))


def test_nnx_sharding_metadata_places_the_parameters():
    mesh = rk_mesh.make("fsdp:4", jax.devices()[:4])
    work = rk.from_model.workload(logical_nnx.model(), BATCH, SEQ, mesh=mesh)
    found = specs(work)
    # ("tensor", "fsdp") on a mesh without tensor: split over fsdp alone.
    assert found["['embedding'].value"] == PartitionSpec(None, "fsdp")
    assert found["['layers'][0]['up']['kernel'].value"] == PartitionSpec("fsdp", None)
    assert found["['layers'][0]['attn_norm']['scale'].value"] == PartitionSpec()
    check_value_and_grad(work, whole_flops(logical_nnx.model()))


def test_a_model_s_own_mesh_is_used_in_its_own_device_order():
    work = rk.from_model.workload(logical_linen.ordered(), BATCH, SEQ)
    assert [d.id for d in work.mesh.devices.flat] == [0, 2, 1, 3]
    assert dict(work.mesh.shape) == {"data": 2, "fsdp": 2}
    assert work.args[1].sharding.spec == PartitionSpec(("data", "fsdp"))  # activation_batch
    assert specs(work)["['layers_0']['wi_0']"] == PartitionSpec("fsdp", None)
    check_value_and_grad(work, whole_flops(logical_linen.model()))


def test_train_step_of_a_model_s_partitioning_equals_a_hand_written_one():
    mesh = rk_mesh.make("fsdp:4", jax.devices()[:4])
    with nn.logical_axis_rules(logical_linen.RULES):
        work = rk.from_model.workload(logical_linen.model(), BATCH, SEQ, mesh=mesh)
    optimizer = rk_step.default_optimizer()
    made = rk_step.workload_step(work, rk.parse("full"), optimizer)
    assert jax.tree.map(lambda x: x.sharding, made.args[1][0].mu) == jax.tree.map(
        lambda x: x.sharding, made.args[0])
    figures = rk.step_memory(work, BATCH, SEQ, "full", optimizer=optimizer)
    hand = memory(hand_train_step(work, optimizer).lower(*made.args).compile())
    assert (figures.argument_size_in_bytes, figures.output_size_in_bytes,
            figures.temp_size_in_bytes) == (hand["argument_size_in_bytes"],
                                            hand["output_size_in_bytes"],
                                            hand["temp_size_in_bytes"])


def test_compare_measures_a_model_on_its_own_mesh(capsys):
    assert cli.main(["compare", "--model", "tests/zoo/logical_linen.py:ordered", "--batch",
                     "8", "--seq", "16", "--policies", "full"]) == 0
    assert ("per device of 4 (data:2,fsdp:2); value-and-grad; gradients sharded like the "
            "parameters over data:2,fsdp:2; on the model's own mesh (2 axes data:2,fsdp:2; "
            "device order [0, 2, 1, 3])") in " ".join(capsys.readouterr().out.split())


def test_another_mesh_than_the_model_s_own_is_refused_in_one_line(capsys):
    assert cli.main(["compare", "--model", "tests/zoo/logical_linen.py:ordered", "--batch",
                     "8", "--seq", "16", "--mesh", "fsdp:8", "--policies", "full"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        "the model builds its own mesh (data: 2, fsdp: 2 over 4 cpu devices) and --mesh asks "
        "for fsdp:8: drop --mesh to measure on the model's own, or give --mesh data:2,fsdp:2; "
        "or build the model over fsdp:8") in err, err


def test_a_mesh_axis_the_model_s_rules_do_not_know_is_refused():
    mesh = rk_mesh.make("data:2,tensor:2", jax.devices()[:4])
    with nn.logical_axis_rules(logical_linen.OWN_RULES), pytest.raises(MeshError) as e:
        rk.from_model.workload(logical_linen.model(), BATCH, SEQ, mesh=mesh)
    assert str(e.value) == (
        "mesh data:2,tensor:2: mesh axis 'tensor' is not in the model's logical-axis rules, "
        "which map to mesh axes ['data', 'fsdp']; build the mesh from those axes "
        "(e.g. --mesh data:4)")


def test_a_batch_the_mesh_s_batch_axes_do_not_split_is_refused_or_noted():
    mesh = rk_mesh.make("data:2,fsdp:2", jax.devices()[:4])
    with nn.logical_axis_rules(logical_linen.RULES), pytest.raises(MeshError) as e:
        rk.from_model.workload(logical_linen.model(), 6, SEQ, mesh=mesh)
    assert str(e.value) == (
        "batch 6 does not split over the 4 devices of mesh axes ['data', 'fsdp'] "
        "(data:2,fsdp:2); give a batch that is a multiple of 4")
    # On the model's own mesh, as the model built it: the tokens whole, and said so.
    work = rk.from_model.workload(logical_linen.ordered(), 6, SEQ)
    assert work.args[1].sharding.spec == PartitionSpec(None)
    assert ("batch 6 does not split over the 4 devices of mesh axes ['data', 'fsdp'] "
            "(data:2,fsdp:2): the tokens are whole on every device of the model's mesh"
            ) in work.notes


@needs_libtpu
def test_an_ahead_of_time_target_keeps_the_model_s_device_order():
    work = rk.from_model.workload(logical_linen.ordered(), BATCH, SEQ)
    placed = lowering.place(work.args, targets.parse_target("tpu:v5e:2x2"))
    mesh = placed[1].sharding.mesh
    assert [d.id for d in mesh.devices.flat] == [0, 2, 1, 3]
    assert mesh.devices.flat[0].platform == "tpu" and dict(mesh.shape) == {"data": 2, "fsdp": 2}
    with pytest.raises(MeshError, match="build the model's mesh over at most 1"):
        lowering.place(work.args, targets.parse_target("tpu:v5e:1x1"))


def hand_value_and_grad(model, mesh):
    """A training script's own step of `model`: its boxed parameters' shardings by
    their names and remat_kit's rules, the tokens over fsdp, `jax.jit(value_and_grad)`
    traced under `jax.set_mesh` and `nn.logical_axis_rules`; compiled."""
    rules = rk_mesh.rules(mesh.shape)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = nn.unbox(boxed)  # off the mesh: the boxes constrain nothing

    def loss(params, tokens):
        return rk.from_model.next_token_loss(model.apply({"params": params}, tokens), tokens)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        step = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, tokens.sharding),
                       out_shardings=(rk_mesh.replicated(mesh), shardings))
        return step.lower(params, tokens).compile()


@pytest.mark.parametrize("spec, query", [("fsdp:4", PartitionSpec(None, "fsdp", None, None)),
                                         ("fsdp:2,tensor:2",
                                          PartitionSpec(None, "fsdp", "tensor", None))])
def test_dense_general_kernels_are_placed_by_their_three_names(spec, query):
    # nn.DenseGeneral constrains its flat kernel by 3 names (google/flax#3676): measured
    # as the same model with whole kernels, which a hand-written step compiles.
    mesh = rk_mesh.make(spec, jax.devices()[:4])
    work = rk.from_model.workload(dense_general_linen.model(), BATCH, SEQ, mesh=mesh)
    found = specs(work)
    assert (found["['layers']['query']['kernel']"], found["['layers']['out']['kernel']"]) == (
        query, PartitionSpec(None, *query[2:], "fsdp"))  # [layers, heads, kv, embed]
    (rec,) = rk.measure(work, policies=["none"])
    hand = memory(hand_value_and_grad(dense_general_linen.model(whole_kernels=True), mesh))
    assert {k: getattr(rec, k) for k in hand} == hand
    assert rec.argument_size_in_bytes == shard_bytes(work.args[0]) + shard_bytes(work.args[1])
