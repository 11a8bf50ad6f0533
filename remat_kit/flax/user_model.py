"""The user's model for `--model FILE.py:FUNCTION` or `--model package.module:FUNCTION`.

FUNCTION either takes no arguments and returns a linen or NNX language model
(tokens [batch, seq] -> logits; `remat_kit.flax.from_model`), or takes
(batch, seq) and returns a `remat_kit.Workload`. Every failure (the file or
module does not import, FUNCTION is missing or returns the wrong type, the
model's output has no logits, no repeated block, a --block that matches
nothing) is a `ModelError` naming the value and what was expected, raised
before anything compiles.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable

from remat_kit.errors import MeshError, RematSpecError
from remat_kit.flax.from_model import ModelError
from remat_kit.flax.from_model import workload as model_workload
from remat_kit.mesh import spanning
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

    Where FUNCTION returns a module, `make.model` is that module.
    vocab_chunks: the built loss over that many vocabulary slices
    (`from_model.next_token_loss`); a FUNCTION(batch, seq) builds its own loss,
    so it takes none. sizes: what the caller's user sets the batch and
    sequence length with, for the line of a model that fails at these shapes.

    Raises:
      ModelError: a malformed spec, a module that does not import, FUNCTION
        missing or not callable, taking other arguments, or returning
        neither a Flax module nor (for (batch, seq)) a Workload, vocab_chunks
        other than 1 for a Workload function. Model
        problems show at the first make() (`remat_kit.flax.from_model.workload`).
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
        raise ModelError(f"--model {spec!r}: {name}() raised {type(e).__name__}: {e}") \
            from None
    _check_module(model, spec, name)

    def make(batch: int, seq: int, mesh=None) -> Workload:
        try:
            with _no_exit():
                return model_workload(model, batch, seq, block=block, name=label, mesh=mesh,
                                      vocab_chunks=vocab_chunks)
        except (ModelError, RematSpecError, MeshError) as e:  # MeshError: placing it
            raise ModelError(f"--model {spec!r}: {e}") from None
        except (Exception, ExitCalled) as e:  # noqa: BLE001 - the model failed to trace
            where = _our_frame(e)
            if where is not None:  # remat_kit's own fault: never the user's shapes
                raise ModelError(f"--model {spec!r}: remat_kit failed on this model at "
                                 f"{where} ({type(e).__name__}: {e}); this is a remat_kit "
                                 "bug, not a fault of the model or its input shapes: please "
                                 "report it") from None
            raise ModelError(f"--model {spec!r}: tracing the model on int32 tokens [{batch}, "
                             f"{seq}] failed: {type(e).__name__}: {e}; if the model takes "
                             f"other shapes (e.g. fewer positions), give them with {sizes}") \
                from None

    make.model = model  # the module itself, for callers that train it (experiments.train)
    return label, make


# Libraries a model's code calls into: a failure raised there is the caller's.
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (
    importlib.import_module("jax"), importlib.import_module("jaxlib"),
    importlib.import_module("flax"), importlib.import_module("optax"),
    importlib.import_module("numpy"), os))
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _our_frame(e: BaseException) -> str | None:
    """"FILE:LINE" of remat_kit's code where `e` was raised, when the last frame
    outside the libraries (jax, flax, optax, numpy, the standard library) is
    remat_kit's own and not the model's; else None."""
    tb, last = e.__traceback__, None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_LIBRARIES):
            last = (path, tb.tb_lineno)
        tb = tb.tb_next
    if last is None or not last[0].startswith(_OURS):
        return None
    return f"{os.path.relpath(last[0], os.path.dirname(_OURS.rstrip(os.sep)))}:{last[1]}"


def _check_module(model, spec: str, name: str) -> None:
    import flax.linen as nn
    from flax import nnx

    if isinstance(model, type) and issubclass(model, (nn.Module, nnx.Module)):
        raise ModelError(f"--model {spec!r}: {name}() returned the class {model.__name__}; "
                         "return an instance")
    if not isinstance(model, (nn.Module, nnx.Module)):
        got = "None (a missing return?)" if model is None else type(model).__name__
        raise ModelError(f"--model {spec!r}: {name}() must return a flax.linen or flax.nnx "
                         f"Module (tokens [batch, seq] -> logits), it returned {got}")


def _function_maker(fn: Callable, spec: str, label: str) -> Callable:
    name = getattr(fn, "__name__", "FUNCTION")

    def make(batch: int, seq: int, mesh=None) -> Workload:
        # A one-chip target's data:1 mesh shards nothing: the Workload is run as it is.
        if spanning(mesh) is not None:
            raise ModelError(f"--model {spec!r}: --mesh is for a model; {name}(batch, seq) "
                             "builds its Workload, so build the mesh into its arguments")
        try:
            with _no_exit():
                got = fn(batch, seq)
        except (Exception, SystemExit) as e:  # noqa: BLE001
            raise ModelError(f"--model {spec!r}: {name}({batch}, {seq}) raised "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(got, Workload):
            raise ModelError(f"--model {spec!r}: {name}(batch, seq) must return a "
                             f"remat_kit.Workload, it returned {type(got).__name__}")
        return got if got.name != "loss" else _named(got, label)
    return make


def _named(workload: Workload, label: str) -> Workload:
    import dataclasses
    return dataclasses.replace(workload, name=label)


__all__ = ["FORMS", "load"]
