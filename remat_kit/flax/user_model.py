"""The user's model for `--model FILE.py:FUNCTION` or `--model package.module:FUNCTION`.

FUNCTION returns a linen or NNX language model, `(model, batch[, loss])` for other inputs, or
takes (batch, seq) and returns a `Workload`; `load` gives the workload. Every failure (does not
import, wrong return type, no logits, no repeated block, a --block that matches nothing) is a
`ModelError` naming the value and what was expected, before anything compiles.
The forms: docs/models.md ("From the command line").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import linecache
import os
import re
import sys
from collections.abc import Callable

from remat_kit.errors import MeshError, RematSpecError
from remat_kit.flax import batch_model
from remat_kit.flax.from_model import OUR_LOSS, ModelError
from remat_kit.flax.from_model import workload as model_workload
from remat_kit.mesh import Fallback, spanning
from remat_kit.trace.workload import Workload

FORMS = "FILE.py:FUNCTION or package.module:FUNCTION"


class ExitCalled(SystemExit):
    """The user's code called os._exit while remat-kit ran it (`_no_exit`)."""


@contextlib.contextmanager
def _no_exit():
    """While the user's code runs, os._exit raises ExitCalled: os._exit(0) in a
    model file would end remat-kit at once, exit 0 and no report, which reads as
    success."""
    real = os._exit

    def refuse(code):
        raise ExitCalled(f"it called os._exit({code}), which would end remat-kit with no "
                         "report")
    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _module(path: str, spec: str):
    if path.endswith(".py") or os.sep in path:
        if not os.path.isfile(path):
            raise ModelError(f"--model {spec!r}: file {path!r} not found")
        name = "_remat_kit_model_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None:
            raise ModelError(f"--model {spec!r}: {path!r} is not a Python (.py) file")
        module = importlib.util.module_from_spec(module_spec)
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:
            # The file may import its neighbours; appended, as pytest's append import
            # mode does, so a file named like a package it imports (nano_moe.py doing
            # `from nano_moe.model import ...`) does not shadow that package.
            sys.path.append(folder)
        # Registered first: dataclasses and pickling look the module up by name.
        sys.modules[name] = module
        load = lambda: module_spec.loader.exec_module(module)  # noqa: E731
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = None
        load = lambda: importlib.import_module(path)  # noqa: E731
    try:
        with _no_exit():
            loaded = load()
    except SyntaxError as e:  # a file of random bytes has no line
        where = e.filename or path
        raise ModelError(f"--model {spec!r}: syntax error ({e.msg}) in {where}"
                         + (f" line {e.lineno}" if e.lineno else "")) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure of user code
        raise ModelError(f"--model {spec!r}: {path} does not import: {type(e).__name__}: "
                         f"{e}") from None
    return module if module is not None else loaded


def load(spec: str, block: str | None = None, vocab_chunks: int = 1,
         sizes: str = "--batch and --seq") -> tuple[str, Callable]:
    """(label, make) for a --model spec: make(batch, seq, mesh) -> Workload.

    Where FUNCTION returns a module, `make.model` is that module; where it
    returns (model, batch[, loss]), see `_batch_maker` for what make carries.
    vocab_chunks: the built loss over that many vocabulary slices
    (`from_model.next_token_loss`); a FUNCTION(batch, seq) builds its own loss,
    so it takes none. sizes: what the caller's user sets the batch and
    sequence length with, for the line of a model that fails at these shapes.

    Raises:
      ModelError: a malformed spec, a module that does not import, FUNCTION
        missing or not callable, taking other arguments, or returning
        neither a Flax module, (model, batch) nor (model, batch, loss) (one
        line naming the forms), nor (for (batch, seq)) a Workload; a batch
        leaf that is not an array, a batch that is not tokens without a
        loss; vocab_chunks other than 1 for a Workload function. Model
        problems show at the first make() (`remat_kit.flax.from_model.workload`,
        `remat_kit.flax.batch_model.workload`).
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ModelError(f"--model takes {FORMS}, got {spec!r}")
    module = _module(path, spec)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ModelError(f"--model {spec!r}: {path} has no {name!r}; its names: "
                         f"{', '.join(found) or 'none'}")
    if not callable(fn):
        raise ModelError(f"--model {spec!r}: {name} is a {type(fn).__name__}, not a function")
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    label = f"{os.path.basename(path)}:{name}"
    if len(params) == 2:
        if vocab_chunks != 1:
            raise ModelError(f"--vocab-chunks is for the loss remat-kit builds; --model "
                             f"{spec!r}: {name}(batch, seq) builds its own Workload and loss")
        return label, _function_maker(fn, spec, label)
    if params:
        raise ModelError(f"--model {spec!r}: {name} takes {len(params)} arguments; it must "
                         "take none (and return a linen or NNX model) or (batch, seq) (and "
                         "return a remat_kit.Workload)")
    try:
        with _no_exit():
            model = fn()
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ModelError(f"--model {spec!r}: {name}() raised {type(e).__name__}"
                         f"{_user_frame(e)}: {e}") from None
    if isinstance(model, tuple):
        return label, _batch_maker(model, spec, name, label, block, vocab_chunks, sizes)
    _check_module(model, spec, name)

    def make(batch: int, seq: int, mesh=None) -> Workload:
        return traced(spec, f"int32 tokens [{batch}, {seq}]", sizes, lambda: model_workload(
            model, batch, seq, block=block, name=label, mesh=mesh, vocab_chunks=vocab_chunks))

    make.model = model  # the module itself, for callers that train it (experiments.train)
    make.loss_words = OUR_LOSS
    return label, make


def check_axes(spec: str, make: Callable, *, seq=None, batch=None, vary=None) -> None:
    """ModelError, in one line, where a (model, batch) FUNCTION's batch (`make` of
    `load`) lacks the axis a flag sets: --seq or fit --vary seq without a sequence
    axis (images, latents), --batch or --vary batch where the leaves share no
    leading axis. Nothing for another FUNCTION."""
    declared = getattr(make, "batch", None)
    if declared is None:
        return
    shapes, sizes = batch_model.describe(declared), make.defaults
    if sizes["seq"] is None and (seq is not None or vary == "seq"):
        flag = "--vary seq" if vary == "seq" else f"--seq {seq}"
        raise ModelError(f"{flag}: the batch of --model {spec} has no sequence axis (no int "
                         f"leaf [batch, seq]; its leaves: {shapes}); "
                         + ("search the batch with --vary batch" if vary == "seq"
                            else "leave --seq out"))
    if sizes["batch"] is None and (vary == "batch" or batch is not None):
        flag = "--vary batch" if vary == "batch" else f"--batch {batch}"
        raise ModelError(f"{flag}: the leaves of the batch of --model {spec} share no "
                         f"leading (batch) axis ({shapes}), so it cannot be resized; make "
                         "every leaf [batch, ...]")


def own_tags(make: Callable, batch: int, seq: int) -> frozenset | None:
    """The `checkpoint_name`s the model of `make` (`load`) emits itself: its own forward
    on tokens [batch, seq] (or its FUNCTION's batch as declared) traced with no
    remat_kit tagging (no FLOPs run). None where `make` builds no Flax model (a Workload
    FUNCTION) or the plain forward does not trace: then whose names are whose is not
    known. Roles (query_proj, mlpwi, ...) that remat_kit infers exist only under
    `rk.remat_model`, not in this set."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat_kit.trace.validate import emitted_tags
    model = getattr(make, "model", None)
    if model is None:
        return None
    shaped = getattr(make, "batch", None)  # as declared: which names, not sizes, matter
    inputs = jax.ShapeDtypeStruct((batch, seq), jnp.int32) if shaped is None else shaped
    args, kwargs = batch_model.call_args(model, inputs)
    try:
        with _no_exit():
            if isinstance(model, nnx.Module):
                graphdef, state = nnx.split(model)
                return frozenset(emitted_tags(
                    lambda s: nnx.merge(graphdef, s)(*args, **kwargs), state))
            variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
            return frozenset(emitted_tags(lambda v: model.apply(v, *args, **kwargs), variables))
    except (Exception, ExitCalled):  # noqa: BLE001 - unknown, not a failure of the command
        return None


def traced(spec: str, inputs: str, sizes: str, build: Callable, loss: Callable | None = None):
    """`build()` (the model's workload, or a trace of the user's loss), with every
    failure a ModelError in one line: the one place that tells the user's code from
    remat_kit's. The model's own or its `loss`'s (it failed on `inputs`; other shapes are
    set with `sizes`), with the file and line of the user's frame, or remat_kit's, said
    to be a remat_kit bug."""
    try:
        with _no_exit():
            return build()
    except (ModelError, RematSpecError, MeshError) as e:  # MeshError: placing it
        raise ModelError(f"--model {spec!r}: {e}") from None
    except (Exception, ExitCalled) as e:  # noqa: BLE001 - the model failed to trace
        where = _our_frame(e)
        if where is not None:  # remat_kit's own fault: never the user's shapes
            raise ModelError(f"--model {spec!r}: remat_kit failed on this model at "
                             f"{where} ({type(e).__name__}: {e}); this is a remat_kit "
                             "bug, not a fault of the model or its input shapes: please "
                             "report it") from None
        who = (f"the loss {_name_of(loss)!r}" if _raised_in(e, loss)
               else "the model")
        raise ModelError(f"--model {spec!r}: {who} raised {type(e).__name__}"
                         f"{_user_frame(e)} on {inputs}: {_said(e)}; if it takes other shapes "
                         f"(e.g. fewer positions), give them with {sizes}") from None


# shard_map's refusal of an argument a mesh axis does not divide (jax 0.12's words).
_NOT_DIVIDED = re.compile(r"maps array axis (\d+) \(of size (\d+)\) to mesh axis '([^']+)' "
                          r"\(of size (\d+)\)")


def _said(e: BaseException) -> str:
    """`e`'s text; shard_map's many-line "not evenly divisible" text as one clause
    naming the sizes and the rule."""
    m = _NOT_DIVIDED.search(str(e)) if "not evenly divisible" in str(e) else None
    if m is None:
        return str(e)
    axis, size, mesh_axis, n = m.groups()
    return (f"its shard_map splits an argument's axis {axis} of size {size} over mesh axis "
            f"{mesh_axis!r} of size {n}, which does not divide it (each device takes an "
            f"equal share: a pipeline's stages must divide its stacked layers)")


def _batch_maker(got: tuple, spec: str, name: str, label: str, block, vocab_chunks: int,
                 sizes: str) -> Callable:
    """make(batch, seq, mesh) for a FUNCTION that returned (model, batch[, loss])
    (`batch_model.workload`), with `make.model`, `make.batch` (ShapeDtypeStructs),
    `make.values` (the batch as returned), `make.loss` and `make.defaults` ({"batch": its leading axis or None, "seq":
    its sequence length or None})."""
    import flax.linen as nn
    from flax import nnx

    if not (len(got) in (2, 3) and isinstance(got[0], (nn.Module, nnx.Module))
            and not isinstance(got[0], type) and (len(got) == 2 or callable(got[2]))):
        kinds = ", ".join(type(x).__name__ for x in got)
        raise ModelError(f"--model {spec!r}: {name}() must return {batch_model.FORMS}; it "
                         f"returned a tuple ({kinds})")
    model, batch, loss = (*got, None)[:3]
    if loss is not None:
        _check_loss(loss, spec, name)
    try:
        shaped = batch_model.abstract(batch, "the batch")
        if loss is None and not batch_model.is_tokens(shaped):
            batch_model.workload(model, shaped)  # refuses in its own words
    except ModelError as e:
        raise ModelError(f"--model {spec!r}: {name}(): {e}") from None
    shapes = batch_model.describe(shaped)
    first, seq_axis = batch_model.declared(shaped)

    # Leaves with no common leading axis cannot be resized: --batch is refused (check_axes).
    if first is None:
        sizes = (f"the batch {name}() returns: its leaves share no leading (batch) axis, so "
                 "--batch cannot resize it; make every leaf [batch, ...]")

    def make(size: int, seq: int, mesh=None) -> Workload:
        return traced(spec, f"the batch ({shapes})" + (f" at batch {size}" if first else " as "
                       "declared") + (f", seq {seq}" if seq_axis else ""), sizes,
                       lambda: batch_model.workload(
                           model, shaped, loss, size=size, seq=seq if seq_axis else None,
                           block=block, name=label, mesh=mesh, vocab_chunks=vocab_chunks),
                       loss)

    make.model, make.batch, make.loss, make.values = model, shaped, loss, batch
    make.loss_words = OUR_LOSS if loss is None else f"your {_name_of(loss)}"
    make.defaults = {"batch": first, "seq": seq_axis}
    return make


def _check_loss(loss: Callable, spec: str, name: str) -> None:
    """ModelError naming the loss FUNCTION returned, with its file and line, unless it
    can be called as loss(output, batch)."""
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):  # no signature to read (a builtin): its call tells
        return
    try:
        signature.bind(None, None)
    except TypeError:
        code = _code_of(loss)
        where = f" at {code.co_filename}:{code.co_firstlineno}" if code else ""
        raise ModelError(f"--model {spec!r}: the loss {_name_of(loss)!r}"
                         f"{where} that {name}() returned takes {signature}; it must take "
                         "(output, batch)") from None


# Libraries a model's code calls into: a failure raised there is the caller's.
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (
    importlib.import_module("jax"), importlib.import_module("jaxlib"),
    importlib.import_module("flax"), importlib.import_module("optax"),
    importlib.import_module("numpy"), os)) + (
    # The cuDNN stand-in plays JAX's cuDNN call: its refusals are the model's, as JAX's are.
    importlib.import_module("remat_kit.trace.stand_in").__file__,)
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _frames(e: BaseException) -> list[tuple[str, int]]:
    """(path, line) of each frame of `e`'s traceback outside the libraries (jax, flax,
    optax, numpy, the standard library), outermost first, less remat_kit's frames that
    only pass a call of the model's on (an interceptor's `next_fun(...)`, a wrapped
    class's `orig(...)`): a failure raised there is the caller's."""
    out, tb = [], e.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        line = linecache.getline(path, tb.tb_lineno)
        if not path.startswith(_LIBRARIES) and not (
                path.startswith(_OURS) and _PASSES.search(line)):
            out.append((path, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _code_of(fn: Callable | None):
    """The code object `fn` runs: a function's, a functools.partial's function's, or a
    callable object's `__call__`; None for a builtin."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    return code if code is not None else getattr(getattr(type(fn), "__call__", None),
                                                 "__code__", None)


def _name_of(fn: Callable) -> str:
    """A callable's name for messages: a function's, a partial's function's, a class's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _raised_in(e: BaseException, fn: Callable | None) -> bool:
    """Whether `e`'s traceback passes through `fn`'s own code (a loss's frame)."""
    code, tb = _code_of(fn), e.__traceback__
    while code is not None and tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


# A line of remat_kit's that calls the model's own code on.
_PASSES = re.compile(r"\b(next_fun|orig)\(")


def _our_frame(e: BaseException) -> str | None:
    """"FILE:LINE" of remat_kit's code where `e` was raised, when the last frame
    outside the libraries is remat_kit's own and not the model's (`_frames`); else None."""
    frames = _frames(e)
    if not frames or not frames[-1][0].startswith(_OURS):
        return None
    path, line = frames[-1]
    return f"{os.path.relpath(path, os.path.dirname(_OURS.rstrip(os.sep)))}:{line}"


def _user_frame(e: BaseException) -> str:
    """" at FILE:LINE" of the model's code where `e` was raised (the last frame that is
    neither remat_kit's nor a library's), or ""."""
    mine = [f for f in _frames(e) if not f[0].startswith(_OURS)]
    return f" at {mine[-1][0]}:{mine[-1][1]}" if mine else ""


def _check_module(model, spec: str, name: str) -> None:
    import flax.linen as nn
    from flax import nnx

    if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
        raise ModelError(f"--model {spec!r}: {name}() returned the class {model.__name__}; "
                         "return an instance")
    if not isinstance(model, (nn.Module, nnx.Module)):
        got = "None (a missing return?)" if model is None else type(model).__name__
        raise ModelError(f"--model {spec!r}: {name}() must return {batch_model.FORMS}; it "
                         f"returned {got}")


def _function_maker(fn: Callable, spec: str, label: str) -> Callable:
    name = getattr(fn, "__name__", "FUNCTION")

    def make(batch: int, seq: int, mesh=None) -> Workload:
        # A one-chip target's data:1 mesh shards nothing, and a target's chips (a
        # Fallback) are no ask: the Workload is run as it is.
        if not isinstance(mesh, Fallback) and spanning(mesh) is not None:
            raise ModelError(f"--model {spec!r}: --mesh is for a model; {name}(batch, seq) "
                             "builds its Workload, so build the mesh into its arguments")
        try:
            with _no_exit():
                got = fn(batch, seq)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            raise ModelError(f"--model {spec!r}: {name}({batch}, {seq}) raised "
                             f"{type(e).__name__}{_user_frame(e)}: {e}") from None
        if not isinstance(got, Workload):
            raise ModelError(f"--model {spec!r}: {name}(batch, seq) must return a "
                             f"remat_kit.Workload, it returned {type(got).__name__}")
        import jax

        from remat_kit.policy.policy import Policy
        # Its own code, run here where a failure is named: loss_for_policy, then the loss.
        inputs = f"the Workload's args at {name}({batch}, {seq})"
        loss = traced(spec, inputs, "--batch and --seq",
                      lambda: got.loss_for_policy(Policy(remat=False)))
        traced(spec, inputs, "--batch and --seq", lambda: jax.eval_shape(loss, *got.args), loss)
        return got if got.name != "loss" else _named(got, label)
    make.loss_words = f"the loss {name}(batch, seq)'s Workload builds"
    return make


def _named(workload: Workload, label: str) -> Workload:
    import dataclasses
    return dataclasses.replace(workload, name=label)


__all__ = ["FORMS", "check_axes", "load", "own_tags"]
