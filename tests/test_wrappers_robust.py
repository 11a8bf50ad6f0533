"""rk.linen and rk.nnx on models written the way model libraries write them: their own
Einsum and RMSNorm classes, fused GQA key/value, a gated MLP, a ClassVar, nn.share_scope,
tuple and dataclass outputs, nn.jit / nnx.jit on __call__, a model traced before wrapping.

On commit dc9de24 each test here failed: the default auto_tag found no tags, the instance
form raised `TypeError: __init__() got an unexpected keyword argument 'INFO'`, nn.jit layers
raised UnknownModuleError or lost their tags, share_scope modules shared one name, and
`Policy.to_jax()` turned `save:*/attn/q_einsum` into nothing_saveable.
"""

import dataclasses
import importlib
import typing

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_kit as rk

measure = importlib.import_module("remat_kit.measure.residuals")  # the module, not rk.measure()

VOCAB, D, HEADS, KV, DH, MLP, LAYERS, BATCH, SEQ = 16, 8, 2, 1, 4, 16, 2, 2, 4
SPEC = "save:*/attn/q_einsum,*/mlp/inner;recompute:*"


def per_layer(prefix, *suffixes, layers=LAYERS):
    return {f"{prefix}{i}{s}" for i in range(layers) for s in suffixes}


def xent(logits):
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


def close(a, b):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


# -- linen ------------------------------------------------------------------------


class Einsum(nn.Module):
    shape: tuple

    @nn.compact
    def __call__(self, eq, x):
        return jnp.einsum(eq, x, self.param("w", nn.initializers.normal(0.5), self.shape))


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale)


def _gqa(attn, x):
    """Grouped-query attention over `attn`'s einsums, linen or NNX: (output, probabilities)."""
    q = attn.q_einsum("bsd,dnh->bsnh", x)
    k, v = attn.kv_einsum("bsd,cdkh->cbskh", x)
    k, v = (jnp.repeat(t, HEADS // KV, axis=2) for t in (k, v))
    probs = jax.nn.softmax(jnp.einsum("bqnh,bknh->bnqk", q, k) / DH ** 0.5)
    return attn.attn_vec_einsum("bqnh,nhd->bqd", jnp.einsum("bnqk,bknh->bqnh", probs, v)), probs


class Attention(nn.Module):
    """Returns (output, probabilities): a tuple output."""

    KIND: typing.ClassVar[str] = "gqa"

    def setup(self):
        self.q_einsum = Einsum((D, HEADS, DH))
        self.kv_einsum = Einsum((2, D, KV, DH))  # fused key/value
        self.attn_vec_einsum = Einsum((HEADS, DH, D))

    def __call__(self, x):
        return _gqa(self, x)


class GatedMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        gate, up = Einsum((2, D, MLP), name="gating")("bsd,cdf->cbsf", x)
        return Einsum((MLP, D), name="linear")("bsf,fd->bsd", nn.gelu(gate) * up)


class Sublayer(nn.Module):
    """Norm, then an inner module on the same scope (its params sit beside the norm's)."""

    def setup(self):
        self.norm = RMSNorm()
        self.inner = GatedMlp()
        nn.share_scope(self, self.inner)
        self.gain = self.param("gain", nn.initializers.ones, (D,))

    def __call__(self, x):
        return self.inner(self.norm(x)) * self.gain  # the inner output is a residual


@dataclasses.dataclass
class PlainOut:
    """A plain (unregistered) dataclass output, with a non-array field."""

    x: jax.Array
    probs: jax.Array
    note: str = "block"


@flax.struct.dataclass
class StructOut:
    """A flax struct output (a pytree: what a jitted call may return)."""

    x: jax.Array
    probs: jax.Array
    note: str = flax.struct.field(pytree_node=False, default="block")


def block_body(block, x):
    """A pre-norm decoder layer over `block`'s submodules: (output, attention probs)."""
    h, probs = block.attn(block.pre_norm(x))
    x = x + h
    return x + block.mlp(x), probs


class Block(nn.Module):
    INFO: typing.ClassVar[dict] = {"family": "gemma-like"}

    def setup(self):
        self.pre_norm = RMSNorm()
        self.attn = Attention()
        self.mlp = Sublayer()

    def __call__(self, x):
        return PlainOut(*block_body(self, x))


class JitBlock(Block):
    @nn.jit
    def __call__(self, x):
        return StructOut(*block_body(self, x))


@flax.struct.dataclass
class ModelOut:
    logits: jax.Array
    hidden: tuple


class Model(nn.Module):
    INFO: typing.ClassVar[str] = "a ClassVar the constructor must not get"
    jit: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embedder")(tokens)
        hidden = []
        for i in range(LAYERS):
            out = (JitBlock if self.jit else Block)(name=f"layer_{i}")(x)
            x = out.x
            hidden.append(out.probs)
        return ModelOut(nn.Dense(VOCAB, name="head")(RMSNorm(name="final_norm")(x)),
                        tuple(hidden))


def linen_loss(model):
    return lambda params, tokens: xent(model.apply({"params": params}, tokens).logits)


LAYER_TAGS = ("", ".probs", "/pre_norm", "/attn/q_einsum", "/attn/kv_einsum",
              "/attn/attn_vec_einsum", "/attn", "/attn.1", "/mlp/norm", "/mlp/gating",
              "/mlp/linear", "/mlp")
LINEN_TAGS = {"embedder", "final_norm", "head"} | per_layer("layer_", *LAYER_TAGS,
                                                            "/mlp/inner")


@pytest.fixture(scope="module")
def linen_setup():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    params = Model().init(jax.random.key(1), tokens)["params"]
    ref = jax.jit(jax.value_and_grad(linen_loss(Model())))(params, tokens)
    return tokens, params, ref


def linen_saved(model, params, tokens):
    """Tags saved inside the layers (a layer's own output is the next one's input, saved
    outside any remat region)."""
    with rk.linen.auto_tag():
        found = measure.residuals(linen_loss(model), params, tokens)
    return {r.name for r in found if r.kind == "tag" and r.name.startswith("layer_")
            and "/" in r.name}


@pytest.mark.parametrize("jit", [False, True])
def test_linen_default_auto_tag_names_every_submodule(linen_setup, jit):
    """Own Einsum/RMSNorm classes are tagged; tuple and dataclass outputs get a dotted
    suffix per extra array; the share_scope pair keeps two names; the root is not
    tagged; under nn.jit each layer keeps its own names."""
    tokens, params, _ = linen_setup
    assert set(rk.linen.tags(Model(jit=jit), tokens)) == LINEN_TAGS
    found = rk.linen.tags(Model(jit=jit), tokens, variables={"params": params})
    assert set(found) == LINEN_TAGS
    assert found["layer_1/attn.1"].shape == (BATCH, HEADS, SEQ, SEQ)  # the probabilities
    assert found["layer_1.probs"].shape == (BATCH, HEADS, SEQ, SEQ)  # a dataclass field
    assert found["layer_0/attn/kv_einsum"].shape == (2, BATCH, SEQ, KV, DH)


@pytest.mark.parametrize("jit", [False, True])
def test_linen_instance_form_glob_and_grads(linen_setup, jit):
    """ClassVars stay out of the constructor; nn.jit layers are matched and remat; the
    share_scope inner module is saved by its own name; grads equal no remat."""
    tokens, params, ref = linen_setup
    plain = Model(jit=jit)
    jax.eval_shape(linen_loss(plain), params, tokens)  # traced before wrapping, same shapes
    model = rk.linen.apply_remat(plain, {"Block": SPEC}, validate=True)
    assert type(model).INFO == Model.INFO and model.jit is jit
    with rk.linen.auto_tag():
        close(jax.jit(jax.value_and_grad(linen_loss(model)))(params, tokens), ref)
        for _ in range(2):  # again at the same shapes: nn.jit reuses its trace
            jax.eval_shape(model.apply, {"params": params}, tokens)
    assert linen_saved(model, params, tokens) == per_layer("layer_", "/attn/q_einsum",
                                                           "/mlp/inner")


def test_linen_class_form_with_classvar_and_dataclass_output(linen_setup):
    tokens, params, ref = linen_setup
    wrapped = rk.linen.remat(Block, SPEC, validate=True)

    class Wrapped(Model):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, D, name="embedder")(tokens)
            for i in range(LAYERS):
                x = wrapped(name=f"layer_{i}")(x).x
            return ModelOut(nn.Dense(VOCAB, name="head")(RMSNorm(name="final_norm")(x)), ())

    with rk.linen.auto_tag():
        close(jax.jit(jax.value_and_grad(linen_loss(Wrapped())))(params, tokens), ref)
    assert linen_saved(Wrapped(), params, tokens) == per_layer("layer_", "/attn/q_einsum",
                                                               "/mlp/inner")


def test_to_jax_keeps_path_globs(linen_setup):
    """Without names to resolve against, a path glob is decided per emitted name."""
    tokens, params, ref = linen_setup
    policy = rk.parse(SPEC).to_jax()
    assert isinstance(policy, rk.policy.TagPolicy)
    loss = jax.checkpoint(linen_loss(Model()), policy=policy)
    with rk.linen.auto_tag():
        found = {r.name for r in measure.residuals(loss, params, tokens) if r.kind == "tag"}
        close(jax.jit(jax.value_and_grad(loss))(params, tokens), ref)
    assert found == per_layer("layer_", "/attn/q_einsum", "/mlp/inner")
    assert rk.parse("save:query_proj").to_jax() is not policy  # built-ins where they fit


# -- nnx --------------------------------------------------------------------------


class NEinsum(nnx.Module):
    def __init__(self, shape, rngs):
        self.w = nnx.Param(0.5 * jax.random.normal(rngs.params(), shape))

    def __call__(self, eq, x):
        return jnp.einsum(eq, x, self.w[...])


class NRMSNorm(nnx.Module):
    def __init__(self, d):
        self.scale = nnx.Param(jnp.zeros((d,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + self.scale[...])


class NAttention(nnx.Module):
    KIND: typing.ClassVar[str] = "gqa"

    def __init__(self, rngs):
        self.q_einsum = NEinsum((D, HEADS, DH), rngs)
        self.kv_einsum = NEinsum((2, D, KV, DH), rngs)
        self.attn_vec_einsum = NEinsum((HEADS, DH, D), rngs)

    def __call__(self, x):
        return _gqa(self, x)


class NMlp(nnx.Module):
    def __init__(self, rngs):
        self.norm = NRMSNorm(D)
        self.gating = NEinsum((2, D, MLP), rngs)
        self.linear = NEinsum((MLP, D), rngs)
        self.gain = nnx.Param(jnp.ones((D,)))

    def __call__(self, x):
        gate, up = self.gating("bsd,cdf->cbsf", self.norm(x))
        return self.linear("bsf,fd->bsd", nnx.gelu(gate) * up) * self.gain[...]


class NBlock(nnx.Module):
    def __init__(self, rngs):
        self.pre_norm = NRMSNorm(D)
        self.attn = NAttention(rngs)
        self.mlp = NMlp(rngs)

    @nnx.jit
    def __call__(self, x):
        return StructOut(*block_body(self, x))


class NPlainBlock(NBlock):
    def __call__(self, x):
        return PlainOut(*block_body(self, x))


class NModel(nnx.Module):
    """Two identical nnx.jit layers, then one returning a plain dataclass."""

    def __init__(self, rngs):
        self.embedder = nnx.Embed(VOCAB, D, rngs=rngs)
        self.layers = nnx.List([NBlock(rngs), NBlock(rngs), NPlainBlock(rngs)])
        self.final_norm = NRMSNorm(D)

    @nnx.jit
    def __call__(self, tokens):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x).x
        return ModelOut(self.embedder.attend(self.final_norm(x)), ())


def nnx_loss(model):
    graphdef, _ = nnx.split(model)
    return lambda state, tokens: xent(nnx.merge(graphdef, state)(tokens).logits)


NNX_LAYERS = 3
NNX_TAGS = {"embedder", "final_norm"} | per_layer("layers/", *LAYER_TAGS, layers=NNX_LAYERS)


@pytest.fixture(scope="module")
def nnx_setup():
    model = NModel(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    model(tokens)  # traced by nnx.jit before any wrapping, at the same shapes
    state = nnx.state(model)
    return model, tokens, state, jax.jit(jax.value_and_grad(nnx_loss(model)))(state, tokens)


def test_nnx_default_auto_tag_names_every_submodule(nnx_setup):
    model, tokens, _, _ = nnx_setup
    found = rk.nnx.tags(model, tokens)
    assert set(found) == NNX_TAGS
    assert found["layers/1/attn.1"].shape == (BATCH, HEADS, SEQ, SEQ)


def test_nnx_instance_form_glob_and_grads(nnx_setup):
    """nnx.jit layers in an nnx.jit model: remat with a dataclass output, grads equal no
    remat, the glob saves exactly its per-layer names."""
    model, tokens, state, ref = nnx_setup
    wrapped = rk.nnx.apply_remat(rk.nnx.auto_tag(model), {
        "NBlock": "save:*/attn/q_einsum,*/mlp/gating;recompute:*"}, validate=True)
    close(jax.jit(jax.value_and_grad(nnx_loss(wrapped)))(state, tokens), ref)
    found = {r.name for r in measure.residuals(nnx_loss(wrapped), state, tokens)
             if r.kind == "tag" and r.name.count("/") > 1}  # inside the layers
    assert found == per_layer("layers/", "/attn/q_einsum", "/mlp/gating", layers=NNX_LAYERS)
    out = wrapped(tokens)  # eager through both nnx.jit levels
    assert isinstance(out, ModelOut) and out.logits.shape == (BATCH, SEQ, VOCAB)
