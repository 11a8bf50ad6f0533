"""rk.nnx on a user model with no tags and no remat: instance form, auto-tagging, class and
function forms.

The core tests run twice in `make test`: with jax_remat3 off, and with JAX_REMAT3=1.
"""

import importlib

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import linen, nnx

import remat_kit as rk

measure = importlib.import_module("remat_kit.measure.residuals")  # its residuals(), as rk.residuals

VOCAB, D, HEADS, LAYERS, BATCH, SEQ = 32, 16, 2, 2, 2, 8
STANDARD = rk.nnx.AUTO_TAG_CLASSES  # tags only flax's layers: the names below list them


class Mlp(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = Mlp(d, rngs)

    def __call__(self, x, deterministic: bool = True):
        x = x + self.attn(self.ln1(x), deterministic=deterministic)
        return x + self.mlp(self.ln2(x))


class Model(nnx.Module):
    """A typical user decoder: plain NNX layers, no tags, no remat."""

    def __init__(self, rngs, block=Block, layers=LAYERS):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([block(D, HEADS, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens, deterministic: bool = True):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, deterministic)
        return self.head(self.ln(x))


def xent(logits):
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


def pure_loss(model):
    """loss(state, tokens) of `model`'s graph: a function of arrays, for jax.grad/measure."""
    graphdef, _ = nnx.split(model)
    return lambda state, tokens: xent(nnx.merge(graphdef, state)(tokens))


def paths(state):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


@pytest.fixture(scope="module")
def setup():
    model = Model(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    state = nnx.state(model)
    ref = jax.jit(jax.value_and_grad(pure_loss(model)))(state, tokens)
    return model, tokens, state, ref


def saved_tags(model, state, tokens):
    found = measure.residuals(pure_loss(model), state, tokens)
    return {r.name for r in found if r.kind == "tag" and r.name.startswith("blocks/")}


def per_layer(*suffixes):
    return {f"blocks/{i}/{s}" for i in range(LAYERS) for s in suffixes}


@pytest.mark.remat_modes
def test_apply_remat_keeps_state_and_grads(setup):
    model, tokens, state, ref = setup
    wrapped = rk.nnx.apply_remat(rk.nnx.auto_tag(model, STANDARD),
                                 {"Block": "full", Mlp: "dots"})
    assert paths(nnx.state(wrapped)) == paths(state)
    assert type(model.blocks[0]) is Block and type(model.blocks[0].mlp) is Mlp  # input untouched
    assert isinstance(wrapped.blocks[0], Block) and type(wrapped.blocks[0]) is not Block
    grads = jax.jit(jax.value_and_grad(pure_loss(wrapped)))(state, tokens)
    chex.assert_trees_all_close(grads, ref, rtol=1e-5, atol=1e-7)
    # nnx's own transforms see the same module.
    nnx_grads = nnx.jit(nnx.grad(lambda m, t: xent(m(t))))(wrapped, tokens)
    chex.assert_trees_all_close(nnx_grads, ref[1], rtol=1e-5, atol=1e-7)


@pytest.mark.remat_modes
@pytest.mark.parametrize("spec, expected", [
    ("full", set()),
    ("save:*/attn/query,*/attn/key;recompute:*", per_layer("attn/query", "attn/key")),
    ("save:*/mlp/up,*/ln1", per_layer("mlp/up", "ln1")),
])
def test_saved_residuals_follow_spec(setup, spec, expected):
    model, tokens, state, _ = setup
    wrapped = rk.nnx.apply_remat(rk.nnx.auto_tag(model, STANDARD), {"Block": spec})
    assert saved_tags(wrapped, state, tokens) == expected


def test_auto_tag_names_by_attribute_path(setup):
    model, tokens, _, _ = setup
    found = rk.nnx.tags(model, tokens, classes=STANDARD)
    assert list(found) == [
        f"blocks/{i}/{s}" for i in range(LAYERS)
        for s in ("ln1", "attn/query", "attn/key", "attn/value", "attn/out", "attn", "ln2",
                  "mlp/up", "mlp/down")] + ["ln", "head"]
    # By default every called submodule is tagged, the model itself not.
    assert list(rk.nnx.tags(model, tokens)) == ["embed"] + [
        f"blocks/{i}{s}" for i in range(LAYERS)
        for s in ("/ln1", "/attn/query", "/attn/key", "/attn/value", "/attn/out", "/attn",
                  "/ln2", "/mlp/up", "/mlp/down", "/mlp", "")] + ["ln", "head"]
    assert found["blocks/0/attn/query"].shape == (BATCH, SEQ, HEADS, D // HEADS)
    assert found["head"].shape == (BATCH, SEQ, VOCAB) and found["head"].dtype == jnp.float32
    assert rk.emitted_tags(pure_loss(model), nnx.state(model), tokens) == {}


def test_temp_bytes_fall(setup):
    model, _, state, _ = setup
    tokens = jnp.zeros((4, 32), jnp.int32)

    def temp(m):
        grad = jax.jit(jax.grad(pure_loss(m)))
        return grad.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes

    assert temp(rk.nnx.apply_remat(model, {"Block": "full"})) < temp(model)


@pytest.mark.remat_modes
def test_class_instance_and_function_forms(setup):
    model, tokens, state, ref = setup
    spec = "save:*/mlp/up;recompute:*"
    wrapped_cls = rk.nnx.remat(Block, spec, validate=True)
    built = rk.nnx.auto_tag(Model(nnx.Rngs(0), block=wrapped_cls), STANDARD)
    assert paths(nnx.state(built)) == paths(state)
    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(pure_loss(built)))(state, tokens),
                                ref, rtol=1e-5, atol=1e-7)
    assert saved_tags(built, state, tokens) == per_layer("mlp/up")

    one = rk.nnx.remat(rk.nnx.auto_tag(model, STANDARD).blocks[1], spec)  # one layer
    assert type(one).__mro__[1] is Block and paths(nnx.state(one)) == paths(state["blocks"][1])

    graphdef, _ = nnx.split(rk.nnx.auto_tag(model, STANDARD))
    body = rk.nnx.remat(lambda m, t: xent(m(t)), spec)  # function form, glob via TagPolicy

    def loss(s, t):
        return body(nnx.merge(graphdef, s), t)

    chex.assert_trees_all_close(jax.jit(jax.value_and_grad(loss))(state, tokens), ref,
                                rtol=1e-5, atol=1e-7)
    found = {r.name for r in measure.residuals(loss, state, tokens) if r.kind == "tag"}
    assert found == per_layer("mlp/up")


def test_errors(setup):
    model, tokens, _, _ = setup
    with pytest.raises(rk.UnknownModuleError) as info:
        rk.nnx.apply_remat(model, {"Blok": "full"})
    assert info.value.closest == "Block" and {"Block", "Mlp", "Linear"} <= set(info.value.choices)
    with pytest.raises(rk.RematSpecError, match="minimal"):
        rk.nnx.apply_remat(model, {"Block": "minimall"})
    with pytest.raises(rk.RematSpecError, match="applies to a stack of layers"):
        rk.nnx.remat(Block, "selective@first:2")
    with pytest.raises(TypeError, match="nnx.Module instance"):
        rk.nnx.apply_remat(Model, {"Block": "full"})
    with pytest.raises(TypeError, match="Module class, instance or function"):
        rk.nnx.remat(3, "full")
    with pytest.raises(TypeError, match="static_argnums is for functions"):
        rk.nnx.remat(Block, "full", static_argnums=(1,))
    assert rk.nnx.remat(Block, "none") is Block  # "none" means no wrapper
    with pytest.raises(TypeError, match="validate=True needs a module"):
        rk.nnx.remat(lambda m, x: m(x), "full", validate=True)
    wrapped = rk.nnx.apply_remat(rk.nnx.auto_tag(model, STANDARD),
                                 {"Block": "save:*/attn/qeury"}, validate=True)
    with pytest.raises(rk.UnknownTagError, match="never emits") as info:
        jax.eval_shape(pure_loss(wrapped), nnx.state(wrapped), tokens)
    assert info.value.closest == "blocks/0/attn/query"
    assert type(model.blocks[0]) is Block  # the failed wrap left the input as it was


@pytest.mark.parametrize("classes, exc, message", [
    ("Linear", TypeError, "got 'Linear'"),
    ((), ValueError, "classes is empty"),
    ((nnx.Linear, "LayerNorm"), TypeError, "classes[1] is 'LayerNorm', not a flax.nnx"),
    ((nnx.Linear, linen.Dense), TypeError,
     "classes[1] is <class 'flax.linen.linear.Dense'>, not a flax.nnx"),
    (3, TypeError, "got 3"),  # None is the default: every called submodule
])
def test_auto_tag_checks_classes(setup, classes, exc, message):
    model = setup[0]
    with pytest.raises(exc) as info:
        rk.nnx.auto_tag(model, classes)
    assert message in str(info.value) and "rk.nnx.auto_tag" in str(info.value)


@pytest.mark.parametrize("call, exc, message", [
    (lambda m: rk.nnx.remat(lambda b, x: b(x), "full", static_argnums="1"), TypeError,
     "static_argnums must be an int or a tuple of ints, got '1'"),
    (lambda m: rk.nnx.remat(Block, "full", prevent_cse=1), TypeError,
     "prevent_cse must be True or False, got 1"),
    (lambda m: rk.nnx.remat(Block, "full", methods=("encode",)), ValueError,
     "Block has no method 'encode'; methods it defines: __call__"),
    (lambda m: rk.nnx.apply_remat(m, {"Mlp": "full"}, methods=("encode",)), ValueError,
     "Mlp has no method 'encode'"),
    (lambda m: rk.nnx.apply_remat(m, {"Mlp": "full"}, methods=[]), ValueError,
     "methods is empty"),
])
def test_wrapper_options_are_checked(setup, call, exc, message):
    with pytest.raises(exc) as info:
        call(setup[0])
    assert message in str(info.value)
