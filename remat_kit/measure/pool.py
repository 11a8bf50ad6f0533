"""The compile pool: every compile a command makes runs here, at most `jobs` at a time.

One pool a process (`current`; `using(jobs)` for a block) bounds compare's, plan's and fit's
compiles together. Its workers are daemon threads (XLA releases the GIL while it compiles), so
figures never leave the process, and a signal ends a command without waiting for a compile
(`cli.stops.end_process`). `side_by_side` runs a search's steps at once. Docs: docs/compare.md ("Flags").
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

# What the default bound allows one compile of host memory (XLA's buffers, the HLO, the
# executable): the host's free memory divided by it. A round figure, not measured per
# compile: a real-size model's compile may hold more; --jobs sets the bound outright.
COMPILE_BYTES = 2 << 30


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, else `os.cpu_count`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_bytes() -> int | None:
    """The host's available memory (MemAvailable of /proc/meminfo), bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _resident_bytes() -> int:
    """This process's resident memory now (VmRSS), bytes; 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _peak_resident_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss, KiB on Linux), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def default_jobs() -> int:
    """The compiles run at once by default: $REMAT_KIT_JOBS where set, else one a core, at
    most as many as the host's available memory holds at `COMPILE_BYTES` each, at least 1.
    Within that bound a compile starts beside others only while the available memory holds
    the measured `CompilePool.compile_rss` (`CompilePool._admit`).

    Raises:
      ValueError: $REMAT_KIT_JOBS not a whole number from 1 to the cores.
    """
    if (given := os.environ.get("REMAT_KIT_JOBS", "").strip()):
        try:
            return check_jobs(int(given))
        except ValueError:
            raise ValueError(f"REMAT_KIT_JOBS={given!r}: give a whole number from 1 to "
                             f"{cores()} (this machine's cores), or unset it") from None
    free = available_bytes()
    by_memory = cores() if free is None else free // COMPILE_BYTES
    return max(1, min(cores(), by_memory))


def check_jobs(jobs) -> int:
    """`jobs` as an int in 1..cores().

    Raises:
      ValueError: not an int, below 1, or more than the cores (one line naming the value
        and the valid range).
    """
    most = cores()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= most:
        raise ValueError(f"jobs must be a whole number from 1 to {most} (this machine's "
                         f"cores), got {jobs!r}")
    return jobs


class CompilePool:
    """At most `jobs` compiles at once, on daemon threads; counts running, done and queued.
    A compile that would start beside another waits while the host's available memory is
    below `compile_rss`, the most a compile run alone has grown the process's peak RSS.

    Args:
      jobs: the bound, 1..cores() (`check_jobs`).
      most: instead of the cores, the most `jobs` may be (a cluster's CPUs: `using_bound`).
    """

    def __init__(self, jobs: int, most: int | None = None):
        self.jobs = check_jobs(jobs) if most is None else max(1, min(jobs, most))
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._workers = 0
        self.running = self.done = self.queued = 0
        self.compile_rss = 0  # the most a compile run alone grew the process's peak RSS, bytes

    def submit(self, fn: Callable, *args) -> Future:
        """fn(*args) on a worker once one is free; its `Future` (result or exception)."""
        future: Future = Future()
        with self._lock:
            self.queued += 1
            if self._workers < self.jobs:
                self._workers += 1
                threading.Thread(target=self._work, daemon=True,
                                 name=f"remat_kit-compile-{self._workers}").start()
        self._tasks.put((future, fn, args))
        return future

    def run(self, fn: Callable, *args):
        """fn(*args) on the pool, waited for here (a signal still reaches this thread)."""
        return self.submit(fn, *args).result()

    def _work(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            alone = self._admit()
            outcome, raised = None, None
            before = (_resident_bytes(), _peak_resident_bytes()) if alone else None
            started = future.set_running_or_notify_cancel()  # False: cancelled while queued
            if started:
                try:
                    outcome = fn(*args)
                except BaseException as e:  # noqa: BLE001 - the caller's to raise
                    raised = e
            with self._lock:  # counted before the caller wakes
                self.running, self.done = self.running - 1, self.done + 1
                if before is not None and (peak := _peak_resident_bytes()) > before[1]:
                    # it set a new peak: what it added is that peak over the RSS it found
                    self.compile_rss = max(self.compile_rss, peak - before[0])
                self._freed.notify_all()
            if started and raised is not None:
                future.set_exception(raised)
            elif started:
                future.set_result(outcome)

    def _admit(self) -> bool:
        """Waits, while another compile runs, until the host's available memory holds
        `compile_rss` more (its peak RSS growth: the bound measured, not guessed); then
        counts this compile running. Returns whether it runs alone."""
        with self._freed:
            while (self.running and self.compile_rss
                   and (available_bytes() or self.compile_rss) < self.compile_rss):
                self._freed.wait(timeout=1.0)
            self.queued, self.running = self.queued - 1, self.running + 1
            return self.running == 1

    def status(self) -> str:
        """"compiles: 2 running, 5 done, 1 queued" for a progress line."""
        with self._lock:
            return (f"compiles: {self.running} running, {self.done} done, "
                    f"{self.queued} queued")


_CURRENT = {"pool": None}
_POOLS: dict[int, CompilePool] = {}
_SET = threading.Lock()


def current() -> CompilePool:
    """The process's pool: the one `using` set, else one of `default_jobs()` made on first use."""
    with _SET:
        if _CURRENT["pool"] is None:
            jobs = default_jobs()
            _CURRENT["pool"] = _POOLS.setdefault(jobs, CompilePool(jobs))
        return _CURRENT["pool"]


@contextlib.contextmanager
def using(jobs: int | None) -> Iterator[CompilePool]:
    """A block whose compiles run on the pool of `jobs` (None: `current()` as it is).

    Raises:
      ValueError: a bad `jobs` (`check_jobs`).
    """
    if jobs is None:
        yield current()
        return
    check_jobs(jobs)
    with _SET:  # one pool a bound (a nested block shares it), its threads kept for the next
        pool = _POOLS.setdefault(jobs, CompilePool(jobs))
    with _current(pool):
        yield pool


def using_bound(jobs: int) -> contextlib.AbstractContextManager[CompilePool]:
    """`using`, with `jobs` not bounded by this machine's cores: the compiles run on a
    cluster (`measure.cluster`), and a worker thread here only waits for one."""
    return _current(CompilePool(jobs, most=jobs))


@contextlib.contextmanager
def _current(pool: CompilePool) -> Iterator[CompilePool]:
    """`pool` as the process's `current()` for a block."""
    with _SET:
        before, _CURRENT["pool"] = _CURRENT["pool"], pool
    try:
        yield pool
    finally:
        with _SET:
            _CURRENT["pool"] = before


def side_by_side(calls: Sequence[Callable[[], object]]) -> list:
    """Each call's result (or the exception it raised, returned, not raised), in order:
    whole steps of a search (trace, lower, compile), each on a daemon thread of its own,
    their compiles bounded by the pool's `jobs`. One call, or a pool of one, runs here."""
    def caught(call):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - the caller decides
            return e
    if len(calls) <= 1 or current().jobs == 1:
        return [caught(c) for c in calls]
    futures = []
    for call in calls:
        future: Future = Future()
        threading.Thread(target=lambda f=future, c=call: f.set_result(caught(c)),
                         daemon=True).start()
        futures.append(future)
    return [f.result() for f in futures]


__all__ = ["COMPILE_BYTES", "CompilePool", "available_bytes", "check_jobs", "cores", "current",
           "default_jobs", "side_by_side", "using", "using_bound"]
