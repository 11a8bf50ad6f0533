"""How a command ends on Ctrl-C (SIGINT) or SIGTERM: one line and 128 + the signal.

`catching` turns either signal into `Stopped` (a BaseException, so the `except Exception` that
makes one policy's failure its row lets it through) in the main thread, wherever it is, instead
of a long traceback; `kept` says what the run leaves: the cache entries written before the signal
(every write is whole or not at all). Docs: docs/compare.md ("Flags").
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived. Attributes: signum, name ("SIGINT"), exit_code (128 + signum,
    as a shell reports a process the signal ended)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name
        self.exit_code = 128 + signum


def _raise(signum, frame):
    del frame
    raise Stopped(signum)


@contextlib.contextmanager
def catching() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Stopped` for the duration of the block (main thread
    only, where Python runs signal handlers); the previous handlers come back after.
    A compile in progress in XLA finishes first: Python runs the handler once the
    main thread is back in Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def kept(args) -> str:
    """What a command stopped early leaves, one clause: the caches (compiled programs and
    figures, and for plan the plans) as written before the signal, or nothing."""
    import jax

    folder = jax.config.jax_compilation_cache_dir
    caches = [f"the compile cache {folder!r}"] if folder else []
    if getattr(args, "command", None) == "plan" and args.cache != "":  # '': none
        from remat_kit.decide.plan_cache import default_cache_path
        path = args.cache if args.cache is not None else default_cache_path()
        caches.append(f"the plan cache {path!r}")
    if not caches:
        return "nothing was kept (no cache folder is set)"
    return (f"kept: what was compiled or planned before it, in {' and '.join(caches)}; no "
            "report was written")


__all__ = ["SIGNALS", "Stopped", "catching", "kept"]
