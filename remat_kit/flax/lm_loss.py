"""A language model's loss: its logits found in its output, their mean next-token cross-entropy.

`next_token_loss` is the loss `flax.from_model.workload` measures unless the user gives one
(`OUR_LOSS` names it in the tables' titles); `logits_of` takes the logits out of a model's output.
Docs: docs/models.md ("A Flax model, no glue").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from remat_kit.flax.blocks import ModelError
from remat_kit.flax.chunked_loss import chunked_logits_loss

# What the tables' titles call `next_token_loss`, the loss measured unless the user gives one.
OUR_LOSS = "remat-kit's mean next-token cross-entropy of the logits"


def logits_of(out, batch: int, seq: int):
    """The logits array of a model output: the array itself, its `logits`
    entry (dict) or attribute (dataclass, flax struct), or the first element of
    a tuple (logits, aux, ...).

    Raises:
      ModelError: no logits, or not shaped [batch, seq, vocab].
    """
    if isinstance(out, (tuple, list)) and out:  # (logits, aux_loss, ...), as many libraries
        out = out[0]
    found = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", out)
    shape = getattr(found, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != (batch, seq):
        raise ModelError(
            f"the model's output is {_describe(out)}; expected logits [batch={batch}, "
            f"seq={seq}, vocab], or a dict or object with a 'logits' entry. For another "
            "output or your own loss, return (model, batch, loss) from --model FILE:FUNCTION, "
            "loss(output, batch) -> scalar, or give a function (batch, seq) -> rk.Workload")
    return found


def _describe(out) -> str:
    """'an array float32[2, 8]', or the container with each leaf so (not a tracer's type)."""
    def one(x):
        return f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"an array {one(out)}"
    return f"{type(out).__name__} {jax.tree.map(one, out)}"


def label_cross_entropy(logits, labels):
    """Cross-entropy of each position's logits [..., vocab] (any float dtype) against int
    labels [...], in float32: log-sum-exp minus the label's logit, that logit taken by a
    one-hot contraction as MaxText's `cross_entropy_with_logits` (from T5X) takes it.

    Not a gather (`optax.softmax_cross_entropy_with_integer_labels`' `take_along_axis`):
    XLA:TPU sends a gather of [batch, seq, vocab] to the SparseCore, which reads its own
    float32 copy of the logits from HBM, 4 bytes a logit beyond what the model and its
    gradient hold (0.125 GiB a chip at batch 2, seq 1024, vocab 32000); the contraction fuses
    into the reductions. Equal to optax's value; a label outside [0, vocab) picks 0.
    Returns float32 [...].
    """
    logits = logits.astype(jnp.float32)
    hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * hot, axis=-1)


def next_token_loss(logits, tokens, vocab_chunks: int = 1):
    """Mean cross-entropy of logits[:, :-1] against tokens[:, 1:], in float32.

    vocab_chunks > 1: computed over that many vocabulary slices of the logits
    (`chunked_loss.chunked_logits_loss`), equal to the plain loss without its
    float32 copies of the logits and their gradient (the model's own logits stay).
    Raises ModelError: fewer than 2 positions (no target: a mean over nothing, NaN),
    vocab_chunks below 1 or not dividing the vocabulary.
    """
    if tokens.shape[1] < 2:
        raise ModelError(f"seq {tokens.shape[1]}: the next-token loss needs seq >= 2 (at seq 1 "
                         "no position has a next token: a mean over nothing, NaN)")
    if vocab_chunks == 1:
        return label_cross_entropy(logits[:, :-1], tokens[:, 1:]).mean()
    try:
        return chunked_logits_loss(logits[:, :-1], tokens[:, 1:], vocab_chunks)
    except ValueError as e:
        raise ModelError(str(e)) from None
