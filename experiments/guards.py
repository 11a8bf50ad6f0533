"""Ways a training run stops early on purpose: a non-finite loss, a stop
signal (Ctrl-C, or SIGTERM as schedulers send on pre-emption), or another
run already writing the same workdir."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

from remat_kit.errors import BadInput

LOCK = ".lock"


class RunStopped(Exception):
    """The run stopped before num_steps; the message says why and which
    checkpoint holds the state to resume from.

    Attributes:
      exit_code: the process exit code for this stop.
    """

    exit_code = 1


class NonFiniteLoss(RunStopped):
    """The train loss became NaN or infinite; the state after that step is not saved."""


class Interrupted(RunStopped):
    """SIGINT or SIGTERM arrived; a checkpoint of the last finished step was written.
    Exit code 128 + the signal number, as a shell reports a process the signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """Records SIGINT and SIGTERM instead of dying, so the training loop can
    save and stop between steps. `received` is the signal number, or None."""

    def __init__(self):
        self.received: int | None = None

    def _handle(self, signum, frame) -> None:
        del frame
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """Catches SIGINT and SIGTERM for the duration of the block (main thread
    only: elsewhere Python cannot install handlers, and nothing is caught);
    the previous handlers come back after."""
    stop = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop._handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_past_stuck_threads(code: int, seconds: float = 5.0) -> None:
    """Ends the process with `code` now (os._exit, after flushing) where threads
    other than this one that the interpreter would wait for at exit are still
    alive after `seconds`: after a failed checkpoint write, orbax's threads can
    wait for one another forever (`blocking_key_value_get`), and the run hung
    after printing its error. Returns where none is left."""
    deadline = time.monotonic() + seconds

    def stuck():
        return [t for t in threading.enumerate()
                if t is not threading.current_thread() and not t.daemon and t.is_alive()]
    for t in stuck():
        t.join(max(0.0, deadline - time.monotonic()))
    if stuck():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def workdir_lock(workdir: pathlib.Path, process: int = 0) -> Iterator[pathlib.Path]:
    """Holds an exclusive `fcntl.flock` on workdir/.lock (.lock.N for process
    N > 0 of a multi-process run, whose processes share the workdir) for the
    duration of the block; the file holds "PID on HOST" of the holder.

    The kernel drops the lock when its holder exits, however it dies, so a
    lock file left by a dead run is simply taken over. (On NFS, flock is only
    as good as the server's lock support.)

    Raises:
      BadInput: another process holds the lock; names its PID and host.
    """
    path = workdir / (LOCK if process == 0 else f"{LOCK}.{process}")
    fh = path.open("a+")  # not "w": that would erase the holder's PID before we know
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise BadInput(f"workdir {str(workdir)!r} is in use by another run (PID {holder}, which "
                       f"holds {path}): wait for it to end or stop it, or use another "
                       "workdir") from None
    try:
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()} on {socket.gethostname()}\n")
            fh.flush()
        except OSError:
            pass  # a full disk: the lock holds all the same, without the PID
        yield path
    finally:
        fh.close()  # releases the lock
