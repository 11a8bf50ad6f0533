"""What a training run leaves in its workdir besides checkpoints: the metrics
log (metrics.jsonl, optionally TensorBoard) and the config of every start.

A run may stop anywhere (pre-emption, SIGKILL) and resume from its last
checkpoint, so both logs are written to survive that: metrics.jsonl is
append-only, flushed per line, and cut back to the restored step on resume;
the config history keeps one line per start, with the step it started from.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

import ml_collections

METRICS = "metrics.jsonl"
CONFIG = "config.json"
HISTORY = "config_history.jsonl"
TENSORBOARD = "tensorboard"


def _replace_text(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` atomically (a crash leaves the old or the new file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    """The complete JSON lines of `path` ([] if absent). A last line cut short by a
    crash mid-write is dropped."""
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            break
    return lines


class MetricsLog:
    """workdir/metrics.jsonl, and workdir/tensorboard/ when `tensorboard` is set.

    Opening cuts metrics.jsonl to the lines of steps <= `resume_step` (the step
    the run restarts from; 0 for a fresh run), so a resumed run neither repeats
    nor skips a step. TensorBoard events of later steps are purged the same way
    (tensorboardX's `purge_step`). Use as a context manager. With `enabled`
    False (every process but the first of a multi-process run) it writes
    nothing.
    """

    def __init__(self, workdir: pathlib.Path, resume_step: int, tensorboard: bool = False,
                 enabled: bool = True):
        self._writer = None
        if not enabled:
            self._file = open(os.devnull, "a")
            return
        path = workdir / METRICS
        kept = [line for line in _read_jsonl(path) if line["step"] <= resume_step]
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
                 from_step: int) -> tuple[list[dict], list[str]]:
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
    history = _read_jsonl(workdir / HISTORY)
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
