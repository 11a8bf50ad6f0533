"""A `Workload` from a Flax model that is not a token LM: a batch of any inputs and a loss.

`workload(model, batch, loss)` measures `loss(model(...batch...), batch)` (a ViT on images, a DiT
on latents, an encoder on a dict) with `from_model`'s block finding, tagging and roles. The model
is called on the batch by one rule (`call_args`: a tuple, a dict by its `__call__`'s names, or the
batch); every leaf's leading axis is the batch. Main names: `workload`, `call_args`.
The call rule, the sizes and the loss: docs/models.md ("Models that are not token LMs").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat_kit.flax import from_model
from remat_kit.flax import nnx as flax_nnx
from remat_kit.flax.from_model import ModelError
from remat_kit.trace.workload import Workload

FORMS = ("a flax.linen or flax.nnx Module, (model, batch) or (model, batch, loss): batch a "
         "pytree of arrays or jax.ShapeDtypeStructs, loss(output, batch) -> scalar")


def abstract(batch, where: str = "batch"):
    """`batch` as `jax.ShapeDtypeStruct`s. ModelError, naming the leaf's path,
    for a leaf that is not an array or ShapeDtypeStruct (a Python number, None)
    or whose leading (batch) axis is 0, or an empty batch."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ModelError(f"{where} holds no arrays; give a pytree of arrays or "
                         "jax.ShapeDtypeStructs (images, a dict of token ids, ...)")
    for path, x in leaves:
        if not isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            raise ModelError(f"{where}{jax.tree_util.keystr(path)} is {type(x).__name__} "
                             f"{x!r:.40}, not an array or jax.ShapeDtypeStruct")
        if x.shape and x.shape[0] == 0:  # no examples: nothing to measure
            raise ModelError(f"{where}{jax.tree_util.keystr(path)} is {x.dtype}"
                             f"{list(x.shape)}, an empty batch axis; give it at least one "
                             "example")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)


def describe(batch) -> str:
    """'float32[2, 8, 8, 4], int32[2]': each leaf's dtype and shape, in tree order."""
    return ", ".join(f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(batch))


def leading(batch) -> int:
    """The batch size: the leading axis every leaf shares. ModelError naming the
    leaves' shapes where they share none (a scalar leaf, or leading axes that
    differ), so the batch cannot be resized."""
    heads = {x.shape[0] if x.shape else None for x in jax.tree.leaves(batch)}
    if len(heads) != 1 or None in heads:
        raise ModelError(f"the batch's leaves share no leading (batch) axis ({describe(batch)}), "
                         "so it cannot be resized; make every leaf [batch, ...]")
    return heads.pop()


def declared(batch) -> tuple[int | None, int | None]:
    """(batch size, sequence length) of a batch as declared: its common leading axis
    (`leading`) and `seq_length`, each None where it has none."""
    try:
        size = leading(batch)
    except ModelError:  # nothing to resize: measured as declared
        size = None
    return size, seq_length(batch)


def _is_seq_leaf(x, seq: int) -> bool:
    kind = jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_)
    return kind and len(x.shape) >= 2 and x.shape[1] == seq


def seq_length(batch) -> int | None:
    """The sequence length: axis 1 of the first int array of rank 2 (token ids
    [batch, seq]); None where the batch has none (images, latents)."""
    for x in jax.tree.leaves(batch):
        if jnp.issubdtype(x.dtype, jnp.integer) and len(x.shape) == 2:
            return x.shape[1]
    return None


def resized(batch, size: int, seq: int | None):
    """`batch` (ShapeDtypeStructs) with every leaf's leading axis `size` and, where it
    has a sequence axis (`seq_length`), that axis `seq` (None: kept).

    Raises:
      ModelError: a new size for a batch without a common leading axis
        (`leading`), or a new seq for a batch without a sequence axis.
    """
    now = seq_length(batch)
    if seq is not None and now is None:
        raise ModelError(f"the batch has no sequence axis (no int leaf [batch, seq]; its "
                         f"leaves: {describe(batch)}): the sequence length cannot be set; "
                         "vary the batch instead")
    grow = size != leading(batch) if size is not None else False

    def one(x):
        shape = list(x.shape)
        if grow:
            shape[0] = size
        if seq is not None and _is_seq_leaf(x, now):
            shape[1] = seq
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
    return jax.tree.map(one, batch)


def call_args(model, batch) -> tuple[tuple, dict]:
    """(args, kwargs) the model is called with on `batch`, by the module's rule:
    a tuple or list as the positional arguments, a dict as keywords (the entries
    `type(model).__call__` names, or all where it takes **kwargs), anything else as
    the one argument."""
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), {k: v for k, v in batch.items() if _takes(model, k)}
    return (batch,), {}


def _takes(model, name: str) -> bool:
    try:
        params = inspect.signature(type(model).__call__).parameters
    except (TypeError, ValueError):  # no signature to read: pass the entry
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _scalar(value, loss: Callable):
    """`value` if it is a float scalar; else ModelError naming the loss and what it gave."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ModelError(f"loss {getattr(loss, '__name__', loss)!r} must return a float "
                         f"scalar, it returned {_returned(value)}")
    return value


def _returned(value) -> str:
    """'float32[4, 8]', 'int 3', 'a tuple (float32[], dict)': what a loss gave."""
    if isinstance(value, tuple):  # (loss, aux), as value_and_grad(has_aux=True) takes it
        parts = (_returned(v) if hasattr(v, "dtype") else type(v).__name__ for v in value)
        return f"a tuple ({', '.join(parts)}); return the scalar alone (no auxiliary outputs)"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"{value.dtype}{list(value.shape)}"
    return f"{type(value).__name__} {value!r:.40}"  # a Python number: no dtype to show


class BatchInputs:
    """A batch of any inputs and a loss of the model's output: the `inputs=` of
    `from_model.workload` for a model that is not a token LM.

    Attributes:
      batch: the batch as declared, ShapeDtypeStructs (`abstract`).
      loss: loss(output, batch) -> float scalar.
    """

    def __init__(self, batch, loss: Callable):
        self.batch, self.loss = abstract(batch), loss

    def check(self, model) -> None:
        """ModelError, in one line, where the model's `__call__` cannot take the batch
        by `call_args`' rule (a missing or an unknown argument)."""
        args, kwargs = call_args(model, self.batch)
        try:
            signature = inspect.signature(type(model).__call__)
        except (TypeError, ValueError):  # no signature to read: the trace tells
            return
        try:
            signature.bind(model, *args, **kwargs)
        except TypeError as e:
            raise ModelError(f"{type(model).__name__}.__call__ cannot take the batch ({e}): "
                             "a tuple is passed as model(*batch), a dict as model(**entries "
                             "it names), anything else as model(batch)") from None

    def build(self, model, batch: int, seq: int | None, block) -> tuple:
        """(the layers found, `blocks.Pick`; loss(params, batch, other variables); its
        args) at these sizes: `from_model`'s tokens and next-token loss,
        for this batch and loss."""
        shaped = resized(self.batch, batch, seq)
        loss = self.loss
        if isinstance(model, nnx.Module):
            args, kwargs = call_args(model, shaped)
            pick = from_model.nnx_block(model, block, *args, **kwargs)
            graphdef, params, rest = nnx.split(from_model.nnx_marked(model, pick.cls),
                                               nnx.Param, ...)

            def marked(params, b, rest):
                args, kwargs = call_args(model, b)
                out = flax_nnx.root_call(nnx.merge(graphdef, params, rest), *args, **kwargs)
                return _scalar(loss(out, b), loss)

            shapes = lambda s: jax.tree.map(  # noqa: E731
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s)
            return pick, marked, (shapes(params), shaped, shapes(rest))

        def init(b):
            args, kwargs = call_args(model, b)
            return model.init(jax.random.key(0), *args, **kwargs)
        pick, variables = from_model.linen_block(model, init, shaped, block=block)
        rest = {k: v for k, v in variables.items() if k != "params"}

        def marked(params, b, rest):
            args, kwargs = call_args(model, b)
            with from_model.marking_linen(pick.cls), from_model.applied_plainly(batch=True):
                out = model.apply({"params": params, **rest}, *args, **kwargs)
            return _scalar(loss(out, b), loss)

        return pick, marked, (variables["params"], shaped, nn.unbox(rest))


def is_tokens(batch) -> bool:
    """Whether `batch` is a token LM's: one int array [batch, seq]."""
    return (not isinstance(batch, (tuple, list, dict)) and hasattr(batch, "dtype")
            and jnp.issubdtype(batch.dtype, jnp.integer) and len(batch.shape) == 2)


def workload(model, batch, loss: Callable | None = None, *, size: int | None = None,
             seq: int | None = None, block=None, name: str | None = None,
             mesh: jax.sharding.Mesh | None = None, vocab_chunks: int = 1) -> Workload:
    """The `Workload` of `loss(model(...batch...), batch)` for a linen or NNX model.

    Args:
      model: a `flax.linen.Module` instance (unbound) or a `flax.nnx.Module`.
      batch: a pytree of arrays or `jax.ShapeDtypeStruct`s, each [batch, ...]:
        images [B, H, W, C], (latents, timesteps), a dict of input_ids,
        attention_mask and labels [B, S]; called as `call_args` says.
      loss: loss(output, batch) -> float32 scalar, e.g. softmax cross-entropy
        of the logits against batch["label"]; None only for a batch of one int
        array [B, S], which gets the next-token loss (`from_model.workload`).
      size, seq: the batch size and sequence length to measure at (default the
        batch's own; `resized`); seq is for a batch with a sequence axis.
      block, name, mesh: as `from_model.workload` (the batch split over the
        mesh's data axes along its leading axis).
      vocab_chunks: for a batch of tokens and no loss, as `from_model.workload`.
    Returns:
      A `Workload` with args (params, batch, other variables) as
      ShapeDtypeStructs, `batch` the leading axis and `seq` the sequence
      length (None without a sequence axis); `Workload.at` resizes the batch.
    Raises:
      ModelError: a leaf that is not an array, no loss for a batch that is not
        tokens, a `__call__` that cannot take the batch, a loss that does not
        return a float scalar, a size the batch cannot be resized to; and
        everything `from_model.workload` raises.
      UnknownModuleError: no repeated block, or `block` matches none.
    """
    shaped = abstract(batch)
    if loss is None:
        if not is_tokens(batch):
            raise ModelError(f"the batch ({describe(shaped)}) is not one int array of tokens "
                             "[batch, seq], so there is no default loss: give loss(output, "
                             "batch) -> scalar")
        b, s = shaped.shape
        return from_model.workload(model, size or b, seq or s, block=block, name=name,
                                   mesh=mesh, vocab_chunks=vocab_chunks)
    if vocab_chunks != 1:
        raise ModelError(f"vocab chunks ({vocab_chunks}) are for the next-token loss remat_kit "
                         "builds; this model's loss is its own")
    if not callable(loss):
        raise ModelError(f"loss must be a function loss(output, batch) -> scalar, got "
                         f"{type(loss).__name__} {loss!r:.60}")
    first, length = declared(shaped)
    return from_model.workload(model, size or first, seq or length, block=block,
                               name=name or type(model).__name__, mesh=mesh,
                               inputs=BatchInputs(shaped, loss))


__all__ = ["BatchInputs", "FORMS", "abstract", "call_args", "declared", "describe", "is_tokens",
           "leading",
           "resized", "seq_length", "workload"]
