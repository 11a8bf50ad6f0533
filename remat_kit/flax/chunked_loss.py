"""Next-token cross-entropy computed over vocabulary chunks, for a smaller peak.

The float32 logits and their gradient are made one vocabulary chunk at a time in a rematerialized
`lax.scan` keeping a running max, sum of exponentials and target logit (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"); the largest temporary is one chunk.
Main names: `chunked_head_loss`, `chunked_logits_loss`, `check_chunks`.
Docs: docs/plan.md (`--vocab-chunks`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def check_chunks(chunks, vocab: int) -> int:
    """`chunks` if it is an int >= 1 dividing `vocab`; else ValueError, one line
    naming both and the valid counts nearest to it."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"vocab chunks must be an int >= 1, got {chunks!r}")
    if vocab % chunks:
        divisors = [d for d in range(1, vocab + 1) if vocab % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - chunks))[:3]
        raise ValueError(f"vocab chunks {chunks} does not divide the vocabulary of "
                             f"{vocab}; valid counts nearest it: {', '.join(map(str, sorted(near)))}")
    return chunks


def _per_token(chunk_logits: Callable, chunks: int, size: int, targets):
    """Cross-entropy per token, [*targets.shape] float32, from `chunk_logits(i)`
    (the float32 logits of vocabulary ids [i * size, (i + 1) * size))."""
    low = jnp.finfo(jnp.float32).min

    @jax.checkpoint  # the backward pass recomputes a chunk's logits, never stores them
    def body(carry, i):
        top, total, hit = carry
        z = chunk_logits(i)
        new_top = jnp.maximum(top, z.max(axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(z - new_top[..., None]).sum(axis=-1)
        local = targets - i * size
        inside = (local >= 0) & (local < size)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1)[..., None], axis=-1)
        return (new_top, total, hit + jnp.where(inside, picked[..., 0], 0.0)), None

    start = (jnp.full(targets.shape, low), jnp.zeros(targets.shape), jnp.zeros(targets.shape))
    (top, total, hit), _ = jax.lax.scan(body, start, jnp.arange(chunks))
    return top + jnp.log(total) - hit


def chunked_logits_loss(logits, targets, chunks: int):
    """Mean cross-entropy of `logits` [..., vocab] against int `targets` [...],
    over `chunks` vocabulary slices: equal to
    `optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()`,
    without its float32 copies of the logits. Raises ValueError (`check_chunks`)."""
    vocab = logits.shape[-1]
    size = vocab // check_chunks(chunks, vocab)
    def part(i):
        return jax.lax.dynamic_slice_in_dim(logits, i * size, size, -1).astype(jnp.float32)

    return _per_token(part, chunks, size, targets).mean()


def chunked_head_loss(x, head, targets, chunks: int, *, vocab_axis: int = -1, dtype=None):
    """Mean cross-entropy of the logits `x @ head` (vocab_axis=-1, head [d, vocab])
    or `x @ head.T` (vocab_axis=0, a tied embedding [vocab, d]) against int
    `targets`, computed `chunks` vocabulary slices at a time; the full logits
    never exist.

    Args:
      x: [..., d] hidden states after the final norm.
      head: the output projection, [d, vocab] or [vocab, d].
      targets: int [...], ids in [0, vocab).
      chunks: vocabulary slices, dividing vocab.
      dtype: the matmul's dtype (as the model's head computes it), then float32;
        default x's.
    Returns:
      A float32 scalar, equal to the mean cross-entropy of the full logits.
    Raises:
      ValueError: chunks below 1 or not dividing vocab (`check_chunks`).
    """
    dtype = dtype or x.dtype
    vocab = head.shape[vocab_axis]
    size = vocab // check_chunks(chunks, vocab)
    x, head = x.astype(dtype), head.astype(dtype)
    axis = head.ndim - 1 if vocab_axis == -1 else 0
    contract = 0 if axis == 1 else 1

    def part(i):
        w = jax.lax.dynamic_slice_in_dim(head, i * size, size, axis)
        z = jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ())))
        return z.astype(jnp.float32)

    return _per_token(part, chunks, size, targets).mean()
