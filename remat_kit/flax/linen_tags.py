"""Auto-tagging for flax.linen models: every submodule call's outputs named by module path.

    with rk.linen.auto_tag():                  # name Dense/LayerNorm/... outputs by path
        loss = ...model.apply(...)
    rk.linen.tags(model, x)                    # {path tag: ShapedArray} the model emits

Path-glob specs select these names (`save:*/attn/query;recompute:*`). Docs: docs/wrappers.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import flax.linen as nn
import jax

from remat_kit.trace import wrapping
from remat_kit.trace.validate import emitted_tags

# Standard flax layers: `auto_tag(AUTO_TAG_CLASSES)` names only their outputs.
AUTO_TAG_CLASSES: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv, nn.LayerNorm, nn.RMSNorm,
    nn.MultiHeadDotProductAttention)

# Path of the module being traced on its own (class-form validation), prefixed to auto tags.
_PREFIX: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_prefix", default=())
# The class tuples of the active auto_tag contexts: the names a model emits depend on them.
_TAGGING: contextvars.ContextVar = contextvars.ContextVar("remat_kit_linen_tagging", default=())


def path_name(module: nn.Module) -> str:
    """The tag name of `module`'s outputs: '/'.join of its path from the model root,
    e.g. 'Block_3/attn/query'. A module sharing its parent's scope (`nn.share_scope`,
    so the same path) adds its own name: 'Block_3/attn/inner'."""
    path = (*_PREFIX.get(), *module.path)
    if module.name is not None and module.path and module.path[-1] != module.name:
        path = (*path, module.name)
    return "/".join(path)


def tagging() -> tuple:
    """The class tuples (or "every module") of the active `auto_tag` contexts, outermost
    first; () outside any. The names a model emits depend on them."""
    return _TAGGING.get()


@contextlib.contextmanager
def prefixed(path: tuple[str, ...]):
    """Inside, `path_name` puts `path` before a module's own path: a module traced on its
    own (class-form validation) is named as it is in the whole model."""
    token = _PREFIX.set(path)
    try:
        yield
    finally:
        _PREFIX.reset(token)


@contextlib.contextmanager
def auto_tag(classes: "Sequence[type] | type | None" = None):
    """Names the outputs of every submodule call by module path, for any linen model.

    Inside the context the `__call__` of every submodule (or, with `classes`,
    only of modules of those classes, e.g. `AUTO_TAG_CLASSES`) returns its
    outputs wrapped in `checkpoint_name(out, name)`, with `name` from
    `path_name`: `Block_3/attn/query` (a Dense inside the attention of Block_3),
    `Block_3/attn` (the attention output), `Block_3` (the block output). The
    model root's own output is not tagged. Specs then select by path glob:
    `save:*/attn/query,*/attn/key;recompute:*`. Shapes and dtypes are unchanged.

    Names:
      * a call returning several arrays (tuple, dict, dataclass, flax struct)
        names the first `name` and each other `name.` + its key path, e.g.
        `Block_0/attn` and `Block_0/attn.1` for `(out, weights)`,
        `Block_0/attn.cache` for a dict entry `cache`; None, ints and other
        non-array leaves pass through;
      * two modules on one scope (`nn.share_scope`): the one whose name is not
        the scope's last path part appends its name (`Block_0/attn/inner`);
      * a module whose `__call__` is `nn.jit`-ed is traced per path inside the
        context, so identical layers keep their own names (`_key_jit_by_path`).

    Based on `flax.linen.intercept_methods`; enter it around `init`/`apply`
    (or around `jax.jit` tracing of a function that calls them). The context
    is part of every jit cache key, so traces made outside it (nn.jit bodies,
    a model applied before) are not reused.

    Raises (on entering the context):
      TypeError: `classes` is a string or holds something that is not a
        `flax.linen.Module` subclass (an NNX class, a name, an instance).
      ValueError: `classes` is empty.
    """
    if classes is not None:
        classes = wrapping.module_classes(classes, nn.Module, "rk.linen.auto_tag")

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        mod = context.module
        if context.method_name == "__call__" and (classes is None or isinstance(mod, classes)):
            name = path_name(mod)
            if name:  # the root's output is the model's, not a submodule's
                out = wrapping.tag_output(out, name)
        return out

    state = "every module" if classes is None else classes
    _key_jit_by_path()
    token = _TAGGING.set((*_TAGGING.get(), state))
    try:
        with wrapping.keyed(("linen.auto_tag", state)), nn.intercept_methods(interceptor):
            yield
    finally:
        _TAGGING.reset(token)


def _key_jit_by_path() -> None:
    """Makes `nn.jit` trace per module path while an `auto_tag` context is active.

    nn.jit caches a trace by a fingerprint of the module's fields, not its path,
    so identical layers share one trace and the tags inside would carry the first
    layer's path. flax 0.12 computes that fingerprint in the private
    `flax.linen.transforms._HashableProxy.from_module`; it is wrapped (once) to
    add `path_name` inside auto_tag. Where it does not exist, layers share names.
    """
    proxy = getattr(nn.transforms, "_HashableProxy", None)
    if proxy is None or getattr(proxy.from_module, "_remat_kit", False):
        return
    original = proxy.from_module.__func__

    def from_module(cls, module):
        out = original(cls, module)
        if _TAGGING.get():
            out = cls(out.module_ref, hash((out.hash_key, path_name(module))))
        return out

    from_module._remat_kit = True
    proxy.from_module = classmethod(from_module)


def tags(model: nn.Module, *args, variables=None, rngs=None, method=None, classes=None,
         **kwargs) -> dict[str, jax.core.ShapedArray]:
    """The tags `model` emits with `auto_tag` applied: {name: ShapedArray(shape, dtype)}.

    Traces `model.apply(variables, *args, **kwargs)` (or `model.init` when
    `variables` is None) with `jax.make_jaxpr`: no FLOPs, and args may be
    `jax.ShapeDtypeStruct`s. Lists auto tags (module paths, e.g.
    `Block_0/attn/query`; names as `auto_tag` gives them) and tags the model
    applies itself (`rk.tag`), in call order, each once with its first shape.

    Args:
      rngs: rng streams for `init`/`apply`; default a key for "params" and
        "dropout" (init) or for "dropout" (apply).
      classes: as in `auto_tag`: None tags every submodule call.
    Raises:
      TypeError: `model` is not a linen Module instance, or bad `classes`.
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

    with auto_tag(classes):
        return emitted_tags(run, *arrays)


__all__ = ["AUTO_TAG_CLASSES", "auto_tag", "path_name", "prefixed", "tagging", "tags"]
