"""The reference transformer in Flax NNX: the twin of `models.transformer.Transformer`.

It calls the linen model's layer functions, so it emits the same tags and, with converted
parameters (`from_linen` / `to_linen`), gives the same loss and gradients; a looped stack takes
every schedule, `scan_layers=True` is one `nnx.scan` (uniform). Tokens int32 [batch, seq] ->
logits float32 [batch, seq, vocab]. Also `make_loss_fn`. Docs: docs/scan.md ("NNX twin").
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import linen, nnx

from remat_kit.flax.chunked_loss import chunked_head_loss
from remat_kit.models.config import TransformerConfig
from remat_kit.models.transformer import attention, decoder_layer, lm_loss, mlp
from remat_kit.policy.policy import Policy


def _norm(cfg: TransformerConfig, rngs: nnx.Rngs) -> nnx.Module:
    cls = nnx.LayerNorm if cfg.family == "gpt2" else nnx.RMSNorm
    return cls(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype,
               param_dtype=cfg.param_dtype, rngs=rngs)


def _dense(cfg: TransformerConfig, in_features, out_features, axis, rngs: nnx.Rngs):
    return nnx.LinearGeneral(in_features, out_features, axis=axis,
                             use_bias=cfg.family == "gpt2", dtype=cfg.dtype,
                             param_dtype=cfg.param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """`attention` with NNX parameters (query, key, value, out as in linen)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        heads = (cfg.num_heads, cfg.heads_dim)
        kv = (cfg.kv_heads, cfg.heads_dim)
        self.query = _dense(cfg, cfg.d_model, heads, -1, rngs)
        self.key = _dense(cfg, cfg.d_model, kv, -1, rngs)
        self.value = _dense(cfg, cfg.d_model, kv, -1, rngs)
        self.out = _dense(cfg, heads, cfg.d_model, (-2, -1), rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, x, deterministic: bool):
        return attention(self.cfg, x, lambda feats, name, axes, axis=-1: getattr(self, name),
                         lambda p: self.dropout(p, deterministic=deterministic))


class Mlp(nnx.Module):
    """`mlp` with NNX parameters (wi, or wi_0 and wi_1, then wo, as in linen)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        names = ("wi",) if cfg.family == "gpt2" else ("wi_0", "wi_1")
        for name in names:
            setattr(self, name, _dense(cfg, cfg.d_model, cfg.mlp_dim, -1, rngs))
        self.wo = _dense(cfg, cfg.mlp_dim, cfg.d_model, -1, rngs)

    def __call__(self, x):
        return mlp(self.cfg, x, lambda feats, name, axes: getattr(self, name))


class DecoderLayer(nnx.Module):
    """`decoder_layer` with NNX parameters. x: [batch, seq, d_model] -> same."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = Mlp(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate)

    def __call__(self, x, deterministic: bool):
        return decoder_layer(x, lambda name: getattr(self, name),
                             lambda h: self.attn(h, deterministic), self.mlp,
                             lambda h: self.dropout(h, deterministic=deterministic))


def _run(policy: Policy, layer: DecoderLayer, x, deterministic: bool, scan: bool):
    """`layer(x)` under nnx.remat with `policy`; prevent_cse off under scan, as in linen."""
    if not policy.remat:
        return layer(x, deterministic)
    return nnx.remat(lambda layer, x: layer(x, deterministic), policy=policy.to_jax(),
                     prevent_cse=not scan)(layer, x)


class Transformer(nnx.Module):
    """Decoder-only language model in NNX, the twin of the linen `Transformer`.

    __call__(tokens int32 [batch, seq], deterministic=True) -> float32 logits
    [batch, seq, vocab]; __call__(tokens, deterministic, targets=int32 [batch,
    seq]) -> the mean next-token cross-entropy, a float32 scalar, as in linen:
    with config.vocab_chunks > 1 computed a vocabulary slice at a time
    (`remat_kit.flax.chunked_loss.chunked_head_loss`), the logits never whole.
    `rngs` (construction) initializes the parameters.
    Dropout layers hold no rng stream: this twin runs deterministic (the
    forward and gradient checks); train with dropout on the linen model.

    Raises:
      NotImplementedError: scan_layers=True with the nested schedule (use
        the linen model, or the looped NNX stack).
      ValueError: deterministic=False with dropout_rate > 0 (on call).
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        if cfg.scan_layers and cfg.policy.schedule.group_size(cfg.num_layers) > 1:
            raise NotImplementedError(
                f"the NNX scanned stack takes the uniform schedule, got {cfg.policy.schedule}; "
                "use scan_layers=False (nested runs looped in NNX) or the linen Transformer")
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, rngs=rngs)
        if cfg.family == "gpt2":
            self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, dtype=cfg.dtype,
                                       param_dtype=cfg.param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return DecoderLayer(cfg, rngs=rngs)
            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs)
                                    for _ in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, rngs)
        if cfg.family == "llama":
            self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                      dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, tokens, deterministic: bool = True, targets=None):
        cfg = self.cfg
        if not deterministic and cfg.dropout_rate:
            raise ValueError(f"the NNX twin runs deterministic only (dropout_rate="
                             f"{cfg.dropout_rate}); pass deterministic=True or use the linen "
                             "Transformer for dropout")
        x = self.embed(tokens)
        if cfg.family == "gpt2":
            x = x + self.pos_embed(jnp.arange(tokens.shape[1])[None, :])
        x = self.dropout(x, deterministic=deterministic)
        if cfg.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(x, layer):
                return _run(cfg.policy, layer, x, deterministic, scan=True)
            x = step(x, self.layers)
        else:
            size = cfg.policy.schedule.group_size(cfg.num_layers)  # 1 unless nested
            policies = cfg.layer_policies
            for lo in range(0, cfg.num_layers, size):
                group = [(layer, policy) for layer, policy in zip(
                    self.layers[lo:lo + size], policies[lo:lo + size])]
                x = _run_group(group, x, deterministic, nested=size > 1)
        x = self.final_norm(x)
        if targets is not None and cfg.vocab_chunks > 1:
            # The tied embedding is [vocab, d_model], the untied head's kernel [d_model, vocab].
            kernel, axis = ((self.embed.embedding[...], 0) if cfg.family == "gpt2"
                            else (self.lm_head.kernel[...], -1))
            return chunked_head_loss(x, kernel, targets, cfg.vocab_chunks, vocab_axis=axis,
                                     dtype=cfg.activation_dtype)
        logits = (self.embed.attend(x) if cfg.family == "gpt2" else self.lm_head(x))
        logits = logits.astype(jnp.float32)
        return logits if targets is None else lm_loss(logits, targets)


def _run_group(group, x, deterministic: bool, nested: bool):
    """Layers, each under its own policy; under nested, the group as a whole
    under nothing_saveable too (Chen et al. 2016: only its input is stored)."""
    def body(layers, x):
        for layer, (_, policy) in zip(layers, group):
            x = _run(policy, layer, x, deterministic, scan=False)
        return x
    layers = [layer for layer, _ in group]
    if not nested:
        return body(layers, x)
    return nnx.remat(body, policy=jax.checkpoint_policies.nothing_saveable)(layers, x)


def make_loss_fn(model: Transformer, deterministic: bool = True):
    """(loss(params, inputs, targets) -> scalar, params): the NNX twin of `models.make_loss_fn`.

    params: the model's `nnx.Param` state (`nnx.split(model, nnx.Param, ...)`),
    the argument to differentiate; inputs, targets int32 [batch, seq]. Other
    state (dropout rng streams) is closed over as of this call, so a
    non-deterministic loss draws the same masks on every call. With the model's
    config.vocab_chunks > 1 the loss is computed over vocabulary chunks
    (`Transformer`), equal to the plain one.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, inputs, targets):
        return nnx.merge(graphdef, params, rest)(inputs, deterministic=deterministic,
                                                 targets=targets)
    return loss, params


def from_linen(params: Mapping, cfg: TransformerConfig) -> dict:
    """Linen `Transformer(cfg)` params -> the pure-dict state of the NNX twin.

    Use as `state = nnx.state(model, nnx.Param)`,
    `state.replace_by_pure_dict(from_linen(params, cfg))`, `nnx.update(model, state)`.
    Parameter names are the same; the looped stack maps layers_{i} to
    layers[i]; the scanned stack's params["layers"]["layer"] to layers
    (stacked [num_layers, ...] in both). Logically partitioned params (linen
    `init`'s boxes) are unboxed.
    """
    params = linen.unbox(params)
    out = {k: v for k, v in params.items() if not k.startswith("layers")}
    if cfg.scan_layers:
        out["layers"] = params["layers"]["layer"]
    else:
        out["layers"] = {i: params[f"layers_{i}"] for i in range(cfg.num_layers)}
    return out


def to_linen(state: Mapping, cfg: TransformerConfig) -> dict:
    """The NNX twin's pure-dict params (`nnx.state(model, nnx.Param).to_pure_dict()`)
    -> linen `Transformer(cfg)` params; the inverse of `from_linen`."""
    out = {k: v for k, v in state.items() if k != "layers"}
    if cfg.scan_layers:
        out["layers"] = {"layer": state["layers"]}
    else:
        out.update({f"layers_{i}": state["layers"][i] for i in range(cfg.num_layers)})
    return out


__all__ = ["Attention", "DecoderLayer", "Mlp", "Transformer", "from_linen", "make_loss_fn",
           "to_linen"]
