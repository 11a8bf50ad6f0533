"""Drop-in remat for flax.linen models: class form, instance form, auto-tagging.

    import remat_kit as rk
    Block = rk.linen.remat(Block, "selective")                 # class form
    model = rk.linen.apply_remat(model, {"Block": "full"})     # instance form, source untouched
    with rk.linen.auto_tag():                                  # name Dense/LayerNorm/... outputs
        loss = ...model.apply(...)                             # by module path

Parameters keep their structure and names under every form: a checkpoint of
the unwrapped model applies unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from remat_kit import wrapping
from remat_kit.policy import Policy
from remat_kit.validate import check_names, emitted_tags

# Modules whose outputs `auto_tag` names (their `__call__` results).
AUTO_TAG_CLASSES: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv, nn.LayerNorm, nn.RMSNorm,
    nn.MultiHeadDotProductAttention)

# (module, owners): the module a remat region is re-entering and the wrappers (an
# apply_remat plan, a class form) whose regions it is inside, so each lets that call
# through once it has made its region; another wrapper nests its own region inside.
_ENTERED: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_entered",
                                                          default=None)
# Path of the module being traced on its own (class-form validation), prefixed to auto tags.
_PREFIX: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_prefix", default=())
# The class tuples of the active auto_tag contexts: the names a model emits depend on them.
_TAGGING: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_tagging", default=())


def path_name(module: nn.Module) -> str:
    """'/'.join of the module's path from the model root, e.g. 'Block_3/attn/query'."""
    return "/".join((*_PREFIX.get(), *module.path))


@contextlib.contextmanager
def auto_tag(classes: "Sequence[type] | type" = AUTO_TAG_CLASSES):
    """Names the outputs of standard layers by module path, for any linen model.

    Inside the context every `__call__` of a module of `classes` (default
    `AUTO_TAG_CLASSES`: Dense, DenseGeneral, Einsum, Conv, LayerNorm, RMSNorm,
    MultiHeadDotProductAttention) returns its outputs wrapped in
    `checkpoint_name(out, path)`, path as `path_name` gives it, e.g.
    `Block_3/attn/query` (a DenseGeneral inside the attention of Block_3) or
    `Block_3/attn` (the attention output). Specs then select by path glob:
    `save:*/attn/query,*/attn/key;recompute:*`. Shapes and dtypes are unchanged.

    Based on `flax.linen.intercept_methods`; enter it around `init`/`apply`
    (or around `jax.jit` tracing of a function that calls them).

    Raises (on entering the context):
      TypeError: `classes` is a string or holds something that is not a
        `flax.linen.Module` subclass (an NNX class, a name, an instance).
      ValueError: `classes` is empty.
    """
    classes = wrapping.module_classes(classes, nn.Module, "rk.linen.auto_tag")

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, classes):
            name = path_name(context.module)
            out = jax.tree.map(lambda v: checkpoint_name(v, name) if wrapping.is_array(v)
                               else v, out)
        return out

    token = _TAGGING.set((*_TAGGING.get(), classes))
    try:
        with nn.intercept_methods(interceptor):
            yield
    finally:
        _TAGGING.reset(token)


def _entered(module: nn.Module, owner) -> bool:
    """Whether this call of `module` is inside a region `owner` made for it."""
    entry = _ENTERED.get()
    return entry is not None and entry[0] is module and any(o is owner for o in entry[1])


def _region(module: nn.Module, method: str, jax_policy, prevent_cse: bool, args, kwargs,
            owner):
    """Runs `module.method(*args, **kwargs)` as one lifted `nn.remat` region made by
    `owner` (inside the regions other owners made for this call, if any).

    Array arguments are traced; everything else (flags, None) is closed over,
    so `deterministic=True` stays a Python bool inside the region.
    """
    arrays, rebuild = wrapping.split_static(args, kwargs)
    entry = _ENTERED.get()
    owners = (*entry[1], owner) if entry is not None and entry[0] is module else (owner,)

    def body(mdl, *xs):
        a, kw = rebuild(xs)
        token = _ENTERED.set((mdl, owners))
        try:
            return getattr(mdl, method)(*a, **kw)
        finally:
            _ENTERED.reset(token)

    return nn.remat(body, policy=jax_policy, prevent_cse=prevent_cse)(module, *arrays)


def remat(cls: type, policy: "str | Policy", *, static_argnums: int | Sequence[int] = (),
          prevent_cse: bool = True, validate: bool = False,
          methods: Sequence[str] | None = None) -> type:
    """`nn.remat(cls)` under a remat_kit policy: a class with `cls`'s constructor.

    Args:
      cls: a `flax.linen.Module` subclass, e.g. a transformer block.
      policy: a spec string (`rk.parse`) or a `Policy`. "none" returns `cls`.
      static_argnums: positions of non-array arguments of the wrapped methods
        (e.g. a `deterministic` flag), flax's convention: `self` is 0, so in
        `__call__(self, x, deterministic)` the flag is 2. Keyword arguments
        must be arrays (jax.checkpoint traces them); pass flags positionally.
        Not needed with `validate` or a glob policy (below).
      prevent_cse: as in `jax.checkpoint`; False inside `nn.scan`.
      validate: at each call (once per compile under `jax.jit`), trace the
        unwrapped module alone (no FLOPs) and check the policy's tags against
        what it emits; auto tags count only inside `auto_tag()`.
      methods: a method name or names to wrap; default `("__call__",)`.
    Returns:
      The wrapped class. Parameters keep the names and structure of `cls`.
      Without `validate` and globs it is flax's `nn.remat(cls, policy=...)`
      with a JAX built-in policy. With either, each call first traces the
      module alone for the names it emits, so globs (`save:*/attn/*`) become
      a built-in over those names, and then runs as one lifted remat region,
      as `apply_remat` does: array arguments are traced, all others static.
    Raises:
      TypeError: `cls` is not a linen Module class; `static_argnums` not
        ints; `prevent_cse` or `validate` not a bool.
      ValueError: a `static_argnums` position below 1 (`self` is 0), no
        methods, or a method `cls` does not define.
      RematSpecError: the policy does not parse.
      UnknownTagError: `validate` and the policy names a tag the module never
        emits (raised when the module is called).
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"rk.linen.remat takes a flax.linen.Module subclass, got {cls!r}; "
                        "for a model instance use rk.linen.apply_remat(model, {...})")
    methods = wrapping.options("rk.linen.remat", prevent_cse, validate, methods, cls, nn.Module)
    static_argnums = wrapping.static_positions(static_argnums, "rk.linen.remat", minimum=1)
    policy = wrapping.module_policy(policy)
    if not policy.remat:
        return cls
    if not (validate or wrapping.needs_names(policy)):
        return nn.remat(cls, policy=policy.to_jax(), static_argnums=static_argnums,
                        prevent_cse=prevent_cse, methods=list(methods))

    def wrap(name):
        def method(self, *args, **kwargs):
            if _entered(self, traced):  # the region's own call of this method
                return getattr(super(traced, self), name)(*args, **kwargs)
            emitted = _emitted_alone(cls, self, name, args, kwargs)
            if validate:
                check_names(policy, emitted,
                            where=f"{cls.__name__} at {'/'.join(self.path) or 'root'}")
            jax_policy = wrapping.to_jax(policy, emitted)
            return _region(self, name, jax_policy, prevent_cse, args, kwargs, traced)
        return method

    traced = type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__,
                                         "__module__": cls.__module__,
                                         **{name: wrap(name) for name in methods}})
    return traced


def _emitted_alone(cls: type, module: nn.Module, method: str, args, kwargs) -> tuple[str, ...]:
    """The tags `module.method(*args, **kwargs)` emits, traced on an unbound copy of
    class `cls` (auto tags named by `module`'s path)."""
    fields = {f: getattr(module, f) for f, spec in module.__dataclass_fields__.items()
              if f not in ("parent", "name") and spec.init}
    alone = cls(**fields, parent=None)
    arrays, rebuild = wrapping.split_static(args, kwargs)
    rngs = {name: jax.random.key(0) for name in ("params", *module.scope.rngs)}

    def run(*xs):
        a, kw = rebuild(xs)
        return alone.init_with_output(rngs, *a, method=method, **kw)

    token = _PREFIX.set(module.path)
    try:
        return tuple(emitted_tags(run, *arrays))
    finally:
        _PREFIX.reset(token)


def apply_remat(model: nn.Module, mapping, *, prevent_cse: bool = True,
                validate: bool = False, methods: Sequence[str] = ("__call__",)) -> nn.Module:
    """Runs every submodule whose class matches under that class's policy, without
    editing the model's source.

    Args:
      model: a linen Module instance (unbound), e.g. `Transformer(cfg)`.
      mapping: {class name or linen Module class: spec string or Policy},
        e.g. {"Block": "selective", "MlpBlock": "full"}. A name matches the
        class or a base class; a module matched by several keys takes the
        key of its most derived class. Nested matches nest remat regions.
      prevent_cse: as in `jax.checkpoint`.
      validate: check each policy against the tags its submodules emit
        (traces the model once more, no FLOPs).
      methods: the submodule methods to rematerialize.
    Returns:
      A model of a subclass of `type(model)` with the same fields, whose
      `init`, `init_with_output` and `apply` take the same arguments (rngs,
      `mutable=`, `method=`) and give the same variables, outputs and
      gradients as `model`'s. Policies with globs (`save:*/attn/*`) are
      resolved to JAX built-ins with the names the model emits (one extra
      trace per distinct argument signature). Array arguments of a matched
      call are traced; other arguments (flags) stay static.
    Raises:
      TypeError: `model` is not a linen Module instance, a mapping key is
        neither a class name nor a Module class, or `prevent_cse` /
        `validate` is not a bool.
      ValueError: `methods` is empty.
      RematSpecError: a policy spec does not parse.
      UnknownModuleError: on a call of `__call__`, a key matched no submodule;
        lists the classes the model calls and the closest name.
      UnknownTagError: `validate` and a policy names a tag its submodules
        never emit.
    """
    if not isinstance(model, nn.Module) or isinstance(model, type):
        raise TypeError(f"rk.linen.apply_remat takes a flax.linen.Module instance, got "
                        f"{model!r}; for a class use rk.linen.remat(cls, policy)")
    plan = wrapping.Plan.of(mapping, nn.Module, "rk.linen.apply_remat")
    methods = wrapping.options("rk.linen.apply_remat", prevent_cse, validate, methods)
    base = type(model)
    resolved_cache: dict = {}

    def run(fn, method, args, kwargs):
        """fn(*args, **kwargs) with matching submodules rematerialized."""
        if not plan.needs_trace(validate):
            resolved = plan.resolve(None, validate=False)
        else:
            arrays, rebuild = wrapping.split_static(args, kwargs)
            key = _cache_key(arrays, rebuild)
            resolved = resolved_cache.get(key) if key is not None else None
            if resolved is None:
                markers = {k: wrapping.Marker(plan.label(k)) for k in plan.keys}
                with _intercepting(plan, markers, prevent_cse, methods, check=method is None):
                    emitted = wrapping.traced_names(
                        lambda *xs: fn(*rebuild(xs)[0], **rebuild(xs)[1]), arrays)
                resolved = plan.resolve(emitted, validate)
                if key is not None:
                    resolved_cache[key] = resolved
        with _intercepting(plan, resolved, prevent_cse, methods, check=method is None):
            return fn(*args, **kwargs)

    def init_with_output(self, rngs, *args, method=None, **kwargs):
        return run(lambda *a, **kw: base.init_with_output(self, *a, method=method, **kw),
                   method, (rngs, *args), kwargs)

    def apply(self, variables, *args, method=None, **kwargs):
        return run(lambda *a, **kw: base.apply(self, *a, method=method, **kw),
                   method, (variables, *args), kwargs)

    sub = type(base.__name__, (base,), {"init_with_output": init_with_output, "apply": apply,
                                        "__qualname__": base.__qualname__,
                                        "__module__": base.__module__})
    fields = {f: getattr(model, f) for f, spec in model.__dataclass_fields__.items()
              if spec.init and f != "parent"}
    return sub(**fields)


def _cache_key(arrays, rebuild):
    """Argument shapes, static arguments and active auto_tag contexts, or None if unhashable."""
    try:
        key = (tuple((a.shape, str(a.dtype)) for a in arrays),
               repr(rebuild([None] * len(arrays))), _TAGGING.get())
        hash(key)
        return key
    except TypeError:
        return None


@contextlib.contextmanager
def _intercepting(plan, policies: dict, prevent_cse: bool, methods, check: bool):
    """An interceptor that runs matching submodule calls as remat regions; on exit,
    if `check`, raises for plan keys that matched nothing."""
    matched, seen = set(), {}

    def interceptor(next_fun, args, kwargs, context):
        mod = context.module
        seen.setdefault(type(mod).__name__)
        if _entered(mod, plan) or context.method_name not in methods:
            return next_fun(*args, **kwargs)
        key = plan.match(mod)
        if key is None:
            return next_fun(*args, **kwargs)
        matched.add(key)
        if not plan.policy(key).remat:
            return next_fun(*args, **kwargs)
        return _region(mod, context.method_name, policies[key], prevent_cse, args, kwargs,
                       plan)

    with nn.intercept_methods(interceptor):
        yield
    if check:
        plan.check_matched(matched, seen)


def tags(model: nn.Module, *args, variables=None, rngs=None, method=None,
         **kwargs) -> dict[str, jax.core.ShapedArray]:
    """The tags `model` emits with `auto_tag` applied: {name: ShapedArray(shape, dtype)}.

    Traces `model.apply(variables, *args, **kwargs)` (or `model.init` when
    `variables` is None) with `jax.make_jaxpr`: no FLOPs, and args may be
    `jax.ShapeDtypeStruct`s. Lists auto tags (module paths, e.g.
    `Block_0/attn/query`) and tags the model applies itself (`rk.tag`), in
    call order, each once with its first shape.

    Args:
      rngs: rng streams for `init`/`apply`; default a key for "params" and
        "dropout" (init) or for "dropout" (apply).
    Raises:
      TypeError: `model` is not a linen Module instance.
    """
    if not isinstance(model, nn.Module) or isinstance(model, type):
        raise TypeError(f"rk.linen.tags takes a flax.linen.Module instance, got {model!r}")
    arrays, rebuild = wrapping.split_static((variables, *args), kwargs)
    streams = ("dropout",) if variables is not None else ("params", "dropout")
    rngs = rngs if rngs is not None else {s: jax.random.key(0) for s in streams}

    def run(*xs):
        (v, *a), kw = rebuild(xs)
        if v is None:
            return model.init_with_output(rngs, *a, method=method, **kw)
        return model.apply(v, *a, rngs=rngs, method=method, **kw)

    with auto_tag():
        return emitted_tags(run, *arrays)


__all__ = ["AUTO_TAG_CLASSES", "apply_remat", "auto_tag", "path_name", "remat", "tags"]
