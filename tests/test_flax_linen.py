"""rk.linen on a user model with no tags and no remat: instance form, auto-tagging, class form.

The core tests run twice in `make test`: with jax_remat3 off, and with JAX_REMAT3=1.
"""

import importlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.trace.validate import emitted_tags

measure = importlib.import_module("remat_kit.measure.residuals")  # its residuals(), as rk.residuals

VOCAB, D, HEADS, LAYERS, BATCH, SEQ = 32, 16, 2, 2, 2, 8
STANDARD = rk.linen.AUTO_TAG_CLASSES  # tags only flax's layers: the names below list them


class Mlp(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d, name="wo")(nn.gelu(nn.Dense(4 * self.d, name="wi")(x)))


class Block(nn.Module):
    d: int
    heads: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic=True):
        h = nn.LayerNorm(name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(self.heads, dropout_rate=self.dropout_rate,
                                            name="attn")(h, h, deterministic=deterministic)
        self.sow("intermediates", "attn_out", h)
        x = x + nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return x + Mlp(self.d, name="mlp")(nn.LayerNorm(name="ln2")(x))


class Model(nn.Module):
    """A typical user decoder: plain Flax layers, no tags, no remat. `block` lets the
    class-form test swap in a wrapped Block."""

    layers: int = LAYERS
    dropout_rate: float = 0.0
    block: type = Block

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        x = nn.Embed(VOCAB, D)(tokens)
        for i in range(self.layers):
            x = self.block(D, HEADS, self.dropout_rate, name=f"Block_{i}")(x, deterministic)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def loss_fn(model, deterministic=True):
    def loss(params, tokens, rng):
        logits = model.apply({"params": params}, tokens, deterministic, rngs={"dropout": rng})
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
    return loss


@pytest.fixture(scope="module")
def setup():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    params = jax.jit(Model().init)(jax.random.key(1), tokens)["params"]
    with rk.linen.auto_tag():  # dropout on: equal grads show recompute replays its masks
        ref = jax.jit(jax.value_and_grad(loss_fn(Model(dropout_rate=0.1), False)))(
            params, tokens, jax.random.key(2))
    return tokens, params, ref


def same_tree(model, params, tokens):
    """The wrapped model's parameter paths, shapes and dtypes are the unwrapped model's."""
    shapes = jax.eval_shape(model.init, jax.random.key(1), tokens)["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(shapes, params)


def saved_tags(model, params, tokens, deterministic=True):
    """Auto tags of standard layers the layers save for the backward pass (outside them
    nothing is remat)."""
    with rk.linen.auto_tag(STANDARD):
        found = measure.residuals(loss_fn(model, deterministic), params, tokens,
                                  jax.random.key(2))
    return {r.name for r in found if r.kind == "tag" and r.name.startswith("Block_")}


def per_layer(*suffixes):
    return {f"Block_{i}/{s}" for i in range(LAYERS) for s in suffixes}


@pytest.mark.remat_modes
@pytest.mark.parametrize("mapping", [{"Block": "full", Mlp: "dots"}, {"Block": "minimal"},
                                     {"Block": "selective"}],
                         ids=["path", "minimal", "selective"])
def test_apply_remat_keeps_params_and_grads(setup, mapping):
    """Role presets run with their roles tagged, on the region's variables and RNG
    streams: the same dropout masks, so the same grads."""
    tokens, params, ref = setup
    model = rk.linen.apply_remat(Model(dropout_rate=0.1), mapping)
    assert isinstance(model, Model) and type(model).__name__ == "Model"
    # The same parameter tree: an unwrapped model's checkpoint applies unchanged.
    same_tree(model, params, tokens)
    with rk.linen.auto_tag():
        grads = jax.jit(jax.value_and_grad(loss_fn(model, False)))(
            params, tokens, jax.random.key(2))
    chex.assert_trees_all_close(grads, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.remat_modes
@pytest.mark.parametrize("spec, expected", [
    ("full", set()),
    ("save:*/attn/query,*/attn/key;recompute:*", per_layer("attn/query", "attn/key")),
    ("save:*/mlp/wi,*/ln1", per_layer("mlp/wi", "ln1")),
])
def test_saved_residuals_follow_spec(setup, spec, expected):
    tokens, params, _ = setup
    model = rk.linen.apply_remat(Model(), {"Block": spec})
    assert saved_tags(model, params, tokens) == expected


def test_glob_resolution_follows_auto_tag(setup):
    """Globs resolve against the names emitted in this call: none outside auto_tag."""
    tokens, params, _ = setup
    model = rk.linen.apply_remat(Model(), {"Block": "save:*/mlp/wi;recompute:*"})
    outside = measure.residuals(loss_fn(model), params, tokens, jax.random.key(2))
    assert not {r.name for r in outside if r.kind == "tag"}
    assert saved_tags(model, params, tokens) == per_layer("mlp/wi")


def test_auto_tag_names_by_module_path(setup):
    tokens, params, _ = setup
    found = rk.linen.tags(Model(layers=1), tokens, classes=STANDARD)
    assert list(found) == [
        "Block_0/ln1", "Block_0/attn/query", "Block_0/attn/key", "Block_0/attn/value",
        "Block_0/attn/out", "Block_0/attn", "Block_0/ln2", "Block_0/mlp/wi", "Block_0/mlp/wo",
        "LayerNorm_0", "Dense_0"]
    assert found["Block_0/attn/query"].shape == (BATCH, SEQ, HEADS, D // HEADS)
    assert found["Block_0/mlp/wi"].shape == (BATCH, SEQ, 4 * D)
    assert found["Dense_0"].dtype == jnp.float32
    # Outside the context nothing is tagged; apply with variables traces the same names.
    assert rk.emitted_tags(loss_fn(Model()), params, tokens, jax.random.key(2)) == {}
    assert list(rk.linen.tags(Model(), tokens, variables={"params": params})) == list(
        rk.linen.tags(Model(), tokens))
    # By default every submodule call is tagged, the root's output not.
    assert list(rk.linen.tags(Model(layers=1), tokens)) == [
        "Embed_0", "Block_0/ln1", "Block_0/attn/query", "Block_0/attn/key",
        "Block_0/attn/value", "Block_0/attn/out", "Block_0/attn", "Block_0/Dropout_0",
        "Block_0/ln2", "Block_0/mlp/wi", "Block_0/mlp/wo", "Block_0/mlp", "Block_0",
        "LayerNorm_0", "Dense_0"]


def test_temp_bytes_fall(setup):
    tokens, params, _ = setup
    tokens = jnp.zeros((4, 32), jnp.int32)

    def temp(model):
        grad = jax.jit(jax.grad(loss_fn(model)))
        return grad.lower(params, tokens, jax.random.key(2)).compile().memory_analysis(
            ).temp_size_in_bytes

    assert temp(rk.linen.apply_remat(Model(), {"Block": "full"})) < temp(Model())


@pytest.mark.parametrize("spec", ["full", "minimal"])
def test_mutable_and_rngs_pass_through(setup, spec):
    tokens, params, _ = setup
    model = rk.linen.apply_remat(Model(dropout_rate=0.5), {"Block": spec})

    @jax.jit
    def run(params, tokens, rng):
        kw = dict(rngs={"dropout": rng}, mutable=["intermediates"])
        return (model.apply({"params": params}, tokens, False, **kw),
                Model(dropout_rate=0.5).apply({"params": params}, tokens, False, **kw))

    (out, state), ref = run(params, tokens, jax.random.key(3))
    chex.assert_trees_all_close((out, state), ref)
    assert state["intermediates"]["Block_1"]["attn_out"][0].shape == (BATCH, SEQ, D)


@pytest.mark.remat_modes
@pytest.mark.parametrize("spec", ["dots", "minimal"])
def test_class_form_static_flag_and_dropout(setup, spec):
    tokens, params, ref = setup
    # flax's nn.remat: static_argnums count self, __call__(self, x, deterministic) -> 2.
    model = Model(dropout_rate=0.1, block=rk.linen.remat(Block, spec, static_argnums=(2,)))
    same_tree(model, params, tokens)
    with rk.linen.auto_tag():
        grads = jax.jit(jax.value_and_grad(loss_fn(model, deterministic=False)))(
            params, tokens, jax.random.key(2))
    chex.assert_trees_all_close(grads, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.remat_modes
def test_class_form_glob_policy(setup):
    """A glob needs the names the module emits: each call traces it alone first."""
    tokens, params, _ = setup
    wrapped = rk.linen.remat(Block, "save:*/mlp/wi;recompute:*", validate=True)
    model = Model(dropout_rate=0.1, block=wrapped)
    with rk.linen.auto_tag(STANDARD):  # validate=True sees auto tags only inside it
        same_tree(model, params, tokens)
        assert saved_tags(model, params, tokens, deterministic=False) == per_layer("mlp/wi")


def test_path_tags_in_specs():
    p = rk.parse("save:*/attn/query,*/attn/key;recompute:*")
    assert rk.parse(str(p)) == p and str(p) == "save:*/attn/key,*/attn/query;recompute:*"
    assert p.resolve(["Block_3/attn/query", "Block_3/attn/value"]) == {
        "Block_3/attn/query": "save", "Block_3/attn/value": "recompute"}
    literal = rk.parse("save:Block_0/mlp/wi|minimal")  # literal path tags survive a union
    assert literal.decide("Block_0/mlp/wi") == "save" and literal.decide("mlpwo") == "save"
    with pytest.raises(rk.RematSpecError, match="path globs"):
        rk.parse("save:*/attn/query|minimal")


def test_errors(setup):
    tokens, params, _ = setup
    # A name no linen class has is refused at the call, before any init.
    with pytest.raises(rk.UnknownModuleError, match="no linen Module class of this name") as info:
        rk.linen.apply_remat(Model(), {"Blok": "full"})
    assert info.value.closest == "Block" and {"Block", "Mlp"} <= set(info.value.choices)
    # A loaded class the model never calls is found missing at the first call.
    with pytest.raises(rk.UnknownModuleError, match="no submodule") as info:
        jax.eval_shape(rk.linen.apply_remat(Model(), {"Conv": "full"}).init,
                       jax.random.key(1), tokens)
    assert {"Block", "Mlp", "Dense"} <= set(info.value.choices)
    with pytest.raises(rk.RematSpecError, match="minimal"):
        rk.linen.apply_remat(Model(), {"Block": "minimall"})
    with pytest.raises(TypeError, match="Module instance"):
        rk.linen.apply_remat(Model, {"Block": "full"})
    with pytest.raises(TypeError, match="Module subclass"):
        rk.linen.remat(Model(), "full")
    with pytest.raises(TypeError, match="class name"):
        rk.linen.apply_remat(Model(), {3: "full"})
    for wrap in (lambda: rk.linen.remat(Block, "full@every:2"),
                 lambda: rk.linen.apply_remat(Model(), {"Block": "nested"})):
        with pytest.raises(rk.RematSpecError, match="applies to a stack of layers"):
            wrap()
    with pytest.raises(rk.RematSpecError, match="planned for a whole model's shapes"):
        rk.linen.remat(Block, "auto:budget=0.5")
    assert rk.linen.remat(Block, "none") is Block  # "none" means no wrapper
    with pytest.raises(rk.UnknownTagError, match="never emits") as info:
        model = rk.linen.apply_remat(Model(), {"Block": "save:*/attn/qeury"}, validate=True)
        jax.eval_shape(model.init, jax.random.key(1), tokens)
    # The roles are tagged: query_proj validates; the ungated MLP has no mlpwi_0.
    wrapped = rk.linen.remat(Block, "save:query_proj", validate=True)
    jax.eval_shape(Model(block=wrapped).apply, {"params": params}, tokens)
    with pytest.raises(rk.UnknownTagError, match=r"'mlpwi_0', which rk.linen \(Block\) never emits"):
        wrapped = rk.linen.remat(Block, "save:mlpwi_0", validate=True)
        jax.eval_shape(Model(block=wrapped).apply, {"params": params}, tokens)
    with rk.linen.auto_tag():  # a glob the model emits passes
        model = rk.linen.apply_remat(Model(), {"Block": "save:*/attn/*"}, validate=True)
        assert jax.eval_shape(model.apply, {"params": params}, tokens).shape == (
            BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("classes, exc, message", [
    ("Dense", TypeError, "got 'Dense'"),
    ((), ValueError, "classes is empty"),
    ((nn.Dense, "LayerNorm"), TypeError, "classes[1] is 'LayerNorm', not a flax.linen"),
    ((nn.Dense, int), TypeError, "classes[1] is <class 'int'>"),
    ([nn.Dense(4)], TypeError, "classes[0] is Dense("),
    (3, TypeError, "got 3"),
])
def test_auto_tag_checks_classes(classes, exc, message):
    with pytest.raises(exc) as info:
        with rk.linen.auto_tag(classes):
            pass
    assert message in str(info.value) and "rk.linen.auto_tag" in str(info.value)


def test_auto_tag_takes_one_class(setup):
    tokens, params, _ = setup
    with rk.linen.auto_tag(nn.LayerNorm):
        found = emitted_tags(lambda p: Model().apply({"params": p}, tokens), params)
    assert set(found) == {"LayerNorm_0",
                          *(f"Block_{i}/ln{j}" for i in range(LAYERS) for j in (1, 2))}


@pytest.mark.parametrize("call, exc, message", [
    # flax shifts positions down by one for self: 0 would mark the last argument static.
    (lambda: rk.linen.remat(Block, "full", static_argnums=(0,)), ValueError,
     "first argument after self is 1"),
    (lambda: rk.linen.remat(Block, "full", static_argnums="2"), TypeError, "got '2'"),
    (lambda: rk.linen.remat(Block, "full", prevent_cse="no"), TypeError,
     "prevent_cse must be True or False, got 'no'"),
    (lambda: rk.linen.remat(Block, "full", methods=["encode"]), ValueError,
     "Block has no method 'encode'; methods it defines: __call__"),
    (lambda: rk.linen.apply_remat(Model(), {"Block": "full"}, methods=()), ValueError,
     "methods is empty"),
    (lambda: rk.linen.apply_remat(Model(), {"Block": "full"}, validate="yes"), TypeError,
     "validate must be True or False"),
])
def test_wrapper_options_are_checked(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value)


def test_one_method_name_is_a_method_list(setup):
    tokens, params, _ = setup
    model = rk.linen.apply_remat(Model(), {"Block": "full"}, methods="__call__")
    assert jax.eval_shape(model.apply, {"params": params}, tokens).shape == (BATCH, SEQ, VOCAB)


def test_apply_remat_of_a_rematerialized_model_nests(setup):
    """Fault 10: a second apply_remat raised UnknownModuleError naming 'Block' as absent
    and present. Each wraps Block in its own region, the second around the first."""
    tokens, params, ref = setup
    once = rk.linen.apply_remat(Model(dropout_rate=0.1), {"Block": "save:*/mlp/wi"})
    twice = rk.linen.apply_remat(once, {"Block": "full"})
    same_tree(twice, params, tokens)
    with rk.linen.auto_tag():
        grads = jax.jit(jax.value_and_grad(loss_fn(twice, False)))(
            params, tokens, jax.random.key(2))
    chex.assert_trees_all_close(grads, ref, rtol=1e-5, atol=1e-7)
    # The outer full region saves nothing of the layer, whatever the inner one saves.
    assert saved_tags(twice, params, tokens) == set()
    assert saved_tags(once, params, tokens) == per_layer("mlp/wi")
