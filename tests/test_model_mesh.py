"""The mesh a step is measured on: host devices the CLI makes for --mesh (no XLA_FLAGS); a
model's own mesh, whatever its axes are called, in its own device order, on host devices
and on TPU slices ahead of time, equal to a hand-written compile of the same step;
--mesh equal to it or refused naming both."""

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec

import remat_kit as rk
from remat_kit import cli
from remat_kit import mesh as rk_mesh
from remat_kit.measure import lowering, targets
from remat_kit.measure.costs import loop_scaled_costs
from remat_kit.trace import retarget
from remat_kit.decide import step as rk_step
from tests.test_sharded_step import check_value_and_grad, hand_train_step, memory, shard_bytes
from tests.test_targets import needs_libtpu
from tests.zoo import axes_linen, axes_nnx

BATCH, SEQ = 8, 16


def test_the_cli_makes_the_host_devices_mesh_needs_without_xla_flags(tmp_path):
    # A fresh process whose backend has not started: --mesh data:2 needs 2 CPU devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "remat_kit.cli", "compare", "--config", "tiny",
                           "--batch", "2", "--seq", "16", "--mesh", "data:2", "--policies",
                           "full", "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    context = json.loads(out.read_text())["context"]
    assert (context["devices"], context["mesh"]) == (2, "data:2")


# Models over meshes of their own (tests/zoo/axes_linen.py, axes_nnx.py), on host devices.
OWN = {"five_permuted": (axes_linen.five_permuted, lambda: axes_linen.plain()),
       "five_scanned": (axes_linen.five_scanned, lambda: axes_linen.plain(scan=True)),
       "nnx": (axes_nnx.model, axes_nnx.plain)}
needs_8 = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 host devices")


@needs_8
@pytest.mark.parametrize("name", OWN)
def test_a_model_s_own_mesh_with_axes_of_its_own_is_the_mesh(name):
    make, plain = OWN[name]
    work = rk.from_model.workload(make(), BATCH, SEQ)
    own = work.own_mesh
    assert dict(work.mesh.shape) == axes_linen.FIVE == dict(own.shape)
    assert [d.id for d in work.mesh.devices.flat] == [d.id for d in own.devices.flat]
    assert work.args[1].sharding.spec == PartitionSpec(("replica", "shard"))
    (one,) = rk.measure(rk.from_model.workload(plain(), BATCH, SEQ), policies=["full"])
    check_value_and_grad(work, one.flops)  # shard bytes, FLOPs / 4, a hand-written step


def hand_compile(work, target):
    """A training script's own ahead-of-time compile of value-and-grad on its mesh."""
    params = work.args[0]
    step = jax.jit(jax.value_and_grad(work.loss_for_policy(rk.parse("full"))),
                   out_shardings=(rk_mesh.replicated(work.mesh),
                                  jax.tree.map(lambda x: x.sharding, params)))
    return step.trace(*work.args).lower(lowering_platforms=("tpu",)).compile()


@needs_8
@needs_libtpu
@pytest.mark.parametrize("make, target", [(axes_linen.twelve, "tpu:v5p:2x2x1"),
                                          (axes_nnx.model, "tpu:v5e:2x2")])
def test_on_a_tpu_slice_the_model_s_own_mesh_gives_its_own_compile(make, target):
    """Built over this machine's devices and measured for the slice with no mesh asked, the
    figures are those of the same model built over the slice's chips and compiled by hand."""
    work = rk.from_model.workload(make(), BATCH, SEQ)
    placed = lowering.place(work.args, targets.parse_target(target))
    mesh = placed[1].sharding.mesh
    assert mesh.devices.flat[0].platform == "tpu" and dict(mesh.shape) == dict(work.mesh.shape)
    assert [d.id for d in mesh.devices.flat] == [0, 2, 1, 3]
    (rec,) = rk.measure(work, policies=["full"], target=target)
    hand = hand_compile(rk.from_model.workload(make(targets.devices(target)), BATCH, SEQ),
                        target)
    assert {k: getattr(rec, k) for k in memory(hand)} == memory(hand)
    assert rec.flops == loop_scaled_costs(hand)[0]["flops"]


@needs_8
@needs_libtpu
def test_the_train_step_on_the_model_s_own_mesh_on_a_slice_is_its_own():
    """The train step (AdamW, state donated) on the 12-axis model's own mesh for a slice:
    the figures of the training codebase's own jit of it on the slice's chips."""
    optimizer = rk_step.default_optimizer()
    work = rk.from_model.workload(axes_linen.twelve(), BATCH, SEQ)
    figures = rk.step_memory(work, BATCH, SEQ, "full", optimizer=optimizer,
                             target="tpu:v5p:2x2x1")
    own = rk.from_model.workload(axes_linen.twelve(targets.devices("tpu:v5p:2x2x1")), BATCH,
                                 SEQ)
    made = rk_step.workload_step(own, rk.parse("full"), optimizer)
    hand = memory(hand_train_step(own, optimizer).trace(*made.args).lower(
        lowering_platforms=("tpu",)).compile())
    assert (figures.argument_size_in_bytes, figures.output_size_in_bytes,
            figures.temp_size_in_bytes) == (hand["argument_size_in_bytes"],
                                            hand["output_size_in_bytes"],
                                            hand["temp_size_in_bytes"])


@needs_libtpu
def test_the_cli_measures_the_model_s_own_mesh_on_a_slice_or_refuses_another(tmp_path, capsys):
    common = ["compare", "--model", "tests/zoo/axes_linen.py:twelve", "--batch", "8", "--seq",
              "16", "--target", "tpu:v5p:2x2x1", "--policies", "full"]
    spec = rk_mesh.spec_text(axes_linen.TWELVE)
    out = tmp_path / "out.json"
    assert cli.main([*common, "--mesh", spec, "--json", str(out)]) == 0  # the same: taken
    context = json.loads(out.read_text())["context"]
    assert (context["devices"], context["mesh"]) == (4, spec)
    assert context["step"] == f"value-and-grad; gradients sharded like the parameters over {spec}"
    assert context["mesh_origin"] == (f"the model's own mesh (12 axes {spec}; device order "
                                      "[0, 2, 1, 3])")
    capsys.readouterr()
    assert cli.main([*common, "--mesh", "data:4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "remat-kit compare: error: --model 'tests/zoo/axes_linen.py:twelve': the model builds "
        f"its own mesh ({retarget.describe(axes_linen.own_mesh(axes_linen.TWELVE))}) and "
        f"--mesh asks for data:4: drop --mesh to measure on the model's own, or give --mesh "
        f"{spec}; or build the model over data:4"]


@needs_libtpu
def test_a_two_slice_target_adds_a_data_axis_across_the_slices():
    two = targets.parse_target("tpu:v5p:2x2x1:slices=2")
    assert (str(two), two.slices, len(two.devices)) == ("tpu:v5p:2x2x1:slices=2", 2, 8)
    mesh = targets.make_mesh(two, {"fsdp": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert [[d.slice_index for d in row] for row in mesh.devices] == [[0] * 4, [1] * 4]
    merged = targets.make_mesh(two, {"data": 2, "fsdp": 2})  # the slices outside data
    assert dict(merged.shape) == {"data": 4, "fsdp": 2}
    assert [d.slice_index for d in merged.devices[:, 0]] == [0, 0, 1, 1]
    with pytest.raises(targets.TargetError, match="needs 8 devices; each slice of target "
                       "tpu:v5p:2x2x1:slices=2 has 4"):
        targets.make_mesh(two, {"fsdp": 8})
    with pytest.raises(targets.TargetError,
                       match="give slices=N with N a number of slices from 1 to 512"):
        targets.parse_target("tpu:v5p:2x2x1:slices=0")
    assert str(targets.parse_target("tpu:v5p:2x2x1:slices=1")) == "tpu:v5p:2x2x1"


@needs_libtpu
def test_on_two_slices_a_chip_holds_one_slice_s_shard_and_the_step_pays_the_dcn(tmp_path):
    cfg = rk.models.get_config("tiny_llama")
    two, one = (targets.parse_target(t) for t in ("tpu:v5p:2x2x1:slices=2", "tpu:v5p:2x2x1"))
    # A global batch of 8 on two slices: each slice's chips run what one slice runs on 4.
    work = rk.models.workload(cfg, 8, 64, mesh=targets.make_mesh(two, {"fsdp": 4}))
    (both,) = rk.measure(work, policies=["full"], target=two)
    (alone,) = rk.measure(rk.models.workload(cfg, 4, 64, mesh=targets.make_mesh(
        one, {"fsdp": 4})), policies=["full"], target=one)
    assert (both.argument_size_in_bytes, both.output_size_in_bytes) == (
        alone.argument_size_in_bytes, alone.output_size_in_bytes)
    assert both.flops == pytest.approx(alone.flops, rel=0.001)
    # Every gradient crosses the slices, all-reduced at the DCN's bandwidth on top of the
    # slice's own step (TPU tiles pad the buffers sent: more than the shard's bytes).
    grads = shard_bytes(work.args[0])
    assert both.predicted_seconds >= alone.predicted_seconds + grads / two.roofline.dcn_bandwidth
    out = tmp_path / "out.json"
    assert cli.main(["compare", "--config", "tiny_llama", "--batch", "8", "--seq", "64",
                     "--mesh", "fsdp:4", "--target", str(two), "--policies", "full",
                     "--json", str(out)]) == 0
    context = json.loads(out.read_text())["context"]
    assert (context["devices"], context["mesh"], context["mesh_origin"]) == (
        8, "data:2,fsdp:4", "--mesh over 2 slices, data parallel across them (2 axes "
        "data:2,fsdp:4)")


@needs_8
def test_any_axis_names_in_a_mesh_the_model_s_rules_use_and_none_other():
    mesh = rk_mesh.make(axes_linen.FIVE, jax.devices()[:4])  # --mesh stage:1,replica:2,...
    ruled = axes_linen.Llama(axes_linen.Config(batch_name="activation_batch",
                                               rules=axes_linen.FIVE_RULES))
    work = rk.from_model.workload(ruled, BATCH, SEQ, mesh=mesh)
    assert work.args[1].sharding.spec == PartitionSpec(("replica", "shard"))
    assert work.args[0]["layers_0"]["wi_0"].sharding.spec == PartitionSpec("shard", "model")
    with pytest.raises(rk_mesh.MeshError) as e:
        rk.from_model.workload(axes_linen.plain(), BATCH, SEQ, mesh=mesh)
    assert str(e.value) == (
        f"mesh {rk_mesh.spec_text(axes_linen.FIVE)}: mesh axis 'replica' is named by no "
        "parameter of the model and "
        "no logical-axis rule, so it would split nothing; the axes it can use: ['data', "
        "'fsdp', 'tensor']")
