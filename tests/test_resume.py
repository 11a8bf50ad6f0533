"""Runs that survive: checkpoints, resume after SIGKILL and SIGTERM, a policy switch on
resume, metrics without lost or repeated steps, and the guards.

The interrupted runs are subprocesses stopped at a known step by config.hang_after_step
(the run finishes its checkpoint writes, prints a line and waits for a signal); each
is resumed in-process and compared with one uninterrupted run.
"""

import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import threading

import chex
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import guards, runlog, train
from experiments.configs import tiny

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = "".join(f"def g{i}(y):\n    return y - {i} * {i % 5}\n\n" for i in range(300))
N = 8  # steps of every run
FIELDS = dict(num_steps=N, seq_len=32, batch_size=4, log_every=1, eval_every=4,
              eval_batches=1, checkpoint_every=3, warmup_steps=2, dropout_rate=0.1,
              remat="none", num_layers=1)


def _config(data: pathlib.Path, **fields):
    config = tiny.get_config()
    config.update({**FIELDS, "data": str(data), **fields})
    return config


def _losses(workdir: pathlib.Path) -> list[tuple[int, float]]:
    return [(line["step"], line["train_loss"]) for line in
            map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]


def _state(workdir: pathlib.Path, step: int) -> dict:
    """The arrays of checkpoint `step`, as numpy, read without a target."""
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


def _tensorboard_losses(path: pathlib.Path) -> list[tuple[int, float]]:
    """(step, train_loss) of one TensorBoard event file (TFRecord: 8-byte length,
    4-byte CRC, the Event proto, 4-byte CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    blob, out, at = path.read_bytes(), [], 0
    while at < len(blob):
        size = int.from_bytes(blob[at:at + 8], "little")
        event = Event.FromString(blob[at + 12:at + 12 + size])
        at += 12 + size + 4
        out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "train_loss"]
    return out


def _steps(workdir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _stopped_run(data: pathlib.Path, workdir: pathlib.Path, hang: int, signum: int,
                 **fields) -> subprocess.CompletedProcess:
    """Runs experiments.train in a subprocess until it hangs after step `hang`,
    then sends `signum`; returns the finished process."""
    flags = [f"--config.{k}={v}" for k, v in {**FIELDS, "data": data, **fields,
                                               "hang_after_step": hang}.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
         f"--workdir={workdir}", *flags], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    watchdog = threading.Timer(180, proc.kill)  # a run that never hangs fails, not blocks
    watchdog.start()
    try:
        for line in proc.stdout:
            if f"waiting for a signal after step {hang}" in line:
                proc.send_signal(signum)
                break
        stdout, stderr = proc.communicate()
    finally:
        watchdog.cancel()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "text.py"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> pathlib.Path:
    """The uninterrupted run's workdir: N steps under no remat."""
    workdir = tmp_path_factory.mktemp("reference")
    train.train_and_evaluate(_config(data), str(workdir))
    return workdir


def test_uninterrupted_run_checkpoints_and_history(reference):
    assert _steps(reference) == [3, 6, 8]  # every 3 steps and the last, keeping 3
    assert [s for s, _ in _losses(reference)] == list(range(1, N + 1))
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["policies"] == [{"from_step": 0, "remat": "none", "policy": "none"}]
    saved = summary["checkpoint"]
    assert saved["step"] == N and saved["bytes"] > 0
    assert 0 < saved["blocking_seconds"] <= saved["write_seconds"]
    saved = _state(reference, N)
    assert int(saved["step"]) == N
    history = [json.loads(l) for l in (reference / "config_history.jsonl").read_text().splitlines()]
    assert [(h["from_step"], h["remat"]) for h in history] == [(0, "none")]
    assert json.loads((reference / "config.json").read_text())["num_steps"] == N


def test_starting_a_finished_run_again_changes_nothing(data, reference, tmp_path):
    workdir = tmp_path / "copy"
    shutil.copytree(reference, workdir)
    before = {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    summary = train.train_and_evaluate(_config(data), str(workdir))
    assert summary == json.loads(before["summary.json"])
    after = {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    assert after["summary.json"] == before["summary.json"]
    assert after["metrics.jsonl"] == before["metrics.jsonl"]


def test_sigkill_then_resume_is_bitwise_equal(data, reference, tmp_path):
    proc = _stopped_run(data, tmp_path, hang=5, signum=signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # Killed after step 5: its metrics lines are there, its last checkpoint is step 3.
    assert [s for s, _ in _losses(tmp_path)] == [1, 2, 3, 4, 5]
    assert _steps(tmp_path) == [3]

    summary = train.train_and_evaluate(_config(data, tensorboard=True), str(tmp_path))
    assert summary["start_step"] == 3
    # Lines 4 and 5 were trimmed and trained again: N lines, losses bitwise equal.
    assert _losses(tmp_path) == _losses(reference)
    chex.assert_trees_all_equal(_state(tmp_path, N), _state(reference, N))
    # TensorBoard gets the resumed steps (float32 scalars).
    [events] = (tmp_path / "tensorboard").iterdir()
    tb_steps, tb_losses = zip(*_tensorboard_losses(events))
    assert tb_steps == tuple(range(4, N + 1))
    np.testing.assert_array_equal(np.float32([l for _, l in _losses(reference)[3:]]), tb_losses)


def test_sigterm_checkpoints_then_resume_under_another_policy(data, reference, tmp_path):
    proc = _stopped_run(data, tmp_path, hang=4, signum=signal.SIGTERM, remat="full")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stopped: SIGTERM after step 4: wrote checkpoint 4 in {tmp_path / 'checkpoints'}; "
        "run the same command to resume")
    assert _steps(tmp_path) == [3, 4]

    summary = train.train_and_evaluate(_config(data, remat="minimal"), str(tmp_path))
    assert summary["start_step"] == 4
    assert [p["remat"] for p in summary["policies"]] == ["full", "minimal"]
    assert [p["from_step"] for p in summary["policies"]] == [0, 4]
    history = (tmp_path / "config_history.jsonl").read_text().splitlines()
    assert [json.loads(h)["remat"] for h in history] == ["full", "minimal"]
    # Remat changes memory and time, never the maths: the losses of the
    # uninterrupted no-remat run, within f32 rounding.
    ours, ref = _losses(tmp_path), _losses(reference)
    assert [s for s, _ in ours] == list(range(1, N + 1))
    np.testing.assert_allclose([l for _, l in ours], [l for _, l in ref], rtol=1e-5)
    chex.assert_trees_all_close(_state(tmp_path, N)["params"], _state(reference, N)["params"],
                                rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fields, message", [
    ({"d_model": 32}, "parameter 'embed/embedding' is (256, 64) float32, this model's is "
                      "(256, 32) float32; it holds another model's checkpoint"),
    ({"num_layers": 2}, "has no parameter 'layers_1/"),
    ({"seed": 1}, "was trained with seed 0, which fixes its data order and dropout"),
    ({"num_steps": 5}, "config.num_steps=5, but "),
])
def test_mismatched_checkpoint_is_bad_input(data, reference, fields, message):
    before = (reference / "config_history.jsonl").read_text()
    with pytest.raises(train.BadInput) as e:
        train.train_and_evaluate(_config(data, **fields), str(reference))
    assert message in str(e.value)
    assert (reference / "config_history.jsonl").read_text() == before  # nothing recorded


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(data, tmp_path, monkeypatch):
    make_step = train.make_train_step

    def poisoned(model, deterministic):  # the loss turns NaN at step 5
        step = make_step(model, deterministic)

        def nan_from_5(state, inputs, targets, rng):
            new_state, loss = step(state, inputs, targets, rng)
            return new_state, jnp.where(state.step >= 4, jnp.nan, loss)
        return nan_from_5
    monkeypatch.setattr(train, "make_train_step", poisoned)
    with pytest.raises(guards.NonFiniteLoss) as e:
        train.train_and_evaluate(_config(data), str(tmp_path))
    assert str(e.value).startswith(
        f"train loss is nan at step 5: stopped without saving that state; the last good "
        f"checkpoint is step 3 in {tmp_path / 'checkpoints'}")
    assert _steps(tmp_path) == [3]
    assert [s for s, _ in _losses(tmp_path)] == [1, 2, 3, 4]


def test_failed_checkpoint_write_keeps_the_previous(data, reference, tmp_path):
    # A file-size limit makes every larger write fail (EFBIG), as a full disk would.
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, hard))
    try:
        with pytest.raises(train.BadInput) as e:
            train.train_and_evaluate(_config(data, num_steps=9), str(workdir))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value).startswith(f"writing checkpoint 9 in {str(workdir / 'checkpoints')!r} "
                                   "failed (")
    assert str(e.value).endswith("; checkpoint 8 is intact")
    assert _steps(workdir) == [3, 6, 8]
    chex.assert_trees_all_equal(_state(workdir, N), _state(reference, N))


def test_policies_leave_out_lost_starts(tmp_path):
    # full from 0; minimal from 6 (died before its first checkpoint); resumed at 3 under
    # selective; then at 9 under selective again.
    for remat, step in (("full", 0), ("minimal", 6), ("selective", 3)):
        runlog.record_start(tmp_path, _with(remat), remat.upper(), step)
    policies, changed = runlog.record_start(tmp_path, _with("selective"), "SELECTIVE", 9)
    assert policies == [{"from_step": 0, "remat": "full", "policy": "FULL"},
                        {"from_step": 3, "remat": "selective", "policy": "SELECTIVE"}]
    assert changed == []
    assert len((tmp_path / runlog.HISTORY).read_text().splitlines()) == 4
    assert json.loads((tmp_path / runlog.CONFIG).read_text())["remat"] == "selective"


def _with(remat):
    config = tiny.get_config()
    config.remat = remat
    return config


def test_metrics_cut_back_to_the_resumed_step(tmp_path):
    lines = [json.dumps({"step": s, "train_loss": 1.0 / s}) for s in range(1, 6)]
    # The last line was cut short by a crash mid-write.
    (tmp_path / runlog.METRICS).write_text("\n".join(lines) + '\n{"step": 6, "tra')
    with runlog.MetricsLog(tmp_path, resume_step=3) as metrics:
        metrics.write({"step": 4, "train_loss": 0.5})
    assert (tmp_path / runlog.METRICS).read_text().splitlines() == lines[:3] + [
        json.dumps({"step": 4, "train_loss": 0.5})]
