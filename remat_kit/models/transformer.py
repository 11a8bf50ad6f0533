"""Reference decoder-only transformers in flax.linen, with every vocabulary value tagged.

`Transformer(cfg)`: GPT-2 (LayerNorm, GELU, learned positions, MHA) or Llama (RMSNorm, RoPE,
SwiGLU, GQA) by `cfg.family`; tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
Each layer runs under `nn.remat` with the config's policy and schedule; parameters carry
logical axes and activations are constrained (`mesh.constrain`) before they are tagged.
Also `make_loss_fn`, `lm_loss`. Sharding: docs/meshes.md ("Sharded"); schedules: docs/scan.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from remat_kit import mesh as rk_mesh
from remat_kit.flax.chunked_loss import chunked_head_loss
from remat_kit.models.config import TransformerConfig
from remat_kit.policy.names import tag
from remat_kit.policy.policy import Policy


def _axes(init, *names: str | None):
    """`init` whose parameter carries logical axis names (see remat_kit.mesh)."""
    return nn.with_logical_partitioning(init, names)


def _constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """x under a logical sharding constraint; a no-op outside remat_kit.mesh.use."""
    return rk_mesh.constrain(x, names)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer), half-split layout as in Llama.

    x: [batch, seq, heads, head_dim]; positions: int [seq]. Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [seq, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# Large and finite: masked scores underflow to 0 in softmax, with no inf - inf = nan.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def causal_attention(q, k, v, dropout, dtype):
    """Scaled dot-product causal attention with grouped-query heads.

    Args:
      q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim].
      dropout: function applied to the attention probabilities.
      dtype: dtype of the probabilities fed to the value matmul.
    Returns:
      context [batch, q_len, heads, head_dim]. Tags attn_logits and attn_probs
      with shape [batch, heads, q_len, kv_len].
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, s, kvh, h // kvh, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / math.sqrt(d)
    logits = tag(logits.reshape(b, h, s, k.shape[1]), "attn_logits")
    # jnp.where, not an additive bias: its jaxpr keeps a [b, h, q, kv] mask and
    # zeros as residuals, but XLA fuses those broadcasts away. Measured on
    # gpt2_small (bf16, batch 8, seq 1024, XLA CPU), the bias form needed
    # 0.37 GiB more temp without remat and 0.75 GiB more under full remat.
    causal = jnp.tril(jnp.ones((s, k.shape[1]), dtype=bool))
    logits = jnp.where(causal, logits.astype(jnp.float32), _MASK_VALUE)
    probs = tag(dropout(jax.nn.softmax(logits, axis=-1).astype(dtype)), "attn_probs")
    probs = probs.reshape(b, kvh, h // kvh, s, k.shape[1])
    context = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return context.reshape(b, s, h, d)


def _norm(cfg: TransformerConfig, name: str) -> nn.Module:
    scale = _axes(nn.initializers.ones, "embed")
    if cfg.family == "gpt2":
        return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                            scale_init=scale, bias_init=_axes(nn.initializers.zeros, "embed"),
                            name=name)
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      scale_init=scale, name=name)


# The layer computation, shared by the linen modules below and the NNX twin
# (models/nnx_transformer.py). Each takes its submodules as callables:
# dense(features, name, logical_axes[, axis]) and norm(name) return the named submodule
# (created by linen on first use, an attribute in NNX); dropout(x) -> x.

def attention(cfg: TransformerConfig, x, dense: Callable, dropout: Callable):
    """Self-attention: tags query_proj, key_proj, value_proj, attn_logits, attn_probs,
    context and out_proj. Input and output [batch, seq, d_model].

    Values are constrained to their logical axes before they are tagged, so a
    policy decides over the sharded values (a no-op off a mesh).
    """
    heads = lambda name, n: _constrain(
        dense((n, cfg.heads_dim), name, ("embed", "heads", "kv"))(x),
        "batch", "length", "heads", "kv")
    q, k = heads("query", cfg.num_heads), heads("key", cfg.kv_heads)
    v = tag(heads("value", cfg.kv_heads), "value_proj")
    if cfg.family == "llama":
        positions = jnp.arange(x.shape[1])
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    # Named after the rotary embedding, as MaxText names them (layers/attentions.py).
    q, k = tag(q, "query_proj"), tag(k, "key_proj")
    context = causal_attention(q, k, v, dropout, cfg.dtype)
    context = tag(_constrain(context, "batch", "length", "heads", "kv"), "context")
    out = dense((cfg.d_model,), "out", ("heads", "kv", "embed"), axis=(-2, -1))(context)
    return tag(_constrain(out, "batch", "length", "embed"), "out_proj")


def mlp(cfg: TransformerConfig, x, dense: Callable):
    """GELU MLP (gpt2: mlpwi, mlp_act, mlpwo) or SwiGLU (llama: mlpwi_0, mlpwi_1,
    mlp_act, mlpwo). Input and output [batch, seq, d_model]."""
    wi = lambda name: _constrain(dense(cfg.mlp_dim, name, ("embed", "mlp"))(x),
                                 "batch", "length", "mlp")
    if cfg.family == "gpt2":
        h = tag(wi("wi"), "mlpwi")
        h = tag(jax.nn.gelu(h), "mlp_act")
    else:
        gate = tag(wi("wi_0"), "mlpwi_0")
        up = tag(wi("wi_1"), "mlpwi_1")
        h = tag(jax.nn.silu(gate) * up, "mlp_act")
    out = dense(cfg.d_model, "wo", ("mlp", "embed"))(h)
    return tag(_constrain(out, "batch", "length", "embed"), "mlpwo")


def decoder_layer(x, norm: Callable, attn: Callable, mlp_: Callable, dropout: Callable):
    """Pre-norm decoder layer. x: [batch, seq, d_model] -> same shape and dtype.

    Tags decoder_layer_input, attn_norm, mlp_norm, decoder_layer_output;
    attn(h) and mlp_(h) tag the rest of the vocabulary.
    """
    x = tag(_constrain(x, "batch", "length", "embed"), "decoder_layer_input")
    h = tag(norm("attn_norm")(x), "attn_norm")
    x = x + dropout(attn(h))
    h = tag(norm("mlp_norm")(x), "mlp_norm")
    x = x + dropout(mlp_(h))
    return tag(_constrain(x, "batch", "length", "embed"), "decoder_layer_output")


class Attention(nn.Module):
    """`attention` in linen. Input and output [batch, seq, d_model]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        dense = lambda feats, name, axes, axis=-1: nn.DenseGeneral(
            feats, axis=axis, use_bias=cfg.family == "gpt2", dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, name=name,
            kernel_init=_axes(nn.initializers.lecun_normal(), *axes),
            bias_init=_axes(nn.initializers.zeros, *axes[len(axes) - len(feats):]))
        drop = nn.Dropout(cfg.dropout_rate)
        return attention(cfg, x, dense, lambda p: drop(p, deterministic=deterministic))


class Mlp(nn.Module):
    """`mlp` in linen. Input and output [batch, seq, d_model]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dense = lambda feats, name, axes: nn.Dense(
            feats, use_bias=cfg.family == "gpt2", dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            kernel_init=_axes(nn.initializers.lecun_normal(), *axes),
            bias_init=_axes(nn.initializers.zeros, axes[-1]), name=name)
        return mlp(cfg, x, dense)


class DecoderLayer(nn.Module):
    """`decoder_layer` in linen. x: [batch, seq, d_model] -> same shape and dtype.

    Tags every value of the vocabulary (the fused qkv_proj, kv_proj aside).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        return decoder_layer(x, lambda name: _norm(cfg, name),
                             lambda h: Attention(cfg, name="attn")(h, deterministic),
                             lambda h: Mlp(cfg, name="mlp")(h),
                             lambda h: drop(h, deterministic=deterministic))


class _ScanLayer(nn.Module):
    """DecoderLayer in nn.scan's (carry, x) -> (carry, y) form."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        return DecoderLayer(self.config, name="layer")(x, deterministic), None


def remat_layer(cls: type[nn.Module], cfg: TransformerConfig,
                policy: Policy | None = None) -> type[nn.Module]:
    """`cls` wrapped in `nn.remat` with `policy` (default the config's); unchanged for "none".

    The policy's layer schedule is not applied here (see `Transformer`).
    `deterministic` (argument 2, counting self) is static. Under scan,
    prevent_cse=False: the loop already stops XLA from merging recompute
    with the forward pass (Flax `nn.remat` docs).
    """
    policy = cfg.policy if policy is None else policy
    if not policy.remat:
        return cls
    return nn.remat(cls, policy=policy.to_jax(), static_argnums=(2,),
                    prevent_cse=not cfg.scan_layers)


class _ScanGroup(nn.Module):
    """One group of a nested scanned stack: an nn.scan over its layers, (carry, None) form."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        cfg = self.config
        size = cfg.policy.schedule.group_size(cfg.num_layers)
        return _scan(remat_layer(_ScanLayer, cfg), cfg, size, "group")(x, deterministic), None


def _restack(tree, reshape: Callable, rename: Callable):
    """Reshapes stacked parameters; a logically partitioned one also gets its axis
    names renamed, so they keep one name per dimension (see remat_kit.mesh)."""
    def one(a):
        if isinstance(a, nn.LogicallyPartitioned):
            return a.replace(value=reshape(a.value), names=rename(a.names))
        return reshape(a)
    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, nn.LogicallyPartitioned))


def _scan(body: type[nn.Module], cfg: TransformerConfig, length: int, name: str,
          groups: int = 1):
    """`length` copies of `body` as one nn.scan, parameters stacked on axis 0.

    groups > 1: body is a group of num_layers / groups layers (nested);
    its parameters, stacked [groups, group size, ...] by the two scans, are
    stored as [num_layers, ...], the layout of the uniform scanned stack.
    """
    stack = nn.scan(body, variable_axes={"params": 0},
                    split_rngs={"params": True, "dropout": True},
                    in_axes=(nn.broadcast,), length=length,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    if groups > 1:
        def grouped(v):  # [num_layers, ...] -> [groups, group size, ...]
            return {"params": {"group": {"layer": _restack(
                v["params"]["layer"], lambda a: a.reshape((groups, -1) + a.shape[1:]),
                lambda names: ("layers",) + names)}}}

        def flat(v):  # [groups, group size, ...] -> [num_layers, ...]
            return {"params": {"layer": _restack(
                v["params"]["group"]["layer"], lambda a: a.reshape((-1,) + a.shape[2:]),
                lambda names: names[1:])}}

        stack = nn.map_variables(stack, "params", init=True, mutable=True,
                                 trans_in_fn=lambda v: grouped(v) if v.get("params") else v,
                                 trans_out_fn=lambda v: flat(v) if v.get("params") else v)
    return lambda x, deterministic: stack(cfg, name=name)(x, deterministic)[0]


# Chen et al. 2016: a group saves only its input; its layers are recomputed
# (with their own policy) in the group's backward pass.
_GROUP_POLICY = jax.checkpoint_policies.nothing_saveable


def _looped_layers(module: nn.Module, x, deterministic: bool, lo: int, hi: int):
    """Layers lo..hi-1 of `module`'s config, each under its own policy, named layers_{i}."""
    cfg = module.config
    policies = cfg.layer_policies[lo:hi]
    # One wrapped class per policy: layers sharing a class trace to shared
    # sub-jaxprs, so equal policies lower to identical programs.
    classes = {p: remat_layer(DecoderLayer, cfg, p) for p in set(policies)}
    for i, policy in enumerate(policies, start=lo):
        x = classes[policy](cfg, parent=module, name=f"layers_{i}")(x, deterministic)
    return x


class _Head(nn.Module):
    """Llama's untied output projection: `nn.Dense(vocab, use_bias=False)` (the same
    parameter, its name and init) with the kernel [d_model, vocab] at hand, so a
    chunked loss can take it a vocabulary slice at a time."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.kernel = self.param("kernel", _axes(nn.initializers.lecun_normal(), "embed", "vocab"),
                                 (cfg.d_model, cfg.vocab_size), cfg.param_dtype)

    def __call__(self, x):
        x, kernel = nn.dtypes.promote_dtype(x, self.kernel, dtype=self.config.dtype)
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class Transformer(nn.Module):
    """Decoder-only language model.

    __call__(tokens int32 [batch, seq], deterministic=True) -> float32 logits
    [batch, seq, vocab]; __call__(tokens, deterministic, targets=int32 [batch,
    seq]) -> the mean next-token cross-entropy, a float32 scalar: `lm_loss` of
    the logits, or with config.vocab_chunks > 1 the same loss computed a
    vocabulary slice at a time (`remat_kit.flax.chunked_loss.chunked_head_loss`),
    the logits never whole. seq must be <= config.max_len for gpt2. Dropout
    needs rngs={"dropout": key} when deterministic is False.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True, targets=None):
        cfg = self.config
        embed_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                         param_dtype=cfg.param_dtype, name="embed",
                         embedding_init=_axes(embed_init, "vocab", "embed"))
        x = embed(tokens)
        if cfg.family == "gpt2":
            pos = nn.Embed(cfg.max_len, cfg.d_model, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, name="pos_embed",
                           embedding_init=_axes(embed_init, None, "embed"))
            x = x + pos(jnp.arange(tokens.shape[1])[None, :])
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        size = cfg.policy.schedule.group_size(cfg.num_layers)  # 1 unless nested
        if cfg.scan_layers and size == 1:
            x = _scan(remat_layer(_ScanLayer, cfg), cfg, cfg.num_layers, "layers")(
                x, deterministic)
        elif cfg.scan_layers:
            group = nn.remat(_ScanGroup, policy=_GROUP_POLICY, static_argnums=(2,),
                             prevent_cse=False)
            x = _scan(group, cfg, cfg.num_layers // size, "layers",
                      groups=cfg.num_layers // size)(x, deterministic)
        elif size == 1:
            x = _looped_layers(self, x, deterministic, 0, cfg.num_layers)
        else:
            group = nn.remat(_looped_layers, policy=_GROUP_POLICY, static_argnums=(2, 3, 4))
            for lo in range(0, cfg.num_layers, size):
                x = group(self, x, deterministic, lo, lo + size)
        x = _norm(cfg, "final_norm")(x)
        head = None if cfg.family == "gpt2" else _Head(cfg, name="lm_head")
        if targets is not None and cfg.vocab_chunks > 1:
            kernel, axis = (embed.embedding, 0) if head is None else (head.kernel, -1)
            return chunked_head_loss(x, kernel, targets, cfg.vocab_chunks, vocab_axis=axis,
                                     dtype=cfg.activation_dtype)
        logits = (embed.attend(x) if head is None else head(x)).astype(jnp.float32)
        return logits if targets is None else lm_loss(logits, targets)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats per token.

    logits float [batch, seq, vocab]; targets int [batch, seq]. Returns a float32 scalar.
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_loss_fn(model: Transformer, deterministic: bool = True):
    """loss(params, inputs, targets, dropout_rng) -> scalar, for `jax.grad` and measurement.

    inputs, targets: int32 [batch, seq]; dropout_rng: a PRNG key (ignored when
    deterministic). With the model's config.vocab_chunks > 1 the loss is computed
    over vocabulary chunks (`Transformer`), equal to the plain one.
    """
    def loss(params, inputs, targets, dropout_rng):
        return model.apply({"params": params}, inputs, deterministic=deterministic,
                           targets=targets, rngs={"dropout": dropout_rng})
    return loss
