"""Expert parallelism: the zoo's MoE decoder with its experts split over a mesh axis `expert`
of 4 (tests/zoo/moe_ep_nnx.py: dispatch and combine by all-to-all inside a shard_map). Each
chip holds its local experts only; the all-to-alls are priced at the chip's ICI bandwidth,
their outputs (`moe_dispatch`, `moe_combine`) are residual choices; the routing is saved and
the gradients equal no remat's on 4 CPU devices. Beside it, the shared-expert variant."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat_kit as rk
from remat_kit.errors import MeshError
from tests.test_targets import needs_libtpu
from tests.zoo import moe_ep_nnx, moe_nnx

B, T, CHIPS = 4, 64, 4
C = moe_nnx.MoEConfig()
R = (B // CHIPS) * T * C.top_k  # routed rows a chip sends (its tokens x top-k)
TPU = "tpu:v5p:2x2x1"
needs_4 = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@needs_4
@pytest.mark.parametrize("chips, experts, why", [(8, 4, "is larger than"),
                                                  (3, 4, "does not divide")])
def test_an_expert_axis_that_does_not_fit_the_experts_is_one_line(chips, experts, why):
    if jax.device_count() < chips:
        pytest.skip(f"needs {chips} host devices")
    model, _, _ = moe_ep_nnx.make(B, T, abstract=True, chips=chips, experts=experts,
                                  matmul="ragged_dot")
    with pytest.raises(MeshError) as e:
        rk.from_model.workload(model, 24, T)
    assert str(e.value) == (f"expert axis 'expert' of {chips} devices splits the {experts} "
                            f"experts of parameter blocks/0/moe/wi_0 [{experts}, {C.dim}, "
                            f"{C.hidden}]: {chips} {why} {experts}; give an expert axis of "
                            "[1, 2, 4]")


@needs_4
def test_each_chip_holds_its_local_experts_and_its_batch():
    """Per chip: the experts' weights a quarter (1 of 4 experts each), the rest whole."""
    model, params, _ = moe_ep_nnx.make(B, T, abstract=True, matmul="ragged_dot")
    work = rk.from_model.workload(model, B, T)
    assert work.placement == ("parameters by their own NamedShardings; batch 4 over expert "
                              "(the data axes): 1 per device")
    experts = C.layers * _nbytes({k: v for k, v in params["blocks"][0]["moe"].items()
                                  if k in ("wi_0", "wi_1", "wo")})
    (rec,) = rk.measure(work, policies=["full"])
    assert rec.parameter_bytes_per_device == _nbytes(params) - experts + experts // CHIPS


@needs_4
def test_grads_on_the_cpu_equal_no_remat_and_the_routing_is_saved():
    """bf16 router logits with ties (experts 0 and 1 alike), a shared expert beside: the
    recomputed forward routes as the forward did (`full`). `full` saves the routing: per layer, the
    chip's expert ids and their sort order (int32, R each) and, after the dispatch, the local
    ids and their order (4 R each), on each of the 4 chips; `save:moe_dispatch` the rows the
    dispatch brought ([4, R, d] f32 a chip) too."""
    model, params, forward = moe_ep_nnx.make(B, T, matmul="ragged_dot", router_dtype="bfloat16",
                                             shared=64)
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: w.at[..., 1].set(w[..., 0]) if "router" in jax.tree_util.keystr(
            path) else w, params)
    work = rk.from_model.workload(model, B, T)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, C.vocab // 4, jnp.int32)
    rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), work.args[2])

    def reference(p):
        logits = forward(p, tokens)[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    specs = ("full", "save:moe_dispatch")
    losses = {spec: work.loss_for_policy(rk.parse(spec)) for spec in specs}
    want, got = jax.jit(lambda p, t, r: (jax.grad(reference)(p), jax.grad(losses["full"])(
        p, t, r)))(params, tokens, rest)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    routing = C.layers * CHIPS * (2 * R + 2 * CHIPS * R) * 4
    assert _saved(work, losses["full"]) == {"moe_routing_maps": routing}
    assert _saved(work, losses["save:moe_dispatch"]) == {
        "moe_routing_maps": routing, "moe_dispatch": C.layers * CHIPS * CHIPS * R * C.dim * 4}


def _saved(work, loss) -> dict:
    """MoE tag -> bytes saved for the backward by `loss`, all chips."""
    out = {}
    for r in rk.residuals(loss, *work.args):
        if r.name.startswith("moe_"):
            out[r.name] = out.get(r.name, 0) + r.nbytes
    return out


@pytest.fixture(scope="module")
def on_tpu():
    """The megablox model (2 layers), experts over the 4 chips of a v5p slice, compiled
    ahead of time under `none` and `save:moe_dispatch` (which recomputes all else)."""
    model, _, _ = moe_ep_nnx.make(B, T, abstract=True, devices=rk.targets.devices(TPU))
    work = rk.from_model.workload(model, B, T)
    records = rk.measure(work, policies=["none", "save:moe_dispatch"], target=TPU)
    return {r.names[0]: r for r in records}


@needs_libtpu
def test_the_all_to_alls_are_priced_at_ici_bandwidth(on_tpu):
    """A chip's dispatch buffer [4, R, d] f32 (every row could go to one chip), of which an
    all-to-all sends 3/4: `none` sends it 4 times a layer (dispatch, combine, and their
    transposes in the backward) and the ids [4, R] int32 once; a policy that recomputes the
    layer sends the combine again (the routing ids are saved), and the dispatch too unless it
    saves `moe_dispatch` (`full`: 6 buffers, measured once on this model). Two layers."""
    line = rk.targets.parse_target(TPU).roofline
    rows = 3 / 4 * CHIPS * R * C.dim * 4
    ids = 3 / 4 * CHIPS * R * 4
    sent = {name: r.audit["step_terms"]["all_to_all_seconds"] * line.ici_bandwidth
            for name, r in on_tpu.items()}
    assert not {n: r.error for n, r in on_tpu.items() if r.error}
    assert sent["none"] == pytest.approx(C.layers * (4 * rows + ids), rel=1e-9)
    assert sent["save:moe_dispatch"] == pytest.approx(C.layers * (5 * rows + ids), rel=1e-9)
    for name, r in on_tpu.items():
        terms = r.audit["step_terms"]
        assert r.predicted_seconds >= terms["all_to_all_seconds"] > 0, name
    assert on_tpu["none"].predicted_seconds < on_tpu["save:moe_dispatch"].predicted_seconds


@needs_libtpu
def test_the_experts_kernels_run_over_the_rows_a_chip_may_receive(on_tpu):
    """The grouped matmuls run over the 4 R rows a chip may receive (the static bound):
    3 forward matmuls of 2·m·k·n, their backward twice that; a recomputed layer reruns the
    forward."""
    f = C.layers * 3 * 2 * (CHIPS * R) * C.dim * C.hidden
    assert on_tpu["none"].kernel_flops == 3 * f
    assert on_tpu["save:moe_dispatch"].kernel_flops == 4 * f
    assert "rows at their static bound" in on_tpu["none"].notes[0]


@needs_4
def test_dispatch_and_combine_are_found_on_a_model_that_tags_nothing():
    """No checkpoint_name: the float all-to-all before the grouped matmuls is the dispatch,
    the one after them the combine (the routing ids' all-to-all is integer: routing)."""
    model, _, _ = moe_ep_nnx.make(B, T, abstract=True, matmul="ragged_dot", tags=False)
    work = rk.from_model.workload(model, B, T)
    tags = set(rk.emitted_tags(work.loss_for_policy(rk.parse("full")), *work.args))
    assert {"moe_dispatch", "moe_combine", *rk.trace.roles.MOE_ROLES} <= tags
