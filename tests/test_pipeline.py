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
from remat_kit.trace import pipeline
from tests.test_targets import needs_libtpu
from tests.zoo import gpipe_nnx

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
def test_what_a_stage_passes_on_is_priced_at_ici_bandwidth():
    target = targets.parse_target("tpu:v5p:2x2x1")
    work = rk.from_model.workload(gpipe_nnx.model(target.devices), BATCH, SEQ)
    step = jax.value_and_grad(work.loss_for_policy(rk.parse("full")))
    compiled = lowering.lower(step, lowering.place(work.args, target), target).compile()
    # one microbatch's activations (2 x 16 x 32 float32) per iteration, forward and back
    passed = sum(op.trips * op.ici_bytes for op in time_model.compiled_ops(compiled))
    assert passed == 2 * 7 * (BATCH // gpipe_nnx.MICRO) * SEQ * gpipe_nnx.DIM * 4
    line = target.roofline
    without = dataclasses.replace(line, ici_bandwidth=None)
    assert time_model.compiled_seconds(compiled, line) - time_model.compiled_seconds(
        compiled, without) == pytest.approx(passed / 9e10)


def test_a_policy_s_saved_names_are_read_from_its_closure():
    both = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.save_only_these_names("iteration_input", "decoder_layer_input"))
    assert pipeline.saved_names(both) == ("decoder_layer_input", "iteration_input")
