"""How a command ends on Ctrl-C (SIGINT) or SIGTERM: one line and 128 + the signal.

`catching` turns either signal into `Stopped` (a BaseException, so the `except Exception` that
makes one policy's failure its row lets it through) in the main thread, wherever it is, instead
of a long traceback, once, however many signals follow and in whatever order, and again where a
callback swallowed it; `kept` says what the run leaves: the cache entries written before the
signal (every write is whole or not at all); `end_process` ends the command's process at once.
Docs: docs/compare.md ("Flags").
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
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


class _Stop:
    """The first signal of a `catching` block and whether a caller has taken its `Stopped`."""

    def __init__(self):
        self.signum: int | None = None
        self.handled = False
        self.again = False  # the watchdog asks for the `Stopped` once more
        self.wake = threading.Event()  # a `Stopped` was swallowed: raise it again now


_stop = _Stop()
# How often an unhandled stop is raised again: a `Stopped` raised inside a callback that
# swallows exceptions (a gc callback: "Exception ignored in ...") would otherwise be lost.
RETRY_SECONDS = 1.0


def _handler(signum, frame):
    del frame
    if _stop.handled:
        return  # the command is ending: nothing more to stop
    if _stop.signum is None:
        _stop.signum = signum
        threading.Thread(target=_watch, name="remat-kit-stop", daemon=True).start()
    elif not _stop.again:
        return  # a second signal while the first unwinds: it is stopping already
    _stop.again = False
    raise Stopped(_stop.signum)


def _watch() -> None:
    """Raises the stop in the main thread again, each `RETRY_SECONDS` or when woken (a
    swallowed `Stopped`), until taken."""
    while True:
        _stop.wake.wait(RETRY_SECONDS)
        _stop.wake.clear()
        if _stop.handled:
            return
        _stop.again = True
        _thread.interrupt_main(_stop.signum)


def _unraisable(unraisable) -> None:
    """`sys.unraisablehook` in a `catching` block: a `Stopped` raised inside a callback that
    cannot raise (a gc callback) is raised again in the main thread at once, unprinted."""
    if isinstance(unraisable.exc_value, Stopped) and not _stop.handled:
        _stop.wake.set()  # the watchdog raises it, once this callback has returned
    else:
        _hooks[-1](unraisable)


_hooks: list = []  # the unraisable hooks `catching` replaced


def handled() -> None:
    """Says that the `Stopped` was taken (the command is ending): later signals are ignored
    and the stop is not raised again."""
    _stop.handled = True


@contextlib.contextmanager
def catching() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Stopped` for the duration of the block (main thread
    only, where Python runs signal handlers). A compile in progress in XLA finishes
    first: Python runs the handler once the main thread is back in Python.

    Only the first signal raises; later ones, in any order and spacing, are ignored.
    Until a caller calls `handled` (or the block ends with an exception), the stop is
    raised again each `RETRY_SECONDS`, and at the block's end if it returns normally, so
    a `Stopped` swallowed on the way (raised inside a callback) still stops the command.
    The previous handlers come back after, unless a signal came: then ours stays, to
    ignore more signals while the process ends. A signal ignored when the block starts
    (SIG_IGN) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop.__init__()
    # A signal the process was started ignoring (SIGINT of a shell's background job) stays
    # ignored, as Python leaves it.
    previous = {s: signal.signal(s, _handler) for s in SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}
    _hooks.append(sys.unraisablehook)
    sys.unraisablehook = _unraisable
    try:
        yield
    except BaseException:
        handled()  # propagating: a Stopped, or what ends the command instead
        raise
    finally:
        sys.unraisablehook = _hooks.pop()
        if _stop.signum is None:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if _stop.signum is not None and not _stop.handled:  # swallowed on its way
        handled()
        raise Stopped(_stop.signum)


def end_process(code: int) -> None:
    """Ends this process with `code` at once, after flushing its output: neither a compile
    still running on a worker thread (which exit would wait for) nor XLA's teardown of
    those threads (which can abort) holds a stopped command."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def kept(args) -> str:
    """What a command stopped early leaves, one clause: the caches (compiled programs and
    figures, and for plan the plans) as written before the signal, or nothing."""
    import jax

    folder = jax.config.jax_compilation_cache_dir
    caches = [f"the compile cache {folder!r}"] if folder else []
    if getattr(args, "command", None) == "plan" and args.cache != "":  # '': none
        from remat_kit.decide.plan_cache import default_cache_path
        path = args.cache if args.cache is not None else default_cache_path()
        if os.path.isfile(path):  # none is named where no plan was ever written
            caches.append(f"the plan cache {path!r}")
    if not caches:
        return "nothing was kept (no cache folder is set)"
    return (f"kept: what was compiled or planned before it, in {' and '.join(caches)}; no "
            "report was written")


__all__ = ["RETRY_SECONDS", "SIGNALS", "Stopped", "catching", "end_process", "handled", "kept"]
