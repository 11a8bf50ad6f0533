"""A decoder written the way MaxText writes its `Decoder` with `scan_layers=True`, its
production default: the layer class under `nn.remat` with a policy of its own
(`remat_policy`, here MaxText's "minimal": the projections named by `checkpoint_name`,
`prevent_cse=False` inside a scan) and then `nn.scan` over the layers, parameters stacked
on a leading layer axis. MaxText wraps the scan body in `jax.checkpoint` whatever its remat
flag says; `remat_policy="full"` saves nothing.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

VOCAB, EMBED, HEADS, MLP, LAYERS = 64, 32, 4, 64, 2
POLICIES = {
    "minimal": jax.checkpoint_policies.save_only_these_names(
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo"),
    "full": jax.checkpoint_policies.nothing_saveable,
}


class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x, decoder_segment_ids):
        b, t, d = x.shape
        y = nn.RMSNorm(name="pre_self_attention_norm")(x)
        q, k, v = (checkpoint_name(nn.DenseGeneral((HEADS, d // HEADS), name=n)(y), f"{n}_proj")
                   for n in ("query", "key", "value"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v)
        x = x + checkpoint_name(nn.DenseGeneral(d, axis=(-2, -1), name="out")(o), "out_proj")
        y = nn.RMSNorm(name="post_self_attention_norm")(x)
        h = nn.silu(checkpoint_name(nn.Dense(MLP, name="wi")(y), "mlpwi"))
        return x + checkpoint_name(nn.Dense(d, name="wo")(h), "mlpwo"), None


class Decoder(nn.Module):
    remat_policy: str = "minimal"

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, EMBED, name="token_embedder")
        layer = nn.remat(DecoderLayer, prevent_cse=False, policy=POLICIES[self.remat_policy])
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,), length=LAYERS)
        x, _ = stack(name="layers")(embed(tokens), None)
        return nn.Dense(VOCAB, name="logits_dense")(nn.RMSNorm(name="decoder_norm")(x))


def model(remat_policy: str = "minimal") -> Decoder:
    """For `remat-kit --model tests/zoo/maxtext_scan_linen.py:model`."""
    return Decoder(remat_policy)
