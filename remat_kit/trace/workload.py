"""What to measure: one value that every command takes (`Workload`).

A workload is a loss under a policy, its abstract arguments, and how to build it again at another
size; `measure`, `explain`, `plan`, `fit` and the CLI know nothing else of the model. Providers:
`remat_kit.models.workload`, `remat_kit.flax.from_model.workload`, `from_loss`, or a function
`(batch, seq) -> Workload` of the user's (`as_factory`). Also `checkpointed`.
The providers: docs/models.md ("Full control"); the data flow: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from remat_kit.policy.policy import Policy
from remat_kit.trace.model_map import ModelMap


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """A loss under a policy, its abstract arguments, and how it resizes.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.sin(jnp.sin(x @ w) @ w))
    >>> work = rk.Workload(rk.checkpointed(loss), (jnp.ones((8, 8)), jnp.ones((64, 8))), name="mlp")
    >>> [(r.policy, r.memory_bytes) for r in rk.measure(work, policies=["none", "full"])]
    [('none', 8200), ('full', 6144)]

    Attributes:
      loss_for_policy: policy -> loss(*args) returning a float scalar. The
        policy is a `Policy` (with an optional layer schedule) or a list of
        one `Policy` per layer (`remat_kit.policy.spec.layer_policies`); the
        provider decides where it applies (per block, layer inputs kept).
        The loss is differentiated with respect to `args[0]`.
      args: the loss's arguments as pytrees of `jax.ShapeDtypeStruct`
        (`args[0]` the parameters; with `sharding=` on a mesh).
      name: what the reports call the model, e.g. "gpt2_small" or
        "models.py:build".
      batch, seq: the sizes `args` were built for (None where they mean
        nothing, e.g. a plain loss, or a batch of images has no sequence axis).
      resize: (batch, seq) -> the same workload at those sizes; None if it
        cannot be resized (`fit` needs it).
      sample_args: PRNG key -> concrete arrays shaped like `args`, for timed
        runs; None draws random normal floats and zero ints.
      per_device: (loss_for_policy, args) of the program one device runs on
        `mesh`, where a shard of `args` is not a valid input of the global
        loss (parameters split over fsdp or tensor); else None.
      mesh: the `jax.sharding.Mesh` the args are sharded over, or None.
      own_mesh: the mesh the model builds for itself, as it built it (any size,
        its own axis names and device order), or None; a report says the step
        ran on it (`remat_kit.mesh.origin`).
      num_layers: how many blocks a layer schedule or a per-layer list
        counts (None where the loss has no blocks).
      block: policy -> (loss of one block alone under that policy, its args
        as ShapeDtypeStructs, args[0] the block's parameters), for `explain`
        and the per-layer figures; None where the loss has no blocks.
      notes: lines the reports print under the table (e.g. a preset's roles
        the model lacks).
      block_name: the class name of the blocks (`num_layers` of them), e.g.
        "DecoderLayer"; a plan made on this workload names it, so it is refused
        on a model of other blocks (`rk.remat_model`).
      parameter_count: the scalars in the parameters the blocks were found in,
        e.g. 1,234,688; a plan made on this workload records it, so it is
        refused on another model of the same blocks and layer count.
      size_bound: (vary, fixed, budget_bytes, floor_bytes, platform) ->
        (size, exact): the largest batch (vary="batch") or seq whose train
        step might fit budget_bytes per device and compile, exact when the
        budget set it; None where the provider cannot tell (`fit` then
        searches up to its max_size).
      model_map: what the loss's layers are (`remat_kit.trace.model_map.ModelMap`):
        its stacks, their layers' classes and structures, the model's own remat and
        what lies outside every layer; every report prints its line. None where the
        provider has none (a hand-written loss).
      placement: how the parameters and the batch were placed on `mesh`, for a
        caption ("parameters by their own NamedShardings; batch 8 over fsdp (the
        model's rules): 2 per device"); None off a mesh or where the provider
        does not say.
    """

    loss_for_policy: Callable
    args: tuple
    name: str = "loss"
    batch: int | None = None
    seq: int | None = None
    resize: Callable[[int, int], "Workload"] | None = None
    sample_args: Callable | None = None
    per_device: tuple | None = None
    mesh: jax.sharding.Mesh | None = None
    own_mesh: jax.sharding.Mesh | None = None
    num_layers: int | None = None
    block: Callable | None = None
    notes: tuple[str, ...] = ()
    size_bound: Callable[[str, int, int, int, str], tuple[int, bool]] | None = None
    block_name: str | None = None
    parameter_count: int | None = None
    model_map: "ModelMap | None" = None
    placement: str | None = None

    @property
    def params(self):
        """`args[0]`, the parameters the loss is differentiated by."""
        return self.args[0]

    def at(self, batch: int | None = None, seq: int | None = None) -> "Workload":
        """The same workload at another batch and/or sequence length (seq is
        ignored where the workload has none: `seq` None, a batch of images).

        Raises:
          ValueError: the workload cannot be resized (no `resize`), or a size
            is not a positive int.
        """
        batch = self.batch if batch is None else batch
        seq = self.seq if seq is None or self.seq is None else seq
        if batch == self.batch and seq == self.seq:
            return self
        if self.resize is None:
            raise ValueError(f"workload {self.name!r} cannot be resized (it was built for "
                             f"batch {self.batch}, seq {self.seq}); give a function "
                             "(batch, seq) -> Workload to resize it")
        for label, value in (("batch", batch), ("seq", seq)):
            if value is None and getattr(self, label) is None:  # a batch without that axis
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        return self.resize(batch, seq)


def from_loss(loss_for_policy: Callable, *args, name: str = "loss") -> Workload:
    """A workload of a loss factory (policy -> loss) or a plain loss and its args.

    A plain loss(*args) (calling it with a Policy fails or does not return a
    callable) is wrapped whole in one remat region per policy
    (`checkpointed`): its arguments are always kept.
    """
    return Workload(as_factory(loss_for_policy, len(args)), tuple(args), name=name)


def checkpointed(loss_fn: Callable) -> Callable:
    """A loss factory that wraps all of `loss_fn` in one remat region.

    policy -> `jax.checkpoint(loss_fn, policy=policy.to_jax())`, or `loss_fn`
    itself for the `none` policy. The region's inputs (all of `loss_fn`'s
    arguments) are always kept.
    >>> import jax, jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
    >>> full = rk.checkpointed(loss)(rk.parse("full"))  # all recomputed in the backward pass
    >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    >>> bool(jnp.allclose(jax.grad(full)(w, x), jax.grad(loss)(w, x)))
    True

    """
    def factory(policy: Policy):
        if not policy.remat:
            return loss_fn
        return jax.checkpoint(loss_fn, policy=policy.to_jax())
    return factory


def has_gradient_path(loss: Callable, *args) -> bool:
    """Whether `loss(*args)` depends differentiably on args[0] (the parameters).

    Traced only (no compile): the tangent of the loss along a tangent of
    args[0] (`jax.jvp`); JAX drops what a cast to an integer, a comparison or
    a `stop_gradient` cuts, so where no equation links the tangent input to
    the output, the gradient is zero and there is no backward pass: integer or
    boolean logits, say. args: arrays or `jax.ShapeDtypeStruct`s.
    """
    params, rest = args[0], args[1:]

    def tangent(p, t, *rest):
        # An integer leaf (a step counter) has no tangent space: JAX wants float0 there.
        t = jax.tree.map(lambda x, u: u if jnp.issubdtype(x.dtype, jnp.inexact) else
                         np.zeros(np.shape(x), jax.dtypes.float0), p, t)
        return jax.jvp(lambda q: loss(q, *rest), (p,), (t,))[1]

    jaxpr = jax.make_jaxpr(tangent)(params, params, *rest).jaxpr
    n = len(jax.tree.leaves(params))
    live = set(jaxpr.invars[n:2 * n])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    return any(not isinstance(v, Literal) and v in live for v in jaxpr.outvars)


def _takes(fn: Callable, n: int) -> bool:
    """Whether `fn` can be called with `n` positional arguments (True where its
    signature cannot be read)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature
        return True
    return True


def as_factory(fn: Callable, nargs: int | None = None) -> Callable:
    """`fn` if it maps a Policy to a loss, else `checkpointed(fn)` (fn is a plain loss).

    nargs: how many arguments the loss is called with. Where `fn` takes one
    argument and cannot take `nargs`, it is a factory: what it raises when
    called with a Policy is the user's own error and propagates.

    Raises:
      TypeError: `fn` is not callable, or a factory returns no loss.
    """
    if not callable(fn):
        raise TypeError(f"loss_fn must be a loss(*args), a policy -> loss factory or a "
                        f"remat_kit.Workload, got {type(fn).__name__} {fn!r}")
    if nargs is not None and nargs != 1 and _takes(fn, 1) and not _takes(fn, nargs):
        made = fn(Policy(remat=False))
        if not callable(made):
            raise TypeError(f"loss_fn takes one argument, not the {nargs} the loss is called "
                            f"with, so it is a policy -> loss factory; it returned "
                            f"{type(made).__name__}, not a loss")
        return fn
    try:
        made = fn(Policy(remat=False))
    except Exception:  # noqa: BLE001 - a plain loss fails on a Policy argument
        made = None
    return fn if callable(made) else checkpointed(fn)


__all__ = ["Workload", "as_factory", "checkpointed", "from_loss", "has_gradient_path"]
