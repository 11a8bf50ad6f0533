"""A Llama-like linen model partitioned by logical axes, as MaxText and the Flax examples
write one: every parameter made with `nn.with_logical_partitioning`, activations
constrained with `nn.with_logical_constraint`, and the logical-axis rules given
where the model is built (`nn.logical_axis_rules(RULES)`) or on the model itself.

* `model()`: the layers in a Python loop; rules from the caller's context.
* `scanned()`: the layers as one `nn.scan`, the stacked axis named "layers".
* `ordered()`: built over its own mesh, data:2 x fsdp:2 in device order
  [0, 2, 1, 3], with its own rules (MaxText's `activation_batch` name) on every
  box and constraint, as a training codebase pins its layout inside the model.

tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("heads", "tensor"),
         ("mlp", "tensor"), ("vocab", "tensor"), ("length", None), ("kv", None),
         ("layers", None))
OWN_RULES = (("activation_batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", None),
             ("heads", None), ("vocab", None))


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 2
    scan: bool = False
    batch_name: str = "batch"
    mesh: Mesh | None = None
    rules: tuple | None = None


def _param(module, name, shape, names, cfg: Config, init=nn.initializers.lecun_normal()):
    return module.param(name, nn.with_logical_partitioning(init, names, mesh=cfg.mesh,
                                                           rules=cfg.rules), shape)


def _constrain(x, names, cfg: Config):
    return nn.with_logical_constraint(x, names, mesh=cfg.mesh, rules=cfg.rules)


class RMSNorm(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), ("embed",), self.cfg, nn.initializers.ones)
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, _=None):
        c = self.cfg
        b, t, d = x.shape
        hd = d // c.heads
        act = (c.batch_name, "length", "embed")
        y = RMSNorm(c, name="attn_norm")(x)
        q, k, v = (jnp.einsum("btd,dhk->bthk", y, _param(self, n, (d, c.heads, hd),
                                                           ("embed", "heads", "kv"), c))
                   for n in ("query", "key", "value"))
        att = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(hd)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(att, -1), v)
        x = _constrain(x + jnp.einsum("bthk,hkd->btd", o, _param(
            self, "out", (c.heads, hd, d), ("heads", "kv", "embed"), c)), act, c)
        y = RMSNorm(c, name="mlp_norm")(x)
        gate, up = (y @ _param(self, n, (d, c.hidden), ("embed", "mlp"), c)
                    for n in ("wi_0", "wi_1"))
        h = _constrain(nn.silu(gate) * up, (c.batch_name, "length", "mlp"), c)
        x = _constrain(x + h @ _param(self, "wo", (c.hidden, d), ("mlp", "embed"), c), act, c)
        return x, None


class Llama(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        table = _param(self, "embedding", (c.vocab, c.dim), ("vocab", "embed"), c,
                       nn.initializers.normal(1.0))
        x = _constrain(table[tokens], (c.batch_name, "length", "embed"), c)
        if c.scan:
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=c.layers, metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(c, name="layers")(x, None)
        else:
            for i in range(c.layers):
                x, _ = Block(c, name=f"layers_{i}")(x)
        x = RMSNorm(c, name="final_norm")(x)
        return x @ _param(self, "lm_head", (c.dim, c.vocab), ("embed", "vocab"), c)


def model() -> Llama:
    """For `remat-kit --model tests/zoo/logical_linen.py:model`."""
    return Llama(Config())


def scanned() -> Llama:
    return Llama(Config(scan=True))


def ordered() -> Llama:
    """Over its own mesh, data:2 x fsdp:2 on devices [0, 2, 1, 3] of this machine."""
    devices = np.array(jax.devices()[:4])[[0, 2, 1, 3]].reshape(2, 2)
    return Llama(Config(batch_name="activation_batch", mesh=Mesh(devices, ("data", "fsdp")),
                        rules=OWN_RULES))
