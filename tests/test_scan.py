"""Scanned vs looped stacks, stacked <-> looped parameter converters, and the NNX twin."""

from collections import Counter

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_kit as rk
from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.models import nnx_transformer as nt
from remat_kit.models.layout import stack_layers, unstack_layers

LAYERS, BATCH, SEQ = 4, 2, 8


def _tokens(cfg):
    return jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, cfg.vocab_size)


def _linen(cfg, params=None):
    """(loss, grads, residuals) of the linen model of cfg at params (default: init)."""
    tokens = _tokens(cfg)
    if params is None:
        params = nn.unbox(Transformer(cfg).init(jax.random.key(1), tokens)["params"])
    loss = make_loss_fn(Transformer(cfg))
    value, grads = jax.value_and_grad(loss)(params, tokens, tokens, jax.random.key(2))
    return params, value, grads, rk.residuals(loss, params, tokens, tokens, jax.random.key(2))


def _saved_tags(found, layers: int) -> dict:
    """{tag: shape across all layers}: `layers` looped copies of one shape and
    one stacked [layers, ...] residual both read as (layers, *shape)."""
    counts = Counter((r.name, r.shape) for r in found if r.kind == "tag")
    return {name: (n, *shape) if n == layers else shape for (name, shape), n in counts.items()}


@pytest.mark.parametrize("fam, spec, layers", [("tiny_llama", "selective", 2),
                                               ("tiny", "selective@nested:2", 4)])
def test_scanned_equals_looped(fam, spec, layers):
    looped = get_config(fam, num_layers=layers, remat=spec)
    scanned = looped.replace(scan_layers=True)
    params, loss, grads, found = _linen(looped)
    stacked = stack_layers(params, scanned)
    _, s_loss, s_grads, s_found = _linen(scanned, stacked)
    assert s_loss == pytest.approx(float(loss), rel=1e-6)
    chex.assert_trees_all_close(unstack_layers(s_grads, scanned), grads, rtol=1e-5, atol=1e-6)
    if "nested" in spec:  # only group inputs are stored: 2 groups of 2 layers
        assert [(r.name, r.shape) for r in s_found if r.shape[1:] == (BATCH, SEQ, 64)] == [
            ("scan input", (2, BATCH, SEQ, 64))]
        return
    # Same tags saved per layer: n looped copies of [b, s, ...] vs one [n, b, s, ...].
    tags = _saved_tags(found, layers)
    assert _saved_tags(s_found, layers) == tags
    assert tags["query_proj"] == (layers, BATCH, SEQ, 4, 16)
    assert {"decoder_layer_input", "mlp_act"} <= set(tags) and "attn_probs" not in tags


def test_layout_round_trip_and_shapes():
    cfg = get_config("tiny", num_layers=LAYERS, remat="full@nested:2", scan_layers=True)
    tokens = _tokens(cfg)
    boxed = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
    params = nn.unbox(boxed)
    kernel = params["layers"]["layer"]["attn"]["query"]["kernel"]
    assert kernel.shape == (LAYERS, 64, 4, 16)  # [layers, d_model, heads, head_dim]
    # Logical axis names follow the stacked axis both ways.
    assert boxed["layers"]["layer"]["attn"]["query"]["kernel"].names == (
        "layers", "embed", "heads", "kv")
    looped_boxed = unstack_layers(boxed, cfg)
    assert looped_boxed["layers_0"]["attn"]["query"]["kernel"].names == ("embed", "heads", "kv")
    chex.assert_trees_all_equal(stack_layers(looped_boxed, cfg), boxed)
    # Nested and uniform scanned stacks share one layout.
    uniform = nn.unbox(jax.eval_shape(Transformer(cfg.replace(remat="full")).init,
                                      jax.random.key(1), tokens)["params"])
    chex.assert_trees_all_equal_shapes(uniform, params)
    looped = unstack_layers(params, cfg)
    assert sorted(k for k in looped if k.startswith("layers")) == [f"layers_{i}"
                                                                   for i in range(LAYERS)]
    chex.assert_trees_all_equal(looped["layers_3"]["attn"]["query"]["kernel"], kernel[3])
    chex.assert_trees_all_equal(stack_layers(looped, cfg), params)


def test_layout_bad_input():
    looped = get_config("tiny", num_layers=LAYERS)
    with pytest.raises(ValueError, match="looped stack"):
        unstack_layers({}, looped)
    scanned = looped.replace(scan_layers=True)
    with pytest.raises(ValueError, match=r"no scanned subtree layers/layer; top-level keys: "
                                         r"\['embed'\]"):
        unstack_layers({"embed": {}}, scanned)
    with pytest.raises(ValueError, match="no 4 layers like layers_0"):
        stack_layers({"embed": {}}, scanned)


def _nnx(cfg, linen_params):
    model = nt.Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    state.replace_by_pure_dict(nt.from_linen(linen_params, cfg))
    nnx.update(model, state)
    loss, params = nt.make_loss_fn(model)
    tokens = _tokens(cfg)
    value, grads = jax.value_and_grad(loss)(params, tokens, tokens)
    return value, grads, rk.residuals(loss, params, tokens, tokens)


@pytest.mark.parametrize("fam, spec, scan", [("tiny_llama", "selective", True),
                                             ("tiny", "minimal@nested:2", False)])
def test_nnx_twin_equals_linen(fam, spec, scan):
    cfg = get_config(fam, num_layers=LAYERS, remat=spec, scan_layers=scan)
    params, loss, grads, found = _linen(cfg)
    n_loss, n_grads, n_found = _nnx(cfg, params)
    assert float(n_loss) == float(loss)
    chex.assert_trees_all_close(nt.to_linen(n_grads.to_pure_dict(), cfg), grads,
                                rtol=1e-6, atol=1e-7)
    stored = lambda rs: Counter((r.kind, r.name, r.shape) for r in rs if r.kind != "argument")
    assert stored(n_found) == stored(found)  # the same tags and primitives, the same shapes


def test_nnx_bad_input():
    with pytest.raises(NotImplementedError, match="uniform schedule, got nested"):
        nt.Transformer(get_config("tiny", num_layers=4, remat="nested", scan_layers=True),
                       rngs=nnx.Rngs(0))
    model = nt.Transformer(get_config("tiny", dropout_rate=0.1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"deterministic only \(dropout_rate=0.1\)"):
        model(jnp.zeros((1, 4), jnp.int32), deterministic=False)
