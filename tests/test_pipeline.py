"""A pipelined model (tests/zoo/gpipe_nnx.py: a GPipe over `shard_map` + `ppermute`, 8
blocks as 4 stages of 2, 4 microbatches) through remat_kit: compiled on CPU and on a TPU
slice, its model map naming the pipeline, each chip holding its stage's parameters, the
policy applied to the layers within a stage, grads equal to the unpipelined model's.

Runs on the 8 host devices tests/conftest.py creates (4 of them for the stages).
"""

import dataclasses
import types
from fractions import Fraction

import flax.nnx as nnx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import remat_kit as rk
from remat_kit import cli
from remat_kit.decide import stages
from remat_kit.errors import MeshError
from remat_kit.flax import user_model
from remat_kit.flax.from_model import ModelError
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
    assert (pipe.axis, pipe.stages, pipe.iterations, pipe.microbatches, pipe.repeats,
            pipe.schedule, pipe.own_remat) == ("stage", 4, 7, 4, 1, "GPipe", "")
    assert pipe.bubble == pytest.approx(3 / 7)
    assert work.model_map.line().endswith(
        "; pipeline: 4 stages over stage, 4 microbatches, 1 repeat, GPipe (bubble 3/7 of "
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
    assert (pipe.stages, pipe.iterations, pipe.microbatches, pipe.repeats, pipe.own_remat,
            pipe.own_saves) == (4, 7, 4, 1, "save_only_these_names",
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


def _piped(micro=4, repeats=1, both_ways=False, custom=False, devices=4, stages=4):
    """The pipeline `find` reads in a small program (traced, never compiled): a loop of
    micro x repeats + stages - 1 iterations passing [2, 8] to the next stage (and back,
    both_ways), under a custom_vjp (custom), on a mesh of `devices`."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("stage",))

    def body(w, xs):
        def step(carry, i):
            held, outs = carry
            h = jax.numpy.tanh(held @ w[0])
            passed = jax.lax.ppermute(h, "stage", [(s, s + 1) for s in range(stages - 1)])
            if both_ways:
                passed += jax.lax.ppermute(h, "stage", [(s + 1, s) for s in range(stages - 1)])
            return (passed + xs[i % micro], outs.at[i % micro].set(h)), None
        carry = (jax.numpy.zeros_like(xs[0]), jax.numpy.zeros_like(xs))
        (_, outs), _ = jax.lax.scan(step, carry, jax.numpy.arange(micro * repeats + stages - 1))
        return outs.sum()

    run = jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P(),
                        check_vma=False)
    if custom:  # a backward written by hand
        run = jax.custom_vjp(run)
        run.defvjp(lambda w, xs: (run(w, xs), (w, xs)),
                   lambda res, g: jax.tree.map(jax.numpy.zeros_like, res))
    w, xs = jax.numpy.ones((devices, 8, 8)), jax.numpy.ones((micro, 2, 8))
    return pipeline.find(jax.make_jaxpr(run)(w, xs).jaxpr)


@pytest.mark.parametrize("kw, schedule, micro, repeats, bubble, in_flight", [
    ({}, "GPipe", 4, 1, (3, 7), [4, 4, 4, 4]),
    ({"repeats": 2}, "GPipe", 4, 2, (3, 11), [8, 8, 8, 8]),
    ({"micro": 8, "repeats": 2}, "GPipe", 8, 2, (3, 19), [16, 16, 16, 16]),
    # a loop passing both ways is still autodiff's backward (MaxText's circular buffers)
    ({"both_ways": True}, "GPipe", 4, 1, (3, 7), [4, 4, 4, 4]),
    ({"custom": True}, "unknown", 4, 1, (3, 7), [None] * 4)])
def test_the_schedule_microbatches_and_repeats_are_read_from_the_program(
        kw, schedule, micro, repeats, bubble, in_flight):
    pipe = _piped(**kw)
    assert (pipe.schedule, pipe.microbatches, pipe.repeats) == (schedule, micro, repeats)
    assert pipe.bubble == Fraction(*bubble)  # (S - 1) / (r m + S - 1)
    assert [pipe.in_flight(s) for s in range(4)] == in_flight
    assert pipe.to_dict()["in_flight"] == in_flight


def test_a_1f1b_stage_holds_up_to_the_stages_in_flight():
    given = dataclasses.replace(_piped(micro=2), schedule="1F1B")  # not read: given
    assert [given.in_flight(s) for s in range(4)] == [2, 2, 2, 1]
    assert "the first stage holds 2 microbatches in flight, the last 1" in given.text()


def test_microbatches_not_told_from_repeats_are_said_so():
    # xs of 3 microbatches does not divide 4 passes: no size read, the product kept
    pipe = dataclasses.replace(_piped(), told=None)
    assert (pipe.microbatches, pipe.repeats) == (4, None)
    assert "4 microbatches x repeats (not told apart)" in pipe.text()


def test_a_pipeline_past_its_mesh_s_stages_is_refused_in_one_line():
    with pytest.raises(MeshError) as e:
        _piped(devices=2)
    assert str(e.value).startswith(
        "the pipeline passes to stage 3 along mesh axis 'stage', which has 2 device(s) in "
        "the model's mesh: a stage index must be below the axis's size")


class _Planner:
    """A planner's answers without compiles: full remat's program 1,000 B of which 400 B
    are residuals (fixed 600 B); a budget's plan is its own bytes."""

    def measure(self, policy):
        return types.SimpleNamespace(memory_bytes=1000, residual_bytes_by_tag={"x": 400})

    def minimum(self):
        return 1000, 4000

    def frontier(self, budgets):
        return [types.SimpleNamespace(spec=f"plan@{b}", measured_bytes=b) for b in budgets]


def test_a_1f1b_first_stage_gets_the_tightest_plan():
    pipe = dataclasses.replace(_piped(), schedule="1F1B")  # 4 stages, 4 microbatches
    got = stages.per_stage(_Planner(), pipe, 1000)
    # the program holds 4 passes; stage s holds 4 - s: budget 600 + 400 x 4 / (4 - s)
    assert [(sp.in_flight, sp.budget, sp.stage_bytes) for sp in got] == [
        (4, 1000, 1000), (3, 1133, 999), (2, 1400, 1000), (1, 2200, 1000)]
    assert stages.lines(got)[0] == "stage 0 (4 microbatch passes in flight): plan@1000, 1000 B"
    gpipe = stages.per_stage(_Planner(), _piped(), 1000)
    assert stages.lines(gpipe) == [
        "stages 0-3 (4 microbatch passes in flight each): plan@1000, 1000 B"]
    assert stages.maxtext_settings(_piped(repeats=2)) == (
        "ici_pipeline_parallelism=4 num_pipeline_microbatches=4 num_pipeline_repeats=2")


def test_plan_gives_a_plan_per_stage_and_maxtext_s_pipeline_settings(capsys):
    assert cli.main(["plan", "--model", "tests/zoo/maxtext_pipeline_nnx.py:model", "--batch",
                     "8", "--seq", "16", "--budgets", "1", "--uniform", "--emit", "maxtext",
                     "--no-presets", "--cache", ""]) == 0
    out = capsys.readouterr().out
    assert "  stages 0-3 (4 microbatch passes in flight each): full, " in out
    assert ("--emit maxtext, the pipeline: ici_pipeline_parallelism=4 "
            "num_pipeline_microbatches=4 num_pipeline_repeats=1") in out


def test_stages_that_do_not_divide_the_layers_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(gpipe_nnx, "LAYERS", 6)  # 6 blocks over 4 stages
    with pytest.raises(ModelError) as e:
        user_model.traced(MODEL, "int32 tokens [8, 16]", "--batch and --seq",
                          lambda: rk.from_model.workload(gpipe_nnx.model(), BATCH, SEQ))
    assert ("its shard_map splits an argument's axis 0 of size 6 over mesh axis 'stage' of "
            "size 4, which does not divide it (each device takes an equal share: a "
            "pipeline's stages must divide its stacked layers); if it takes other shapes"
            ) in str(e.value)


def test_fit_names_the_batch_in_microbatches():
    pipe = _piped()
    rows = [types.SimpleNamespace(policy="none", size=32), types.SimpleNamespace(
        policy="full", size=76)]
    assert stages.fit_line(pipe, rows, "batch") == (
        "pipeline: largest batch in microbatches: none 32 = 4 x 8, full 76 = 4 x 19; GPipe: "
        "every stage holds every microbatch, so the compiled figure is each stage's, the "
        "first's included")
    assert "the first stage, the tightest, holds 4 of 4" in stages.fit_line(
        dataclasses.replace(_piped(), schedule="1F1B"), rows, "seq")


def test_microbatches_of_one_row_are_told_from_the_stage_buffer():
    pipe = rk.from_model.workload(gpipe_nnx.model(), 4, SEQ).model_map.pipeline
    assert (pipe.microbatches, pipe.repeats) == (4, 1)  # 4 microbatches of 1
