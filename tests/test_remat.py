"""Policies applied to the reference model: gradients, saved tags, presets, validation.

Tests marked remat_modes run twice in `make test`: with jax_remat3 off, and with
JAX_REMAT3=1. The preset decisions over a list of tags and the built-in policy objects
do not trace anything under remat, so they run once.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit._jax_private import saved_residuals
from remat_kit.models import Transformer, get_config, make_loss_fn, stack_layers, unstack_layers
from remat_kit.models.transformer import DecoderLayer, remat_layer
from remat_kit.policy.presets import PRESET_TABLE

remat_mode = pytest.mark.remat_modes
REMAT3 = jax.config.jax_remat3

SPECS = ["full", "everything", "dots", "dots_no_batch", "selective", "minimal",
         "save:query_proj,key_proj,value_proj", "save:mlp*", "save:query_proj;offload:mlpwo"]
FAMILIES = ["tiny", "tiny_llama"]
BATCH, SEQ = 2, 16


@pytest.fixture(scope="module")
def setups():
    out = {}
    for fam in FAMILIES:
        cfg = get_config(fam, dropout_rate=0.1)
        tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, cfg.vocab_size)
        params = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
        ref = jax.jit(jax.grad(make_loss_fn(Transformer(cfg), deterministic=False)))(
            params, tokens, tokens, jax.random.key(2))
        out[fam] = cfg, tokens, params, ref
    return out


@pytest.fixture(scope="module")
def spec_grads(setups):
    """{family: {spec: grads}}, every spec's grads of a family in one jitted program: one
    compile per family, not one per spec. Each remat region's recompute stays behind
    its optimization barrier (prevent_cse), so XLA cannot share it with another spec's
    forward pass. The reference grads are a program of their own (`setups`)."""
    out = {}
    for fam in FAMILIES:
        cfg, tokens, params, _ = setups[fam]
        losses = [make_loss_fn(Transformer(cfg.replace(remat=spec)), deterministic=False)
                  for spec in SPECS]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # remat3's callable warning is tested below
            grads = jax.jit(lambda p, t, k: [jax.grad(loss)(p, t, t, k) for loss in losses])(
                params, tokens, jax.random.key(2))
        out[fam] = dict(zip(SPECS, grads))
    return out


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("spec", SPECS)
def test_grads_equal_no_remat_with_dropout(setups, spec_grads, fam, spec):
    """Same rng, dropout on: equal grads show recompute replays the same masks."""
    chex.assert_trees_all_close(spec_grads[fam][spec], setups[fam][3], rtol=1e-5, atol=1e-7)


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("spec", ["selective", "minimal"])
def test_scanned_grads_equal_looped(setups, fam, spec):
    cfg, tokens, params, ref = setups[fam]
    scan_cfg = cfg.replace(remat=spec, scan_layers=True, dropout_rate=0.0)
    scan_params = Transformer(scan_cfg).init(jax.random.key(1), tokens)["params"]
    g_loop = jax.grad(make_loss_fn(Transformer(cfg.replace(dropout_rate=0.0))))(
        unstack_layers(scan_params, scan_cfg), tokens, tokens, jax.random.key(2))
    g_scan = jax.grad(make_loss_fn(Transformer(scan_cfg)))(
        scan_params, tokens, tokens, jax.random.key(2))
    chex.assert_trees_all_close(g_scan, stack_layers(g_loop, scan_cfg),
                                rtol=1e-5, atol=1e-6)  # scan and loop sum in different orders


def layer_residuals(fam, spec):
    """Saved residuals of one remat'd decoder layer: (named tags, untagged primitives, bytes)."""
    cfg = get_config(fam, remat=spec)
    layer = remat_layer(DecoderLayer, cfg)(cfg)
    x = jnp.ones((BATCH, SEQ, cfg.d_model))
    params = layer.init(jax.random.key(0), x, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = saved_residuals(lambda p, h: layer.apply(p, h, True), params, x)
    named = {d.split("'")[1] for _, d in res if d.startswith("named '")}
    prims = [d.split()[2] for _, d in res if d.startswith("output of ")]
    # Scalars (constants such as 1/sqrt(head_dim)) are left out: JAX keeps them or not.
    nbytes = sum(a.size * a.dtype.itemsize for a, d in res if "argument" not in d and a.ndim)
    return named, prims, nbytes


_QKV = {"query_proj", "key_proj", "value_proj"}
_MLP_IN = {"tiny": {"mlpwi"}, "tiny_llama": {"mlpwi_0", "mlpwi_1"}}


def expected_named(fam, spec):
    """Tags saved by one layer, stated independently of the policy code.

    A layer's output (decoder_layer_output) and the MLP output (mlpwo, which
    only feeds the residual add) are never residuals of the layer itself.
    """
    mlp_in = _MLP_IN[fam]
    return {
        "full": set(),
        "selective": {"decoder_layer_input", "attn_norm", *_QKV, "context", "out_proj",
                      "mlp_norm", *mlp_in, "mlp_act"},
        "minimal": {*_QKV, "out_proj", *mlp_in},
        "save:query_proj,key_proj,value_proj": _QKV,
        "save:mlp*": {"mlp_norm", *mlp_in, "mlp_act"},
        "save:query_proj;offload:mlpwo": {"query_proj"},
        "dots": set(),
        "dots_no_batch": set(),
    }[spec]


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("spec", [s for s in SPECS if s != "everything"])
def test_saved_tag_set(fam, spec):
    named, prims, _ = layer_residuals(fam, spec)
    assert named == expected_named(fam, spec)
    # q k v logits context out_proj + MLP input matmuls; mlpwo only feeds the residual add.
    n_dots = {"tiny": 7, "tiny_llama": 8}[fam]
    n_dots_no_batch = n_dots - 2  # the two attention einsums carry a batch dim
    if spec == "dots":
        assert prims == ["dot_general"] * n_dots
    elif spec == "dots_no_batch":
        assert prims == ["dot_general"] * n_dots_no_batch
    else:
        assert prims == []


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
def test_everything_saves_as_much_as_no_remat(fam):
    _, _, everything = layer_residuals(fam, "everything")
    _, _, none = layer_residuals(fam, "none")
    _, _, full = layer_residuals(fam, "full")
    assert everything == none > 0 and full == 0


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
def test_residual_bytes_are_shape_times_itemsize(fam):
    cfg = get_config(fam)
    _, _, nbytes = layer_residuals(fam, "save:query_proj,key_proj,value_proj")
    q = BATCH * SEQ * cfg.num_heads * cfg.heads_dim * 4
    kv = BATCH * SEQ * cfg.kv_heads * cfg.heads_dim * 4
    assert nbytes == q + 2 * kv


# -- every preset, decisions over the tags the model emits ------------------------

def _design_saved(name, fam):
    """Saved tags of each preset, transcribed from DESIGN.md's tables."""
    qkv = {"query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj"}
    mlp_in = {"mlpwi", "mlpwi_0", "mlpwi_1"}
    minimal = qkv | {"out_proj", "mlpwo"} | mlp_in
    every = set(rk.TAGS)
    return {
        "none": every, "everything": every, "full": set(), "dots": set(),
        "dots_no_batch": set(), "selective": every - {"attn_logits", "attn_probs"},
        "nothing_saveable": set(), "everything_saveable": every, "dots_saveable": set(),
        "checkpoint_dots": set(), "dots_with_no_batch_dims_saveable": set(),
        "checkpoint_dots_with_no_batch_dims": set(),
        "minimal": minimal, "minimal_with_context": minimal | {"context"},
        "save_dot_with_context_except_mlp": qkv | {"context", "out_proj"},
        "save_dot_except_mlpwi": qkv | {"out_proj", "mlpwo"},
        "save_dot_except_mlp": qkv | {"out_proj"}, "save_qkv_proj": qkv,
        "save_out_proj": {"out_proj"}, "qkv_proj_offloaded": set(), "minimal_offloaded": set(),
        "save_nothing": set(), "save_everything": every, "save_dot_only": set(),
        "save_dot_with_no_batch_dims": set(),
        "save_qkv_out_proj": {"query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj"},
        "save_context": {"context"}, "save_encoded_and_out_proj": {"context", "out_proj"},
        "save_dot_except_logits_ffn1": {"query_proj", "key_proj", "value_proj", "qkv_proj",
                                        "context", "out_proj", "mlpwo"},
        "save_dot_except_logits": {"query_proj", "key_proj", "value_proj", "qkv_proj",
                                   "context", "out_proj", "mlpwi", "mlpwo"},
        "save_transformer_layer_output": {"decoder_layer_output"},
        "true": set(), "false": every, "recompute": set(), "save_all": every,
        "offload": set(),
        "nested": set(),  # full inside each layer; the schedule adds the group level
    }[name]


def _design_offloaded(name):
    return {"qkv_proj_offloaded": {"query_proj", "key_proj", "value_proj", "kv_proj"},
            "minimal_offloaded": {"query_proj", "key_proj", "value_proj", "kv_proj",
                                  "qkv_proj", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1",
                                  "mlpwo"},
            "offload": {"decoder_layer_input"}}.get(name, set())


@pytest.fixture(scope="module")
def emitted():
    out = {}
    for fam in FAMILIES:
        cfg = get_config(fam)
        layer = DecoderLayer(cfg)
        x = jax.ShapeDtypeStruct((BATCH, SEQ, cfg.d_model), jnp.float32)
        params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.ones(x.shape), True))
        out[fam] = tuple(rk.emitted_tags(lambda p, h: layer.apply(p, h, True), params, x))
    return out


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("codebase, name", [(cb, n) for cb, n, *_ in PRESET_TABLE])
def test_every_preset_decisions(emitted, fam, codebase, name):
    tags = emitted[fam]
    p = rk.parse(f"{codebase}:{name}")
    decided = {t: p.decide(t) for t in tags}
    saved = {t for t, d in decided.items() if d == "save"}
    offloaded = {t for t, d in decided.items() if d == "offload"}
    recomputed = {t for t, d in decided.items() if d == "recompute"}
    assert saved == _design_saved(name, fam) & set(tags)
    assert offloaded == _design_offloaded(name) & set(tags)
    assert recomputed == set(tags) - saved - offloaded


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("name", ["minimal_with_context", "save_dot_except_mlp",
                                  "save_qkv_proj", "save_encoded_and_out_proj",
                                  "megatron:selective", "recompute:core_attn,mlp"])
def test_recomputed_tags_are_never_saved(fam, name):
    p = rk.parse(name)
    named, _, _ = layer_residuals(fam, name)
    assert all(p.decide(t) == "save" for t in named)
    assert named  # each of these keeps something


@remat_mode
@pytest.mark.parametrize("fam", FAMILIES)
def test_save_anything_except_query_proj(fam):
    named, _, _ = layer_residuals(fam, "save_anything_except_these_names:query_proj")
    assert "query_proj" not in named
    # JAX's own version ignores its names and keeps query_proj.
    cfg = get_config(fam)
    layer = nn_layer = DecoderLayer(cfg)
    x = jnp.ones((BATCH, SEQ, cfg.d_model))
    params = nn_layer.init(jax.random.key(0), x, True)
    theirs = jax.checkpoint(lambda p, h: layer.apply(p, h, True), policy=(
        jax.checkpoint_policies.save_anything_except_these_names("query_proj")))
    assert len(saved_residuals(theirs, params, x)) > len(
        saved_residuals(jax.checkpoint(lambda p, h: layer.apply(p, h, True),
                                       policy=rk.parse("full").to_jax()), params, x))


# -- to_jax: built-ins first ----------------------------------------------------

@pytest.mark.parametrize("spec, builtin", [
    ("full", jax.checkpoint_policies.nothing_saveable),
    ("everything", jax.checkpoint_policies.everything_saveable),
    ("dots", jax.checkpoint_policies.dots_saveable),
    ("dots_no_batch", jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
])
def test_to_jax_returns_builtin_objects(spec, builtin):
    assert rk.parse(spec).to_jax() is builtin


@remat_mode
@pytest.mark.parametrize("spec", ["minimal", "selective", "save:mlp*", "maxtext:minimal_offloaded"])
def test_to_jax_named_policies_are_builtin_factories(spec):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no remat3 warning: these are JAX built-ins
        fn = rk.parse(spec).to_jax()
    assert fn.__qualname__.split(".")[0] in (
        "save_only_these_names", "save_and_offload_only_these_names")


@remat_mode
def test_callable_policy_warns_under_remat3_only():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk.parse("dots;save:attn_probs").to_jax()
    assert bool(caught) == REMAT3
    if REMAT3:
        assert "dots;save:attn_probs" in str(caught[0].message)


# -- validate -------------------------------------------------------------------

def _layer_fn(fam):
    cfg = get_config(fam)
    layer = DecoderLayer(cfg)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, cfg.d_model), jnp.float32)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.ones(x.shape), True))
    return (lambda p, h: layer.apply(p, h, True)), params, x


@remat_mode
def test_validate_unknown_pattern_lists_present_tags():
    fn, params, x = _layer_fn("tiny")
    with pytest.raises(rk.UnknownTagError) as info:
        rk.validate("save:kv_proj", fn, params, x)
    assert "never emits" in str(info.value) and "'key_proj'" in str(info.value)
    assert info.value.closest == "key_proj"
    with pytest.raises(rk.UnknownTagError, match="mlpwi_0"):
        rk.validate("save:mlpwi_0", fn, params, x)  # GPT-2 has no gated MLP


@remat_mode
def test_validate_accepts_presets_naming_variants():
    fn, params, x = _layer_fn("tiny_llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rk.validate("minimal", fn, params, x) == rk.parse("minimal")


@remat_mode
def test_validate_warns_on_targets_that_are_never_residuals():
    fn, params, x = _layer_fn("tiny")
    with pytest.warns(UserWarning, match="'decoder_layer_output' is never a residual"):
        rk.validate("save:decoder_layer_output", fn, params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rk.validate("save:query_proj", fn, params, x)


@remat_mode
def test_emitted_tags_shapes():
    fn, params, x = _layer_fn("tiny_llama")
    tags = rk.emitted_tags(fn, params, x)
    assert tags["attn_logits"].shape == (BATCH, 4, SEQ, SEQ)
    assert tags["key_proj"].shape == (BATCH, SEQ, 2, 16)
    assert tags["mlp_act"].shape == (BATCH, SEQ, 192)


# -- explain --------------------------------------------------------------------

@remat_mode
def test_explain_rows_per_residual():
    fn, params, x = _layer_fn("tiny")
    cfg = get_config("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = rk.explain("selective", lambda p, h: fn(p, h).sum(), params, x)
    rows = {r.name: r for r in e.rows}
    act = BATCH * SEQ * cfg.d_model * 4
    scores = BATCH * cfg.num_heads * SEQ * SEQ * 4
    assert rows["query_proj"].decision == "saved" and rows["query_proj"].nbytes == act
    assert rows["mlp_act"].nbytes == BATCH * SEQ * cfg.mlp_dim * 4
    assert (rows["attn_logits"].decision, rows["attn_logits"].nbytes) == ("recomputed", scores)
    assert rows["attn_probs"].decision == "recomputed"
    assert rows["decoder_layer_output"].decision == "not needed"
    # selective saves 8 [b,s,d]-sized tags and 2 [b,s,mlp]-sized ones per layer
    assert e.saved_bytes == 8 * act + 2 * BATCH * SEQ * cfg.mlp_dim * 4
