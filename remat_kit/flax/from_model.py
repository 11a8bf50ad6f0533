"""A `Workload` from any Flax language model, linen or NNX, with no glue code.

The model maps int32 tokens [batch, seq] to logits [batch, seq, vocab], or to
a dict or object with a `logits` entry. `workload(model, batch, seq)`

1. builds the next-token loss: mean cross-entropy of logits[:, :-1] against
   tokens[:, 1:] (`optax.softmax_cross_entropy_with_integer_labels`);
2. finds the repeated block: of the module classes holding submodules of their
   own (not a Dense or a norm), the one instantiated at least twice with one
   parameter structure whose instances together hold the most parameters
   (ties: the outermost); `block=` names it instead;
3. traces the loss once with each block call wrapped in a marked remat region
   and every submodule output tagged by its path (`rk.linen.auto_tag`,
   `rk.nnx.auto_tag`), infers each value's role (`remat_kit.trace.roles`), and
4. returns a workload whose loss runs each block under the policy
   (`remat_kit.trace.regions`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from remat_kit.flax import linen as flax_linen
from remat_kit.flax import nnx as flax_nnx
from remat_kit.trace import regions
from remat_kit.trace import roles
from remat_kit.trace import wrapping
from remat_kit import mesh as rk_mesh
from remat_kit.errors import UnknownModuleError
from remat_kit.policy.spec import layer_policies
from remat_kit.trace.validate import emitted_tags
from remat_kit.trace.workload import Workload

_KEY = "remat_kit_block"


class ModelError(ValueError):
    """The model is not a language model remat_kit can measure without glue."""


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
            "output or loss, give a function (batch, seq) -> rk.Workload")
    return found


def _describe(out) -> str:
    shapes = jax.tree.map(lambda x: getattr(x, "shape", type(x).__name__), out)
    return f"{type(out).__name__} {shapes}"


def next_token_loss(logits, tokens):
    """Mean cross-entropy of logits[:, :-1] against tokens[:, 1:], in float32."""
    logits = logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def pick_block(instances: dict[tuple, list], block) -> tuple[type, int]:
    """The block class and its count, from {(class, structure, size): [instance ids]}.

    Raises:
      UnknownModuleError: `block` names no class of the model, or no class that
        holds submodules (layers of its own) is instantiated twice with one structure.
    """
    classes = {cls.__name__: cls for cls, _, _ in instances}
    if block is not None:
        name = block if isinstance(block, str) else getattr(block, "__name__", str(block))
        hits = [(len(ids), cls) for (cls, _, _), ids in instances.items()
                if cls.__name__ == name or cls is block]
        if not hits:
            raise UnknownModuleError(name, sorted(classes),
                                     message="the block class matches no module of the model")
        count, cls = max(hits, key=lambda h: h[0])
        return cls, count
    paths = {tuple(p) for ids in instances.values() for p in ids}

    def composite(path) -> bool:  # holds modules of its own: a block, not a Dense or a norm
        return any(len(q) > len(path) and q[:len(path)] == path for q in paths)

    best = None
    for (cls, _, size), ids in instances.items():
        if len(ids) < 2 or not composite(tuple(ids[0])):
            continue
        rank = (len(ids) * size, -len(ids))  # most parameters covered, then the outermost
        if best is None or rank > best[0]:
            best = (rank, cls, len(ids))
    if best is None:
        raise UnknownModuleError(
            None, sorted(classes),
            message="no module class holding submodules is instantiated twice with one "
                    "parameter structure, so there is no repeated block (a one-layer model?); "
                    "name the block with --block NAME (block=) or give a function "
                    "(batch, seq) -> rk.Workload")
    return best[1], best[2]


def _structure(tree) -> tuple[object, int]:
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
    return (treedef, shapes), sum(math.prod(s) for s, _ in shapes)


# ---------------------------------------------------------------------------
# linen
# ---------------------------------------------------------------------------

def _linen_instances(model: nn.Module, tokens) -> tuple[dict, dict]:
    """Every submodule's class by path, from one abstract `init`; and the variables."""
    paths: dict[tuple, type] = {}

    def record(next_fun, args, kwargs, context):
        paths.setdefault(tuple(context.module.path), type(context.module))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = nn.unbox(variables.get("params", {}))
    instances = collections.defaultdict(list)
    for path, cls in paths.items():
        if not path:
            continue
        sub = params
        for p in path:
            sub = sub.get(p, {}) if isinstance(sub, dict) else {}
        if not sub:
            continue
        structure, size = _structure(sub)
        instances[(cls, structure, size)].append(path)
    return instances, variables


def _linen(model: nn.Module, batch: int, seq: int, block) -> tuple:
    init_tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    instances, variables = _linen_instances(model, init_tokens)
    cls, _ = pick_block(instances, block)
    params = variables["params"]  # boxed with logical axes where the model names them
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params, tokens, rest):
        out = model.apply({"params": params, **rest}, tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens)

    plan = wrapping.Plan.of({cls: "full"}, nn.Module, "remat_kit.flax.from_model")
    markers = {k: wrapping.Marker(_KEY) for k in plan.keys}

    def marked(*args):
        with flax_linen._intercepting(plan, markers, True, ("__call__",), check=False), \
                flax_linen.auto_tag():
            return loss(*args)

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return cls, marked, (params, tokens, nn.unbox(rest))


def _on_mesh(args, mesh):
    """args as ShapeDtypeStructs placed on `mesh`: parameters by their logical axes
    where they are boxed (linen `nn.with_logical_partitioning`), else whole; the
    tokens split over the batch axes; other variables whole."""
    params, tokens, rest = args
    if mesh is None:
        return nn.unbox(params), tokens, rest
    shardings = rk_mesh.shardings(params, mesh)
    place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    whole = rk_mesh.replicated(mesh)
    return (jax.tree.map(place, nn.unbox(params), shardings),
            place(tokens, rk_mesh.batch_sharding(mesh)),
            jax.tree.map(lambda x: place(x, whole), rest))


# ---------------------------------------------------------------------------
# NNX
# ---------------------------------------------------------------------------

def _nnx_marked_class(cls: type) -> type:
    orig = cls.__call__

    def __call__(self, *args, **kwargs):
        arrays, rebuild = wrapping.split_static(args, kwargs)

        def body(mdl, *xs):
            a, kw = rebuild(xs)
            return orig(mdl, *a, **kw)

        return nnx.remat(body, policy=wrapping.Marker(_KEY))(self, *arrays)

    return flax_nnx._subclass(cls, {"__call__": __call__})


def _nnx(model: nnx.Module, batch: int, seq: int, block) -> tuple:
    instances = collections.defaultdict(list)
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, nnx.Module):
            structure, size = _structure(nnx.state(node, nnx.Param))
            if size:
                instances[(type(node), structure, size)].append(tuple(path))
    cls, _ = pick_block(instances, block)
    blocks = {p for (c, _, _), paths in instances.items() if c is cls for p in paths}
    tagged = flax_nnx.auto_tag(model)
    for path, node in nnx.iter_graph(tagged):
        if tuple(path) in blocks:
            node.__class__ = _nnx_marked_class(type(node))
    graphdef, params, rest = nnx.split(tagged, nnx.Param, ...)
    abstract = lambda s: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s)

    def marked(params, tokens, rest):
        out = nnx.merge(graphdef, params, rest)(tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens)

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return cls, marked, (abstract(params), tokens, abstract(rest))


# ---------------------------------------------------------------------------
# the provider
# ---------------------------------------------------------------------------

def workload(model, batch: int, seq: int, *, block=None, name: str | None = None,
             mesh: jax.sharding.Mesh | None = None) -> Workload:
    """The `Workload` of a linen or NNX language model's next-token loss.

    Args:
      model: a `flax.linen.Module` instance (unbound) or a `flax.nnx.Module`
        mapping int32 tokens [batch, seq] to logits [batch, seq, vocab] (or a
        dict / object with `logits`).
      batch, seq: positive ints.
      block: the block class or its name; default the repeated class found.
      name: the report's name for the model; default its class name.
      mesh: a `jax.sharding.Mesh` (`remat_kit.mesh.make`) with data and fsdp
        axes: tokens split over them, parameters sharded by their logical
        axes where the model names them (linen), else whole on every device.
        A tensor axis needs the model's own tensor parallelism: refused.
    Returns:
      A `Workload` with args (params, tokens, other variables) as
      ShapeDtypeStructs; `loss_for_policy` takes a policy, a layer schedule
      or one policy per block. Resizing re-traces the model.
    Raises:
      ModelError: not a linen/NNX module, the output has no logits, or a mesh
        with a tensor axis.
      UnknownModuleError: no repeated block class, or `block` matches none.
      RematSpecError: (from loss_for_policy) a policy does not parse.
    """
    for label, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if mesh is not None and rk_mesh.axis_size(mesh, "heads") > 1:
        raise ModelError(f"mesh {rk_mesh.spec_text(mesh)}: a tensor axis splits heads and MLP "
                         "inside the model's own layers, which remat_kit cannot do for a model "
                         "that is not its own; use data and fsdp axes")
    if mesh is not None and batch % rk_mesh.axis_size(mesh, "batch"):
        raise ModelError(f"batch {batch} does not split over the "
                         f"{rk_mesh.axis_size(mesh, 'batch')} data x fsdp devices of mesh "
                         f"{rk_mesh.spec_text(mesh)}")
    if isinstance(model, nnx.Module):
        cls, marked, args = _nnx(model, batch, seq, block)
    elif isinstance(model, nn.Module) and not isinstance(model, type):
        cls, marked, args = _linen(model, batch, seq, block)
    else:
        raise ModelError(f"expected a flax.linen.Module instance or a flax.nnx.Module, got "
                         f"{type(model).__name__} {model!r:.80}")
    sharded = rk_mesh.spanning(mesh)  # a one-device mesh: its program is the per-device one
    args = _on_mesh(args, sharded)
    traced = _trace(marked, args, sharded)
    n = regions.count_marked(traced.jaxpr, _KEY)
    if n == 0:
        raise UnknownModuleError(
            cls.__name__, [cls.__name__],
            message="the block class is instantiated but never called by the model's "
                    "__call__; name another block with --block")
    leaves = jax.tree.leaves(args[0])
    found = roles.infer_roles(traced, [True] * len(leaves)
                              + [False] * (len(traced.jaxpr.invars) - len(leaves)))
    emitted = tuple(dict.fromkeys((*emitted_tags(jax.extend.core.jaxpr_as_fun(traced),
                                                 *jax.tree.leaves(args)),
                                   *regions.block_tags(traced.jaxpr, _KEY),
                                   *found.of.values())))
    traced_regions = regions.Regions(traced, jax.tree.structure(args), _KEY, n, found.of,
                                     emitted, num_params=len(leaves))

    def loss_for_policy(policy):
        return traced_regions.loss(layer_policies(policy, n))

    label = name or type(model).__name__
    notes = tuple(f"{tag}: {why}" for tag, why in sorted(found.missing.items()))
    local = None
    if sharded is not None:  # what one device runs: its share of the batch, whole parameters
        one = workload(model, batch // rk_mesh.axis_size(mesh, "batch"), seq, block=cls)
        local = (one.loss_for_policy, one.args)
    return Workload(loss_for_policy, args, name=label, batch=batch, seq=seq,
                    resize=lambda b, s: workload(model, b, s, block=cls, name=label, mesh=mesh),
                    per_device=local, mesh=mesh, num_layers=n, notes=notes,
                    block=traced_regions.block)


def _trace(fn: Callable, args, mesh):
    def traced_fn(*xs):
        with rk_mesh.use(mesh):
            return fn(*xs)

    traced = jax.make_jaxpr(traced_fn)(*args)
    if regions.count_marked(traced.jaxpr, _KEY) == 0:
        # A jit-ed call traced before (by the user, at these shapes) comes from
        # jax's trace cache, without our interceptors: trace it afresh.
        jax.clear_caches()
        traced = jax.make_jaxpr(traced_fn)(*args)
    return traced


__all__ = ["ModelError", "logits_of", "next_token_loss", "pick_block", "workload"]
