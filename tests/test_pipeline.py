"""A pipelined model (tests/zoo/gpipe_nnx.py: a GPipe over `shard_map` + `ppermute`, 8
blocks as 4 stages of 2, 4 microbatches) through remat_kit: compiled on CPU and on a TPU
slice, its model map naming the pipeline, each chip holding its stage's parameters, the
policy applied to the layers within a stage, grads equal to the unpipelined model's.

Runs on the 8 host devices tests/conftest.py creates (4 of them for the stages).
"""

import dataclasses

import flax.nnx as nnx
import jax
import numpy as np
import pytest

import remat_kit as rk
from remat_kit import cli
from remat_kit.flax.from_model import next_token_loss
from remat_kit.measure import lowering, targets, time_model
from remat_kit.measure.explain import stack_stored_bytes
from remat_kit.trace import pipeline, regions
from tests.test_targets import needs_libtpu
from tests.zoo import gpipe_nnx, maxtext_pipeline_nnx

MODEL = "tests/zoo/gpipe_nnx.py:model"
BATCH, SEQ = 8, 16
pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 host devices")


def test_the_model_map_names_the_pipeline():
    work = rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ)
    pipe = work.model_map.pipeline
    assert (pipe.axis, pipe.stages, pipe.iterations, pipe.microbatches, pipe.schedule,
            pipe.own_remat) == ("stage", 4, 7, 4, "GPipe", "")
    assert pipe.bubble == pytest.approx(3 / 7)
    assert work.model_map.line().endswith(
        "; pipeline: 4 stages over stage, 4 microbatches (x repeats), GPipe (bubble 3/7 of "
        "the iterations, every microbatch in flight); no own remat per iteration; the "
        "policy applies to the layers within a stage")
    assert work.model_map.to_dict()["pipeline"]["microbatches"] == 4


def test_each_chip_holds_its_stage_s_parameters():
    work = rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ)
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(work.args[0])
               if "blocks" in jax.tree_util.keystr(path)]
    assert {leaf.sharding.shard_shape(leaf.shape) for leaf in kernels} == {
        (2, gpipe_nnx.DIM, gpipe_nnx.HIDDEN), (2, gpipe_nnx.HIDDEN, gpipe_nnx.DIM)}


def test_the_policy_applies_within_a_stage_on_cpu():
    none, full = rk.measure(rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ),
                            policies=["none", "full"])
    assert none.error is None and full.error is None
    assert full.temp_size_in_bytes < none.temp_size_in_bytes
    assert full.flops > none.flops  # the stages' forward again
    # none saves each block's MLP activation, for every microbatch and iteration
    assert set(none.residual_bytes_by_tag) == {"decoder_layer_input", "mlp_act"}
    assert set(full.residual_bytes_by_tag) == {"decoder_layer_input"}


def test_grads_equal_the_unpipelined_model_s():
    work = rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ)
    graph, params, rest = nnx.split(gpipe_nnx.GPipe(gpipe_nnx.model().mesh, nnx.Rngs(0)),
                                    nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, gpipe_nnx.VOCAB)

    def unpipelined(p):  # the same blocks one after another, the same loss
        model = nnx.merge(graph, p, rest)
        return next_token_loss(gpipe_nnx.sequential(model, tokens), tokens)

    want = jax.grad(unpipelined)(params)
    for policy in ("none", "full"):
        got = jax.grad(work.loss_for_policy(rk.parse(policy)))(params, tokens, rest)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     got, want)


def test_compare_and_explain_run_on_cpu(capsys):
    assert cli.main(["compare", "--model", MODEL, "--batch", "8", "--seq", "16",
                     "--policies", "none,full"]) == 0
    got = capsys.readouterr()
    out = got.out + got.err
    assert "; pipeline: 4 stages over stage, 4 microbatches" in out
    assert "include the bubble (3/7 of the iterations), as compiled" in out
    assert cli.main(["explain", "--model", MODEL, "--batch", "8", "--seq", "16",
                     "--policy", "full"]) == 0


@needs_libtpu
def test_a_tpu_slice_compiles_the_pipeline():
    devices = targets.devices("tpu:v5p:2x2x1")
    work = rk.from_model.workload(gpipe_nnx.model(devices), BATCH, SEQ)
    none, full = rk.measure(work, policies=["none", "full"], target="tpu:v5p:2x2x1")
    assert none.error is None and full.error is None
    assert full.peak_memory_in_bytes < none.peak_memory_in_bytes
    assert work.model_map.pipeline.stages == 4


@needs_libtpu
def test_explain_takes_a_block_out_of_its_stage_on_a_tpu_slice(capsys):
    assert cli.main(["explain", "--model", "tests/zoo/gpipe_nnx.py:on_v5p", "--batch", "8",
                     "--seq", "16", "--policy", "full", "--target", "tpu:v5p:2x2x1"]) == 0
    out = capsys.readouterr().out
    # one microbatch's stream per layer run: 2 layers x 7 iterations on each chip
    row = "│ decoder_layer_input │ tag  │ [2, 16, 32] │ float32 │ 4.00 KiB │ saved "
    assert row in out
    assert "model (14 layers) │ 56.00 KiB" in out
    assert "one layer's value-and-grad, XLA TPU compile (v5p:2x2x1, AOT)" in out


@needs_libtpu
def test_what_a_stage_passes_on_is_priced_at_ici_bandwidth():
    target = targets.parse_target("tpu:v5p:2x2x1")
    work = rk.from_model.workload(gpipe_nnx.model(target.devices), BATCH, SEQ)
    step = jax.value_and_grad(work.loss_for_policy(rk.parse("full")))
    compiled = lowering.lower(step, lowering.place(work.args, target), target).compile()
    # one microbatch's activations (2 x 16 x 32 float32) per iteration, forward and back
    ops = time_model.compiled_ops(compiled)
    passed = sum(op.trips * op.ici_bytes for op in ops if "CollectivePermute" in op.opcode)
    assert passed == 2 * 7 * (BATCH // gpipe_nnx.MICRO) * SEQ * gpipe_nnx.DIM * 4
    # every collective's bytes (the permutes and the gradients' reductions) at 90 GB/s
    sent = sum(op.trips * op.ici_bytes for op in ops)
    assert sent > passed
    line = target.roofline
    without = dataclasses.replace(line, ici_bandwidth=None)
    assert time_model.compiled_seconds(compiled, line) - time_model.compiled_seconds(
        compiled, without) == pytest.approx(sent / 9e10)


def test_a_policy_s_saved_names_are_read_from_its_closure():
    both = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.save_only_these_names("iteration_input", "decoder_layer_input"))
    assert pipeline.saved_names(both) == ("decoder_layer_input", "iteration_input")


@needs_libtpu
@pytest.mark.parametrize("target, said", [
    ("tpu:v5p:1x1x1", "the model builds its own mesh (stage: 4 over 4 cpu devices) and target "
                      "tpu:v5p:1x1x1 has 1 device: name a target with at least 4, or build "
                      "the model's mesh over at most 1"),
    ("tpu:v5p:2x2x1", "the model runs a shard_map over its own mesh (stage: 4 over 4 cpu "
                      "devices), which is not rebuilt for target tpu:v5p:2x2x1: build that "
                      "mesh over the target's chips (remat_kit.measure.targets.devices("
                      "'tpu:v5p:2x2x1')), as MaxText builds its own for an ahead-of-time "
                      "compile")])
def test_a_pipeline_the_target_cannot_run_is_refused_in_one_line(capsys, target, said):
    assert cli.main(["compare", "--model", MODEL, "--batch", "8", "--seq", "16", "--target",
                     target, "--policies", "none"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"remat-kit compare: error: {said}"]


def test_a_maxtext_style_pipeline_s_own_remat_is_named_and_nests_the_policy():
    work = rk.from_model.workload(maxtext_pipeline_nnx.model(), BATCH, SEQ)
    pipe = work.model_map.pipeline
    assert (pipe.stages, pipe.iterations, pipe.microbatches, pipe.own_remat,
            pipe.own_saves) == (4, 7, 4, "save_only_these_names",
                                ("decoder_layer_input", "iteration_input"))
    assert ("own remat per iteration: jax.checkpoint(save_only_these_names) saves "
            "decoder_layer_input, iteration_input") in work.model_map.line()
    assert ("nested remat: the pipeline's own remat per iteration (jax.checkpoint("
            "save_only_these_names)) saves decoder_layer_input, iteration_input; within it "
            "each layer's remat saves what the policy under test saves") in work.notes
    none, full = rk.measure(work, policies=["none", "full"])
    # the iteration's remat stores only its input (the stage's block's input, named
    # decoder_layer_input): the policy changes the recompute only
    assert set(none.residual_bytes_by_tag) == set(full.residual_bytes_by_tag) == {
        "decoder_layer_input"}
    assert full.temp_size_in_bytes == none.temp_size_in_bytes
    # L x one layer's residuals is no figure under the iteration's remat
    assert stack_stored_bytes(work, rk.parse("none"))["layers_residual_bytes"] is None


def test_a_gpipe_s_layer_runs_per_chip_store_l_times_one_layer():
    work = rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ)
    got = stack_stored_bytes(work, rk.parse("full"))
    # each chip runs its 2 layers for 7 iterations, each storing a [2, 16, 32] input
    assert (work.num_layers, got["layer_residual_bytes"], got["layers_residual_bytes"]) == (
        14, 2 * 16 * 32 * 4, 14 * 2 * 16 * 32 * 4)


def test_a_maxtext_style_pipeline_s_grads_equal_the_unpipelined_model_s():
    work = rk.from_model.workload(maxtext_pipeline_nnx.model(), BATCH, SEQ)
    module = maxtext_pipeline_nnx.Pipelined(maxtext_pipeline_nnx.model().mesh, nnx.Rngs(0))
    graph, params, rest = nnx.split(module, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, maxtext_pipeline_nnx.VOCAB)

    def unpipelined(p):
        model = nnx.merge(graph, p, rest)
        return next_token_loss(maxtext_pipeline_nnx.sequential(model, tokens), tokens)

    want = jax.grad(unpipelined)(params)
    got = jax.grad(work.loss_for_policy(rk.parse("full")))(params, tokens, rest)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got, want)


@needs_libtpu
def test_a_maxtext_style_pipeline_compiles_for_a_tpu_slice():
    work = rk.from_model.workload(
        maxtext_pipeline_nnx.model(targets.devices("tpu:v5p:2x2x1")), BATCH, SEQ)
    none, full = rk.measure(work, policies=["none", "full"], target="tpu:v5p:2x2x1")
    assert none.error is None and full.error is None
    assert set(none.residual_bytes_by_tag) == set(full.residual_bytes_by_tag) == {
        "decoder_layer_input"}


@needs_libtpu
def test_constants_placed_on_a_tpu_slice_fold_without_running_there():
    """A position table built with jnp and constrained onto the slice's chips (MaxText's
    pipeline does so) folds to its value; a call under the slice's mesh (a shard_map)
    is left: running either on chips compiled for, not attached, raised AttributeError
    ('Executable' has no 'local_devices')."""
    mesh = jax.sharding.Mesh(np.array(targets.devices("tpu:v5p:2x2x1")), ("stage",))
    on_chips = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def build():
        table = jax.lax.with_sharding_constraint(jax.numpy.arange(8.0), on_chips)
        spread = jax.shard_map(lambda t: t * 2, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                               out_specs=jax.sharding.PartitionSpec())
        return table, spread(table)

    known: dict = {}
    eqns = jax.make_jaxpr(build)().jaxpr.eqns
    for eqn in eqns:
        regions._fold(eqn, known)
    placed, spread = eqns[-2].outvars[0], eqns[-1].outvars[0]
    np.testing.assert_array_equal(known[placed], np.arange(8.0))
    assert eqns[-1].primitive.name == "shard_map" and spread not in known
