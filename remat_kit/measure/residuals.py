"""Residuals: the values a forward pass saves for its backward pass, and who produced them.

One trace of `jax.vjp` gives both the program `measure` compiles and the
residuals, each attributed to the `checkpoint_name` tag, the untagged
primitive or the function argument that produced it (`residuals`).
Docs: docs/compare.md, docs/architecture.md ("The data flow").
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal
from jax.extend.core.primitives import (copy_p, device_put_p, reduce_precision_p,
                                        reshape_p, scan_p, squeeze_p, transpose_p)
from jax.sharding import NamedSharding

from remat_kit import mesh as rk_mesh

from remat_kit.trace.validate import tag_of

# Copies and layout changes (the same bytes in another shape or memory): the
# value they take is the residual's real source, e.g. a reshaped query_proj.
COPY_PRIMITIVES = (reduce_precision_p, device_put_p, copy_p, reshape_p, squeeze_p, transpose_p)


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the forward pass saves for the backward pass.

    Attributes:
      kind: "tag" (a `checkpoint_name` value), "primitive" (an untagged
        value, named by the primitive that computed it, e.g. "dot_general",
        "mul"; "scan input" for a loop-body input stacked per trip) or
        "argument" (an input of the function, kept by reference).
      name: the tag, primitive, or argument path (e.g. "params['embed']['embedding']").
      shape: the residual's shape; for a value saved inside a scanned layer
        stack, the stacked shape [layers, ...].
      dtype: its dtype name.
      nbytes: bytes, prod(shape) * itemsize.
      memory: "device", or "host" for an offloaded residual.
      constant: the value depends on no float input of the function (neither
        its parameters nor its activations, nor a PRNG key): a literal, an
        iota-derived table (a rotary sin/cos, a causal mask), or a value of
        its signed-integer and boolean inputs alone (position ids, a mask
        passed in), the same for every layer that computes it (`_dependent`).
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    memory: str
    constant: bool = False


def call_body(eqn, keys=("jaxpr", "call_jaxpr")):
    """The jaxpr of a call-like equation (jit, remat, custom_jvp/vjp, scan), held in
    one of the params `keys`, whose inputs and outputs match the equation's one to one,
    else None."""
    for key in keys:
        body = eqn.params.get(key)
        body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
        if (hasattr(body, "eqns") and len(body.invars) == len(eqn.invars)
                and len(body.outvars) == len(eqn.outvars)):
            return body
    return None


class _Sources:
    """Attributes the values of a jaxpr (and its sub-jaxprs) to tags and primitives."""

    def __init__(self):
        self._producers: dict[int, dict] = {}
        self._taggers: dict[int, dict] = {}

    def _index(self, jaxpr):
        key = id(jaxpr)
        if key not in self._producers:
            self._producers[key] = {v: e for e in jaxpr.eqns for v in e.outvars}
            self._taggers[key] = {v: t for e in jaxpr.eqns if (t := tag_of(e))
                                  for v in e.invars if not isinstance(v, Literal)}
        return self._producers[key], self._taggers[key]

    def source(self, var, jaxpr) -> tuple[str, str] | int:
        """(kind, name) of `var`, or the index of the `jaxpr` input it is."""
        while True:
            if isinstance(var, Literal):
                return ("primitive", "literal")
            producers, taggers = self._index(jaxpr)
            eqn = producers.get(var)
            if eqn is None:
                # An input of this jaxpr. A layer names its input itself
                # (decoder_layer_input), so the tag applied to it is its name.
                if var in taggers:
                    return ("tag", taggers[var])
                if var in jaxpr.invars:
                    return jaxpr.invars.index(var)
                return ("primitive", "constant")
            if tag := tag_of(eqn):
                return ("tag", tag)
            i = eqn.outvars.index(var)
            if eqn.primitive in COPY_PRIMITIVES:
                var = eqn.invars[i]
                continue
            body = call_body(eqn)
            if body is None:
                return ("primitive", eqn.primitive.name)
            found = self.source(body.outvars[i], body)
            if not isinstance(found, int):
                return found
            if eqn.primitive is scan_p:
                return ("primitive", "scan input")  # a loop-body input, stacked per trip
            var = eqn.invars[found]


def _varies(aval) -> bool:
    """Whether an input of this type can differ from layer to layer: not a signed
    integer or boolean array (ids, positions, masks; unsigned ints may be raw PRNG keys)."""
    dtype = getattr(aval, "dtype", None)
    return not (dtype is not None and (dtype == jnp.bool_
                                       or jnp.issubdtype(dtype, jnp.signedinteger)))


def _dependent(jaxpr, live: Sequence[bool]) -> set:
    """The vars of `jaxpr` computed from its inputs flagged in `live`, through its
    equations: a call-like equation (jit, remat, custom_jvp/vjp; `call_body`) output
    by output, any other (scan, while, cond) as a whole."""
    found = {v for v, d in zip(jaxpr.invars, live) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, Literal) and v in found for v in eqn.invars]
        if not any(ins):
            continue
        body = call_body(eqn)
        if body is None:
            found.update(eqn.outvars)
            continue
        inner = _dependent(body, ins)
        found.update(v for v, o in zip(eqn.outvars, body.outvars)
                     if not isinstance(o, Literal) and o in inner)
    return found


def aval_bytes(aval) -> int:
    """Bytes of one abstract value: the product of its shape x its dtype's item size."""
    return math.prod(aval.shape) * aval.dtype.itemsize


def _memory(aval) -> str:
    return "host" if "host" in str(getattr(aval, "memory_space", "")).lower() else "device"


def _arg_names(f, n: int) -> list[str]:
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    if len(params) >= n and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                for p in params[:n]):
        return [p.name for p in params[:n]]
    return [f"arg{i}" for i in range(n)]


def _leaf_names(f, args) -> list[str]:
    """'params['embed']['embedding']' for each flattened leaf of `args`."""
    out = []
    for name, arg in zip(_arg_names(f, len(args)), args):
        out += [name + jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]
    return out


@dataclasses.dataclass(frozen=True)
class Staged:
    """A loss's value-and-grad traced once (`stage`): the program and its residuals."""

    program: ClosedJaxpr  # value_and_grad w.r.t. args[0], flat inputs and outputs
    residuals: tuple[Residual, ...]
    leaves: list
    residual_vars: tuple = ()  # program vars (or literals) saved for backward, as `residuals`


def _held_like_params(grads, params):
    """The gradients as a training step holds them on a mesh: each constrained to
    its parameter's sharding (`jax.lax.with_sharding_constraint`), so FSDP's
    gradient is reduce-scattered to the parameter's shard and pure data
    parallelism's all-reduced to a replica, as `jax.jit(value_and_grad,
    out_shardings=<the parameters'>)` compiles it. Off a mesh (no parameter
    sharded over several devices), as they are."""
    if not any(rk_mesh.is_sharded(p) for p in params):
        return grads
    return [jax.lax.with_sharding_constraint(g, p.sharding)
            if isinstance(getattr(p, "sharding", None), NamedSharding) else g
            for g, p in zip(grads, params)]


def stage(f, args) -> Staged:
    """Traces f's forward and backward pass once: the program and its residuals.

    The program's outputs are the loss and the gradients with respect to args[0],
    each gradient sharded like its parameter where args carry a mesh
    (`_held_like_params`)."""
    leaves, tree = jax.tree.flatten(args)
    n_grads = len(jax.tree.leaves(args[0]))

    def flat(*xs):
        return f(*jax.tree.unflatten(tree, xs))

    def value_grad_residuals(*xs):
        out, vjp_fn = jax.vjp(flat, *xs)
        if jnp.shape(out) != ():
            raise TypeError(f"the loss must return a scalar, got shape {jnp.shape(out)}")
        grads = vjp_fn(jnp.ones_like(out))
        return (out, _held_like_params(grads[:n_grads], leaves[:n_grads])), \
            jax.tree.leaves(vjp_fn)

    closed, (_, res_shapes) = jax.make_jaxpr(value_grad_residuals, return_shape=True)(*leaves)
    jaxpr, n_res = closed.jaxpr, len(res_shapes)
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - n_res:]
    program = ClosedJaxpr(jaxpr.replace(outvars=jaxpr.outvars[:len(jaxpr.outvars) - n_res]),
                          closed.consts)
    names, sources, seen, found, kept = _leaf_names(f, args), _Sources(), set(), [], []
    varying = _dependent(jaxpr, [_varies(v.aval) for v in jaxpr.invars])
    for var in res_vars:
        if not isinstance(var, Literal):
            if var in seen:  # one buffer saved twice is stored once
                continue
            seen.add(var)
        src = sources.source(var, jaxpr)
        kind, name = ("argument", names[src]) if isinstance(src, int) else src
        found.append(Residual(kind, name, tuple(var.aval.shape), str(var.aval.dtype),
                              aval_bytes(var.aval), _memory(var.aval),
                              isinstance(var, Literal) or var not in varying))
        kept.append(var)
    return Staged(program, tuple(found), leaves, tuple(kept))


def residuals(f: Callable, *args) -> list[Residual]:
    """The values `f(*args)` saves for its backward pass, each with its source.

    Unlike `jax.ad_checkpoint.print_saved_residuals`, values saved inside a
    `scan` (e.g. `nn.scan` over layers) are named by the tag or primitive that
    produced them in the loop body, with their stacked [layers, ...] shape;
    offloaded values (`device_put` to host) and reshaped or transposed values
    by the value they copy; and values computed in a `jit`-wrapped function by
    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(rk.tag(x @ w, "mlpwi")))
    >>> saving = rk.checkpointed(loss)(rk.parse("save:mlpwi"))
    >>> saved = rk.residuals(saving, jnp.ones((8, 8)), jnp.ones((4, 8)))
    >>> [(r.kind, r.name, r.nbytes) for r in saved]
    [('argument', 'w', 256), ('argument', 'x', 128), ('tag', 'mlpwi', 128)]

    the primitive inside it.

    Args:
      f: a function of arrays returning a scalar (a loss).
      args: arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
    Returns:
      One `Residual` per saved buffer, in forward order.
    Raises:
      TypeError: `f` does not return a scalar.
    """
    return list(stage(f, args).residuals)


def split(found: Sequence[Residual]) -> dict:
    by = {"tag": {}, "primitive": {}, "argument": {}}
    for r in found:
        # Arguments are grouped by top-level name: "params['embed']" -> "params".
        key = re.match(r"[^\[.]+", r.name).group(0) if r.kind == "argument" else r.name
        by[r.kind][key] = by[r.kind].get(key, 0) + r.nbytes
    return {"residual_bytes_by_tag": by["tag"], "residual_bytes_by_primitive": by["primitive"],
            "residual_bytes_by_argument": by["argument"],
            "offloaded_bytes": sum(r.nbytes for r in found if r.memory == "host")}



__all__ = ["COPY_PRIMITIVES", "Residual", "Staged", "aval_bytes", "residuals", "split", "stage"]
