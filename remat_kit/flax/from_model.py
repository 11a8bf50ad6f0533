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
import contextlib
import inspect
import math
from collections.abc import Callable

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from remat_kit.flax import linen as flax_linen
from remat_kit.flax.blocks import Pick, pick_block, unremat_note
from remat_kit.flax.chunked_loss import chunked_logits_loss
from remat_kit.flax import nnx as flax_nnx
from remat_kit.flax import placement
from remat_kit.trace import regions, retarget
from remat_kit.trace import wrapping
from remat_kit import mesh as rk_mesh
from remat_kit.errors import UnknownModuleError
from remat_kit.policy.spec import layer_policies
from remat_kit.trace.workload import Workload

KEY = "remat_kit_block"


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


def _describe(out) -> str:
    """'an array float32[2, 8]', or the container with each leaf so (not a tracer's type)."""
    def one(x):
        return f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"an array {one(out)}"
    return f"{type(out).__name__} {jax.tree.map(one, out)}"


@contextlib.contextmanager
def _applied_plainly():
    """Inside: a linen model that needs more than its variables at apply (an rng
    stream, a collection it writes) is a ModelError saying so, in one line: the
    loss applies it as `model.apply(variables, tokens)`, no rngs, nothing mutable."""
    try:
        yield
    except flax.errors.InvalidRngError as e:
        raise ModelError(f"the model asks for a PRNG stream ({_first_line(e)}): remat_kit "
                         "applies it to tokens with no rngs, as its loss has no dropout; "
                         "build it deterministic (e.g. deterministic=True), or give a "
                         "function (batch, seq) -> rk.Workload whose loss passes rngs") from None
    except flax.errors.ModifyScopeVariableError as e:
        raise ModelError(f"the model updates its variables ({_first_line(e)}): remat_kit "
                         "applies it with every collection read-only; build it not to update "
                         "them (e.g. BatchNorm(use_running_average=True)), or give a function "
                         "(batch, seq) -> rk.Workload") from None


def _first_line(e: BaseException) -> str:
    """flax's message without its documentation link."""
    return str(e).split(" (https://")[0].rstrip(". ")


def next_token_loss(logits, tokens, vocab_chunks: int = 1):
    """Mean cross-entropy of logits[:, :-1] against tokens[:, 1:], in float32.

    vocab_chunks > 1: computed over that many vocabulary slices of the logits
    (`chunked_loss.chunked_logits_loss`), equal to the plain loss without its
    float32 copies of the logits and their gradient (the model's own logits stay).
    Raises ModelError: vocab_chunks below 1 or not dividing the vocabulary.
    """
    if vocab_chunks == 1:
        logits = logits[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    try:
        return chunked_logits_loss(logits[:, :-1], tokens[:, 1:], vocab_chunks)
    except ValueError as e:
        raise ModelError(str(e)) from None


def _structure(tree) -> tuple[object, int]:
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
    return (treedef, shapes), sum(math.prod(s) for s, _ in shapes)


def _stacked(whole, seen) -> int:
    """How many layers one instance runs: its parameters `whole` (as the model
    holds them) against `seen` (as its call sees them). A scanned stack
    (`nn.scan`, `nnx.scan` over `nnx.vmap`-made blocks) holds each parameter with
    leading layer axes its call does not see: their product; else 1."""
    (tree, shapes), _ = _structure(whole)
    (tree_seen, inner), _ = _structure(seen)
    if tree != tree_seen or not shapes:
        return 1
    lead = {s[:len(s) - len(i)] for (s, _), (i, _) in zip(shapes, inner)
            if len(s) >= len(i) and s[len(s) - len(i):] == i}
    return math.prod(lead.pop()) if len(lead) == 1 and len(shapes) == len(inner) else 1


# ---------------------------------------------------------------------------
# linen
# ---------------------------------------------------------------------------

def _linen_instances(model: nn.Module, fn: Callable, *args,
                     params=None) -> tuple[dict, dict, dict]:
    """Every submodule's class by path, from one abstract run of `fn(*args)` (an
    `init`, whose output's "params" are read, or an `apply` of `params`); the
    layers each instance runs (`_stacked`); and what `fn` returned."""
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
    instances, copies = collections.defaultdict(list), {}
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
        copies[path] = _stacked(sub, seen.get(path, sub))
    return instances, copies, out


@contextlib.contextmanager
def marking_linen(cls: type):
    """Inside: every call of a `cls` submodule runs as a remat region marked for
    `remat_kit.trace.regions`, and every submodule output is tagged by its path."""
    plan = wrapping.Plan.of({c: "full" for c in cls}, nn.Module, "remat_kit.flax.from_model")
    markers = {k: wrapping.Marker(KEY) for k in plan.keys}
    with flax_linen._intercepting(plan, markers, True, ("__call__",), check=False), \
            flax_linen.auto_tag():
        yield


def _linen(model: nn.Module, batch: int, seq: int, block, vocab_chunks: int = 1) -> tuple:
    init_tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    instances, copies, variables = _linen_instances(
        model, lambda t: model.init(jax.random.key(0), t), init_tokens)
    cls, _, others = pick_block(instances, block, copies)
    params = variables["params"]  # boxed with logical axes where the model names them
    rest = {k: v for k, v in variables.items() if k != "params"}

    def marked(params, tokens, rest):
        with marking_linen(cls), _applied_plainly():
            out = model.apply({"params": params, **rest}, tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens, vocab_chunks)

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return cls, marked, (params, tokens, placement.unboxed(rest)), others


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

    return flax_nnx._subclass(cls, {"__call__": __call__})


def _nnx_copies(model: nnx.Module, paths, *args, **kwargs) -> dict:
    """{path: layers it runs} of the modules at `paths` (`_stacked`): one abstract
    forward `model(*args, **kwargs)` of a copy whose modules there record the
    parameters their call sees."""
    seen: dict[tuple, object] = {}
    copy = flax_nnx._copy(model)

    def recorder(cls, path):
        orig = cls.__call__

        def __call__(self, *args, **kwargs):
            seen.setdefault(path, nnx.state(self, nnx.Param))
            return orig(self, *args, **kwargs)
        return flax_nnx._subclass(cls, {"__call__": __call__})

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
    """The block class of `model` (`pick_block`); a stack held by one module (a scan)
    is counted by one abstract forward `model(*args, **kwargs)`."""
    instances = collections.defaultdict(list)
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, nnx.Module):
            structure, size = _structure(nnx.state(node, nnx.Param))
            if size:
                instances[(type(node), structure, size)].append(tuple(path))
    every = [p for ids in instances.values() for p in ids]
    singles = {ids[0] for ids in instances.values() if len(ids) == 1  # composite ones
               and any(len(q) > len(ids[0]) and q[:len(ids[0])] == ids[0] for q in every)}
    copies = _nnx_copies(model, singles, *args, **kwargs) if singles else {}
    return pick_block(instances, block, copies)


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
    cls, _, others = nnx_block(model, block, tokens)
    graphdef, params, rest = nnx.split(nnx_marked(model, cls), nnx.Param, ...)

    def marked(params, tokens, rest):
        out = nnx.merge(graphdef, params, rest)(tokens)
        return next_token_loss(logits_of(out, batch, seq), tokens, vocab_chunks)

    return cls, marked, (params, tokens, _plain(rest)), others


# ---------------------------------------------------------------------------
# the provider
# ---------------------------------------------------------------------------

def workload(model, batch: int, seq: int, *, block=None, name: str | None = None,
             mesh: jax.sharding.Mesh | None = None, vocab_chunks: int = 1) -> Workload:
    """The `Workload` of a linen or NNX language model's next-token loss.

    Args:
      model: a `flax.linen.Module` instance (unbound) or a `flax.nnx.Module`
        mapping int32 tokens [batch, seq] to logits [batch, seq, vocab] (or a
        dict / object with `logits`).
      batch, seq: positive ints.
      block: the block class or its name, or several (a tuple, or "A,B"); default
        the repeated classes found (`pick_block`).
      name: the report's name for the model; default its class name.
      mesh: a `jax.sharding.Mesh` (`remat_kit.mesh.make`) for a model that
        builds none of its own: the model placed as its own partitioning says
        (`remat_kit.flax.placement`: parameters by their names and the
        model's logical-axis rules, else `remat_kit.mesh.RULES`; the tokens
        over the batch axes). A model with a mesh of its own is placed on it,
        in its own device order, without `mesh`. A tensor axis needs the
        model's own tensor parallelism (named parameters): else refused.
      vocab_chunks: compute the loss over this many vocabulary slices of the
        logits (`next_token_loss`); 1, the default, the plain loss.
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
        `placement.resolve`).
      UnknownModuleError: no repeated block class, or `block` matches none.
      RematSpecError: (from loss_for_policy) a policy does not parse.
    """
    for label, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    return _workload(model, batch, seq, block, name, mesh, vocab_chunks, placed=True)


def _workload(model, batch: int, seq: int, block, name, mesh, vocab_chunks: int,
              placed: bool) -> Workload:
    """`workload`; placed=False: the program one device runs (off any mesh, the
    model's own too), whose residuals a sharded workload reports."""
    if isinstance(model, (nn.Module, nnx.Module)) and not isinstance(model, type):
        _check_takes_tokens(model)
    if isinstance(model, nnx.Module):
        cls, marked, args, others = _nnx(model, batch, seq, block, vocab_chunks)
    elif isinstance(model, nn.Module) and not isinstance(model, type):
        cls, marked, args, others = _linen(model, batch, seq, block, vocab_chunks)
    else:
        raise ModelError(f"expected a flax.linen.Module instance or a flax.nnx.Module, got "
                         f"{type(model).__name__} {model!r:.80}")
    named = placement.annotations(args[0])
    if mesh is not None and rk_mesh.axis_size(mesh, "heads") > 1 and not named.any:
        raise ModelError(f"mesh {rk_mesh.spec_text(mesh)}: a tensor axis splits heads and MLP "
                         "inside the model's own layers, and the model names no partitioning "
                         "of its parameters (nn.with_logical_partitioning, nnx.with_partitioning"
                         "); name it, or use data and fsdp axes")
    args = (_plain(args[0]), *args[1:])
    traced, _ = trace(marked, args)  # where a mesh of the model's own shows
    own_mesh = retarget.meshes(traced.jaxpr)
    where = placement.resolve(named, own_mesh[0] if own_mesh else None, mesh,
                              batch) if placed else None
    if where is not None:  # the model's partitioning, on its mesh or `mesh`
        args = placement.place(named, where, args)
        traced, _ = trace(marked, args, where)
    n = regions.count_marked(traced.jaxpr, KEY)
    if n == 0:
        raise UnknownModuleError(
            cls.__name__, [cls.__name__],
            message="the block class is instantiated but never called by the model's "
                    "__call__; name another block with --block")
    traced_regions, found = regions.build(traced, jax.tree.structure(args), KEY,
                                          len(jax.tree.leaves(args[0])))

    def loss_for_policy(policy):
        return traced_regions.loss(layer_policies(policy, n))

    label = name or type(model).__name__
    notes = found.notes()
    own = regions.own_remat(traced.jaxpr, KEY)
    if own:  # the model's own remat stays in every program: say so where `none` shows
        notes += (f"already rematerialized: the model runs {own} remat region"
                  f"{'s' if own > 1 else ''} of its own (nn.remat / nnx.remat / "
                  f"jax.checkpoint) in or around its {n} {cls.__name__} blocks, and they stay "
                  "under every policy: `none` here is not no remat",)
    notes += unremat_note(others, cls)
    notes += (where.note,) if where is not None and where.note else ()

    def again(b, s, *, mesh=mesh, placed=placed, name=label):  # under the rules found now
        with nn.logical_axis_rules(named.rules or nn.get_logical_axis_rules()):
            return _workload(model, b, s, cls, name, mesh, vocab_chunks, placed)

    local = None
    if where is not None:  # what one device runs: its share of the batch, whole parameters
        one = again(batch // where.batch_size(), seq, mesh=None, placed=False, name=None)
        local = (one.loss_for_policy, one.args)
    return Workload(loss_for_policy, args, name=label, batch=batch, seq=seq, resize=again,
                    per_device=local, mesh=where and where.mesh, num_layers=n, notes=notes,
                    block_name=cls.__name__, parameter_count=traced_regions.parameter_count,
                    block=traced_regions.block)


def trace(fn: Callable, args, where: "placement.Placement | None" = None):
    """(the ClosedJaxpr of fn(*args) placed at `where`, its output as ShapeDtypeStructs),
    with its block regions marked (fn marks them): jax's trace caches are cleared and
    fn traced again where a cached jit-ed call hid the marks. Off a mesh, with no
    logical-axis rules: the model's `nn.with_logical_constraint`s constrain nothing."""
    def make():
        with placement.tracing(where) if where is not None else nn.logical_axis_rules(()):
            return jax.make_jaxpr(fn, return_shape=True)(*args)

    traced, shape = make()
    if regions.count_marked(traced.jaxpr, KEY) == 0:
        # A jit-ed call traced before (by the user, at these shapes) comes from
        # jax's trace cache, without our interceptors: trace it afresh.
        jax.clear_caches()
        traced, shape = make()
    return traced, shape


__all__ = ["ModelError", "logits_of", "next_token_loss", "workload"]
