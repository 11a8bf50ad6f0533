"""A GPipe written by hand: an NNX model whose layers run as pipeline stages over a `stage`
mesh axis, in a `shard_map` that passes activations to the next stage with `ppermute`.

8 MLP blocks (stacked by `nnx.vmap`, their parameters split over `stage`: 2 per stage) run
as 4 stages on 4 devices (`model(devices)`); the batch runs as 4 microbatches through a
`lax.scan` of microbatches + stages - 1 iterations (the last 3 the bubble), each stage's
layers a `lax.scan` over its 2 blocks. The backward pass is autodiff's, so every
microbatch's residuals stay until it runs (GPipe). `sequential(model, tokens)` runs the same
blocks one after another on the whole batch, the unpipelined reference.

tokens int32 [batch, seq] (batch a multiple of 4) -> logits float32 [batch, seq, vocab].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

VOCAB, DIM, HIDDEN, LAYERS, STAGES, MICRO = 64, 32, 64, 8, 4, 4


class Block(nnx.Module):
    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None), mesh=mesh)
        self.up = nnx.Linear(DIM, HIDDEN, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class GPipe(nnx.Module):
    def __init__(self, mesh: Mesh, rngs: nnx.Rngs):
        self.mesh = mesh
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "stage"})
        def blocks(rngs):
            return Block(mesh, rngs)
        self.blocks = blocks(rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        b, t, d = x.shape
        graph, state = nnx.split(self.blocks)

        def stage_layers(state, h):  # this stage's blocks, one after another
            def one(h, layer):
                return nnx.merge(graph, layer)(h), None
            return jax.lax.scan(one, h, state)[0]

        def pipeline(state, xs):  # on each stage: its blocks, every microbatch
            stage = jax.lax.axis_index("stage")
            last = STAGES - 1

            def step(carry, i):
                held, outs = carry
                h = stage_layers(state, jnp.where(stage == 0, xs[jnp.minimum(i, MICRO - 1)],
                                                  held))
                done = jnp.clip(i - last, 0, MICRO - 1)
                outs = jnp.where((stage == last) & (i >= last), outs.at[done].set(h), outs)
                held = jax.lax.ppermute(h, "stage", [(s, s + 1) for s in range(last)])
                return (held, outs), None

            (_, outs), _ = jax.lax.scan(step, (jnp.zeros_like(xs[0]), jnp.zeros_like(xs)),
                                        jnp.arange(MICRO + last))
            return jax.lax.psum(outs, "stage")  # the last stage's, on every stage

        run = jax.shard_map(pipeline, mesh=self.mesh, in_specs=(P("stage"), P()), out_specs=P(),
                            check_vma=False)
        y = run(state, x.reshape(MICRO, b // MICRO, t, d)).reshape(b, t, d)
        return self.head(y)


def sequential(model: GPipe, tokens):
    """The same model's blocks run one after another on the whole batch, no pipeline."""
    graph, state = nnx.split(model.blocks)
    x = jax.lax.scan(lambda h, layer: (nnx.merge(graph, layer)(h), None),
                     model.embed(tokens), state)[0]
    return model.head(x)


def model(devices=None) -> GPipe:
    """Abstract (ShapeDtypeStruct parameters), for `--model tests/zoo/gpipe_nnx.py:model`:
    its stages on `devices` (this machine's first 4 when None; a target's chips, as
    `remat_kit.measure.targets.devices("tpu:v5p:2x2x1")` gives them, as MaxText builds its
    mesh for an ahead-of-time compile)."""
    mesh = Mesh(np.array(list(devices or jax.devices())[:STAGES]), ("stage",))
    return nnx.eval_shape(lambda: GPipe(mesh, nnx.Rngs(0)))


def on_v5p() -> GPipe:
    """`model` with its stages on the 4 chips of tpu:v5p:2x2x1 (compiled ahead of time),
    for `--model tests/zoo/gpipe_nnx.py:on_v5p --target tpu:v5p:2x2x1`."""
    from remat_kit.measure import targets
    return model(targets.devices("tpu:v5p:2x2x1"))
