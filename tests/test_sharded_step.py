"""On a mesh, what is measured is the step a sharded training run runs: the gradient
held like the parameters (FSDP's reduce-scatter, data parallelism's all-reduce), and
in the train step the optimizer state sharded likewise. Anchored on hand-written
`jax.jit(..., in_shardings, out_shardings).lower().compile()` of the same program.

Runs on the 8 host devices tests/conftest.py creates (4 of them here).
"""

import json
import math

import jax
import optax
import pytest

import remat_kit as rk
from remat_kit import cli
from remat_kit import mesh as rk_mesh
from remat_kit.decide import step as rk_step
from remat_kit.measure.costs import loop_scaled_costs
from remat_kit.models import get_config

BATCH, SEQ = 8, 32
MESHES = ("fsdp:4", "data:2,fsdp:2", "data:4")
pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    return sum(math.prod(rk_mesh.local_shape(x).shape) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: getattr(m, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                       "temp_size_in_bytes", "alias_size_in_bytes")}


def output_overhead(n_outputs: int) -> int:
    """The loss scalar (f32) and XLA CPU's tuple of output pointers (8 bytes each)."""
    return 4 + 8 * n_outputs


def check_value_and_grad(work, whole_flops: float) -> None:
    """`measure`'s value-and-grad on a mesh: output and argument bytes are the
    parameter shard (output within the loss scalar and its tuple table), FLOPs the
    whole step's over the device count, and every figure equal to a hand-written
    `jax.jit(jax.value_and_grad(loss), out_shardings=(replicated, the params'))`."""
    (rec,) = rk.measure(work, policies=["full"])
    params, rest = work.args[0], work.args[1:]
    n = len(jax.tree.leaves(params))
    assert params and rec.error is None
    assert rec.output_size_in_bytes - shard_bytes(params) in range(4, output_overhead(n + 1) + 1)
    # The dropout key is unused (no dropout) and XLA drops it from the arguments.
    data = [x for x in jax.tree.leaves(rest) if not jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key)]
    assert rec.argument_size_in_bytes == shard_bytes(params) + shard_bytes(data)
    assert rec.flops == pytest.approx(whole_flops / work.mesh.size, rel=0.02)
    loss = work.loss_for_policy(rk.parse("full"))
    hand = jax.jit(jax.value_and_grad(loss), out_shardings=(
        rk_mesh.replicated(work.mesh), jax.tree.map(lambda x: x.sharding, params)))
    compiled = hand.lower(*work.args).compile()
    assert {k: getattr(rec, k) for k in memory(compiled)} == memory(compiled)
    assert rec.flops == loop_scaled_costs(compiled)[0]["flops"]  # a scan counted per trip


@pytest.mark.parametrize("spec", MESHES)
def test_reference_config_value_and_grad_holds_the_parameter_shard(spec):
    cfg = get_config("tiny_llama")
    (one,) = rk.measure(rk.models.workload(cfg, BATCH, SEQ), policies=["full"])
    mesh = rk_mesh.make(spec, jax.devices()[:4])
    check_value_and_grad(rk.models.workload(cfg, BATCH, SEQ, mesh=mesh), one.flops)


def hand_train_step(work, optimizer):
    """A training codebase's own FSDP step: value_and_grad, optax update, jitted with
    in/out shardings and the state donated."""
    loss = work.loss_for_policy(rk.parse("full"))
    params, rest = work.args[0], work.args[1:]
    p_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = jax.tree.map(lambda x: x.sharding,
                          rk_step.train_state(work, optimizer)[1])

    def train_step(params, opt_state, *rest):
        value, grads = jax.value_and_grad(loss)(params, *rest)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    in_sh = (p_sh, opt_sh, *jax.tree.map(lambda x: x.sharding, rest))
    return jax.jit(train_step, in_shardings=in_sh,
                   out_shardings=(p_sh, opt_sh, rk_mesh.replicated(work.mesh)),
                   donate_argnums=(0, 1))


@pytest.mark.parametrize("spec", ("fsdp:4", "data:4"))
def test_train_step_shards_the_optimizer_state_like_the_parameters(spec):
    cfg = get_config("tiny_llama")
    mesh = rk_mesh.make(spec, jax.devices()[:4])
    work = rk.models.workload(cfg, BATCH, SEQ, mesh=mesh)
    optimizer = rk_step.default_optimizer()
    made = rk_step.workload_step(work, rk.parse("full"), optimizer)
    params, opt_state = made.args[:2]
    mu = opt_state[0].mu  # AdamW's first moment mirrors the parameters
    assert jax.tree.map(lambda x: x.sharding, mu) == jax.tree.map(lambda x: x.sharding, params)
    assert shard_bytes(opt_state) == 2 * shard_bytes(params) + 4  # mu, nu and the count
    figures = rk.step_memory(work, BATCH, SEQ, "full", optimizer=optimizer)
    compiled = hand_train_step(work, optimizer).lower(*made.args).compile()
    hand = memory(compiled)
    assert (figures.argument_size_in_bytes, figures.output_size_in_bytes,
            figures.temp_size_in_bytes, figures.alias_size_in_bytes) == (
        hand["argument_size_in_bytes"], hand["output_size_in_bytes"],
        hand["temp_size_in_bytes"], hand["alias_size_in_bytes"])
    assert figures.params_bytes == shard_bytes(params)


def test_step_text_says_what_was_compiled():
    assert rk_mesh.compiled_step("value-and-grad", None) == "value-and-grad"
    assert rk_mesh.compiled_step("value-and-grad", "fsdp:4") == (
        "value-and-grad; gradients sharded like the parameters over fsdp:4")
    assert rk_mesh.compiled_step("train step", {"data": 2, "fsdp": 2}) == (
        "train step; gradients and optimizer state sharded like the parameters over "
        "data:2,fsdp:2")


def test_compare_says_which_step_it_compiled(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert cli.main(["compare", "--config", "tiny", "--batch", "8", "--seq", "16",
                     "--mesh", "fsdp:8", "--policies", "full", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    step = "value-and-grad; gradients sharded like the parameters over fsdp:8"
    assert step in " ".join(stdout.split())
    assert json.loads(out.read_text())["context"]["step"] == step
