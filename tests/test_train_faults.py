"""Faults a training run meets on disk, each reproduced on a copy of one trained
workdir: a damaged latest checkpoint, silent corruption, a full disk, a second
run on the same workdir, and a damaged metrics.jsonl.

In-process runs raise what `experiments.train.main` turns into the exit code:
BadInput is exit 2, NonFiniteLoss exit 1; the second-writer test runs the
command itself.
"""

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading

import chex
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from absl import logging as absl_logging

from experiments import checkpoint, runlog, train
from test_resume import REPO, TEXT, _config, _losses, _steps

N = 8  # steps of the trained workdir; checkpoints 4, 6 and 8 (every 2, keeping 3)
EVERY = dict(checkpoint_every=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "text.py"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("trained")
    train.train_and_evaluate(_config(data, **EVERY), str(workdir))
    assert _steps(workdir) == [4, 6, 8]
    return workdir


@pytest.fixture
def workdir(trained, tmp_path) -> pathlib.Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _largest_data_file(workdir: pathlib.Path, step: int = N) -> pathlib.Path:
    folder = workdir / "checkpoints" / str(step) / "state" / "ocdbt.process_0" / "d"
    return max(folder.iterdir(), key=lambda p: p.stat().st_size)


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def _flip(path: pathlib.Path, count: int = 64) -> None:
    blob = bytearray(path.read_bytes())
    middle = len(blob) // 2
    blob[middle:middle + count] = bytes(b ^ 0xFF for b in blob[middle:middle + count])
    path.write_bytes(bytes(blob))


# The damage, with and without the checksum file: without it, orbax's
# own failure to read (Exception, TypeError, ValueError, KeyError) is the check.
DAMAGE = {
    "truncated data file": (lambda w: os.truncate(_largest_data_file(w), 10), True),
    "deleted data file": (lambda w: _largest_data_file(w).unlink(), False),
    "deleted _METADATA": (lambda w: (w / "checkpoints/8/state/_METADATA").unlink(), False),
    "empty manifest.ocdbt": (lambda w: os.truncate(w / "checkpoints/8/state/manifest.ocdbt", 0),
                             False),
    "deleted state/": (lambda w: shutil.rmtree(w / "checkpoints/8/state"), False),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_checkpoint_is_moved_aside_for_the_one_before(workdir, damage):
    harm, keep_checksums = DAMAGE[damage]
    if not keep_checksums:
        (workdir / "checkpoints/8" / checkpoint.CHECKSUMS).unlink()
    harm(workdir)
    damaged = _files(workdir / "checkpoints/8")
    template = ocp.StandardCheckpointer().restore(workdir / "checkpoints/6/state")  # numpy
    ckpt, warnings = checkpoint.Checkpoints(workdir, keep=3), []
    try:
        step, state, meta = ckpt.restore_latest(template, warnings.append)
    finally:
        ckpt.close()
    assert (step, int(state["step"]), meta["step"], meta["verified"]) == (6, 6, 6, True)
    chex.assert_trees_all_equal(state, template)
    folder = workdir / "checkpoints"
    [line] = warnings
    assert line.startswith(f"checkpoint 8 in {folder} is damaged (")
    assert line.endswith(f"): moved it to {folder / 'damaged' / '8-0'}; resuming from checkpoint 6")
    assert _files(folder / "damaged" / "8-0") == damaged  # moved, byte for byte, not deleted
    assert _steps(workdir) == [4, 6]


def test_damaged_checkpoint_run_resumes_from_the_one_before(data, trained, workdir, capsys):
    os.truncate(_largest_data_file(workdir), 10)
    summary = train.train_and_evaluate(_config(data, num_steps=10, **EVERY), str(workdir))
    assert summary["start_step"] == 6
    folder = workdir / "checkpoints"
    [line] = _warnings(capsys.readouterr().err)
    assert line.startswith(f"warning: checkpoint 8 in {folder} is damaged (file state/ocdbt")
    assert line.endswith(f"): moved it to {folder / 'damaged' / '8-0'}; resuming from checkpoint 6")
    assert (folder / "damaged" / "8-0" / "state").is_dir()
    assert _steps(workdir) == [6, 8, 10]
    assert [s for s, _ in _losses(workdir)] == list(range(1, 11))
    assert _losses(workdir)[:6] == _losses(trained)[:6]


def test_no_intact_checkpoint_refuses_once_then_trains_from_zero(data, trained, workdir, capsys):
    for step in (4, 6, 8):
        shutil.rmtree(workdir / "checkpoints" / str(step) / "state")
    folder = workdir / "checkpoints"
    with pytest.raises(train.BadInput) as e:
        train.train_and_evaluate(_config(data, **EVERY), str(workdir))
    assert str(e.value) == (
        f"no intact checkpoint in {folder}: checkpoint(s) 8, 6, 4 are damaged (checkpoint 8: "
        f"file state/_METADATA is missing) and were moved to {folder / 'damaged'}; run the "
        "same command again to train from step 0")
    assert sorted(p.name for p in (folder / "damaged").iterdir()) == ["4-0", "6-0", "8-0"]
    assert _losses(workdir) == _losses(trained)  # nothing cut before the user decides
    summary = train.train_and_evaluate(_config(data, **EVERY), str(workdir))
    assert summary["start_step"] == 0 and _losses(workdir) == _losses(trained)


def test_flipped_bytes_are_caught_by_the_checksum(data, trained, workdir, capsys):
    _flip(_largest_data_file(workdir))
    summary = train.train_and_evaluate(_config(data, num_steps=10, **EVERY), str(workdir))
    assert summary["start_step"] == 6
    [line] = _warnings(capsys.readouterr().err)
    assert "has changed since it was written (SHA-256 differs)" in line
    assert line.endswith("; resuming from checkpoint 6")


def test_nan_right_after_resume_names_that_checkpoint_as_suspect(data, workdir, monkeypatch):
    make_step = train.make_train_step

    def poisoned(model, deterministic):  # NaN from the first step after checkpoint 8
        step = make_step(model, deterministic)

        def nan_after_8(state, inputs, targets, rng):
            new_state, loss = step(state, inputs, targets, rng)
            return new_state, jnp.where(state.step >= N, jnp.nan, loss)
        return nan_after_8
    monkeypatch.setattr(train, "make_train_step", poisoned)
    with pytest.raises(train.guards.NonFiniteLoss) as e:
        train.train_and_evaluate(_config(data, num_steps=10, **EVERY), str(workdir))
    folder = workdir / "checkpoints"
    assert str(e.value) == (
        f"train loss is nan at step 9: stopped without saving that state; checkpoint 8 in "
        f"{folder}, which this run resumed from, is suspect: move it into {folder / 'damaged'} "
        "and run the same command to resume from checkpoint 6")
    assert _steps(workdir) == [4, 6, 8]


def test_full_disk_is_a_disk_error_and_orbax_logs_stay_off_the_terminal(data, tmp_path, capfd):
    disk = tmp_path / "disk"
    disk.mkdir()
    # A 1.5 MB tmpfs holds one checkpoint (about 0.9 MB), not two: mounting needs root.
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)],
                           capture_output=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mount.stderr.decode().strip()}")
    try:
        workdir = disk / "run"
        with pytest.raises(train.BadInput) as e:
            train.train_and_evaluate(_config(data, keep_checkpoints=1, **EVERY), str(workdir))
        message = str(e.value)
        steps, lines = _steps(workdir), _losses(workdir)
        log = (workdir / "orbax.log").read_text() if (workdir / "orbax.log").exists() else ""
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    folder = workdir / "checkpoints"
    assert message.startswith(f"writing checkpoint 4 failed: disk full (")
    assert " MiB free of 1.5 MiB on the file system of " in message
    assert message.endswith(f"{str(folder)!r}); checkpoint 2 is intact; free some space and "
                            "run the same command to resume")
    assert "memory" not in message
    assert steps == [2]
    assert [s for s, _ in lines] == list(range(1, len(lines) + 1)) and len(lines) >= 4
    err = capfd.readouterr().err
    # orbax's records may not fit on the full disk either (the log drops them then), so the
    # log is checked only for what reached it; the terminal must stay clean either way.
    assert "No space left" not in err and "Traceback" not in err, err[-2000:]
    assert not log or "No space left on device" in log, log[-2000:]


def test_library_log_takes_absl_records_off_the_terminal(tmp_path, caplog):
    with runlog.library_log(tmp_path) as path:
        absl_logging.warning("orbax says %d", 7)
    absl_logging.warning("after the block")
    assert "orbax says 7" in path.read_text() and "after the block" not in path.read_text()
    assert caplog.messages == ["after the block"]  # the root logger's handlers saw only that


def test_full_disk_on_a_metrics_line_names_the_file(data, workdir, monkeypatch):
    write = runlog.MetricsLog.write

    def full_at_10(self, line):
        if line["step"] == 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(workdir / runlog.METRICS))
        write(self, line)
    monkeypatch.setattr(runlog.MetricsLog, "write", full_at_10)
    with pytest.raises(train.BadInput) as e:
        train.train_and_evaluate(_config(data, num_steps=10, **EVERY), str(workdir))
    message = str(e.value)
    assert message.startswith(f"writing {workdir / runlog.METRICS} failed: disk full (")
    assert message.endswith("); checkpoint 8 is intact; free some space and run the same "
                            "command to resume")
    assert [s for s, _ in _losses(workdir)] == list(range(1, 10))


def _command(data, workdir, **fields) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in {"num_steps": N, "seq_len": 32, "batch_size": 4,
                                               "num_layers": 1, "remat": "none",
                                               "eval_every": 4, "eval_batches": 1,
                                               "warmup_steps": 2, "dropout_rate": 0.1,
                                               "data": data, **EVERY, **fields}.items()]
    return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
            f"--workdir={workdir}", *flags]


def test_second_run_on_a_workdir_refuses_naming_the_first(data, trained, tmp_path):
    workdir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen(_command(data, workdir, hang_after_step=5), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(180, first.kill)
    watchdog.start()
    try:
        for line in first.stdout:
            if "waiting for a signal after step 5" in line:
                break
        second = subprocess.run(_command(data, workdir), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        first.send_signal(signal.SIGTERM)
        first.communicate()
    finally:
        watchdog.cancel()
    assert second.returncode == 2, second.stderr
    host = (workdir / ".lock").read_text().split(" on ")[1].strip()
    assert second.stderr.splitlines() == [
        f"error: workdir {str(workdir)!r} is in use by another run (PID {first.pid} on {host}, "
        f"which holds {workdir / '.lock'}): wait for it to end or stop it, or use another workdir"]
    assert first.returncode == 128 + signal.SIGTERM
    assert [s for s, _ in _losses(workdir)] == [1, 2, 3, 4, 5]
    # The first run is gone; its lock file (with its PID) is taken over.
    summary = train.train_and_evaluate(_config(data, **EVERY), str(workdir))
    assert summary["start_step"] == 5
    assert _losses(workdir) == _losses(trained)
    assert (workdir / ".lock").read_text().startswith(f"{os.getpid()} on ")


def test_damaged_metrics_lines_are_set_aside_and_the_rest_kept(tmp_path, capsys):
    lines = [json.dumps({"step": s, "train_loss": 1.0 / s}).encode() for s in range(1, 31)]
    bad = [b'{"step": 15, "train_lo#@!', b"[1, 2, 3]", b'{"note": 1}', b'{"step": "x"}',
           b"\xff\xfe\x00\x9crandom"]
    blob = b"\n".join(lines[:14] + bad[:1] + lines[15:] + bad[1:]) + b"\n"
    (tmp_path / runlog.METRICS).write_bytes(blob)
    with runlog.MetricsLog(tmp_path, resume_step=30) as metrics:
        metrics.write({"step": 31, "train_loss": 0.5})
    kept = (tmp_path / runlog.METRICS).read_bytes().splitlines()
    assert kept == lines[:14] + lines[15:] + [json.dumps({"step": 31, "train_loss": 0.5}).encode()]
    aside = tmp_path / (runlog.METRICS + ".damaged")
    assert aside.read_bytes().splitlines() == bad
    assert _warnings(capsys.readouterr().err) == [
        f"warning: {tmp_path / runlog.METRICS}: 5 damaged line(s) moved to {aside}; kept the 29 "
        "intact one(s)"]


def test_damaged_config_history_line_is_set_aside(tmp_path, capsys):
    config = _config(tmp_path / "text.py")
    runlog.record_start(tmp_path, config, "NONE", 0)
    with (tmp_path / runlog.HISTORY).open("ab") as fh:
        fh.write(b'{"from_step": 3}\n\xff\n')
    policies, changed = runlog.record_start(tmp_path, config, "NONE", 3)
    assert policies == [{"from_step": 0, "remat": "none", "policy": "NONE"}] and changed == []
    assert len((tmp_path / runlog.HISTORY).read_text().splitlines()) == 2
    [line] = _warnings(capsys.readouterr().err)
    assert "2 damaged line(s) moved to" in line
