"""remat_kit.measure.measure and remat_kit.ui.report: residual bytes by tag, loop-aware FLOPs, records."""

import math

import jax
import jax.numpy as jnp
import pytest

import importlib
import remat_kit as rk
from remat_kit.ui import report
from remat_kit.measure.costs import loop_scaled_costs
from remat_kit.measure.explain import stack_stored_bytes

# The module, not rk.measure (the function the package exports under that name).
M = importlib.import_module("remat_kit.measure.measure")
from remat_kit.measure import targets
from remat_kit._jax_private import saved_residuals
from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.policy.spec import parse

# Tests marked remat_modes rerun under jax_remat3 in `make test`: those whose program
# holds a remat region or a tag (both staged as hi-primitives under jax_remat3). Plain
# scans, pure functions and checks made before any trace run once.
remat_mode = pytest.mark.remat_modes

B, S = 2, 16
F32 = 4
MINIMAL_ON_GPT2 = "save:query_proj,key_proj,value_proj,qkv_proj,out_proj,mlpwi,mlpwo"
HERE = targets.parse_target(None)  # JAX's default backend: M.measure takes a Target


@pytest.fixture(scope="module")
def tiny():
    return get_config("tiny")


@pytest.fixture(scope="module")
def records(tiny):
    """Two compiles: none and minimal (given under two names)."""
    return rk.measure_config(tiny, B, S, ["none", "maxtext:minimal", MINIMAL_ON_GPT2])


def by_name(records, name):
    return next(r for r in records if name in r.names)


def model_args(cfg, batch=B, seq=S):
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return make_loss_fn(model), (params["params"], tokens, tokens, key)


# -- bytes by tag -------------------------------------------------------------

@remat_mode
def test_minimal_saves_exactly_its_tags_per_layer(records, tiny):
    r = by_name(records, "maxtext:minimal")
    L, h, d = tiny.num_layers, tiny.num_heads, tiny.heads_dim
    proj = B * S * h * d * F32 * L
    assert r.residual_bytes_by_tag["query_proj"] == proj
    assert r.residual_bytes_by_tag["key_proj"] == proj
    assert r.residual_bytes_by_tag["value_proj"] == proj
    assert r.residual_bytes_by_tag["out_proj"] == B * S * tiny.d_model * F32 * L
    assert r.residual_bytes_by_tag["mlpwi"] == B * S * tiny.mlp_dim * F32 * L
    # Recomputed tags are not stored; attention scores are never saved.
    for t in ("attn_logits", "attn_probs", "mlp_act", "context", "attn_norm"):
        assert t not in r.residual_bytes_by_tag
    assert r.error is None and r.platform == "XLA CPU compile"


@remat_mode
def test_equal_policies_compile_once_and_keep_every_name(records):
    r = by_name(records, "maxtext:minimal")
    assert r.names == ("maxtext:minimal", MINIMAL_ON_GPT2)
    assert len(records) == 2


@remat_mode
def test_failing_policy_is_a_row_and_the_others_still_come_out(tiny):
    loss, args = model_args(tiny)

    def loss_for_policy(policy):
        if policy == parse("full"):  # stands in for a policy the backend cannot compile
            return lambda *a: loss(*a) + jnp.ones(3) @ jnp.ones(4)
        return rk.checkpointed(loss)(policy)

    records = rk.measure(loss_for_policy, *args, policies=["none", "full", "minimal"],
                         target=HERE)
    bad = by_name(records, "full")
    assert bad.error.startswith("TypeError:") and "dot_general" in bad.error
    assert bad.temp_size_in_bytes is None and bad.flops is None
    for r in records:
        if r is not bad:
            assert r.error is None and r.temp_size_in_bytes > 0 and r.flops > 0
    rows = report.rows(records, tiny, B, S)
    assert rows[-1]["names"] == ["full"] and not rows[-1]["pareto"]  # failed rows last, never Pareto


@remat_mode
def test_remat_trades_memory_for_flops(records):
    none, minimal = by_name(records, "none"), by_name(records, "maxtext:minimal")
    assert minimal.temp_size_in_bytes < none.temp_size_in_bytes
    assert minimal.activation_residual_bytes < none.activation_residual_bytes
    assert minimal.flops > none.flops
    assert none.residual_bytes_by_argument["params"] > 0
    assert minimal.layer_residual_bytes < none.layer_residual_bytes


@remat_mode
def test_residuals_total_matches_jax_saved_residuals(tiny):
    loss, args = model_args(tiny.replace(remat="minimal"))
    ours = rk.residuals(loss, *args)
    theirs = saved_residuals(loss, *args)
    assert sum(r.nbytes for r in ours) == sum(
        math.prod(a.shape) * a.dtype.itemsize for a, _ in theirs)
    named = sorted(d.split("'")[1] for _, d in theirs if d.startswith("named '"))
    assert sorted(r.name for r in ours if r.kind == "tag") == named


@remat_mode
def test_offloaded_residual_keeps_its_tag_and_lives_on_host(tiny):
    loss, args = model_args(tiny.replace(remat="offload:query_proj"))
    found = [r for r in rk.residuals(loss, *args) if r.name == "query_proj"]
    assert len(found) == tiny.num_layers
    assert all(r.kind == "tag" and r.memory == "host" for r in found)
    assert found[0].shape == (B, S, tiny.num_heads, tiny.heads_dim)


@remat_mode
def test_reshaped_residuals_keep_their_tag(tiny):
    # Without remat, attention saves q and the probabilities reshaped for the einsum.
    loss, args = model_args(tiny)
    tags = {r.name: r for r in rk.residuals(loss, *args) if r.kind == "tag"}
    assert tags["query_proj"].nbytes == B * S * tiny.num_heads * tiny.heads_dim * F32
    assert tags["attn_probs"].nbytes == B * tiny.num_heads * S * S * F32
    assert "reshape" not in {r.name for r in rk.residuals(loss, *args)}


# -- scanned layers ----------------------------------------------------------

@remat_mode
def test_scanned_and_unrolled_agree_on_flops_and_tag_bytes(records, tiny):
    unrolled = by_name(records, "maxtext:minimal")
    (scanned,) = rk.measure_config(tiny.replace(scan_layers=True), B, S, ["maxtext:minimal"],
                                  per_layer=False)
    assert scanned.flops == pytest.approx(unrolled.flops, rel=0.01)
    assert scanned.transcendentals == pytest.approx(unrolled.transcendentals, rel=0.01)
    for t in ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi"):
        assert scanned.residual_bytes_by_tag[t] == unrolled.residual_bytes_by_tag[t]
    # The scan carry (each layer's input) is named by the tag the layer gives it.
    L = tiny.num_layers
    assert scanned.residual_bytes_by_tag["decoder_layer_input"] == B * S * tiny.d_model * F32 * L


def _scan_fn(nested: bool):
    def f(w, x):
        def inner(c, _):
            return jnp.tanh(c @ w), None

        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=4)[0] if nested else inner(c, _)[0], None

        return jax.lax.scan(outer, x, None, length=3)[0].sum()

    def unrolled(w, x):
        for _ in range(12 if nested else 3):
            x = jnp.tanh(x @ w)
        return x.sum()

    return f, unrolled


@pytest.mark.parametrize("nested", [False, True])
def test_loop_scaled_costs_count_every_trip(nested):
    f, unrolled = _scan_fn(nested)
    # Matmul-dominated, as in a transformer: the loop's own bookkeeping stays < 1%.
    w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
    # Gradients for both arguments: a scan always computes the carry's
    # cotangent, which the unrolled program would drop for x alone.
    looped = jax.jit(jax.grad(f, argnums=(0, 1))).lower(w, x).compile()
    flat = jax.jit(jax.grad(unrolled, argnums=(0, 1))).lower(w, x).compile()
    got, notes = loop_scaled_costs(looped)
    want, _ = loop_scaled_costs(flat)
    raw = looped.cost_analysis()
    raw = raw[0] if isinstance(raw, list) else raw
    assert raw["flops"] < 0.5 * want["flops"]  # XLA alone counts each body once
    assert got["flops"] == pytest.approx(want["flops"], rel=0.01)
    assert got["transcendentals"] == pytest.approx(want["transcendentals"], rel=0.01)
    assert notes == ()


# -- generic measure, timed mode ----------------------------------------------

def _mlp_loss(w, x):
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.tanh(h @ w))


@remat_mode
def test_generic_measure_with_checkpointed_loss_and_timing():
    w, x = jnp.ones((16, 16)), jnp.ones((4, 16))
    recs = rk.measure(_mlp_loss, w, x, policies=["none", "full"], time_steps=3,
                      target=HERE)  # a plain loss
    none, full = recs
    # Without remat the tanh outputs are kept; full remat keeps only the arguments.
    assert none.residual_bytes_by_primitive.get("tanh", 0) > 0
    assert full.residual_bytes_by_tag == {} and full.residual_bytes_by_primitive == {}
    assert full.residual_bytes_by_argument == {"w": 16 * 16 * F32, "x": 4 * 16 * F32}
    assert full.flops > none.flops
    for r in recs:
        st = r.step_time
        assert st.steps == 3 and 0 < st.min_s <= st.q1_s <= st.median_s <= st.q3_s <= st.max_s
    assert none.step_time.ratio_to_none == 1.0
    # The median of per-round ratios: within the extremes of the two policies' steps.
    assert (full.step_time.min_s / none.step_time.max_s <= full.step_time.ratio_to_none
            <= full.step_time.max_s / none.step_time.min_s)
    # Predicted step time: a positive roofline per compiled op; recompute costs more.
    assert 0 < none.predicted_seconds < full.predicted_seconds


@remat_mode
def test_progress_counts_compiled_programs():
    def loss(w, x):
        h = rk.tag(jnp.tanh(x @ w), "mlpwi")
        return jnp.sum(rk.tag(h @ w.T, "mlpwo"))  # sum's backward never reads mlpwo

    calls = []
    w, x = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32)
    recs = rk.measure(loss, w, x, policies=["none", "full", "save:mlpwo", "save:mlpwi"],
                      progress=lambda i, n, r: calls.append((i, n, r.names)), target=HERE)
    if jax.config.jax_remat3:  # the hi-primitive remat lowers save:mlpwo apart from full
        assert calls == [(1, 4, ("none",)), (2, 4, ("full",)), (3, 4, ("save:mlpwo",)),
                         (4, 4, ("save:mlpwi",))]
    else:  # four decision sets, three programs: save:mlpwo lowers to full's program
        assert calls == [(1, 3, ("none",)), (2, 3, ("full", "save:mlpwo")),
                         (3, 3, ("save:mlpwi",))]
    assert [r.names for r in recs] == [names for _, _, names in calls]
    assert all(r.compile_seconds > 0 for r in recs)


def test_bad_sizes_raise_before_measuring(tiny):
    for batch, seq in ((0, 16), (2, -1), (2.0, 16), (True, 16)):
        with pytest.raises(ValueError, match="positive int"):
            rk.measure_config(tiny, batch, seq, ["none"])
    with pytest.raises(ValueError, match="max_len"):
        rk.measure_config(tiny, 1, tiny.max_len + 1, ["none"])


# -- one layer -----------------------------------------------------------------

@remat_mode
def test_layer_residuals_under_selective(tiny):
    layer = rk.layer_residuals(tiny, B, S, "selective")
    rows = {r.name: r for r in layer.rows if r.kind == "tag"}
    scores = B * tiny.num_heads * S * S * F32
    for t in ("attn_logits", "attn_probs"):
        assert rows[t].decision == "recomputed" and rows[t].nbytes == scores
        assert rows[t].shape == (B, tiny.num_heads, S, S)
    q = rows["query_proj"]
    assert q.decision == "saved" and q.shape == (B, S, tiny.num_heads, tiny.heads_dim)
    assert rows["decoder_layer_input"].nbytes == B * S * tiny.d_model * F32
    assert layer.recomputed_bytes == 2 * scores
    assert layer.saved_bytes == sum(r.nbytes for r in layer.rows if r.decision == "saved")
    assert layer.num_layers == tiny.num_layers and layer.parameter_bytes > 0


@remat_mode
def test_layers_column_sums_each_layers_policy_for_schedules():
    """layer x L of a schedule is the sum over its layers, each under its own policy (a
    nested group keeps its input only); with what lies outside the stack (embeddings,
    logits, loss: full's residuals less its 4 layers) it is the whole step's residuals,
    less the constants (each layer's causal mask and its fill: the same in every layer,
    which layer x L leaves out)."""
    cfg = get_config("tiny", num_layers=4)
    work = rk.models.workload(cfg, B, S)
    specs = ("none", "full", "minimal", "full@every:2", "minimal@first:3", "minimal@nested:2")
    found = {spec: stack_stored_bytes(work, rk.parse(spec)) for spec in specs}
    one = {p: found[p]["layer_residual_bytes"] for p in ("none", "full", "minimal")}
    assert one["full"] == B * S * cfg.d_model * F32  # a full-remat layer keeps its input
    expected = {"none": 4 * one["none"], "full": 4 * one["full"], "minimal": 4 * one["minimal"],
                "full@every:2": 2 * one["full"] + 2 * one["none"],
                "minimal@first:3": 3 * one["minimal"] + one["none"],
                "minimal@nested:2": 2 * one["full"]}
    # Each whole step traced once, not compiled: Record.activation_residual_bytes.
    whole_step = {spec: sum(r.nbytes for r in rk.residuals(work.loss_for_policy(rk.parse(spec)),
                                                           *work.args)
                      if r.kind != "argument" and not r.constant)
                  for spec in specs}
    outside = whole_step["full"] - expected["full"]
    for spec, total in expected.items():
        assert found[spec]["layers_residual_bytes"] == total, spec
        assert whole_step[spec] == outside + total, spec
        if rk.parse(spec).schedule.kind != "uniform":
            assert found[spec]["layer_residual_bytes"] is None  # no one layer stands for the stack
    # measure_config fills the record, and the report's layer x L column reads it.
    (rec,) = rk.measure_config(cfg, B, S, ["full@every:2"])
    assert rec.layers_residual_bytes == expected["full@every:2"]
    (row,) = report.rows([rec], cfg, B, S)
    assert row["layers_residual_bytes"] == expected["full@every:2"]


# -- report rows ----------------------------------------------------------------

@remat_mode
def test_report_rows_ratios_pareto_and_formula(records, tiny):
    rows = report.rows(records, tiny, B, S)
    none = next(d for d in rows if d["policy"] == "none")
    minimal = next(d for d in rows if "maxtext:minimal" in d["names"])
    assert none["temp_ratio_to_none"] == 1.0 and none["flops_ratio_to_none"] == 1.0
    assert minimal["temp_ratio_to_none"] < 1 < minimal["flops_ratio_to_none"]
    # Each wins on one axis, so both are Pareto-optimal.
    assert none["pareto"] and minimal["pareto"]
    # Korthikanti no-parallelism row, f32, no dropout: sbh(32 + 2as/h) bytes x 2 per layer.
    h, a = tiny.d_model, tiny.num_heads
    assert none["formula_bytes"] == tiny.num_layers * S * B * h * (32 + 2 * a * S / h) * 2
    assert minimal["formula_bytes"] is None
    assert minimal["layers_residual_bytes"] == minimal["layer_residual_bytes"] * tiny.num_layers


def test_pareto_flags_drop_dominated_points():
    mk = lambda temp, flops: M.Record("p", ("p",), "x", temp_size_in_bytes=temp, flops=flops)
    assert report.pareto_flags([mk(10, 1), mk(5, 2), mk(6, 3), mk(5, 2), mk(1, None)]) == [
        True, True, False, True, False]


# -- FLOPs against an independent count -------------------------------------------

def _matmul_flops(cfg, batch, seq):
    """Forward + backward matmul FLOPs, counted by hand: 2 per multiply-add, and the
    backward pass does twice the forward's matmul work (input and weight gradients)."""
    d, h, kv, hd, m = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.heads_dim, cfg.mlp_dim
    proj = 2 * batch * seq * (d * h * hd + 2 * d * kv * hd + h * hd * d)
    attn = 4 * batch * h * seq * seq * hd  # q.k scores and probs.v
    mlp = 2 * batch * seq * d * m * (2 if cfg.family == "gpt2" else 3)
    logits = 2 * batch * seq * d * cfg.vocab_size
    return 3 * (cfg.num_layers * (proj + attn + mlp) + logits)


@remat_mode  # no remat region, but the model's tags
@pytest.mark.parametrize("family", ["tiny", "tiny_llama"])
def test_flops_match_a_hand_count_of_the_matmuls(family):
    cfg = get_config(family, d_model=256, mlp_dim=1024, num_heads=8,
                     num_kv_heads=4 if family == "tiny_llama" else None, vocab_size=2048)
    (none,) = rk.measure_config(cfg, 2, 128, ["none"])
    # Elementwise ops (softmax, norms, activations) add the last 1-2%.
    assert 1.0 <= none.flops / _matmul_flops(cfg, 2, 128) < 1.02


def test_a_batch_the_models_own_mesh_cannot_split_is_noted_on_every_row():
    """tests/zoo/mesh_linen.py builds its mesh over the 8 devices: a batch of 6 stays whole
    on each, which every row says (the workload's note on the model, not on a tag)."""
    from tests.zoo import mesh_linen
    work = rk.from_model.workload(mesh_linen.model(), 6, 8)
    line = ("batch 6 does not split over the 8 devices of mesh axes ['data'] (data:8): the "
            "tokens are whole on every device of the model's mesh")
    assert [r.notes.count(line) for r in rk.measure(work, policies=["none", "full"])] == [1, 1]
