"""A pipeline written the way MaxText's `pipeline.py` writes it, in NNX: one block per stage
(stage weights stacked by `nnx.vmap`, split over a `stage` mesh axis), every stage run at once
by a vmap over a state buffer [stages, microbatch, seq, dim] that a `shard_map` + `ppermute`
shifts to the next stage each iteration; each iteration's input tagged `iteration_input` and
the iteration under `jax.checkpoint` saving `iteration_input` and `decoder_layer_input`
(MaxText's `get_pipeline_remat_policy`), in a `lax.scan` of microbatches + stages - 1
iterations.

4 stages on 4 devices (`model(devices)`), 4 microbatches. `sequential(model, tokens)` runs
the same blocks one after another on the whole batch, the unpipelined reference.

tokens int32 [batch, seq] (batch a multiple of 4) -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB, DIM, HIDDEN, STAGES, MICRO = 64, 32, 64, 4, 4
SAVES = ("iteration_input", "decoder_layer_input")


class Block(nnx.Module):
    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None), mesh=mesh)
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, HIDDEN, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.silu(self.up(self.norm(x))))


class Pipelined(nnx.Module):
    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        self.mesh = mesh
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=STAGES)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "stage"})
        def stages(rngs):
            return Block(mesh, rngs)
        self.stages = stages(rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        b, t, d = x.shape
        xs = x.reshape(MICRO, b // MICRO, t, d)
        graph, state = nnx.split(self.stages)
        on_stages = NamedSharding(self.mesh, P("stage"))

        @jax.shard_map(mesh=self.mesh, in_specs=P("stage"), out_specs=P("stage"),
                       check_vma=False)
        def shift(buffer):  # each stage's output to the next stage
            return jax.lax.ppermute(buffer, "stage", [(s, (s + 1) % STAGES)
                                                      for s in range(STAGES)])

        def iteration(carry, i):
            buffer, outs = carry
            first = jnp.arange(STAGES)[:, None, None, None] == 0
            stages_in = jnp.where(first, xs[jnp.minimum(i, MICRO - 1)][None], buffer)
            stages_in = checkpoint_name(stages_in, "iteration_input")
            stages_in = jax.lax.with_sharding_constraint(stages_in, on_stages)
            stages_out = jax.vmap(lambda s, h: nnx.merge(graph, s)(h))(state, stages_in)
            done = jnp.clip(i - (STAGES - 1), 0, MICRO - 1)
            outs = jnp.where(i >= STAGES - 1, outs.at[done].set(stages_out[-1]), outs)
            return (shift(stages_out), outs), None

        iteration = jax.checkpoint(
            iteration, policy=jax.checkpoint_policies.save_only_these_names(*SAVES))
        buffer = jnp.zeros((STAGES, b // MICRO, t, d), x.dtype)
        (_, outs), _ = jax.lax.scan(iteration, (buffer, jnp.zeros_like(xs)),
                                    jnp.arange(MICRO + STAGES - 1))
        return self.head(outs.reshape(b, t, d))


def sequential(model: Pipelined, tokens):
    """The same model's blocks run one after another on the whole batch, no pipeline."""
    graph, state = nnx.split(model.stages)
    x = jax.lax.scan(lambda h, s: (nnx.merge(graph, s)(h), None), model.embed(tokens),
                     state)[0]
    return model.head(x)


def model(devices=None) -> Pipelined:
    """Abstract (ShapeDtypeStruct parameters), for `--model
    tests/zoo/maxtext_pipeline_nnx.py:model`: its stages on `devices` (this machine's
    first 4 when None)."""
    mesh = Mesh(np.array(list(devices or jax.devices())[:STAGES]), ("stage",))
    return nnx.eval_shape(lambda: Pipelined(mesh, nnx.Rngs(0)))
