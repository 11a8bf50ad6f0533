"""Drop-in remat for flax.nnx models: class form, instance form, auto-tagging.

    Block = rk.nnx.remat(Block, "selective")                   # class form
    model = rk.nnx.apply_remat(model, {"Block": "full"})       # instance form
    model = rk.nnx.auto_tag(model)                             # name Linear/LayerNorm/... outputs

The instance forms return a new graph sharing the arrays; the input model is left as it was.
The forms and their rules: docs/wrappers.md.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from remat_kit.trace import call_region, wrapping
from remat_kit.policy.policy import Policy, TagPolicy
from remat_kit.policy.spec import parse
from remat_kit.trace.validate import emitted_tags

# Standard nnx layers: `auto_tag(model, AUTO_TAG_CLASSES)` names only their outputs.
AUTO_TAG_CLASSES: tuple[type, ...] = (
    nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.LayerNorm, nnx.RMSNorm,
    nnx.MultiHeadAttention)


def same_named_subclass(cls: type, namespace: dict) -> type:
    """A subclass of `cls` that prints and pickles by the same name; an nnx class
    keeps its `pytree=` setting (flax reads it per class, not from the base: a
    `pytree=False` model's plain lists of blocks would become static)."""
    kwargs = ({"pytree": cls._pytree__is_pytree} if hasattr(cls, "_pytree__is_pytree")
              else {})
    return type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__,
                                       "__module__": cls.__module__, **namespace}, **kwargs)


def copy_model(model: nnx.Module) -> nnx.Module:
    """A copy of `model` that shares no state with it (split, then merged)."""
    return nnx.merge(*nnx.split(model))


def update_changed(module: nnx.Module, new_state, passed: Sequence[bool]) -> None:
    """`nnx.update(module, *new_state)` but for the leaves the call passed through
    unchanged (`passed`, per leaf of `new_state`: `regions.passed_through`): a
    Variable left alone may belong to an outer trace (state merged in under
    `jax.jit(jax.grad(...))`), where flax refuses any write to it."""
    marks = iter(passed)
    kept = [nnx.from_flat_state([(path, var) for path, var in nnx.to_flat_state(part)
                                 if not next(marks)]) for part in new_state]
    nnx.update(module, *kept)


def _check_module(model, where: str) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"{where} takes a flax.nnx.Module instance, got {model!r}")


def path_name(path: Sequence) -> str:
    """'/'.join of an `nnx.iter_graph` path, e.g. ('blocks', 3, 'attn', 'query') ->
    'blocks/3/attn/query'."""
    return "/".join(str(p) for p in path)


@functools.cache
def _tagging_class(cls: type, name: str) -> type:
    def __call__(self, *args, **kwargs):
        with jax.named_scope(name):  # its ops' name stack, as linen's flax_profile gives
            return wrapping.tag_output(cls.__call__(self, *args, **kwargs), name)

    return same_named_subclass(cls, {"__call__": __call__})


def _defines_call(cls: type) -> bool:
    """Whether instances are called: containers (nnx.List, nnx.Dict) are not."""
    return any("__call__" in vars(c) for c in cls.__mro__ if c is not object)


def auto_tag(model: nnx.Module,
             classes: "Sequence[type] | type | None" = None) -> nnx.Module:
    """A copy of `model` whose submodules name their outputs by attribute path.

    Every submodule node that is called (or, with `classes`, only nodes of
    those classes, e.g. `AUTO_TAG_CLASSES`) returns its `__call__` outputs
    wrapped in `checkpoint_name(out, path)`, e.g. `blocks/3/attn/query` (the
    query LinearGeneral of the attention in `model.blocks[3]`),
    `blocks/3/attn` or `blocks/3` (the block's output). The model itself is
    not tagged. Specs then select by path glob:
    `save:*/attn/query,*/attn/key;recompute:*`. Outputs, state and
    `nnx.state` paths are unchanged. Each node's class becomes a subclass per
    path, so `nnx.jit` (whose cache key holds the classes) traces the tagged
    copy anew and keeps each layer's names.

    A call returning several arrays (tuple, dict, dataclass, flax struct)
    names the first `path` and each other `path.` + its key path, e.g.
    `blocks/0/attn` and `blocks/0/attn.1` for `(out, weights)`; non-array
    leaves pass through. A module reachable by two paths is named by the
    first `nnx.iter_graph` gives.

    Raises:
      TypeError: `model` is not an nnx Module, or `classes` is a string or
        holds something that is not a `flax.nnx.Module` subclass (a linen
        class, a name, an instance).
      ValueError: `classes` is empty.
    """
    _check_module(model, "rk.nnx.auto_tag")
    if classes is not None:
        classes = wrapping.module_classes(classes, nnx.Module, "rk.nnx.auto_tag")
    out = copy_model(model)
    for path, node in nnx.iter_graph(out):
        if (path and isinstance(node, classes or nnx.Module)
                and _defines_call(type(node))):
            node.__class__ = _tagging_class(type(node), path_name(path))
    return out


# Per module instance: {argument signature: JAX policy}, for policies resolved by tracing.
_RESOLVED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _jax_policy(module, policy: Policy, body: Callable, arrays, validate: bool):
    """JAX's policy for one call of a remat region `body(module, *arrays)`.

    Globs and `validate` need the names the region emits: the region is traced
    once per argument signature (no FLOPs) on a copy of `module`.
    """
    if not (validate or wrapping.needs_names(policy) or wrapping.names_roles(policy)):
        return policy.to_jax()
    sig = tuple((a.shape, str(a.dtype)) for a in arrays)
    cache = _RESOLVED.setdefault(module, {})
    if sig not in cache:
        graphdef, state = nnx.split(module)
        emitted = emitted_tags(lambda s, *xs: body(nnx.merge(graphdef, s), *xs), state,
                               *arrays)
        cache[sig] = wrapping.resolve(policy, emitted, validate, where="rk.nnx",
                                      checked=type(module).__name__)
    return cache[sig]


# {(graphdef, state structure, call signature, RoleCall): (run, output)} of role-tagged calls.
_ROLE_RUNS: dict = {}


def _role_call(module: nnx.Module, orig: Callable, call, args, kwargs):
    """`orig(module, *args, **kwargs)` as the program `compare --model` measures for a
    block under `call.policy`: the call traced alone on the module's state (an
    `auto_tag` copy: the path tags compare's program has) and run with its dataflow
    roles tagged (`call_region.build`); its state updates land on `module`."""
    state = nnx.state(module, nnx.Param, ...)  # (params, the rest): params first
    leaves, tree = jax.tree.flatten(state)
    arrays, rebuild = wrapping.split_static(args, kwargs)
    output = {}  # the output's non-array structure, filled while tracing

    def make():
        graphdef = nnx.split(auto_tag(module))[0]

        def block(*xs):  # state leaves, then the call's arrays
            a, kw = rebuild(xs[len(leaves):])
            m = nnx.merge(graphdef, *jax.tree.unflatten(tree, xs[:len(leaves)]))
            outs, output["rebuild"] = wrapping.split_output(orig(m, *a, **kw))
            return outs, nnx.state(m, nnx.Param, ...)

        region = call_region.build(block, (*leaves, *arrays), len(jax.tree.leaves(state[0])),
                                   call, f"rk.nnx ({type(module).__name__})")
        return region, output

    key = call_region.key_of(nnx.split(module)[0], tree,
                             tuple((a.shape, str(a.dtype)) for a in arrays),
                             repr(rebuild([None] * len(arrays))), call)
    region, out = call_region.once(_ROLE_RUNS, key, make)
    region.warn()
    outs, new_state = region.run(*leaves, *arrays)
    update_changed(module, new_state, region.passed[len(region.passed) - len(leaves):])
    return out["rebuild"](outs)


@functools.cache
def _remat_class(cls: type, policy: Policy, prevent_cse: bool, validate: bool,
                 methods: tuple[str, ...]) -> type:
    def wrap(name):
        orig = getattr(cls, name)

        def method(self, *args, **kwargs):
            arrays, rebuild = wrapping.split_static(args, kwargs)

            output = {}  # the output's non-array structure, filled while tracing

            def body(mdl, *xs):
                a, kw = rebuild(xs)
                outs, output["rebuild"] = wrapping.split_output(orig(mdl, *a, **kw))
                return outs

            jax_policy = _jax_policy(self, policy, body, arrays, validate)
            if isinstance(jax_policy, wrapping.RoleCall):
                return _role_call(self, orig, jax_policy, args, kwargs)
            outs = nnx.remat(body, policy=jax_policy, prevent_cse=prevent_cse)(self, *arrays)
            return output["rebuild"](outs)

        return functools.wraps(orig)(method)

    return same_named_subclass(cls, {name: wrap(name) for name in methods})


def remat(module_or_fn, policy: "str | Policy", *, static_argnums: int | Sequence[int] = (),
          prevent_cse: bool = True, validate: bool = False,
          methods: Sequence[str] = ("__call__",)):
    """`nnx.remat` under a remat_kit policy, for a Module class, instance or function.

    >>> import jax.numpy as jnp, flax.nnx as nnx, remat_kit as rk
    >>> layer = rk.nnx.remat(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), "full")  # a copy: same params
    >>> layer(jnp.ones((4, 8))).shape
    (4, 8)

    Args:
      module_or_fn: an nnx Module class (returns a subclass with the same
        constructor), a Module instance (returns a copy whose `methods` run
        rematerialized) or a function (returns `nnx.remat(fn, ...)`).
      policy: a spec string (`rk.parse`) or a `Policy`; "none" returns the
        input unchanged.
      static_argnums: function form only, as in `nnx.remat` (0 is the first
        argument). The module forms keep every non-array argument (flags such
        as `deterministic`, None) static themselves and trace the arrays.
      prevent_cse: as in `jax.checkpoint`.
      validate: module forms: on the first call per argument signature,
        trace the method (no FLOPs) and check the policy's tags against what
        it emits.
      methods: module forms: the methods to rematerialize.
    Returns:
      The wrapped class, module or function. Module forms resolve policies
      with globs (`save:*/attn/*`) to JAX built-ins over the names the method
      emits; the function form resolves them through `TagPolicy` (the same
      saved names as the built-in under either remat mode for base "nothing").
    Raises:
      TypeError: not a Module class, instance or callable; `static_argnums`
        with a module or not ints; `validate` with a function (use
        `rk.validate`); `prevent_cse` or `validate` not a bool.
      ValueError: no methods, or a method the module's class does not define.
      RematSpecError: the policy does not parse.
      UnknownTagError: `validate` and the policy names a tag never emitted.
    """
    policy = wrapping.module_policy(parse(policy))  # the public entry: parsed once, here
    is_class = isinstance(module_or_fn, type) and issubclass(module_or_fn, nnx.Module)
    if is_class or isinstance(module_or_fn, nnx.Module):
        if static_argnums != ():
            raise TypeError("rk.nnx.remat: static_argnums is for functions; module forms keep "
                            "non-array arguments static themselves")
        cls = module_or_fn if is_class else type(module_or_fn)
        methods = wrapping.options("rk.nnx.remat", prevent_cse, validate, methods, cls,
                                   nnx.Module)
        if not policy.remat:
            return module_or_fn
        if is_class:
            return _remat_class(module_or_fn, policy, prevent_cse, validate, methods)
        out = copy_model(module_or_fn)
        out.__class__ = _remat_class(type(out), policy, prevent_cse, validate, methods)
        return out
    if isinstance(module_or_fn, type) or not callable(module_or_fn):
        raise TypeError(f"rk.nnx.remat takes an nnx Module class, instance or function, got "
                        f"{module_or_fn!r}")
    wrapping.options("rk.nnx.remat", prevent_cse, validate, methods)
    if validate:
        raise TypeError("rk.nnx.remat: validate=True needs a module; for a function call "
                        "rk.validate(policy, fn, *args)")
    static_argnums = wrapping.static_positions(static_argnums, "rk.nnx.remat")
    if not policy.remat:
        return module_or_fn
    lazy = wrapping.needs_names(policy) and policy.base == "nothing"
    return nnx.remat(module_or_fn, policy=TagPolicy(policy) if lazy else policy.to_jax(),
                     static_argnums=static_argnums, prevent_cse=prevent_cse)


def apply_remat(model: nnx.Module, mapping, *, prevent_cse: bool = True,
                validate: bool = False, methods: Sequence[str] = ("__call__",)) -> nnx.Module:
    """A copy of `model` in which every submodule whose class matches runs under that
    class's policy; the model's source is not edited.
    A remat the model itself runs around a matched block (`nn.remat(Block)`, `nnx.remat`
    around a scanned call) is not taken over: it stays around the policy's region
    (docs/wrappers.md); `rk.remat_model` takes it over.

    Args:
      model: an nnx Module instance.
      mapping: {class name or nnx Module class: spec string or Policy}, e.g.
        {"Block": "selective", "MLP": "full"}. A name matches the class or a
        base class; a module matched by several keys takes the key of its
        most derived class. Nested matches nest remat regions.
      prevent_cse, validate, methods: as in `remat`; each matched module's
        class must define the methods (ValueError otherwise).
    Returns:
      The copy (same arrays, new Variables; `nnx.state` paths unchanged).
    Raises:
      TypeError: `model` is not an nnx Module, or a key is neither a class
        name nor an nnx Module class.
      RematSpecError: a policy spec does not parse.
      UnknownModuleError: a key matches no node of the model; lists the
        classes present and the closest name.
      UnknownTagError: `validate` and a policy names a tag never emitted (at
        the first call).
    """
    _check_module(model, "rk.nnx.apply_remat")
    wrapping.Plan.check(mapping, nnx.Module, "rk.nnx.apply_remat")
    plan = wrapping.Plan.of({key: parse(p) for key, p in mapping.items()})  # once, here
    wrapping.options("rk.nnx.apply_remat", prevent_cse, validate, methods)
    out = copy_model(model)
    matched, seen = set(), {}
    for _, node in nnx.iter_graph(out):
        if not isinstance(node, nnx.Module):
            continue
        seen.setdefault(type(node).__name__)
        key = plan.match(node)
        if key is None:
            continue
        matched.add(key)
        policy = plan.policy(key)
        if policy.remat:
            node.__class__ = _remat_class(type(node), policy, prevent_cse, validate,
                                          wrapping.options("rk.nnx.apply_remat", prevent_cse,
                                                           validate, methods, type(node),
                                                           nnx.Module))
    plan.check_matched(matched, seen)
    return out


def tags(model: nnx.Module, *args, classes=None, **kwargs) -> dict[str, jax.core.ShapedArray]:
    """The tags `model(*args, **kwargs)` emits with `auto_tag(model, classes)` applied:
    {name: ShapedArray(shape, dtype)}, in call order, each once.

    Traces with `jax.make_jaxpr` (no FLOPs); args may be `jax.ShapeDtypeStruct`s.
    Lists auto tags (attribute paths, e.g. `blocks/0/attn/query`; names as
    `auto_tag` gives them) and tags the model applies itself (`rk.tag`).

    Raises:
      TypeError: `model` is not an nnx Module, or bad `classes`.
    """
    _check_module(model, "rk.nnx.tags")
    graphdef, state = nnx.split(auto_tag(model, classes))
    arrays, rebuild = wrapping.split_static(args, kwargs)

    def run(s, *xs):
        a, kw = rebuild(xs)
        return nnx.merge(graphdef, s)(*a, **kw)

    return emitted_tags(run, state, *arrays)


__all__ = ["AUTO_TAG_CLASSES", "apply_remat", "auto_tag", "copy_model", "path_name", "remat",
           "same_named_subclass", "tags"]


def root_call(model: nnx.Module, *args, **kwargs):
    """`model(*args, **kwargs)` scoped by its class, as linen scopes its root (`own_call`)."""
    with jax.named_scope(type(model).__name__):
        return model(*args, **kwargs)
