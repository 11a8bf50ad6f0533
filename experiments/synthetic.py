"""Synthetic batches of a declared batch's shapes, for a user's model that is not a token LM.

`--model FILE.py:FUNCTION` may return `(model, batch, loss)` (images and labels, latents
and timesteps, a dict of token ids and masks; `remat_kit.flax.batch_model`). There is no
corpus for such a model here, so `experiments.train` trains it on batches drawn like the
declared one: every leaf at the run's batch size (its leading axis) and sequence length
(where the batch has one), floats standard normal, integers and booleans drawn from the
values the declared leaf holds (labels stay labels, ids stay in the vocabulary, -100
stays a padding label), zeros where the leaf was declared as a `jax.ShapeDtypeStruct`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from remat_kit.flax import batch_model


def _draw(key, shape, leaf):
    """One leaf of a synthetic batch, `shape`, like the declared `leaf`."""
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jax.random.normal(key, shape, leaf.dtype)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.zeros(shape, leaf.dtype)
    return jax.random.choice(key, jnp.ravel(jnp.asarray(leaf)), shape)


def batches(declared, size: int, seq: int | None, seed: int, num_evals: int,
            second: Callable[[int], object] = lambda i: None
            ) -> tuple[Callable[[int], tuple], list[tuple]]:
    """(train batch(i) -> (batch, second(i)), eval batches [(batch, second(-k - 1))]).

    Batch i is a pure function of (seed, i), as `experiments.data.train_batches`'
    are, so a resumed run sees the batches an uninterrupted one would; the eval
    batches are drawn from another stream of the same seed.

    Args:
      declared: the batch FUNCTION returned (arrays or ShapeDtypeStructs).
      size, seq: the run's batch size and sequence length (seq unused where the
        batch has no sequence axis; `batch_model.resized`).
      second: what stands where a token LM's targets do, per batch number (the
        loss reads its labels from the batch; an NNX model's RNG state there,
        `own_model.rng_state`).
    """
    shaped = batch_model.resized(batch_model.abstract(declared), size,
                                 seq if batch_model.seq_length(declared) else None)
    leaves, tree = jax.tree.flatten(declared)
    shapes = [x.shape for x in jax.tree.leaves(shaped)]

    @jax.jit
    def draw(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(tree, [_draw(k, s, x) for k, s, x in
                                         zip(keys, shapes, leaves)])

    train_key, eval_key = jax.random.split(jax.random.key(seed))

    def train(i: int) -> tuple:
        return jax.tree.map(np.asarray, draw(jax.random.fold_in(train_key, i))), second(i)

    evals = [(jax.tree.map(np.asarray, draw(jax.random.fold_in(eval_key, i))), second(-i - 1))
             for i in range(num_evals)]
    return train, evals


__all__ = ["batches"]
