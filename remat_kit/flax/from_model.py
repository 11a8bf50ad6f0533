"""A `Workload` from any Flax language model, linen or NNX, with no glue code.

`workload(model, batch, seq)` takes a model of int32 tokens [batch, seq] -> logits [batch, seq,
vocab] (or a dict/object with `logits`), builds the next-token loss (`next_token_loss`), finds
its layers (`blocks.pick_block`), traces it once with layers marked and values tagged by path and
role, takes over the model's own remat, and returns a workload that runs each layer under a policy.
The steps and the model map: docs/models.md ("A Flax model, no glue").
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import math
from collections.abc import Callable

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from remat_kit.flax import linen as flax_linen
from remat_kit.flax import linen_tags
from remat_kit.flax.blocks import (Instance, ModelError, Pick, has_parameters, pick_block,
                                   unremat_note)
from remat_kit.flax import nnx as flax_nnx
from remat_kit.flax.lm_loss import OUR_LOSS, logits_of, next_token_loss
from remat_kit.flax import experts, placement
from remat_kit.trace import model_map, own_call, own_remat, pipeline, regions, retarget, stand_in
from remat_kit.trace.marked import count_marked
from remat_kit.trace import wrapping
from remat_kit import mesh as rk_mesh
from remat_kit.errors import UnknownModuleError
from remat_kit.policy.spec import layer_policies
from remat_kit.trace.workload import Workload

KEY = "remat_kit_block"


def _check_takes_tokens(model) -> None:
    """Refuses, in one line, a model whose `__call__` needs more than the tokens (an
    encoder's mask, an image): calling it would fail at remat_kit's call site."""
    try:
        signature = inspect.signature(type(model).__call__)
    except (TypeError, ValueError):  # a builtin or C callable: let the trace tell
        return
    try:
        signature.bind(model, None)
    except TypeError as e:
        raise ModelError(f"{type(model).__name__}.__call__ does not take the tokens alone "
                         f"({e}); for a model with other inputs give a function (batch, seq) "
                         "-> rk.Workload (docs/models.md)") from None


@contextlib.contextmanager
def applied_plainly(batch: bool = False):
    """Inside: a linen model that needs more than its variables at apply (an rng
    stream, a collection it writes) is a ModelError saying so, in one line: the
    loss applies it as `model.apply(variables, tokens)` (`batch`: to the batch of a
    (model, batch, loss) FUNCTION), no rngs, nothing mutable."""
    applied = "to its batch with no rngs, under the FUNCTION's loss" if batch else (
        "to tokens with no rngs, as its loss has no dropout")
    remedy = ("or write it in flax.nnx, whose nnx.Rngs state remat_kit carries (new dropout "
              "masks each training step)" if batch else
              "or give a function (batch, seq) -> rk.Workload whose loss passes rngs")
    try:
        yield
    except flax.errors.InvalidRngError as e:
        raise ModelError(f"the model asks for a PRNG stream ({_first_line(e)}): remat_kit "
                         f"applies it {applied}; build it deterministic (e.g. "
                         f"deterministic=True), {remedy}") from None
    except flax.errors.ModifyScopeVariableError as e:
        raise ModelError(f"the model updates its variables ({_first_line(e)}): remat_kit "
                         "applies it with every collection read-only; build it not to update "
                         "them (e.g. BatchNorm(use_running_average=True)), or give a function "
                         "(batch, seq) -> rk.Workload") from None


def _first_line(e: BaseException) -> str:
    """flax's message without its documentation link."""
    return str(e).split(" (https://")[0].rstrip(". ")


def _structure(tree) -> tuple[tuple, int]:
    """((key path, shape, dtype) per leaf, the scalars in them) of a parameter tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    shapes = tuple((tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                          for k in path), tuple(x.shape), str(x.dtype)) for path, x in leaves)
    return shapes, sum(math.prod(s) for _, s, _ in shapes)


def _stacked(whole, seen) -> int:
    """How many layers one instance runs: its parameters `whole` (as the model
    holds them) against `seen` (as its call sees them). A scanned stack
    (`nn.scan`, `nnx.scan` over `nnx.vmap`-made blocks, MaxText's stack with its
    layer axis at `param_scan_axis` 1) holds each parameter with layer axes its
    call does not see, anywhere in its shape: their product, where every parameter
    that has such axes agrees on one; else 1."""
    shapes, _ = _structure(whole)
    inner, _ = _structure(seen)
    if [k for k, _, _ in shapes] != [k for k, _, _ in inner] or not shapes:
        return 1
    found = [f for (_, s, _), (_, i, _) in zip(shapes, inner) if (f := _left_out(s, i))]
    common = set.intersection(*found) if found else set()
    return common.pop() if len(common) == 1 else 1


def _left_out(shape: tuple, inner: tuple) -> set[int]:
    """The products of the axes of `shape` whose removal leaves `inner`, over every
    choice of those axes ({1} where the two are equal; empty where none)."""
    k = len(shape) - len(inner)
    return {math.prod(shape[n] for n in drop)
            for drop in itertools.combinations(range(len(shape)), max(k, 0))
            if k >= 0 and tuple(d for n, d in enumerate(shape) if n not in drop) == tuple(inner)}


def _loose(params, instances) -> tuple:
    """The top-level names of `params` no submodule holds: parameters of the model's own
    (a learned position table), which run outside every layer."""
    held = {i[0][0] for i in instances}
    return tuple(k for k in params if k not in held)


# ---------------------------------------------------------------------------
# linen
# ---------------------------------------------------------------------------

def linen_instances(model: nn.Module, fn: Callable, *args,
                     params=None) -> tuple[list[Instance], dict]:
    """Every submodule holding parameters (`blocks.Instance`: path, class, structure,
    the layers it runs by `_stacked`), in call order, from one abstract run of
    `fn(*args)` (an `init`, whose output's "params" are read, or an `apply` of
    `params`); and what `fn` returned."""
    paths: dict[tuple, type] = {}
    seen: dict[tuple, object] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        path = tuple(context.module.path)
        paths.setdefault(path, type(context.module))
        if context.method_name != "setup" and path not in seen:
            seen[path] = nn.unbox(context.module.variables.get("params", {}))
        return out

    # jit off: an `nn.jit`-ed method traced before at these shapes is a hit in jax's
    # trace cache, which runs no interceptor, so its submodules would go unseen.
    with nn.intercept_methods(record), jax.disable_jit():
        out = jax.eval_shape(fn, *args)
    params = placement.unboxed(out.get("params", {}) if params is None else params)
    instances = []
    for path, cls in paths.items():
        if not path:
            continue
        sub = params
        for p in path:
            sub = sub.get(p, {}) if isinstance(sub, dict) else {}
        if not sub:
            continue
        structure, size = _structure(sub)
        instances.append(Instance(path, cls, structure, size,
                                  _stacked(sub, seen.get(path, sub))))
    return instances, out


@contextlib.contextmanager
def marking_linen(cls: type):
    """Inside: every call of a `cls` submodule runs as a remat region marked for
    `remat_kit.trace.regions`, and every submodule output is tagged by its path."""
    if not cls:  # no layers: tagged, nothing marked
        with linen_tags.auto_tag():
            yield
        return
    plan = wrapping.Plan.marking(cls)
    markers = {k: wrapping.Marker(KEY) for k in plan.keys}
    with flax_linen.intercepting(plan, markers, True, ("__call__",), check=False), \
            linen_tags.auto_tag():
        yield


def linen_block(model: nn.Module, init: Callable, *args, block=None) -> tuple[Pick, dict]:
    """(the block classes of `model`, `pick_block`; its variables as ShapeDtypeStructs),
    from one abstract `init(*args)` (`model.init` on the inputs): the one way a linen
    model's blocks are found, for its tokens or any batch (`batch_model`)."""
    instances, variables = linen_instances(model, init, *args)
    has_parameters(model, variables.get("params", {}))
    return pick_block(instances, block, _loose(variables["params"], instances)), variables


def _linen(model: nn.Module, batch: int, seq: int, block, vocab_chunks: int = 1) -> tuple:
    init_tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)  # a shard_map refuses batch 1
    pick, variables = linen_block(
        model, lambda t: model.init(jax.random.key(0), t), init_tokens, block=block)
    cls = pick.cls
    params = variables["params"]  # boxed with logical axes where the model names them
    rest = {k: v for k, v in variables.items() if k != "params"}

    def marked(params, tokens, rest):
        with marking_linen(cls), applied_plainly():
            out = model.apply({"params": params, **rest}, tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens, vocab_chunks)

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return pick, marked, (params, tokens, placement.unboxed(rest))


def _plain(params):
    """Parameters as ShapeDtypeStructs, their partitioning boxes (linen) taken off."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        placement.unboxed(params))


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

        return nnx.remat(body, policy=wrapping.Marker(KEY))(self, *arrays)

    return flax_nnx.same_named_subclass(cls, {"__call__": __call__})


def _nnx_copies(model: nnx.Module, paths, *args, **kwargs) -> dict:
    """{path: layers it runs} of the modules at `paths` (`_stacked`): one abstract
    forward `model(*args, **kwargs)` of a copy whose modules there record the
    parameters their call sees."""
    seen: dict[tuple, object] = {}
    copy = flax_nnx.copy_model(model)

    def recorder(cls, path):
        orig = cls.__call__

        def __call__(self, *args, **kwargs):
            seen.setdefault(path, nnx.state(self, nnx.Param))
            return orig(self, *args, **kwargs)
        return flax_nnx.same_named_subclass(cls, {"__call__": __call__})

    for path, node in nnx.iter_graph(copy):
        if tuple(path) in paths:
            node.__class__ = recorder(type(node), tuple(path))
    graphdef, state = nnx.split(copy)
    arrays, rebuild = wrapping.split_static(args, kwargs)

    def forward(s, *xs):
        a, kw = rebuild(xs)
        return nnx.merge(graphdef, s)(*a, **kw)

    jax.eval_shape(forward, state, *arrays)
    whole = {p: nnx.state(n, nnx.Param) for p, n in nnx.iter_graph(model) if tuple(p) in paths}
    return {tuple(p): _stacked(w, seen.get(tuple(p), w)) for p, w in whole.items()}


def nnx_block(model: nnx.Module, block, *args, **kwargs) -> Pick:
    """The layers of `model` (`pick_block`); a stack held by one module (a scan)
    is counted by one abstract forward `model(*args, **kwargs)`."""
    has_parameters(model, nnx.state(model, nnx.Param))
    found = []
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, nnx.Module):
            structure, size = _structure(nnx.state(node, nnx.Param))
            if size:
                found.append((tuple(path), type(node), structure, size))
    every = [p for p, *_ in found]
    repeated = collections.Counter((c, s) for _, c, s, _ in found)
    singles = {p for p, c, s, _ in found if repeated[(c, s)] == 1  # composite ones
               and any(len(q) > len(p) and q[:len(p)] == p for q in every)}
    copies = _nnx_copies(model, singles, *args, **kwargs) if singles else {}
    return pick_block([Instance(p, c, s, n, copies.get(p, 1)) for p, c, s, n in found], block,
                      _loose(nnx.state(model, nnx.Param), found))


def nnx_marked(model: nnx.Module, cls: type) -> nnx.Module:
    """A copy of `model` (same arrays) whose submodule outputs are tagged by path and
    whose `cls` blocks each run as a remat region marked for `remat_kit.trace.regions`."""
    tagged = flax_nnx.auto_tag(model)
    for _, node in nnx.iter_graph(tagged):
        if isinstance(node, cls):
            node.__class__ = _nnx_marked_class(type(node))
    return tagged


def _nnx(model: nnx.Module, batch: int, seq: int, block, vocab_chunks: int = 1) -> tuple:
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    pick = nnx_block(model, block, tokens)
    graphdef, params, rest = nnx.split(nnx_marked(model, pick.cls), nnx.Param, ...)

    def marked(params, tokens, rest):
        out = flax_nnx.root_call(nnx.merge(graphdef, params, rest), tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens, vocab_chunks)

    return pick, marked, (params, tokens, _plain(rest))


# ---------------------------------------------------------------------------
# the provider
# ---------------------------------------------------------------------------

def workload(model, batch: int, seq: int | None, *, block=None, name: str | None = None,
             mesh: "jax.sharding.Mesh | rk_mesh.Fallback | None" = None,
             vocab_chunks: int = 1, inputs=None, rules=None,
             batch_axes: tuple[str, ...] | None = None) -> Workload:
    """The `Workload` of a linen or NNX language model's next-token loss.

    Args:
      model: a `flax.linen.Module` instance (unbound) or a `flax.nnx.Module`
        mapping int32 tokens [batch, seq] to logits [batch, seq, vocab] (or a
        dict / object with `logits`).
      batch, seq: positive ints.
      block: the layer class or its name, or several (a tuple, or "A,B"); default
        the layers found (`pick_block`; none found: nothing to remat, every policy
        runs as none, and the map says so).
      name: the report's name for the model; default its class name.
      mesh: a `jax.sharding.Mesh` (`remat_kit.mesh.make`) for a model that
        builds none of its own: the model placed as its own partitioning says
        (`remat_kit.flax.placement`: parameters by their names and the
        model's logical-axis rules, else `remat_kit.mesh.RULES`; the batch
        over the batch axes). A model with a mesh of its own is placed on it,
        in its own device order, without `mesh`; a `mesh` given beside it must
        equal it, a `rk_mesh.Fallback` (a TPU target's chips) gives way to it.
        A tensor axis needs the model's own tensor parallelism (named
        parameters): else refused.
      vocab_chunks: compute the loss over this many vocabulary slices of the
        logits (`next_token_loss`); 1, the default, the plain loss.
      inputs: what the model is called on and the loss of its output, where
        the model is not a token LM: an object with `check(model)` and
        `build(model, batch, seq, block) -> (block classes, marked loss, args,
        others)` (`remat_kit.flax.batch_model.BatchInputs`; seq None where its
        batch has no sequence axis); default the tokens and next-token loss.
      rules: logical-axis rules ((logical name, mesh axes) pairs) for a model
        whose logical names no rules of its own map (its boxes', its
        `config.logical_axis_rules`, `nn.logical_axis_rules` in effect come
        first: `placement.annotations`).
      batch_axes: mesh axes to split the batch over where the model's rules name
        no batch axis; default `placement.DATA_AXES`.
    Returns:
      A `Workload` with args (params, tokens, other variables) as
      ShapeDtypeStructs; `loss_for_policy` takes a policy, a layer schedule
      or one policy per block. Resizing re-traces the model.
    Raises:
      ModelError: not a linen/NNX module, its `__call__` needs more than the
        tokens, the output has no logits, a mesh with a tensor axis for a model
        that names no partitioning, or vocab_chunks below 1 or not dividing the
        vocabulary.
      MeshError: a mesh other than the model's own, a mesh axis the model's
        rules do not know, or a batch its batch axes do not split (one line,
        `placement.resolve`); `rules` mapping a logical name twice; `batch_axes`
        naming an axis the mesh lacks; parameters sharded over different meshes.
      UnknownModuleError: `block` matches no class, or one never called.
      RematSpecError: (from loss_for_policy) a policy does not parse.
    """
    for label, value in (("batch", batch), ("seq", seq)):
        if inputs is not None and value is None:  # a batch without that axis
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if rules is None and batch_axes is None:  # the CLI's --rules and --batch-axes
        rules, batch_axes = placement.given_now()
    given = placement.check_rules(rules, "the given rules") if rules is not None else None
    return _workload(model, batch, seq, block, name, mesh, vocab_chunks, inputs, placed=True,
                     given=(given, tuple(batch_axes) if batch_axes else None))


def _built(model, batch: int, seq: int | None, block, vocab_chunks: int, inputs) -> tuple:
    """(the `Pick` of its layers, the marked loss, its args) of a linen or NNX model, on
    `inputs` where given, else on tokens under the next-token loss.
    Raises ModelError: not a linen module instance or an NNX module, or it takes other inputs."""
    if isinstance(model, (nn.Module, nnx.Module)) and not isinstance(model, type):
        (_check_takes_tokens if inputs is None else inputs.check)(model)
    if inputs is not None and isinstance(model, (nn.Module, nnx.Module)):
        return inputs.build(model, batch, seq, block)
    if isinstance(model, nnx.Module):
        return _nnx(model, batch, seq, block, vocab_chunks)
    if isinstance(model, nn.Module) and not isinstance(model, type):
        return _linen(model, batch, seq, block, vocab_chunks)
    raise ModelError(f"expected a flax.linen.Module instance or a flax.nnx.Module, got "
                     f"{type(model).__name__} {model!r:.80}")


@stand_in.standing_in  # cuDNN attention traced where this machine cannot build it
def _workload(model, batch: int, seq: int | None, block, name, mesh, vocab_chunks: int,
              inputs, placed: bool, given: tuple = (None, None)) -> Workload:
    """`workload`; placed=False: the program one device runs (off any mesh, the
    model's own too), whose residuals a sharded workload reports."""
    if isinstance(model, nnx.Module):  # before anything traces a shard_map over the axis
        experts.check(nnx.state(model, nnx.Param))
    pick, marked, args = _built(model, batch, seq, block, vocab_chunks, inputs)
    given_rules, batch_axes = given
    named = placement.annotations(args[0], placement.model_rules(model), given_rules)
    asked = rk_mesh.plain(mesh)
    if asked is not None and rk_mesh.axis_size(asked, "heads") > 1 and not named.any:
        raise ModelError(f"mesh {rk_mesh.spec_text(asked)}: a tensor axis splits heads and MLP "
                         "inside the model's own layers, and the model names no partitioning "
                         "of its parameters (nn.with_logical_partitioning, nnx.with_partitioning"
                         "); name it, or use data and fsdp axes")
    args = (_plain(args[0]), *args[1:])
    traced, _ = trace(marked, args, None, pick.cls)  # where a mesh of the model's own shows
    own_mesh = retarget.meshes(traced.jaxpr)
    where = placement.resolve(named, own_mesh[0] if own_mesh else None, mesh,
                              batch, batch_axes) if placed else None
    if where is not None:  # the model's partitioning, on its mesh or `mesh`
        args = placement.place(named, where, args)
        traced, _ = trace(marked, args, where, pick.cls)
    cls, n = pick.cls, count_marked(traced.jaxpr, KEY)
    if n == 0 and cls:
        raise UnknownModuleError(
            cls.__name__, [cls.__name__],
            message="the block class is instantiated but never called by the model's "
                    "__call__; name another block with --block")
    own = own_remat.find(traced.jaxpr, KEY)
    traced_regions, found = regions.build(traced, jax.tree.structure(args), KEY,
                                          len(jax.tree.leaves(args[0])), own.taken)

    def loss_for_policy(policy):
        return traced_regions.loss(layer_policies(policy, n) if n else ())

    label = name or type(model).__name__
    root = ((model.name or type(model).__name__) if isinstance(model, nn.Module)
            else type(model).__name__)
    mine = own_call.own_call(traced.jaxpr, KEY, root)  # a tied head's bare matmul, say
    the_map = model_map.ModelMap(model_map.stacks_of(list(pick.layers)), own.regions,
                                 (*pick.outside, *([mine] if mine else []), "loss"),
                                 pipeline.find(traced.jaxpr))
    notes = found.notes() + model_map.notes(the_map) + unremat_note(pick.others, cls)
    notes += (where.note,) if where is not None and where.note else ()
    how = None
    if where is not None:  # what a caption says placed the parameters and the batch
        params_text, bare = placement.described(named, where.mesh)
        how = f"{params_text}; {where.batch_text(batch)}"
        notes += bare

    def again(b, s, *, mesh=mesh, placed=placed, name=label):  # under the rules found now
        with nn.logical_axis_rules(nn.get_logical_axis_rules()
                                   if named.rules_from != "nn.logical_axis_rules"
                                   else named.rules):
            return _workload(model, b, s, block, name, mesh, vocab_chunks, inputs, placed,
                             given)

    local, per_chip_block = None, traced_regions.block
    if where is not None:  # what one device runs: its share of the batch, whole parameters
        try:
            one = again(batch // where.batch_size(), seq, mesh=None, placed=False, name=None)
            local, per_chip_block = (one.loss_for_policy, one.args), one.block
        except (ValueError, TypeError, AssertionError) as e:  # its own shard_map splits the
            # batch, a pipeline reshapes it into its microbatches, or its code asserts that
            # its mesh splits it (MaxText's flash): the whole program
            if the_map.pipeline is None and not isinstance(e, AssertionError) and not (
                    isinstance(e, ValueError) and "shard_map" in str(e)):
                raise
            local = (loss_for_policy, args)
    return Workload(loss_for_policy, args, name=label, batch=batch, seq=seq, resize=again,
                    per_device=local, mesh=where and where.mesh, num_layers=n or None,
                    own_mesh=(named.mesh or (own_mesh[0] if own_mesh else None)) if placed
                    else None,
                    notes=notes, block_name=cls.__name__ if n else None,
                    parameter_count=traced_regions.parameter_count, placement=how,
                    # per chip, as every figure is: one device's share of the batch
                    block=per_chip_block if n else None,
                    model_map=the_map)

def trace(fn: Callable, args, where: "placement.Placement | None" = None,
          marks: tuple = (None,)):
    """(the ClosedJaxpr of fn(*args) placed at `where`, its output as ShapeDtypeStructs),
    with its block regions marked (fn marks them): jax's trace caches are cleared and
    fn traced again where a cached jit-ed call hid the marks (`marks`: the classes
    marked; none, nothing to look for). Off a mesh, with no logical-axis rules: the
    model's `nn.with_logical_constraint`s constrain nothing."""
    def make():
        with placement.tracing(where) if where is not None else nn.logical_axis_rules(()):
            return jax.make_jaxpr(fn, return_shape=True)(*args)

    traced, shape = make()
    if marks and count_marked(traced.jaxpr, KEY) == 0:
        # A jit-ed call traced before (by the user, at these shapes) comes from
        # jax's trace cache, without our interceptors: trace it afresh.
        jax.clear_caches()
        traced, shape = make()
    return traced, shape

__all__ = ["ModelError", "OUR_LOSS", "applied_plainly", "linen_instances", "logits_of",
           "next_token_loss", "workload"]
