"""Role inference (remat_kit.trace.roles) on our reference models and on models written as libraries do.

Each zoo model must get exactly its roles, per block, on values of the right
shape; values without a role (the embedding, the LM head, an MoE router) none.
The walker must see through: jit (nn.jit, nnx.jit, jnp helpers), checkpoint
(remat), scan (scanned layers), custom_jvp_call (softmax with
jax_softmax_custom_jvp, relu), custom_vjp_call (a custom-gradient attention),
and ffi_call (a fused attention kernel, one op).
"""

import collections
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.trace import dataflow as df
from remat_kit.trace.roles import ROLES, _proj, infer_roles
from remat_kit.trace.validate import tag_of
from tests.zoo import fused_nnx, hf_llama_linen

B, T = 2, 8
BLOCK = ("attn_norm", "attn_logits", "attn_probs", "context", "out_proj", "mlp_norm", "mlp_act",
         "mlpwo")

# model -> {tag: (values, shape)}: each zoo model has 2 blocks.
EXPECTED = {
    "gemma_linen": {**{t: (2, None) for t in BLOCK}, "query_proj": (2, (B, T, 4, 8)),
                    "kv_proj": (2, (2, B, T, 2, 8)), "mlpwi_0": (2, (B, T, 64)),
                    "mlpwi_1": (2, (B, T, 64)), "attn_logits": (2, (B, T, 4, T))},
    "gpt_linen": {**{t: (2, None) for t in BLOCK}, "qkv_proj": (2, (B, T, 96)),
                  "mlpwi": (2, (B, T, 128)), "attn_probs": (2, (B, 4, T, T))},
    # query/key after the rotary embedding (MaxText's meaning), heads split; value at its matmul
    "llama_nnx": {**{t: (2, None) for t in BLOCK}, "query_proj": (2, (B, T, 4, 8)),
                  "key_proj": (2, (B, T, 2, 8)), "value_proj": (2, (B, T, 16)),
                  "mlpwi_0": (2, (B, T, 48)), "mlpwi_1": (2, (B, T, 48)),
                  "attn_logits": (2, (B, 4, T, T))},
    "fused_nnx": {**{t: (2, None) for t in BLOCK}, "query_proj": (2, (B, T, 32)),
                  "key_proj": (2, (B, T, 32)), "value_proj": (2, (B, T, 32)),
                  "mlpwi": (2, (B, T, 96)), "context": (2, (B, T, 32))},
    # One fused Conv1D qkv [B, T, q + 2 kv] (split and rotated after it, as MaxText tags
    # a fused projection), a gated MLP, scores [B, heads, T, T] (keys repeated per group).
    "hf_llama_linen": {**{t: (2, None) for t in BLOCK}, "qkv_proj": (2, (B, T, 64)),
                       "mlpwi_0": (2, (B, T, 64)), "mlpwi_1": (2, (B, T, 64)),
                       "attn_logits": (2, (B, 4, T, T)), "attn_probs": (2, (B, 4, T, T))},
    # Two experts per MoE layer: each expert's MLP has its own roles.
    "nano_moe": {**{t: (2, None) for t in BLOCK}, "qkv_proj": (2, (B, T, 96)),
                 "mlpwi": (4, (B, T, 64)), "mlp_act": (4, (B, T, 64)),
                 "mlpwo": (4, (B, T, 32))},
}
# Primitives each model's jaxpr must contain, so the walk through them is tested.
PRIMS = {"gemma_linen": {"jit", "unstack", "tanh", "split"}, "gpt_linen": {"split"},
         "llama_nnx": {"jit", "concatenate"}, "fused_nnx": {"split"}, "nano_moe": {"gather"},
         "hf_llama_linen": {"split", "gather", "select_n", "and", "stop_gradient"}}


def _subs(eqn):
    params = getattr(eqn.params.get("_prim"), "params", None) or eqn.params  # jax_remat3
    return jcore.jaxprs_in_params(params)


def prims_of(jaxpr) -> set:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in _subs(eqn):
            out |= prims_of(sub)
    return out


def producers_of(jaxpr) -> dict:
    """Var -> the eqn that computes it, in the jaxpr and its sub-jaxprs."""
    out = {}
    for eqn in jaxpr.eqns:
        out.update(dict.fromkeys(eqn.outvars, eqn))
        for sub in _subs(eqn):
            out.update(producers_of(sub))
    return out


def trace(fwd, params):
    tokens = jnp.zeros((B, T), jnp.int32)
    jaxpr = jax.make_jaxpr(fwd)(params, tokens)
    return jaxpr, infer_roles(jaxpr, [True] * len(jax.tree.leaves(params)) + [False])


@pytest.fixture(scope="module")
def zoo():
    out = {}
    for name in EXPECTED:
        _, params, fwd = importlib.import_module(f"tests.zoo.{name}").make(B, T, abstract=True)
        out[name] = trace(fwd, params)
    return out


@pytest.mark.parametrize("name", list(EXPECTED))
def test_zoo_roles_per_block(zoo, name):
    jaxpr, roles = zoo[name]
    counts = collections.Counter(roles.of.values())
    assert dict(counts) == {t: n for t, (n, _) in EXPECTED[name].items()}
    for tag, (_, shape) in EXPECTED[name].items():
        if shape is not None:
            assert {tuple(v.aval.shape) for v, t in roles.of.items() if t == tag} == {shape}, tag
    # Every role it lacks is explained; none it has is.
    assert set(roles.missing) == set(ROLES) - set(counts)
    assert all(isinstance(r, str) and r for r in roles.missing.values())
    assert PRIMS[name] <= prims_of(jaxpr.jaxpr)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_batch_of_one_has_the_same_roles(name):
    """At batch 1 jnp.matmul squeezes the batch axis and broadcasts it back (a
    broadcast_in_dim adding a size-1 axis before the output projection): out_proj
    must still be found, and every other role, in the same count."""
    _, params, fwd = importlib.import_module(f"tests.zoo.{name}").make(1, T, abstract=True)
    jaxpr = jax.make_jaxpr(fwd)(params, jnp.zeros((1, T), jnp.int32))
    roles = infer_roles(jaxpr, [True] * len(jax.tree.leaves(params)) + [False])
    assert collections.Counter(roles.of.values()) == {t: n for t, (n, _) in EXPECTED[name].items()}


@pytest.mark.parametrize("name", ["gpt_linen", "llama_nnx", "gemma_linen", "hf_llama_linen"])
def test_projections_are_param_matmuls(zoo, name):
    """Each projection role sits on a dot_general (or its bias add); a rotated query or
    key on its rotary embedding's output."""
    jaxpr, roles = zoo[name]
    producers = producers_of(jaxpr.jaxpr)
    for var, tag in roles.of.items():
        prim = producers[var].primitive.name
        if tag in ("query_proj", "key_proj") and name != "gpt_linen":  # rope: the rotated
            assert prim == "concatenate", tag  # halves joined (MaxText names them after it)
        elif tag.endswith("_proj") or tag.startswith("mlpw"):  # or its bias add (GPT, Conv1D)
            biased = name == "gpt_linen" or (name, tag) == ("hf_llama_linen", "qkv_proj")
            assert prim == "dot_general" or (prim == "add" and biased), tag
        if tag in ("attn_probs", "mlp_act", "attn_norm", "mlp_norm"):
            assert producers[var].primitive.name != "dot_general", tag


def _downstream(val) -> set:
    """The values computed from `val` (itself included), through every op."""
    out, todo = set(), [val]
    while todo:
        v = todo.pop()
        if v not in out:
            out.add(v)
            todo.extend(o for n in v.consumers for o in n.outs)
    return out


def test_the_rotary_table_mask_and_position_ids_have_no_role():
    """The HF-style Llama with attention_mask and position_ids as inputs: every role is
    on a value computed from the tokens, none on the numpy sin/cos table (a jaxpr
    constant), the combined causal and padding mask, its additive bias, or the
    position ids and the sin/cos gathered by them; the roles are those it gets when
    it builds the mask and ids itself."""
    model, params, _ = hf_llama_linen.make(B, T, abstract=True)
    ints = jax.ShapeDtypeStruct((B, T), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, ids, mask, pos: model.apply(
        {"params": p}, ids, attention_mask=mask, position_ids=pos).logits)(
            params, ints, ints, ints)
    is_param = [True] * len(jax.tree.leaves(params)) + [False] * 3
    graph = df.Graph(jaxpr, is_param)
    roles = infer_roles(jaxpr, is_param)
    assert jaxpr.consts and {c.shape for c in jaxpr.consts} == {(64, 16)}  # the table
    vals = {v.var: v for n in graph.nodes for v in n.ins + n.outs}
    ids, mask, pos = (vals[v] for v in jaxpr.jaxpr.invars[-3:])
    from_tokens = _downstream(ids)
    # The mask and the positions reach the scores, so exclude only what tokens do not.
    side = (_downstream(mask) | _downstream(pos)) - from_tokens
    table = {v for v in vals.values() if v.var in set(jaxpr.jaxpr.constvars)}
    assert len(table) == 2  # one per layer (each layer's setup builds it)
    side |= set().union(*map(_downstream, table)) - from_tokens
    assert {v.shape for v in side} >= {(B, 1, T, T), (B, T, 1, 16), (B, T, 1, 8)}
    assert all(vals[v] in from_tokens for v in roles.of)
    assert collections.Counter(roles.of.values()) == collections.Counter(
        {t: n for t, (n, _) in EXPECTED["hf_llama_linen"].items()})


def test_hf_rotary_names_query_and_key_after_it():
    """HF's rotary form, x * cos + rotate_half(x) * sin, on separate q/k/v projections:
    query_proj and key_proj are its sums (before the head repeat: 2 key heads)."""
    _, params, fwd = hf_llama_linen.make(B, T, abstract=True, fused_qkv=False)
    jaxpr, roles = trace(fwd, params)
    want = {**{t: (n, s) for t, (n, s) in EXPECTED["hf_llama_linen"].items()
               if t != "qkv_proj"},
            "query_proj": (2, (B, T, 4, 8)), "key_proj": (2, (B, T, 2, 8)),
            "value_proj": (2, (B, T, 16))}
    assert dict(collections.Counter(roles.of.values())) == {t: n for t, (n, _) in want.items()}
    producers = producers_of(jaxpr.jaxpr)
    for var, tag in roles.of.items():
        if want[tag][1] is not None:
            assert tuple(var.aval.shape) == want[tag][1], tag
        if tag in ("query_proj", "key_proj", "value_proj"):
            assert producers[var].primitive.name == ("dot_general" if tag == "value_proj"
                                                     else "add"), tag


def test_projection_role_goes_where_a_name_follows_its_layout_ops():
    """jnp.einsum may end in a transpose of its dot: where that is a layer's output
    and carries a (path) name, the role is on it, so the value has both names."""
    def f(w, x):
        kv = jnp.einsum("BSD,CKDH->CBSKH", x, w)
        return kv, checkpoint_name(jnp.einsum("BSD,CKDH->CBSKH", x, w), "blk/kv_einsum")

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2, 32, 8)), jnp.ones((B, T, 32)))
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert prims == ["dot_general", "transpose", "dot_general", "transpose", "name"]
    graph = df.Graph(jaxpr, [True, False])
    dots = [n for n in graph.nodes if n.prim == "dot_general"]
    assert _proj(dots[0]).producer.prim == "dot_general"  # no name: the dot itself
    assert _proj(dots[1]).var is jaxpr.eqns[3].outvars[0]  # the named transpose


def test_fused_attention_one_op():
    """A fused kernel (one op) has context but no scores: missing says why."""
    _, params, fwd = fused_nnx.make(B, T, attention=fused_nnx.one_op_attention, abstract=True)
    jaxpr, roles = trace(fwd, params)
    assert "ffi_call" in prims_of(jaxpr.jaxpr)
    counts = collections.Counter(roles.of.values())
    assert counts["context"] == 2 and counts["query_proj"] == 2 and counts["out_proj"] == 2
    assert "attn_logits" not in counts and "attn_probs" not in counts
    for tag in ("attn_logits", "attn_probs"):
        assert roles.missing[tag].startswith("fused attention (one op, fused_attention_fwd)")


def test_custom_vjp_attention_is_seen_through():
    @jax.custom_vjp
    def attention(q, k, v):
        return fused_nnx.causal_dpa(q, k, v)

    def fwd_rule(q, k, v):
        out, vjp = jax.vjp(fused_nnx.causal_dpa, q, k, v)
        return out, vjp

    attention.defvjp(fwd_rule, lambda vjp, g: vjp(g))
    _, params, fwd = fused_nnx.make(B, T, attention=attention, abstract=True)
    jaxpr, roles = trace(fwd, params)
    assert "custom_vjp_call" in prims_of(jaxpr.jaxpr)
    assert collections.Counter(roles.of.values()) == collections.Counter(
        {t: n for t, (n, _) in EXPECTED["fused_nnx"].items()})


def named_tags(jaxpr) -> dict:
    """Var -> tag of every checkpoint_name in the jaxpr (its input var), under either
    remat mode (jax_remat3 stages a name as a hi-primitive)."""
    out = {}
    for eqn in jaxpr.eqns:
        if (tag := tag_of(eqn)) is not None:
            out[eqn.invars[0]] = tag
        for sub in _subs(eqn):
            out.update(named_tags(sub))
    return out


@pytest.mark.remat_modes
@pytest.mark.parametrize("fam,changes,custom_jvp", [
    ("tiny", {}, False),
    ("tiny_llama", {}, False),
    ("tiny", {"dtype": "bfloat16", "dropout_rate": 0.1}, True),
    ("tiny_llama", {"dtype": "bfloat16", "remat": "minimal"}, True),
    ("tiny_llama", {"scan_layers": True, "remat": "full"}, False),
])
def test_reference_model_roles_equal_its_tags(fam, changes, custom_jvp):
    """Our fully tagged model: inferred roles are its own tags, value for value."""
    prev = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", custom_jvp)
    try:
        cfg = get_config(fam, **changes)
        model = Transformer(cfg)
        tokens = jnp.zeros((B, T), jnp.int32)
        params = jax.eval_shape(lambda k, t: model.init(k, t), jax.random.key(1), tokens)["params"]
        jaxpr = jax.make_jaxpr(make_loss_fn(model, deterministic=False))(
            params, tokens, tokens, jax.random.key(2))
    finally:
        jax.config.update("jax_softmax_custom_jvp", prev)
    roles = infer_roles(jaxpr, [True] * len(jax.tree.leaves(params)) + [False] * 3)
    expected = {v: t for v, t in named_tags(jaxpr.jaxpr).items()
                if t not in ("decoder_layer_input", "decoder_layer_output")}
    assert roles.of == expected
    want = {"custom_jvp_call"} if custom_jvp else set()
    want |= {"scan"} if changes.get("scan_layers") else set()
    assert want <= prims_of(jaxpr.jaxpr)
    if changes.get("remat"):  # jax.checkpoint's primitive (a hi-primitive under jax_remat3)
        assert prims_of(jaxpr.jaxpr) & {"remat2", "call_hi_primitive"}


def plain_jax_lm(params, tokens):
    """A language model in plain JAX: layers in a while_loop over stacked weights
    (indexed by the loop counter), relu MLP, post-norm, attention mask by lax.select."""
    def norm(x):
        x = x - x.mean(-1, keepdims=True)
        return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    def layer(carry):
        i, x = carry
        q, k, v = (x @ params[n][i] for n in ("wq", "wk", "wv"))
        s = jnp.einsum("btd,bsd->bts", q, k)
        s = jax.lax.select(jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), s.shape), s,
                           jnp.full_like(s, -1e9))
        x = norm(x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s), v) @ params["wo"][i])
        return i + 1, norm(x + jax.nn.relu(x @ params["w1"][i]) @ params["w2"][i])

    x = params["embed"][tokens]
    _, x = jax.lax.while_loop(lambda c: c[0] < 3, layer, (0, x))
    return x @ params["embed"].T


def test_plain_jax_while_loop_relu():
    d = 16
    params = {n: jax.ShapeDtypeStruct((3, d, d), jnp.float32)
              for n in ("wq", "wk", "wv", "wo", "w1", "w2")}
    params["embed"] = jax.ShapeDtypeStruct((32, d), jnp.float32)
    jaxpr, roles = trace(plain_jax_lm, params)
    assert {"while", "custom_jvp_call", "dynamic_slice"} <= prims_of(jaxpr.jaxpr)
    # One loop body: each role once. Post-norm: the previous layer's norm feeds both.
    assert collections.Counter(roles.of.values()) == collections.Counter(
        ["query_proj", "key_proj", "value_proj", "attn_logits", "attn_probs", "context",
         "out_proj", "mlpwi", "mlp_act", "mlpwo", "mlp_norm"])
    assert roles.missing["attn_norm"] == "no norm (reduce over the features, rsqrt) feeds " \
        "the projections"


def test_flax_attention_layers():
    """flax's own MultiHeadDotProductAttention (linen) and MultiHeadAttention (NNX),
    cross-attention with 8 queries over 5 keys: the key side is the 5-long one."""
    x, ctx = jnp.ones((B, 8, 32)), jnp.ones((B, 5, 32))
    lin = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)
    p = jax.eval_shape(lambda: lin.init(jax.random.key(0), x, ctx))["params"]
    mod = nnx.eval_shape(lambda: nnx.MultiHeadAttention(4, 32, 32, decode=False,
                                                         rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(mod, nnx.Param)
    for fn, params in ((lambda p, a, b: lin.apply({"params": p}, a, b), p),
                       (lambda s, a, b: nnx.merge(graphdef, s)(a, b), state)):
        jaxpr = jax.make_jaxpr(fn)(params, x, ctx)
        roles = infer_roles(jaxpr, [True] * len(jax.tree.leaves(params)) + [False, False])
        shapes = {t: tuple(v.aval.shape) for v, t in roles.of.items()}
        # NNX's layer calls jax.nn.dot_product_attention: its scores are [B, K, G, T, S].
        for t in ("attn_logits", "attn_probs"):
            assert sorted(d for d in shapes.pop(t) if d > 1) == sorted((B, 4, 8, 5)), t
        assert shapes == {"query_proj": (B, 8, 4, 8), "key_proj": (B, 5, 4, 8),
                          "value_proj": (B, 5, 4, 8), "context": (B, 8, 4, 8),
                          "out_proj": (B, 8, 32)}


def test_no_transformer_no_roles():
    """A linear model and a two-layer net without a nonlinearity have no roles."""
    def f(w1, w2, x):
        h = jnp.einsum("bd,df->bf", x, w1)
        return jax.nn.softmax(h @ w2, axis=-1)  # a softmax over a parameter matmul
    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones((2, 4)))
    roles = infer_roles(jaxpr, [True, True, False])
    assert roles.of == {}
    assert set(roles.missing) == set(ROLES)
    assert roles.missing["attn_probs"].startswith("no attention found")
    assert roles.missing["mlpwo"].startswith("no MLP found")


def test_bad_arguments():
    jaxpr = jax.make_jaxpr(lambda w, x: x @ w)(jnp.ones((2, 2)), jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="is_param has 1 entries; the jaxpr has 2 inputs"):
        infer_roles(jaxpr, [True])
    with pytest.raises(TypeError, match="needs a ClosedJaxpr or Jaxpr"):
        infer_roles(lambda x: x, [])
