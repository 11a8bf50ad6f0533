"""What the linen and NNX wrappers share: matching submodules to policies by class,
splitting call arguments into traced arrays and static values, and turning a
`Policy` into JAX's policy with the names a region really emits.
Docs: docs/wrappers.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping

import flax.linen as nn
import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from remat_kit.policy import names
from remat_kit.errors import RematSpecError, UnknownModuleError
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parsed_only
from remat_kit.trace.validate import check_names, policy_notes, tag_of


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


# A value in every `jax.jit` cache key (JAX's user context), nn.jit and nnx.jit bodies
# included: (what the active wrappers do, the module path being called). A model traced
# before wrapping, or under other policies or at another path, is then traced anew instead
# of reusing a jaxpr made without our tags and regions.
_TRACE_KEY = jax.make_user_context(((), ""))


@contextlib.contextmanager
def keyed(part):
    """Adds the hashable `part` (a wrapper's state) to the jit cache key inside the block."""
    parts, path = _TRACE_KEY.value
    with _TRACE_KEY(((*parts, part), path)):
        yield


@contextlib.contextmanager
def at_path(name: str):
    """Sets the module path of the jit cache key inside the block: a jitted submodule
    names its tags by path, so two layers must not share one trace."""
    parts, _ = _TRACE_KEY.value
    with _TRACE_KEY((parts, name)):
        yield


def trace_key():
    """The current jit cache key (`keyed`, `at_path`): hashable."""
    return _TRACE_KEY.value


def _plain_dataclass(x) -> bool:
    """A dataclass instance JAX treats as a leaf (not registered as a pytree); linen
    modules are dataclasses too, but never outputs to look into."""
    return (dataclasses.is_dataclass(x) and not isinstance(x, (type, nn.Module))
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x)))


def map_leaves(fn, tree, is_value=is_array, path=()):
    """`tree` with every leaf `is_value` accepts replaced by `fn(key_path, leaf)`.

    Walks pytrees and also plain (unregistered) dataclasses, which JAX sees as
    leaves, so a block returning `@dataclasses.dataclass` outputs has its arrays
    found; every other leaf (None, ints, strings) is kept as it is.
    """
    if is_value(tree):
        return fn(path, tree)
    if _plain_dataclass(tree):
        new = copy.copy(tree)
        for f in dataclasses.fields(tree):
            object.__setattr__(new, f.name, map_leaves(
                fn, getattr(tree, f.name), is_value, (*path, jax.tree_util.GetAttrKey(f.name))))
        return new
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree and _plain_dataclass(x))
    if jax.tree_util.treedef_is_leaf(treedef):
        return tree
    return treedef.unflatten([map_leaves(fn, leaf, is_value, (*path, *kp))
                              for kp, leaf in leaves])


def _key_text(key) -> str:
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tag_output(out, name: str):
    """`out` with its arrays named for remat policies (`checkpoint_name`) after `name`.

    One array: `name`. Several (a tuple, dict, dataclass or flax struct output):
    the first keeps `name`, each other gets `name.` plus its key path joined by
    dots, e.g. `Block_0/attn` and `Block_0/attn.1` for `(out, weights)`, or
    `Block_0/attn.cache.k` for a dict `{"out": ..., "cache": {"k": ...}}`.
    Non-array leaves pass through.
    """
    found = []
    map_leaves(lambda kp, v: found.append(kp), out)
    names = {kp: name if i == 0 else name + "." + ".".join(map(_key_text, kp))
             for i, kp in enumerate(found)}
    return map_leaves(lambda kp, v: checkpoint_name(v, names[kp]), out)


class _Slot:
    """Placeholder for an array in an output skeleton (`split_output`)."""

    def __init__(self, index: int):
        self.index = index


def split_output(out):
    """(arrays, rebuild): the arrays of a method's output and a function that puts
    new arrays back into its structure.

    A remat region may only return arrays; flags, None, strings and plain
    dataclasses around them stay Python values outside it.
    """
    arrays = []

    def take(_, v):
        arrays.append(v)
        return _Slot(len(arrays) - 1)

    skeleton = map_leaves(take, out)

    def rebuild(new):
        return map_leaves(lambda _, s: new[s.index], skeleton,
                          is_value=lambda x: isinstance(x, _Slot))

    return tuple(arrays), rebuild


def split_static(args: tuple, kwargs: dict):
    """(arrays, rebuild): the array leaves of (args, kwargs) and a function that
    puts new leaves back, keeping every other leaf (flags, None, strings) static.

    Remat regions trace their array inputs; a Python bool such as
    `deterministic` must stay a Python value, so it is closed over instead.
    """
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if is_array(x)]

    def rebuild(arrays):
        out = list(leaves)
        for i, x in zip(dynamic, arrays):
            out[i] = x
        return jax.tree.unflatten(tree, out)

    return tuple(leaves[i] for i in dynamic), rebuild


def module_classes(classes, module_base: type, where: str) -> tuple[type, ...]:
    """Checks the `classes` of an `auto_tag`: one `module_base` subclass or a
    non-empty sequence of them; returns them as a tuple.

    Raises:
      TypeError: a string, a non-sequence, or an entry that is not a
        `module_base` subclass (named with its index).
      ValueError: an empty sequence, which would tag nothing.
    """
    base = f"{module_base.__module__}.{module_base.__name__}"
    if isinstance(classes, type):
        classes = (classes,)
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        raise TypeError(f"{where}: classes must be {base} subclasses (a class or a tuple of "
                        f"them), got {classes!r}")
    classes = tuple(classes)
    if not classes:
        raise ValueError(f"{where}: classes is empty, so nothing would be tagged; give "
                         f"{base} subclasses, e.g. the default AUTO_TAG_CLASSES")
    for i, c in enumerate(classes):
        if not (isinstance(c, type) and issubclass(c, module_base)):
            raise TypeError(f"{where}: classes[{i}] is {c!r}, not a {base} subclass")
    return classes


def options(where: str, prevent_cse, validate, methods, cls: type | None = None,
            module_base: type | None = None) -> tuple[str, ...]:
    """Checks the options every wrapper takes; returns `methods` as a tuple of names.

    Args:
      methods: a method name or a sequence of them; None means ("__call__",).
      cls, module_base: for the class forms, the class whose methods are
        wrapped and the Module base whose own methods are not listed.
    Raises:
      TypeError: `prevent_cse` or `validate` not a bool, or a method name
        not a string.
      ValueError: no method names, or a name `cls` does not define (the
        message lists the methods it defines).
    """
    for name, value in (("prevent_cse", prevent_cse), ("validate", validate)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {value!r}")
    if methods is None:
        methods = ("__call__",)
    if isinstance(methods, str) or not isinstance(methods, Iterable):
        methods = (methods,)
    methods = tuple(methods)
    if not methods:
        raise ValueError(f"{where}: methods is empty; give the names of the methods to "
                         "rematerialize, e.g. ('__call__',)")
    for m in methods:
        if not isinstance(m, str):
            raise TypeError(f"{where}: a method name must be a string, got {m!r}")
        if cls is not None and not callable(getattr(cls, m, None)):
            own = sorted({n for c in cls.__mro__[:cls.__mro__.index(module_base)]
                          for n, v in vars(c).items() if callable(v)
                          and (n == "__call__" or not n.startswith("_"))})
            raise ValueError(f"{where}: {cls.__name__} has no method {m!r}; methods it "
                             f"defines: {', '.join(own) or 'none'}")
    return methods


def static_positions(value, where: str, minimum: int | None = None) -> tuple[int, ...]:
    """`static_argnums` (an int or ints, each >= `minimum` if given) as a tuple.

    Raises:
      TypeError: not an int or a sequence of ints.
      ValueError: an int below `minimum` (linen counts `self` as 0, so its
        minimum is 1: flax shifts every position down by one, and 0 would
        silently mark the last argument static).
    """
    nums = (value,) if isinstance(value, int) else value
    if (isinstance(nums, (str, bytes)) or not isinstance(nums, Iterable)
            or any(isinstance(n, bool) or not isinstance(n, int) for n in nums)):
        raise TypeError(f"{where}: static_argnums must be an int or a tuple of ints, "
                        f"got {value!r}")
    nums = tuple(nums)
    if minimum is not None and any(n < minimum for n in nums):
        raise ValueError(f"{where}: static_argnums {value!r}: positions count self as 0 "
                         f"(flax's convention), so the first argument after self is "
                         f"{minimum}")
    return nums


def needs_names(policy: Policy) -> bool:
    """Whether the policy has globs, which JAX's built-in policies can only express
    once the names the region emits are known (`save:*/attn/*` -> those names)."""
    return policy.remat and any(names.is_glob(p) for p in policy.patterns())


def role_names(policy: Policy) -> frozenset[str]:
    """The canonical tags the policy names (`query_proj`, `attn_probs`: MaxText's and
    Megatron's presets), saved, offloaded or recomputed; a model not ours emits them
    only once its dataflow roles are tagged (path tags are not roles)."""
    return frozenset(p for p in policy.patterns() if p in names.TAGS) if policy.remat \
        else frozenset()


def names_roles(policy: Policy) -> bool:
    """Whether the policy names a canonical tag (`role_names`)."""
    return bool(role_names(policy))


def to_jax(policy: Policy, emitted=(), where: str | None = None):
    """`policy.to_jax` over the vocabulary, the policy's literal names and `emitted`.

    where: a wrapper's name; then a policy whose names select nothing the region
    emits warns with the note `compare` gives (`validate.policy_notes`), never
    compiling as its base rule without a word.
    """
    if where is not None:
        for line in policy_notes(policy, tuple(emitted), ()):
            warnings.warn(f"{where}: {policy}: {line}", stacklevel=3)
    return policy.to_jax(tuple(dict.fromkeys((*policy.resolve(), *emitted))), emitted)


@dataclasses.dataclass(frozen=True)
class RoleCall:
    """What a wrapper runs a region under in place of a JAX policy where the policy
    names roles (`role_names`) the region does not emit: the call traced alone with
    its roles tagged (`remat_kit.trace.call_region`). `validate`: check the
    policy's names against the tagged region's (UnknownTagError), not warn."""

    policy: Policy
    validate: bool = False


def resolve(policy: Policy, emitted, validate: bool = False, where: str | None = None,
            checked: str | None = None):
    """A wrapper's policy for a region that emits `emitted`: a `RoleCall` where the
    policy names roles and the region emits none of them (a model that tags no
    roles itself), else its JAX policy (`to_jax`, warning as `where`).

    Raises:
      UnknownTagError: `validate` and (not a RoleCall) the policy names a tag the
        region never emits; `checked` names the region in the message.
    """
    emitted = tuple(emitted)
    wanted = role_names(policy)
    if wanted and not wanted & set(emitted):
        return RoleCall(policy, validate)
    if validate:
        check_names(policy, emitted, where=checked or where or "the region")
    return to_jax(policy, emitted, where=where)


@dataclasses.dataclass(frozen=True)
class Marker:
    """A stand-in policy (save nothing) that marks one remat region in a jaxpr, so the
    tags emitted inside it can be attributed to a mapping key (`region_tags`)."""

    key: str

    def __call__(self, prim, *avals, **params):
        return False


def region_tags(jaxpr) -> dict[str, set[str]]:
    """{marker key: tags emitted inside remat regions whose policy is that `Marker`}.

    Walks nested jaxprs under either remat mode (jax_remat3 stages remat as a
    hi-primitive whose params hold the policy and jaxpr). A tag inside nested
    regions counts for each of them.
    """
    found: dict[str, set[str]] = {}

    def walk(jx, keys):
        for eqn in jx.eqns:
            if (t := tag_of(eqn)) is not None:
                for k in keys:
                    found[k].add(t)
            prim = eqn.params.get("_prim")
            params = getattr(prim, "params", {}) if prim is not None else eqn.params
            inner = keys
            if isinstance(params.get("policy"), Marker):
                inner = keys + (params["policy"].key,)
                found.setdefault(params["policy"].key, set())
            for value in params.values():
                for sub in jaxprs_in(value):
                    walk(sub, inner)

    walk(jaxpr, ())
    return found


def jaxprs_in(value):
    """The jaxprs in one equation parameter `value` (a Jaxpr, a ClosedJaxpr's, or those
    of a tuple or list of them), outermost first."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from jaxprs_in(v)


def module_policy(policy: "Policy | AutoSpec") -> Policy:
    """`policy` (parsed where the user gave it: `rk.linen.remat`, `rk.nnx.apply_remat`,
    ...) checked for one module's region.

    Raises:
      TypeError: a spec string (parse it first).
      RematSpecError: an auto:budget= spec, or one with a layer schedule
        (`full@every:2`, `nested`): a schedule picks layers of a stack, which
        one wrapped module does not have (set it on the stack, e.g.
        `TransformerConfig.remat`, or map each layer class to its own policy).
    """
    [policy] = parsed_only([policy], "a wrapped module's policy")
    if isinstance(policy, AutoSpec):
        raise RematSpecError(
            "an auto:budget= spec is planned for a whole model's shapes; plan it first "
            "(remat_kit.decide.plan(loss_fn, *args, budget=...).policy) and wrap with that policy",
            token=str(policy))
    if policy.schedule.kind != "uniform":
        raise RematSpecError(
            "a layer schedule applies to a stack of layers, not to one wrapped module; wrap "
            "with the policy alone, or give the stack the schedule (TransformerConfig.remat)",
            token=str(policy))
    return policy


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mapping keys (class names or types) -> parsed policies, in the user's order."""

    keys: tuple
    policies: tuple[Policy, ...]

    @staticmethod
    def check(mapping, module_base: type, where: str) -> None:
        """Checks an `apply_remat` mapping {class name or type: policy spec or Policy},
        before its policies are parsed.

        Raises:
          TypeError: `mapping` is not a non-empty mapping, or a key is neither
            a string nor a subclass of `module_base`.
        """
        if not isinstance(mapping, Mapping) or not mapping:
            raise TypeError(f"{where} takes a non-empty mapping {{class name or type: policy}}, "
                            f"e.g. {{'Block': 'selective'}}; got {mapping!r}")
        for key in mapping:
            if not (isinstance(key, str) or (isinstance(key, type)
                                             and issubclass(key, module_base))):
                raise TypeError(f"{where}: mapping key {key!r} must be a class name or a "
                                f"{module_base.__module__}.{module_base.__name__} subclass")

    @classmethod
    def of(cls, policies: Mapping) -> "Plan":
        """The plan of a mapping {class name or type: parsed policy} (`check`ed), each
        policy checked by `module_policy`."""
        return cls(tuple(policies), tuple(module_policy(p) for p in policies.values()))

    @classmethod
    def marking(cls, classes) -> "Plan":
        """A plan of `classes` under full remat, for regions marked rather than run
        (`remat_kit.flax.from_model`: the markers stand in for its policies)."""
        keys = tuple(classes)
        return cls(keys, (Policy(),) * len(keys))

    def label(self, key) -> str:
        return key if isinstance(key, str) else key.__name__

    def match(self, module):
        """The key for `module`: the first class in its MRO named or given in the plan."""
        for c in type(module).__mro__:
            for key in self.keys:
                if key is c or key == c.__name__:
                    return key
        return None

    def policy(self, key) -> Policy:
        return self.policies[self.keys.index(key)]

    def check_matched(self, matched: set, seen: Mapping[str, None]) -> None:
        """Raises UnknownModuleError for a key no submodule matched, listing `seen` classes."""
        for key in self.keys:
            if key not in matched:
                raise UnknownModuleError(self.label(key), tuple(seen), message=(
                    "apply_remat: no submodule of the model is of this class (valid choices: "
                    "the classes present)"))

    def resolve(self, emitted: Mapping[str, set[str]] | None, validate: bool,
                where: str | None = None) -> dict:
        """{key: JAX policy}; with `emitted` (per key label) globs become concrete names.

        Raises:
          UnknownTagError: `validate` and a policy names a tag its region never emits.
        """
        return {key: resolve(policy, sorted((emitted or {}).get(self.label(key), ())),
                             validate, where, checked=f"{self.label(key)} (apply_remat)")
                for key, policy in zip(self.keys, self.policies)}

    def needs_trace(self, validate: bool) -> bool:
        return validate or any(needs_names(p) or names_roles(p) for p in self.policies)


def traced_names(fn: Callable, arrays) -> dict[str, set[str]]:
    """Traces `fn(*arrays)` (no FLOPs) and returns `region_tags` of its jaxpr."""
    return region_tags(jax.make_jaxpr(fn)(*arrays).jaxpr)
