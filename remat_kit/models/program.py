"""The reference transformers as one provider of `Workload` (what to measure).

`workload(cfg, batch, seq)` is the language-model loss of
`Transformer(cfg.replace(remat=policy))` on int32 tokens [batch, seq]:
parameters from `jax.eval_shape` (nothing allocated), sharded by their
logical axes on a mesh; one decoder layer alone for `explain`; and the
program one device runs, for per-device residuals on a mesh.
Docs: docs/architecture.md ("The data flow").
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_kit import mesh as rk_mesh
from remat_kit.errors import check_positive
from remat_kit.models import bounds
from remat_kit.models.config import TransformerConfig
from remat_kit.models.transformer import DecoderLayer, Transformer, make_loss_fn, remat_layer
from remat_kit.policy.policy import Policy
from remat_kit.trace import model_map
from remat_kit.trace.workload import Workload


def sized(cfg: TransformerConfig, seq: int) -> TransformerConfig:
    """`cfg` able to take `seq` tokens: GPT-2 learns one position embedding per
    position, so a longer context needs a longer table, as in the user's run."""
    return cfg.replace(max_len=seq) if cfg.family == "gpt2" and seq > cfg.max_len else cfg


def _program(cfg: TransformerConfig, batch: int, seq: int, mesh):
    """(loss_for_policy, args, sample_args) of the reference loss, see `workload`."""
    rk_mesh.check_fits(mesh, cfg, batch)
    deterministic = cfg.dropout_rate == 0
    model = Transformer(cfg.replace(remat="none"))
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                              jnp.zeros((1, seq), jnp.int32)))["params"]
    params = nn.unbox(boxed)
    shardings = (rk_mesh.shardings(boxed, mesh) if mesh is not None
                 else jax.tree.map(lambda _: None, params))
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          params, shardings)
    on_mesh = mesh is not None
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                                  sharding=rk_mesh.batch_sharding(mesh) if on_mesh else None)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=rk_mesh.replicated(mesh) if on_mesh else None)

    def loss_for_policy(policy):
        loss = make_loss_fn(Transformer(cfg.replace(remat=policy)), deterministic)
        if mesh is None:
            return loss

        def sharded_loss(*args):  # the models' logical constraints apply while tracing
            with rk_mesh.use(mesh):
                return loss(*args)
        return sharded_loss

    def sample_args(k):
        k_init, k_in, k_out, k_drop = jax.random.split(k, 4)
        init_tokens = jnp.zeros((1, seq), jnp.int32)
        draw = lambda kk: jax.random.randint(kk, (batch, seq), 0, cfg.vocab_size, jnp.int32)
        params = Transformer(cfg).init(k_init, init_tokens)["params"]
        return nn.unbox(params), draw(k_in), draw(k_out), k_drop

    return loss_for_policy, (params, tokens, tokens, key), sample_args


def layer_program(cfg: TransformerConfig, batch: int, seq: int, policy: Policy):
    """(loss of one decoder layer as the model wraps it, under `policy`; its args).

    The args are ShapeDtypeStructs: the layer's parameters, an input
    [batch, seq, d_model] of `cfg.activation_dtype`, a PRNG key.
    """
    check_positive("batch", batch)
    check_positive("seq", seq)
    cfg = cfg.replace(remat=policy)
    layer = remat_layer(DecoderLayer, cfg)(cfg)
    deterministic = cfg.dropout_rate == 0
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), cfg.activation_dtype)
    key = jax.eval_shape(lambda: jax.random.key(0))
    params = jax.eval_shape(lambda: layer.init(
        jax.random.key(0), jnp.zeros(x.shape, x.dtype), deterministic))["params"]

    def apply(params, x, dropout_rng):
        return layer.apply({"params": params}, x, deterministic,
                           rngs={"dropout": dropout_rng}).astype(jnp.float32).sum()

    return apply, (params, x, key)


def workload(cfg: TransformerConfig, batch: int, seq: int, *, dtype: str | None = None,
             mesh: jax.sharding.Mesh | None = None, name: str | None = None) -> Workload:
    """The `Workload` of a reference transformer's language-model loss.

    >>> import remat_kit as rk
    >>> work = rk.models.workload(rk.models.get_config("tiny"), batch=2, seq=16)
    >>> work.num_layers, work.block_name
    (2, 'DecoderLayer')

    Args:
      cfg: the model config; its `remat` is replaced by each policy measured.
      batch, seq: the global batch size (split over the mesh's data x fsdp
        axes) and the sequence length, positive ints. `Workload.at` makes a
        GPT-2 config's position table as long as a longer seq (`sized`).
      dtype: activation dtype override ("float32", "bfloat16", "float16").
      mesh: a `jax.sharding.Mesh` (`remat_kit.mesh.make`): parameters and
        tokens sharded by the model's logical axes, traced under its rules.
    Returns:
      A `Workload`: loss(params, inputs, targets, dropout_rng); `block` is one
      decoder layer of the program one device runs (heads and MLP split by
      the tensor axis, batch / (data x fsdp)); `per_device` that program.
    Raises:
      ValueError: batch or seq not a positive int, seq above a GPT-2 config's
        max_len, a bad dtype.
      MeshError: the mesh does not split the batch or the heads.
    """
    check_positive("batch", batch)
    check_positive("seq", seq)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    if cfg.family == "gpt2" and seq > cfg.max_len:
        raise ValueError(f"seq {seq} exceeds the model's max_len {cfg.max_len} "
                         "(GPT-2 learns one position embedding per position)")
    sharded = rk_mesh.spanning(mesh)  # a one-device mesh: its program is the per-device one
    loss_for_policy, args, sample_args = _program(cfg, batch, seq, sharded)
    local_cfg = rk_mesh.per_device_config(cfg, mesh)
    local_batch = batch // rk_mesh.axis_size(mesh, "batch")
    per_device = (None if sharded is None
                  else _program(local_cfg, local_batch, seq, None)[:2])
    label = name or getattr(cfg, "name", None) or "transformer"
    return Workload(
        loss_for_policy, args, name=label, batch=batch, seq=seq,
        resize=lambda b, s: workload(sized(cfg, s), b, s, mesh=mesh, name=label),
        sample_args=sample_args, per_device=per_device, mesh=mesh,
        num_layers=cfg.num_layers, block_name="DecoderLayer", model_map=model_map_of(cfg, args[0]),
        block=lambda policy: layer_program(local_cfg, local_batch, seq, policy),
        size_bound=lambda *bound: bounds.size_bound(cfg, *bound, mesh=mesh))


def model_map_of(cfg: TransformerConfig, params) -> model_map.ModelMap:
    """The map of our reference transformer of `params` (arrays or ShapeDtypeStructs,
    as `Transformer(cfg).init` makes them): its DecoderLayers (`layers_i`, or one
    scanned `layers`), the rest of its parameters and the logits and loss outside."""
    def size(tree) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    params = dict(params)
    layers = [model_map.Layer(k, "DecoderLayer", parameters=size(v),
                              copies=cfg.num_layers if k == "layers" else 1)
              for k, v in params.items() if k == "layers" or k.startswith("layers_")]
    outside = tuple(k for k in params if k != "layers" and not k.startswith("layers_"))
    return model_map.ModelMap(model_map.stacks_of(layers), (), (*outside, "logits", "loss"))


def config_map(cfg: TransformerConfig) -> model_map.ModelMap:
    """`model_map_of` `Transformer(cfg)` without a workload, for a report that builds
    none (explain's layer table, fit, the sweep): its parameters' shapes from
    `jax.eval_shape` of init on one token (one trace, nothing allocated)."""
    boxed = jax.eval_shape(lambda: Transformer(cfg.replace(remat="none")).init(
        jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    return model_map_of(cfg, nn.unbox(boxed))


__all__ = ["config_map", "layer_program", "model_map_of", "sized", "workload"]
