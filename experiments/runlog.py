"""What a training run leaves in its workdir besides checkpoints: the metrics
log (metrics.jsonl, optionally TensorBoard) and the config of every start.

A run may stop anywhere (pre-emption, SIGKILL) and resume from its last
checkpoint, so both logs are written to survive that: metrics.jsonl is
append-only, flushed per line, and cut back to the restored step on resume;
the config history keeps one line per start, with the step it started from.
A damaged line in either (a crash mid-write, a garbled disk block) is set
aside, never a reason to drop the intact lines after it or to crash. Orbax's
log lines (through absl logging) go to orbax.log, not the terminal.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import pathlib
import sys
from collections.abc import Callable, Iterator

import ml_collections

from experiments.common import warn_line
from remat_kit import files
from remat_kit.errors import BadInput

METRICS = "metrics.jsonl"
CONFIG = "config.json"
HISTORY = "config_history.jsonl"
TENSORBOARD = "tensorboard"
LIBRARY_LOG = "orbax.log"
SUMMARY = "summary.json"


def check_files(workdir: pathlib.Path) -> None:
    """BadInput, one line, where a file the run writes in `workdir` (metrics.jsonl,
    the config and its history, summary.json) is there but is no writable regular
    file (a folder by that name gave an IsADirectoryError traceback)."""
    for name in (METRICS, CONFIG, HISTORY, SUMMARY):
        path = workdir / name
        if (path.exists() or path.is_symlink()) and (why := files.problem(str(path))):
            raise BadInput(f"--workdir: {why}; the run writes {name} there: move it away or "
                           "use another workdir")


def _replace_text(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` atomically (a crash leaves the old or the new file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What makes a line of each log intact: {field: test}.
_METRICS_FIELDS = {"step": _is_count}
_HISTORY_FIELDS = {"from_step": _is_count, "remat": lambda v: isinstance(v, str),
                   "policy": lambda v: isinstance(v, str), "config": lambda v: isinstance(v, dict)}


def _parse(raw: bytes, fields: dict) -> dict | None:
    """The JSON object of one line, or None if it is not UTF-8, not JSON, not
    an object, or lacks one of `fields` (or has it of the wrong kind)."""
    try:
        line = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(line, dict) or not all(k in line and ok(line[k]) for k, ok in fields.items()):
        return None
    return line


def _read_jsonl(path: pathlib.Path, fields: dict, warn: Callable[[str], None]) -> list[dict]:
    """The intact lines of `path` ([] if absent). Damaged ones (cut short by a
    crash mid-write, garbled, not an object, lacking a field) are appended to
    PATH.damaged with their bytes unchanged, removed from `path`, and counted
    in one `warn` line; blank lines are dropped."""
    if not path.exists():
        return []
    intact, damaged = [], []
    for raw in path.read_bytes().split(b"\n"):
        if raw.strip():
            line = _parse(raw, fields)
            if line is None:
                damaged.append(raw)
            else:
                intact.append(line)
    if damaged:
        aside = path.with_name(path.name + ".damaged")
        with aside.open("ab") as fh:
            fh.write(b"".join(raw + b"\n" for raw in damaged))
        _replace_text(path, "".join(json.dumps(line) + "\n" for line in intact))
        warn(f"{path}: {len(damaged)} damaged line(s) moved to {aside}; kept the "
             f"{len(intact)} intact one(s)")
    return intact


class MetricsLog:
    """workdir/metrics.jsonl, and workdir/tensorboard/ when `tensorboard` is set.

    Opening cuts metrics.jsonl to the lines of steps <= `resume_step` (the step
    the run restarts from; 0 for a fresh run), so a resumed run neither repeats
    nor skips a step. Damaged lines are moved to metrics.jsonl.damaged, with
    one `warn` line (`_read_jsonl`); the intact ones after them are kept.
    TensorBoard events of later steps are purged the same way
    (tensorboardX's `purge_step`). Use as a context manager. With `enabled`
    False (every process but the first of a multi-process run) it writes
    nothing.
    """

    def __init__(self, workdir: pathlib.Path, resume_step: int, tensorboard: bool = False,
                 enabled: bool = True, warn: Callable[[str], None] = warn_line):
        self._writer = None
        if not enabled:
            self._file = open(os.devnull, "a")
            return
        path = workdir / METRICS
        kept = [line for line in _read_jsonl(path, _METRICS_FIELDS, warn)
                if line["step"] <= resume_step]
        _replace_text(path, "".join(json.dumps(line) + "\n" for line in kept))
        self._file = path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional, only when asked for

            self._writer = SummaryWriter(str(workdir / TENSORBOARD), purge_step=resume_step + 1)

    def write(self, line: dict) -> None:
        """Appends `line` (a dict with an int "step" and float metrics) and flushes."""
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in line.items():
                if name != "step":
                    self._writer.add_scalar(name, value, line["step"])
            self._writer.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def record_start(workdir: pathlib.Path, config: ml_collections.ConfigDict, policy: str,
                 from_step: int, warn: Callable[[str], None] = warn_line
                 ) -> tuple[list[dict], list[str]]:
    """Saves the config of this start: workdir/config.json (this start's config)
    and one more line in workdir/config_history.jsonl ({"from_step", "started"
    (UTC, ISO 8601), "remat", "policy" (canonical spec), "config"}).

    Returns:
      policies: the remat policies the parameters were trained under, as
        [{"from_step", "remat", "policy"}], oldest first: a start that a later
        one resumed before (its steps were lost) is left out, and starts with
        the same policy are merged.
      changed: "FIELD: OLD -> NEW" for each config field that differs from the
        previous start's ([] on the first start).
    """
    values = json.loads(config.to_json_best_effort())
    history = _read_jsonl(workdir / HISTORY, _HISTORY_FIELDS, warn)
    entry = {"from_step": from_step,
             "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "remat": config.remat, "policy": policy, "config": values}
    _replace_text(workdir / CONFIG, json.dumps(values, indent=2) + "\n")
    with (workdir / HISTORY).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")
    previous = history[-1]["config"] if history else values
    changed = [f"{k}: {previous.get(k)!r} -> {v!r}" for k, v in values.items()
               if previous.get(k) != v]

    policies: list[dict] = []
    for start in history + [entry]:
        policies = [p for p in policies if p["from_step"] < start["from_step"]]
        if not policies or policies[-1]["policy"] != start["policy"]:
            policies.append({k: start[k] for k in ("from_step", "remat", "policy")})
    return policies, changed


class _QuietFileHandler(logging.FileHandler):
    """A log file that drops records it cannot write (a full disk) instead of
    printing logging's traceback on the terminal."""

    def handleError(self, record: logging.LogRecord) -> None:
        del record


@contextlib.contextmanager
def library_log(workdir: pathlib.Path) -> Iterator[pathlib.Path]:
    """For the duration of the block, the records of the `absl` logger (orbax
    logs through absl: dozens of lines per failed write) go to
    workdir/orbax.log, created at the first record, instead of the terminal.
    Yields the log's path."""
    path = workdir.absolute() / LIBRARY_LOG
    logger = logging.getLogger("absl")
    handler = _QuietFileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(threadName)s %(filename)s:%(lineno)d] %(message)s"))
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        with contextlib.suppress(OSError):  # its last flush, on a full disk
            handler.close()


def divert_stderr(workdir: pathlib.Path) -> None:
    """Points file descriptor 2 at workdir/orbax.log, if orbax has logged
    there, for what is printed while the process exits; else does nothing."""
    path = workdir.absolute() / LIBRARY_LOG
    if not path.is_file():
        return
    sys.stderr.flush()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    os.dup2(fd, 2)
    os.close(fd)
