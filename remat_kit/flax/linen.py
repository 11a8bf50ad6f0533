"""Drop-in remat for flax.linen models: class form, instance form, auto-tagging.

    Block = rk.linen.remat(Block, "selective")                 # class form
    model = rk.linen.apply_remat(model, {"Block": "full"})     # instance form, source untouched

`auto_tag` (from `linen_tags`) names module outputs by path. Parameters keep their structure
and names under every form: a checkpoint of the unwrapped model applies unchanged.
The forms, role presets and their notes: docs/wrappers.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence

import flax
import flax.core.lift
import flax.linen as nn
import jax

from remat_kit.errors import UnknownModuleError
from remat_kit.trace import call_region, wrapping
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parse
from remat_kit.trace.validate import emitted_tags
from remat_kit.flax.linen_tags import (AUTO_TAG_CLASSES, auto_tag, path_name, prefixed, tagging,
                                       tags)

# (class, path, method) of the call a remat region is re-entering, so the wrappers let that
# one call through. Not the module object: an nn.jit method re-enters on a clone.
_ENTERED: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_entered",
                                                          default=None)


def _call_id(module: nn.Module, method: str) -> tuple:
    return type(module), module.path, method


@contextlib.contextmanager
def _passing(module: nn.Module, method: str, owner):
    """True inside if this call is the one a region made by `owner` (an
    apply_remat plan, a class form) re-enters, so `owner` lets it through; a
    wrapper whose region this is not (a second apply_remat) nests its own."""
    entry = _ENTERED.get()
    yield entry is not None and entry[0] == _call_id(module, method) and \
        any(o is owner for o in entry[1])
def _region(module: nn.Module, method: str, jax_policy, prevent_cse: bool, args, kwargs,
            owner, cls: type | None = None):
    """Runs `module.method(*args, **kwargs)` as one lifted `nn.remat` region made by
    `owner`, inside the regions other owners made for this call, if any.

    Array arguments are traced; everything else (flags, None) is closed over,
    so `deterministic=True` stays a Python bool inside the region. Under a
    `RoleCall` the region's values are tagged with their roles (`_role_checkpoint`;
    `cls`, default the module's class, names it).
    """
    entry, call = _ENTERED.get(), _call_id(module, method)
    owners = (*entry[1], owner) if entry is not None and entry[0] == call else (owner,)
    arrays, rebuild = wrapping.split_static(args, kwargs)
    output = {}  # the output's non-array structure, filled while tracing

    def body(mdl, *xs):
        a, kw = rebuild(xs)
        token = _ENTERED.set((_call_id(mdl, method), owners))
        try:
            # An nn.jit method re-enters its own jit here: a key of its own, not recursion.
            with wrapping.keyed("region"):
                outs, output["rebuild"] = wrapping.split_output(getattr(mdl, method)(*a, **kw))
            return outs
        finally:
            _ENTERED.reset(token)

    if isinstance(jax_policy, wrapping.RoleCall) and module.is_initializing():
        jax_policy = jax_policy.policy.to_jax()  # parameters made inside have no roles
    if isinstance(jax_policy, wrapping.RoleCall):
        # Path tags differ per layer; the program does only where a pattern names a path.
        paths = any("/" in p for p in jax_policy.policy.patterns())
        key = call_region.key_of(cls or type(module), module.path if paths else None, method,
                                 jax_policy, tuple(init_fields(module, "parent", "name").items()),
                                 repr(rebuild([None] * len(arrays))))
        outs = nn.transforms.lift_transform(
            _role_checkpoint, body, jax_policy, key,
            f"rk.linen ({(cls or type(module)).__name__})", output)(module, *arrays)
    else:
        outs = nn.remat(body, policy=jax_policy, prevent_cse=prevent_cse)(module, *arrays)
    return output["rebuild"](outs)


# {(class, path, method, fields, RoleCall, argument structure and shapes): run} of the
# role-tagged regions traced so far.
_ROLE_RUNS: dict = {}


def _is_param(path) -> bool:
    """Whether a key path into pack's (variable groups, rng groups, args) is a parameter:
    group, scope, then the collection name."""
    return len(path) > 3 and path[0].idx == 0 and getattr(path[3], "key", None) == "params"


def _role_checkpoint(fn, call, key, where: str, output: dict):
    """flax's lifted `checkpoint` (`flax.core.lift.checkpoint`) with the region made
    by `call_region.build` in place of `jax.checkpoint`: the region's variables
    (parameters first), RNG streams and arrays go in, so dropout masks and mutable
    collections are the plain model's, and its values carry their dataflow roles and
    path tags (`auto_tag()`, as compare's program has them) under `call.policy`.
    Traced once per `key` (None: at each call) and argument structure; `output` (filled by `fn` while it
    is traced) is kept with the program and restored when a kept one runs."""
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
        # pack's groups: one tuple per filter of one dict per scope, {collection: tree}
        paths, tree = jax.tree_util.tree_flatten_with_path((variable_groups, rng_groups, args))
        order = sorted(range(len(paths)), key=lambda i: not _is_param(paths[i][0]))
        leaves = [paths[i][1] for i in order]

        def block(*xs):
            flat = [None] * len(xs)
            for i, x in zip(order, xs):
                flat[i] = x
            groups, rngs, a = jax.tree.unflatten(tree, flat)
            scope = scope_fn(groups, rngs)
            with contextlib.ExitStack() as stack:
                if "every module" not in tagging():
                    stack.enter_context(auto_tag())
                y = fn(scope, *a)
            return y, repack_fn(scope)

        full = key and call_region.key_of(*key, tree, tuple((x.shape, str(x.dtype))
                                                             for x in leaves))

        def make():
            made = call_region.build(block, leaves, sum(_is_param(p) for p, _ in paths), call,
                                     where)
            return made, dict(output)

        region, traced = call_region.once(_ROLE_RUNS, full, make)
        region.warn()
        output.update(traced)
        return region.run(*leaves)

    return flax.core.lift.pack(inner, (True,), (True,), (True,), name="remat")


def remat(cls: type, policy: "str | Policy", *, static_argnums: int | Sequence[int] = (),
          prevent_cse: bool = True, validate: bool = False,
          methods: Sequence[str] | None = None) -> type:
    """`nn.remat(cls)` under a remat_kit policy: a class with `cls`'s constructor.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, remat_kit as rk
    >>> Dense = rk.linen.remat(nn.Dense, "full")  # nn.remat(nn.Dense, policy=...)
    >>> jax.tree.map(jnp.shape, jax.eval_shape(Dense(8).init, jax.random.key(0), jnp.ones((4, 8))))
    {'params': {'bias': (8,), 'kernel': (8, 8)}}

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
      Without `validate`, globs and canonical tags (`minimal`'s query_proj,
      ...) it is flax's `nn.remat(cls, policy=...)` with a JAX built-in
      policy. With any, each call first traces the module alone for the
      names it emits, so globs (`save:*/attn/*`) become a built-in over those
      names and canonical tags the module does not emit warn (path tags are
      not roles: `rk.remat_model` tags roles), and then runs as one lifted
      remat region, as `apply_remat` does: array arguments are traced, all
      others static.
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
    policy = wrapping.module_policy(parse(policy))  # the public entry: parsed once, here
    if not policy.remat:
        return cls
    if not (validate or wrapping.needs_names(policy) or wrapping.names_roles(policy)):
        return nn.remat(cls, policy=policy.to_jax(), static_argnums=static_argnums,
                        prevent_cse=prevent_cse, methods=list(methods))

    def wrap(name):
        def method(self, *args, **kwargs):
            with _passing(self, name, traced) as inside:  # the region's own call of this method
                if inside:
                    return getattr(super(traced, self), name)(*args, **kwargs)
            emitted = _emitted_alone(cls, self, name, args, kwargs)
            jax_policy = wrapping.resolve(
                policy, emitted, validate, where="rk.linen.remat",
                checked=f"{cls.__name__} at {'/'.join(self.path) or 'root'}")
            return _region(self, name, jax_policy, prevent_cse, args, kwargs, traced, cls)
        return method

    traced = type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__,
                                         "__module__": cls.__module__,
                                         **{name: wrap(name) for name in methods}})
    return traced


def _emitted_alone(cls: type, module: nn.Module, method: str, args, kwargs) -> tuple[str, ...]:
    """The tags `module.method(*args, **kwargs)` emits, traced on an unbound copy of
    class `cls` (auto tags named by `module`'s path)."""
    alone = cls(**init_fields(module, "parent", "name"), parent=None)
    arrays, rebuild = wrapping.split_static(args, kwargs)
    rngs = {name: jax.random.key(0) for name in ("params", *module.scope.rngs)}

    def run(*xs):
        a, kw = rebuild(xs)
        return alone.init_with_output(rngs, *a, method=method, **kw)

    with prefixed(module.path):
        return tuple(emitted_tags(run, *arrays))


def init_fields(module: nn.Module, *skip: str) -> dict:
    """The constructor arguments of `module`: its init fields (not ClassVars, not
    `init=False` fields) other than `skip`, with their values."""
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.init and f.name not in skip}


def _loaded_classes() -> set[type]:
    """Every linen Module subclass Python has loaded (flax's own included)."""
    found, todo = set(), [nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _check_class_names(plan: wrapping.Plan, base: type) -> None:
    """UnknownModuleError, at the call, for a mapping key naming no linen Module class
    loaded at all: it can match no submodule, so it would fail at the first call. The
    choices are the classes of the model's own module (else every class outside flax)."""
    loaded = _loaded_classes()
    names = {c.__name__ for c in loaded}
    for key in plan.keys:
        if isinstance(key, str) and key not in names:
            own = {c.__name__ for c in loaded if c.__module__ == base.__module__}
            raise UnknownModuleError(key, sorted(own or {
                c.__name__ for c in loaded if not c.__module__.startswith("flax.")}),
                message="rk.linen.apply_remat: no linen Module class of this name is "
                        "loaded, so it matches no submodule (valid choices: the classes of "
                        "the model's module)")


def apply_remat(model: nn.Module, mapping, *, prevent_cse: bool = True,
                validate: bool = False, methods: Sequence[str] = ("__call__",)) -> nn.Module:
    """Runs every submodule whose class matches under that class's policy, without
    editing the model's source.
    A remat the model itself runs around a matched block (`nn.remat(Block)`, `nnx.remat`
    around a scanned call) is not taken over: it stays around the policy's region
    (docs/wrappers.md); `rk.remat_model` takes it over.

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
      call are traced; other arguments (flags) stay static. Calls inside
      `nn.jit` methods are matched too: the wrapper's state is part of the
      jit cache key, so a body traced before wrapping is traced again.
    Raises:
      TypeError: `model` is not a linen Module instance, a mapping key is
        neither a class name nor a Module class, or `prevent_cse` /
        `validate` is not a bool.
      ValueError: `methods` is empty.
      RematSpecError: a policy spec does not parse.
      UnknownModuleError: here, a key naming no linen Module class loaded (the
        closest class of the model's module named); on a call of `__call__`, a
        key matched no submodule; lists the classes the model calls and the
        closest name.
      UnknownTagError: `validate` and a policy names a tag its submodules
        never emit.
    """
    if not isinstance(model, nn.Module) or isinstance(model, type):
        raise TypeError(f"rk.linen.apply_remat takes a flax.linen.Module instance, got "
                        f"{model!r}; for a class use rk.linen.remat(cls, policy)")
    wrapping.Plan.check(mapping, nn.Module, "rk.linen.apply_remat")
    plan = wrapping.Plan.of({key: parse(p) for key, p in mapping.items()})  # once, here
    _check_class_names(plan, type(model))
    methods = wrapping.options("rk.linen.apply_remat", prevent_cse, validate, methods)
    base = type(model)
    resolved_cache: dict = {}

    def run(fn, method, args, kwargs):
        """fn(*args, **kwargs) with matching submodules rematerialized."""
        part = ("linen.apply_remat", plan, prevent_cse, methods, validate)
        resolved, key = _resolved(plan, fn, args, kwargs, validate, prevent_cse, methods,
                                  method is None, part, resolved_cache)
        with intercepting(plan, resolved, prevent_cse, methods, check=method is None,
                           part=(*part, key)):
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
    return sub(**init_fields(model, "parent"))


def _resolved(plan, fn, args, kwargs, validate: bool, prevent_cse: bool, methods,
              check: bool, part: tuple, cache: dict) -> tuple[dict, tuple | None]:
    """(apply_remat's {plan key: JAX policy} for a call fn(*args, **kwargs), its cache key).

    Policies that name tags by glob or check them (`validate`) need the names the model
    emits: one trace with markers in the matched regions, kept in `cache` per argument
    signature (`call_cache_key`; None where unhashable, traced at each call).
    """
    if not plan.needs_trace(validate):
        return plan.resolve(None, validate=False), ()
    arrays, rebuild = wrapping.split_static(args, kwargs)
    key = call_cache_key(arrays, rebuild)
    resolved = cache.get(key) if key is not None else None
    if resolved is None:
        markers = {k: wrapping.Marker(plan.label(k)) for k in plan.keys}
        with intercepting(plan, markers, prevent_cse, methods, check=check,
                           part=(*part, "markers", key)):
            emitted = wrapping.traced_names(
                lambda *xs: fn(*rebuild(xs)[0], **rebuild(xs)[1]), arrays)
        resolved = plan.resolve(emitted, validate, where="rk.linen.apply_remat")
        if key is not None:
            cache[key] = resolved
    return resolved, key


def call_cache_key(arrays, rebuild):
    """Argument shapes, static arguments and active auto_tag contexts, or None if unhashable."""
    try:
        key = (tuple((a.shape, str(a.dtype)) for a in arrays),
               repr(rebuild([None] * len(arrays))), tagging())
        hash(key)
        return key
    except TypeError:
        return None


# {jit cache key: (plan keys matched, classes seen)} of `intercepting` traces. Under
# `nn.jit` a cached trace runs no interceptor, so a call at a key traced before takes
# what that trace saw.
_MATCHED: dict = {}


@contextlib.contextmanager
def intercepting(plan, policies: dict, prevent_cse: bool, methods, check: bool,
                  part=None):
    """An interceptor that runs matching submodule calls as remat regions; on exit,
    if `check`, raises for plan keys that matched nothing.

    `part` (hashable, or holding None for arguments that are not; default the
    plan and its policies) goes into the jit cache key, so nn.jit bodies are
    traced with these regions, not reused from a trace without them.
    """
    if part is None:
        part = ("linen.intercepting", plan, prevent_cse, tuple(methods),
                tuple(policies[k] for k in plan.keys))
    try:
        hash(part)
    except TypeError:
        part = (None,)
    matched, seen = set(), {}

    def interceptor(next_fun, args, kwargs, context):
        mod = context.module
        seen.setdefault(type(mod).__name__)
        if context.method_name not in methods:
            return next_fun(*args, **kwargs)
        with _passing(mod, context.method_name, plan) as inside:
            if inside:
                return next_fun(*args, **kwargs)
        key = plan.match(mod)
        if key is None:
            return next_fun(*args, **kwargs)
        matched.add(key)
        if not plan.policy(key).remat:
            return next_fun(*args, **kwargs)
        return _region(mod, context.method_name, policies[key], prevent_cse, args, kwargs,
                       plan)

    fresh = None in part  # unhashable arguments: a key of its own, never reused
    with wrapping.keyed(object() if fresh else part), nn.intercept_methods(interceptor):
        jit_key = wrapping.trace_key()
        yield
    if not fresh:
        before_matched, before_seen = _MATCHED.setdefault(jit_key, (set(), {}))
        before_matched |= matched
        before_seen.update(seen)
        matched, seen = before_matched, before_seen
    if check:
        plan.check_matched(matched, seen)


__all__ = ["AUTO_TAG_CLASSES", "apply_remat", "auto_tag", "call_cache_key", "init_fields",
           "intercepting", "path_name", "remat", "tags"]
