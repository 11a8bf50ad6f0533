"""Ways a training run stops early on purpose: a non-finite loss, or a stop
signal (Ctrl-C, or SIGTERM as schedulers send on pre-emption)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


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
