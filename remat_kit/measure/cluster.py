"""Compiles on a Ray cluster (`--ray ADDRESS`, $RAY_ADDRESS; `local` starts one here).

A program that will not run goes to the cluster as bytes (`_jax_private.compile_request`: the
StableHLO and JAX's own compile options) and comes back as its figures (`Figures`: the compiled
HLO text, cost and memory analysis), never an executable; the compile pool's bound becomes the
cluster's CPUs. A task the kernel killed for memory is compiled once more here, one at a time,
then reported (`HostMemoryError`). Ray is optional (`pip install remat-kit[ray]`).
Docs: docs/compare.md ("Flags").
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import warnings
from collections.abc import Iterator
from urllib.parse import urlsplit

from remat_kit._jax_private import (compile_module, compile_request, hlo_module_from_proto,
                                     lowered_shardings)
from remat_kit.errors import BadInput
from remat_kit.measure import pool

# How long an address may take to accept a connection before it is called silent, seconds.
CONNECT_SECONDS = 3.0


class HostMemoryError(MemoryError):
    """A compile ran out of host memory on a cluster worker and again here, one at a time;
    the message names the program and its size."""


class Figures:
    """What the reports read of a compiled program, as a cluster worker sent it back: the
    methods of JAX's `Compiled` that `measure` calls (`as_text`, `cost_analysis`,
    `memory_analysis`), and `input_shardings`, `out_info` as the lowering fixed them
    (`_jax_private.lowered_shardings`, set here); `runtime_executable` gives what
    `_jax_private.hlo_module` reads of it (the optimized HLO module, as XLA serialized it)."""

    def __init__(self, text: str, cost, memory: dict | None, module: bytes | None = None):
        self._text, self._cost, self._memory, self._module = text, cost, memory, module
        self.input_shardings = self.out_info = None

    def as_text(self) -> str:
        return self._text

    def cost_analysis(self):
        if self._cost is None:
            raise NotImplementedError("the cluster's compiler gave no cost analysis")
        return self._cost

    def memory_analysis(self):
        return None if self._memory is None else _Stats(self._memory)

    def runtime_executable(self):
        if self._module is None:
            raise NotImplementedError("compiled on a Ray cluster: no executable here")
        return _Modules(hlo_module_from_proto(self._module))


class _Modules:
    """An executable's `hlo_modules()`, of one module."""

    def __init__(self, module):
        self._module = module

    def hlo_modules(self) -> list:
        return [self._module]


class _Stats:
    """`CompiledMemoryStats` as attributes, from a dict."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)


def compile_figures(module: bytes, options: bytes, device_ids: list[int], target: str
                    ) -> Figures:
    """The `Figures` of one `compile_request`, compiled in this process for `target` (its
    string; `targets.parse_target` here): the body of a cluster's task."""
    from remat_kit.measure.targets import parse_target

    found = {d.id: d for d in parse_target(target).devices}
    missing = [i for i in device_ids if i not in found]
    if missing:
        raise BadInput(f"target {target} has no devices {missing} on this Ray worker")
    exe = compile_module(module, options, [found[i] for i in device_ids])
    text = (exe.get_hlo_text() if hasattr(exe, "get_hlo_text")
            else "\n\n".join(m.to_string() for m in exe.hlo_modules()))
    cost = exe.cost_analysis() if hasattr(exe, "cost_analysis") else None
    stats = exe.get_compiled_memory_stats()
    memory = {k: getattr(stats, k) for k in dir(stats)
              if k.endswith("_in_bytes")} if stats is not None else None
    modules = exe.hlo_modules() if hasattr(exe, "hlo_modules") else []
    return Figures(text, cost, memory,
                   modules[0].as_serialized_hlo_module_proto() if len(modules) == 1 else None)


_STATE = {"ray": None, "task": None, "address": None, "sent": 0}
_SERIAL = threading.Lock()  # a compile retried after a worker died: one at a time
_COUNT = threading.Lock()


def sent() -> int:
    """How many compiles this process has sent to a Ray cluster."""
    return _STATE["sent"]


def active() -> bool:
    """Whether compiles go to a Ray cluster (inside `using` with an address)."""
    return _STATE["task"] is not None


def _check_answers(address: str) -> None:
    """Raises BadInput naming `address` where nothing accepts a connection there within
    `CONNECT_SECONDS` (Ray itself would retry for a minute or more)."""
    if address in ("local", "auto"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise BadInput(f"--ray {address!r}: give host:port (a Ray head's GCS, e.g. "
                       f"10.0.0.2:6379), ray://host:10001, auto or local")
    try:
        socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise BadInput(f"--ray {address!r}: no Ray cluster answers there within "
                       f"{CONNECT_SECONDS:g} s ({e.strerror or e})") from None


def _connect(address: str):
    """`ray`, joined to the cluster at `address` (started here for "local")."""
    try:
        import ray
    except ImportError:
        raise BadInput(f"--ray {address!r}: Ray is not installed; pip install "
                       f"'remat-kit[ray]' (or ray)") from None
    _check_answers(address)
    if not ray.is_initialized():
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with warnings.catch_warnings():  # its processes are exec'd: JAX's fork warning
                warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR")
        except ConnectionError as e:
            raise BadInput(f"--ray {address!r}: {' '.join(str(e).split())}") from None
        finally:  # ray.init sets its own: a stop stays the command's (`cli.stops`)
            if threading.current_thread() is threading.main_thread():
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
    return ray


@contextlib.contextmanager
def using(address: str | None) -> Iterator[None]:
    """A block whose compiles of programs that will not run go to the Ray cluster at
    `address` (None: $RAY_ADDRESS, or no cluster where it is unset), as many at once as
    the cluster has CPUs (`pool.using_bound`).

    Raises:
      BadInput: Ray missing, or no cluster answering at `address` (within seconds).
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or active():
        yield
        return
    started = not _ray_running()
    ray = _connect(address)
    task = ray.remote(num_cpus=1, max_retries=0)(compile_figures)
    _STATE.update(ray=ray, task=task, address=address)
    try:
        with pool.using_bound(max(1, int(ray.cluster_resources().get("CPU", 1)))):
            yield
    finally:
        _STATE.update(ray=None, task=None, address=None)
        if started:  # joined here: left here (a cluster started here ends with it)
            ray.shutdown()


def _ray_running() -> bool:
    """Whether this process has joined a Ray cluster already (`ray.init` before us)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def compile_figures_remote(lowered, options: dict | None, target):
    """`Figures` of `lowered.compile(options)` for `target`, compiled on the cluster; None
    where this program cannot go there (`compile_request`, `lowered_shardings`: host
    callbacks, or shardings XLA would choose; several of this machine's own devices). A
    worker the kernel killed (Ray's OutOfMemoryError, or the worker died): compiled once
    more here, one at a time.

    Raises:
      HostMemoryError: that compile ran out of host memory too.
      Exception: what the worker's compile raised (as a local compile would raise it).
    """
    request = compile_request(lowered, options)
    shardings = lowered_shardings(lowered)
    if request is None or shardings is None or (not target.aot and len(request[2]) > 1):
        return None  # (this machine's several devices: a worker's may number otherwise)
    figures = _remote_or_here(request, target)
    figures.input_shardings, figures.out_info = shardings
    return figures


def _remote_or_here(request: tuple, target) -> Figures:
    ray = _STATE["ray"]
    with _COUNT:
        _STATE["sent"] += 1
    try:
        return ray.get(_STATE["task"].remote(*request, str(target)))
    except (ray.exceptions.OutOfMemoryError, ray.exceptions.WorkerCrashedError) as e:
        died = type(e).__name__
    except ray.exceptions.RayTaskError as e:  # the compile's own error, not Ray's traceback
        raise (e.cause if isinstance(e.cause, Exception) else e) from None
    with _SERIAL:
        try:
            return compile_figures(*request, str(target))
        except MemoryError as e:
            raise HostMemoryError(_out_of_memory(request[0], target, died)) from e
        except Exception as e:
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                raise HostMemoryError(_out_of_memory(request[0], target, died)) from e
            raise


def _out_of_memory(module: bytes, target, died: str) -> str:
    free = pool.available_bytes()
    here = f"{free / 2**30:.1f} GiB available here" if free is not None else "free memory unknown"
    return (f"out of host memory compiling a {len(module) / 2**20:.1f} MiB program for "
            f"{target}: its Ray worker died ({died}) and the compile retried here alone "
            f"failed too ({here}); use a host with more memory or a smaller size")


__all__ = ["CONNECT_SECONDS", "Figures", "HostMemoryError", "active", "compile_figures",
           "compile_figures_remote", "sent", "using"]
