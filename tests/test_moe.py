"""Mixture of experts: grouped matmuls priced from their shapes (megablox `gmm`/`tgmm`, the
TPU production kernel, compiled for a TPU ahead of time; `jax.lax.ragged_dot`), counted in
the FLOPs and the predicted step under every preset, the MoE tags MaxText names, the routing
kept under every policy, and gradients equal to no remat's on the CPU."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_kit as rk
from remat_kit.measure import kernels, time_model
from remat_kit.policy.presets import PRESET_TABLE
from tests.zoo import moe_linen, moe_nnx

B, T = 1, 128
C = moe_nnx.MoEConfig()
M = B * T * C.top_k  # routed rows
# F: one layer's forward expert FLOPs: gate, up (d -> hidden) and down (hidden -> d).
F = 3 * 2 * M * C.dim * C.hidden
TPU = "tpu:v5e:1x1"


def _layer_grad_jaxpr(matmul: str):
    """The value-and-grad jaxpr of one zoo MoE layer at the zoo's shapes."""
    model, _, _ = moe_nnx.make(B, T, abstract=True, matmul=matmul)
    from flax import nnx
    graphdef, params = nnx.split(model.blocks[0].moe, nnx.Param)
    x = jax.ShapeDtypeStruct((B, T, C.dim), jnp.float32)
    loss = lambda p, x: nnx.merge(graphdef, p)(x).sum()
    return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def test_megablox_kernels_are_priced_from_their_shapes_and_timed():
    """Forward: three gmm; backward: a gmm (input gradient) and a tgmm (weight gradient)
    per matmul, each 2·m·k·n at the routed rows' static bound. XLA:TPU counts their
    cost estimate, but the time model's compiled ops give a custom call no FLOPs: their
    seconds are added all the same (else a row recomputing them falls below the floor)."""
    priced = kernels.price(_layer_grad_jaxpr("gmm"), "tpu")
    names = [k.name for k in priced.kernels]
    assert sorted(names) == ["gmm"] * 6 + ["tgmm"] * 3, names
    assert all(k.how == "shapes" and k.counted and k.mask == "rows at their static bound"
               for k in priced.kernels)
    assert priced.kernel_flops == 3 * F and priced.added_flops == 0
    line = rk.targets.parse_target(TPU).roofline
    assert kernels.seconds(priced, line) == pytest.approx(3 * F / line.bf16_flops, rel=1e-6) \
        or kernels.seconds(priced, line) == pytest.approx(3 * F / line.f32_flops, rel=1e-6)
    note = priced.notes()[0]
    assert note.startswith("kernels priced from shapes") and "gmm x6" in note \
        and "tgmm x3" in note and "2·m·k·n" in note, note


def test_the_planner_prices_a_kernel_equation():
    """The planner's per-equation costs (`time_model.eqn_costs`) price a gmm call as the
    report does, not as the nothing XLA gives a custom call lowered alone."""
    eqn = next(e for e in _walk(_layer_grad_jaxpr("gmm").jaxpr) if e.primitive.name ==
               "pallas_call")
    flops, nbytes = time_model.eqn_costs(eqn, {})
    assert flops == 2 * M * C.dim * C.hidden and nbytes > 0


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield from _walk(inner)


def test_ragged_dot_is_listed_with_the_compilers_count():
    """`jax.lax.ragged_dot` and its two transposes: the routed 2·m·k·n listed; JAX lowers
    it to dense dots over every group, which the compiler counts and times itself."""
    priced = kernels.price(_layer_grad_jaxpr("ragged_dot"), "cpu")
    assert sorted(k.name for k in priced.kernels) == (
        ["ragged_dot"] * 6 + ["ragged_dot_transposed"] * 3)
    assert priced.kernel_flops == 3 * F and priced.added_flops == 0 and priced.timed == ()
    assert "dense over every group" in priced.notes()[0]


@pytest.fixture(scope="module")
def on_tpu():
    """Records of the megablox zoo model (2 scanned layers, tagged as MaxText tags) under
    every preset, compiled for TPU v5e ahead of time; and its Workload."""
    model, _, _ = moe_nnx.make(B, T, abstract=True, scan=True)
    work = rk.from_model.workload(model, B, T)
    specs = list(dict.fromkeys(f"{cb}:{name}" for cb, name, *_ in PRESET_TABLE))
    records = rk.measure(work, policies=specs, target=TPU)
    return {name: r for r in records for name in r.names}, work


def test_every_preset_compiles_with_its_kernels_priced(on_tpu):
    """No row stops at the floor check: each prices the kernels it reruns. The FLOPs hold
    every trip's kernels: XLA's count of a scanned layer's body on this machine leaves
    out their cost estimates, which are added to each trip (`costs.loop_scaled_costs`)."""
    rows, _ = on_tpu
    assert not {n: r.error for n, r in rows.items() if r.error}
    peak = rk.targets.parse_target(TPU).roofline.bf16_flops
    for name, r in rows.items():
        assert r.kernel_flops >= 2 * 3 * F and r.flops >= r.kernel_flops, name
        assert r.predicted_seconds >= r.kernel_flops / peak, name


def test_full_reruns_the_forward_kernels(on_tpu):
    """none: each layer's forward F and backward 2F; full reruns the forward (+F a layer),
    maxtext:minimal only the up matmul MaxText does not save (+F/3 a layer)."""
    rows, _ = on_tpu
    none, full, minimal = rows["remat_kit:none"], rows["remat_kit:full"], rows["maxtext:minimal"]
    assert none.kernel_flops == 2 * 3 * F
    assert full.kernel_flops - none.kernel_flops == 2 * F
    assert minimal.kernel_flops - none.kernel_flops == 2 * F / 3
    assert full.flops - none.flops >= 2 * F


def _saved(work, spec: str) -> dict:
    """tag -> bytes saved for the backward under `spec`, per tag."""
    out = {}
    for r in rk.residuals(work.loss_for_policy(rk.parse(spec)), *work.args):
        out[r.name] = out.get(r.name, 0) + r.nbytes
    return out


@pytest.mark.parametrize("spec", ["full", "maxtext:minimal", "maxtext:save_dot_except_mlp",
                                  "dots", "offload:moe_x_sorted"])
def test_routing_is_saved_under_every_policy(on_tpu, spec):
    """The top-k expert ids and the sort permutation (int32, b x s x k each, 2 layers)."""
    _, work = on_tpu
    assert _saved(work, spec).get("moe_routing_maps") == 2 * 2 * M * 4


def test_routing_is_recomputed_where_asked(on_tpu):
    _, work = on_tpu
    assert "moe_routing_maps" not in _saved(work, "recompute:moe_routing_maps")


def test_maxtexts_minimal_saves_its_gate_and_down_matmuls(on_tpu):
    """MaxText names its experts' gate and down matmuls mlpwi_0/moe_mlpwi_0 and
    mlpwo/moe_mlpwo, the up matmul only moe_mlpwi_1 (layers/moe.py): `minimal` keeps the
    first two, as MaxText's does."""
    _, work = on_tpu
    saved = _saved(work, "maxtext:minimal")
    assert {"moe_mlpwi_0", "moe_mlpwo"} <= set(saved) and "moe_mlpwi_1" not in saved
    assert "moe_x_sorted" not in saved


@pytest.mark.parametrize("make, config, specs", [
    (moe_nnx.make, {"matmul": "gmm", "interpret": True, "router_dtype": "bfloat16"},
     ("full",)),  # the kernel interpreted on the CPU: one policy, it compiles slowly
    (moe_nnx.make, {"matmul": "ragged_dot", "router_dtype": "bfloat16"},
     ("full", "maxtext:minimal")),
    (moe_linen.make, {"router_dtype": "bfloat16"}, ("full", "maxtext:minimal"))])
def test_grads_on_the_cpu_equal_no_remat(make, config, specs):
    """bf16 router logits, with ties: the router's columns for experts 0 and 1 made equal,
    so every token's logits tie there and top-k breaks the tie; the recomputed forward
    routes as the forward did (its routing maps saved)."""
    model, params, forward = make(B, T, **config)
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: w.at[..., 1].set(w[..., 0]) if "router" in jax.tree_util.keystr(
            path) else w, params)
    work = rk.from_model.workload(model, B, T)
    vocab = 128 if make is moe_nnx.make else 64
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, vocab // 4, jnp.int32)
    rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), work.args[2])

    def reference(p):
        logits = forward(p, tokens)[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    losses = {spec: work.loss_for_policy(rk.parse(spec)) for spec in specs}
    want, got = jax.jit(lambda p, t, r: (jax.grad(reference)(p), {
        s: jax.grad(loss)(p, t, r) for s, loss in losses.items()}))(params, tokens, rest)
    for spec, grads in got.items():
        chex.assert_trees_all_close(grads, want, rtol=1e-4, atol=1e-5, custom_message=spec)


@pytest.mark.parametrize("make, config", [(moe_linen.make, {}),
                                          (moe_nnx.make, {"tags": False})])
def test_roles_are_found_on_a_model_that_tags_nothing(make, config):
    """ragged_dot (linen) and megablox gmm (NNX), no checkpoint_name: the expert matmuls,
    the dispatched tokens and the routing are found by the dataflow, under MaxText's
    names; `full` keeps the routing (expert ids and sort permutation, int32 b x s x k
    each, 2 layers), `maxtext:minimal` the gate and down matmuls too."""
    model, _, _ = make(B, T, abstract=True, **config)
    work = rk.from_model.workload(model, B, T)
    tags = set(rk.emitted_tags(work.loss_for_policy(rk.parse("full")), *work.args))
    assert set(rk.trace.roles.MOE_ROLES) <= tags, tags
    assert _saved(work, "full").get("moe_routing_maps") == 2 * 2 * M * 4
    saved = _saved(work, "maxtext:minimal")
    assert {"moe_mlpwi_0", "moe_mlpwo", "moe_routing_maps"} <= set(saved)
    assert not {"moe_mlpwi_1", "moe_x_sorted"} & set(saved)
