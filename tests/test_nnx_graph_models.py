"""NNX models written as `dantinox` (PyPI) writes its backbone (tests/zoo/graph_nnx.py).

Each test failed before its fix: a block returning a constant (`0.0`) broke the
region interpreter (an unhashable jaxpr Literal) and `explain`'s block sum; a rope
written with `.at[].set` (a scatter) hid the fused qkv matmul from the query and key,
so it was named `value_proj`; `rk.remat_model` on a `pytree=False` model lost its
plain list of blocks (the wrapper subclass became a pytree); and the wrappers wrote
back every state leaf, so a Dropout's RngCount merged in outside `jax.grad` raised
flax's TraceContextError under `jax.jit(jax.grad(...))`.
"""

import chex
import flax
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_kit as rk
import remat_kit.trace.roles
from remat_kit.flax.from_model import logits_of, next_token_loss
from remat_kit.measure import lowering
from tests.zoo import graph_nnx

B, T = 2, 8
# Bytes of one block's stored values under minimal, float32: decoder_layer_input and
# out_proj [2, 8, 32], qkv_proj [2, 8, 32 + 2 * 2 * 8], mlpwi [2, 8, 128].
MINIMAL_LAYER_BYTES = 4 * (B * T * 32 * 2 + B * T * 64 + B * T * 128)


def _loss(module):
    """(loss(params, tokens, rest), params, rest) of the next-token loss, the module's
    state split in and merged back inside the traced function."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(p, tokens, r):
        return next_token_loss(logits_of(nnx.merge(graphdef, p, r)(tokens), B, T), tokens)
    return loss, params, rest


def _tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, graph_nnx.VOCAB)


@pytest.mark.remat_modes
def test_a_block_with_a_constant_output_measures_and_names_its_roles():
    work = rk.from_model.workload(graph_nnx.model(), B, T)
    (rec,) = rk.measure(work, policies=["minimal"], per_layer=True)
    assert rec.error is None
    assert rec.layer_residual_bytes == MINIMAL_LAYER_BYTES
    # The fused qkv matmul feeds the scores (through the scatter rope) and the context.
    assert set(rec.residual_bytes_by_tag) & set(rk.roles.ROLES) == {
        "qkv_proj", "out_proj", "mlpwi"}


@pytest.mark.remat_modes
def test_remat_model_on_a_pytree_false_model_is_the_measured_program():
    model = graph_nnx.model()
    work = rk.from_model.workload(model, B, T)
    measured = lowering.compile_for(
        lambda *a: jax.value_and_grad(work.loss_for_policy(rk.parse("minimal")))(*a),
        *work.args)
    loss, params, rest = _loss(rk.remat_model(model, "minimal"))
    compiled = lowering.compile_for(lambda *a: jax.value_and_grad(loss)(*a), *work.args)
    assert compiled.memory["temp_size_in_bytes"] == measured.memory["temp_size_in_bytes"]
    assert compiled.flops == measured.flops
    plain, _, _ = _loss(model)
    tokens = _tokens()
    chex.assert_trees_all_close(jax.jit(jax.grad(loss))(params, tokens, rest),
                                jax.jit(jax.grad(plain))(params, tokens, rest),
                                rtol=1e-5, atol=1e-6)


@pytest.mark.remat_modes
def test_apply_remat_leaves_state_from_outside_the_grad_alone():
    """The Dropouts' RngCount is merged in outside jax.grad's trace: writing it back
    is refused by flax, and the call never changed it."""
    model = graph_nnx.model()
    loss, params, rest = _loss(rk.nnx.apply_remat(model, {"Block": "selective"}))
    plain, _, _ = _loss(model)
    tokens = _tokens()
    chex.assert_trees_all_close(jax.jit(jax.grad(loss))(params, tokens, rest),
                                jax.jit(jax.grad(plain))(params, tokens, rest),
                                rtol=1e-5, atol=1e-6)


class Count(nnx.Variable):
    pass


class CountingBlock(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 8, rngs=rngs)
        self.calls = Count(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return x + jnp.tanh(self.proj(x))


class Counting(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.blocks = nnx.List([CountingBlock(rngs) for _ in range(2)])

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h @ self.embed.embedding[...].T


@pytest.mark.filterwarnings("ignore:rk.nnx")  # no roles in this block: noted, not tested here
def test_state_a_call_changes_still_lands_on_the_module():
    tokens = jnp.zeros((B, T), jnp.int32)
    for wrapped in (rk.remat_model(Counting(nnx.Rngs(0)), "full"),
                    rk.nnx.apply_remat(Counting(nnx.Rngs(0)), {"CountingBlock": "minimal"})):
        wrapped(tokens)
        wrapped(tokens)
        assert [int(b.calls[...]) for b in wrapped.blocks] == [2, 2]


@pytest.mark.remat_modes
def test_a_policy_jax_expresses_runs_flax_nnx_remat_which_wants_nnx_grad():
    """`full` goes through flax's own nnx.remat, which writes every leaf back: in the
    merge-inside-jax.grad pattern flax refuses (docs/wrappers.md); nnx.grad works."""
    model = graph_nnx.model()
    wrapped = rk.nnx.apply_remat(model, {"Block": "full"})
    loss, params, rest = _loss(wrapped)
    tokens = _tokens()
    with pytest.raises(flax.errors.TraceContextError):
        jax.jit(jax.grad(loss))(params, tokens, rest)
    of = lambda m: next_token_loss(logits_of(m(tokens), B, T), tokens)  # noqa: E731
    chex.assert_trees_all_close(nnx.state(nnx.jit(nnx.grad(of))(wrapped), nnx.Param),
                                nnx.state(nnx.jit(nnx.grad(of))(model), nnx.Param),
                                rtol=1e-5, atol=1e-6)
