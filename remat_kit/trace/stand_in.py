"""A stand-in for cuDNN fused attention, for tracing where the cuDNN call cannot be built.

Inside `cudnn_stand_in()`, `jax.nn.dot_product_attention(..., implementation="cudnn")` is answered
by a `jax.custom_vjp` with cuDNN's inputs, outputs and residuals (JAX's `fused_attention_stablehlo`,
through `_jax_private`), whose work is a few sums per element: for measuring, never for running.
Main names: `cudnn_stand_in`, `for_target`, `standing_in`.
Shapes, pricing and the notes: docs/targets.md ("cuDNN attention without a GPU").
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import batching, mlir

from remat_kit._jax_private import cudnn_version, has_nvidia_gpu, replacing_cudnn_attention

FWD = "cudnn_attention_fwd_stand_in"
BWD = "cudnn_attention_bwd_stand_in"


def _total(arrays) -> jax.Array:
    """One float32 scalar that reads every element of `arrays`."""
    return sum((jnp.sum(a.astype(jnp.float32)) for a in arrays), jnp.float32(0))


def _fwd_values(q, k, v, *extras, **_params):
    s = _total((k, v) + extras)
    out = (q.astype(jnp.float32) + s).astype(q.dtype)
    stats = jnp.swapaxes(jnp.sum(q.astype(jnp.float32), axis=-1), 1, 2) + s
    return out, stats


def _bwd_values(q, k, v, *rest, n_extras: int, **_params):
    extras, (stats, out, d_out) = rest[:n_extras], rest[n_extras:]
    s = _total((q, k, v, stats, out) + tuple(extras))
    d = d_out.astype(jnp.float32) + s
    grads = [d.astype(q.dtype), (k.astype(jnp.float32) + d.mean()).astype(k.dtype),
             (v.astype(jnp.float32) + d.mean()).astype(v.dtype)]
    return grads + [(e.astype(jnp.float32) + s).astype(e.dtype) for e in extras
                    if jnp.issubdtype(e.dtype, jnp.floating)]


def _primitive(name: str, values) -> jcore.Primitive:
    prim = jcore.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(lambda *xs, **params: values(*xs, **params))
    prim.def_abstract_eval(lambda *avals, **params: [
        jax.core.ShapedArray(o.shape, o.dtype) for o in jax.eval_shape(
            functools.partial(values, **params), *avals)])
    # Lowered out of line, as a function named `name` (a jit's `func.call @name`), so
    # that `kernels.has_kernels` finds it in the program's text.
    def lowered(*xs, **params):
        return values(*xs, **params)

    lowered.__name__ = lowered.__qualname__ = name
    mlir.register_lowering(prim, mlir.lower_fun(
        lambda *xs, **params: jax.jit(functools.partial(lowered, **params))(*xs),
        multiple_results=True))
    return prim


def _batch_rule(prim: jcore.Primitive):
    """`jax.vmap` of `prim`: the mapped axis folded into every operand's leading batch
    axis (an unmapped operand broadcast), so the kernel stays one call, priced at the
    folded batch."""
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        moved = [jnp.broadcast_to(a, (size,) + a.shape) if d is None
                 else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        outs = prim.bind(*[m.reshape((-1,) + m.shape[2:]) for m in moved], **params)
        return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)

    batching.primitive_batchers[prim] = rule


_fwd_p = _primitive(FWD, _fwd_values)
_bwd_p = _primitive(BWD, _bwd_values)
_batch_rule(_fwd_p)
_batch_rule(_bwd_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(params: tuple, q, k, v, extras: tuple):
    return tuple(_fwd_p.bind(q, k, v, *extras, **dict(params)))


def _attention_fwd(params, q, k, v, extras):
    out, stats = _fwd_p.bind(q, k, v, *extras, **dict(params))
    return (out, stats), (q, k, v, extras, stats, out)


def _attention_bwd(params, res, cotangents):
    q, k, v, extras, stats, out = res
    grads = iter(_bwd_p.bind(q, k, v, *extras, stats, out, cotangents[0],
                             n_extras=len(extras), **dict(params)))
    dq, dk, dv = next(grads), next(grads), next(grads)
    return dq, dk, dv, tuple(next(grads) if jnp.issubdtype(e.dtype, jnp.floating) else None
                             for e in extras)


_attention.defvjp(_attention_fwd, _attention_bwd)


# What JAX's cuDNN call accepts (jax._src.cudnn.fused_attention_stablehlo: check_layout,
# check_is_flash_attention), so that a model the GPU would refuse is refused here too: a
# query of float16 or bfloat16 (fp8 aside), a head dim a multiple of 8 and at most 256 (on
# Hopper: H100, H200; 128 before it).
CUDNN_DTYPES = ("float16", "bfloat16")
CUDNN_MAX_HEAD_DIM = 256


def _check_runs(query) -> None:
    """NotImplementedError, as JAX's cuDNN call raises it on a GPU, where `query` [b, s, h,
    d] is of a dtype or head dim that cuDNN's fused attention does not take."""
    dtype, head_dim = jnp.dtype(query.dtype), query.shape[-1]
    if dtype.name not in CUDNN_DTYPES:
        raise NotImplementedError(
            f"cuDNN attention takes a query of {' or '.join(CUDNN_DTYPES)}, got {dtype.name} "
            "(JAX's cuDNN call raises this on a GPU); cast q, k, v, or use "
            "implementation='xla'")
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        raise NotImplementedError(
            f"cuDNN attention takes a head dim that is a multiple of 8 and at most "
            f"{CUDNN_MAX_HEAD_DIM} (128 before Hopper), got {head_dim} (JAX's cuDNN call "
            "raises this on a GPU)")


def cudnn_attention(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None,
                    *, scale: float = 1.0, mask_type=None, sliding_window_length=None,
                    return_residual: bool = False, **_unused):
    """The stand-in, called as `jax.nn.dot_product_attention` calls jax's cuDNN
    `dot_product_attention` (module docstring): query [b, s_q, h, d] -> [b, s_q, h, d],
    and with return_residual the logsumexp [b, h, s_q] float32.

    Raises:
      NotImplementedError: a query dtype or head dim JAX's cuDNN call refuses on a GPU
        (`CUDNN_DTYPES`, `CUDNN_MAX_HEAD_DIM`)."""
    _check_runs(query)
    extras = tuple(x for x in (bias, mask, q_seqlen, kv_seqlen) if x is not None)
    params = (("mask_type", str(getattr(mask_type, "name", mask_type)).lower()),
              ("sliding_window_length", sliding_window_length), ("scale", float(scale)),
              ("variadic_args", (bias is not None or mask is not None, bias is not None)))
    out, stats = _attention(params, query, key, value, extras)
    return (out, stats) if return_residual else out


def cudnn_buildable(platform: str | None = None, aot: bool = False) -> bool:
    """Whether jax's cuDNN attention can be traced and compiled here for a target of
    `platform` ("cpu", "tpu", "gpu"; None: this machine's default backend): a GPU
    of this machine (not an ahead-of-time target, whose FLOPs come from a CPU
    compile), with the cuDNN library found."""
    platform = platform or jax.default_backend()
    return platform == "gpu" and not aot and has_nvidia_gpu() and cudnn_version() is not None


@contextlib.contextmanager
def cudnn_stand_in(active: bool | None = None):
    """A context in which `jax.nn.dot_product_attention(implementation="cudnn")` is
    traced as the stand-in (module docstring), for the whole process; restored on exit.

    Args:
      active: use the stand-in; None: where this machine cannot build the cuDNN call
        (`cudnn_buildable()` is False). False: leave JAX's call as it is.
    """
    if active is None:
        active = not cudnn_buildable()
    with (replacing_cudnn_attention(cudnn_attention) if active else contextlib.nullcontext()):
        yield


def standing_in(fn):
    """`fn`, run inside `cudnn_stand_in()` (a function that traces a user's model
    without a target: a workload's tags and blocks)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with cudnn_stand_in():
            return fn(*args, **kwargs)

    return wrapped


def for_target(target) -> contextlib.AbstractContextManager:
    """`cudnn_stand_in` where `target` (a `remat_kit.measure.targets.Target`, or
    anything with its `platform` and `aot`) cannot build the cuDNN call on this
    machine (`cudnn_buildable`)."""
    return cudnn_stand_in(not cudnn_buildable(getattr(target, "platform", None),
                                              bool(getattr(target, "aot", False))))


__all__ = ["BWD", "CUDNN_DTYPES", "CUDNN_MAX_HEAD_DIM", "FWD", "cudnn_attention", "cudnn_buildable", "cudnn_stand_in", "for_target",
           "standing_in"]
