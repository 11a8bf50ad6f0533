"""Stops: signals, a read-only checkpoint folder, a metrics file that is a
folder. Each test failed on the tree before the fix. The signals are sent at a
controlled point: by the model file itself (at import, in FUNCTION) or by a hook
on `Checkpoints.save` in the training subprocess, never after a sleep.

Item 11: Ctrl-C and SIGTERM gave tracebacks (XLA's SIGTERM stack trace), and in
training, just after the last save started, no summary.json (SIGINT) or a
leftover STEP.orbax-checkpoint-tmp (SIGTERM). Item 10: a read-only checkpoints/
folder hung the run after its error. Item 15: a metrics.jsonl folder was an
IsADirectoryError traceback.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import train
from test_resume import REPO, _config
from test_train_faults import EVERY, N, data, trained, workdir  # noqa: F401 - fixtures

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize("signum,where", [(signal.SIGINT, "function"),
                                          (signal.SIGTERM, "import")])
def test_a_command_stopped_by_a_signal_says_so_in_one_line(tmp_path, signum, where):
    path = tmp_path / "stops.py"
    send = f"os.kill(os.getpid(), {int(signum)})\n"
    path.write_text("import os\n" + (send if where == "import" else "")
                    + "def model():\n    " + (send if where == "function" else "pass\n"))
    proc = subprocess.run([sys.executable, "-m", "remat_kit.cli", "compare", "--model",
                           f"{path}:model"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 128 + signum, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"remat-kit compare: stopped by {signal.Signals(signum).name}; "
                           "kept: what was compiled or planned before it, in the compile "
                           "cache "), line
    assert line.endswith("; no report was written")


# A model file that stops its own command: a SIGTERM sent inside a gc callback (where a raised
# exception is swallowed: "Exception ignored in ..."), or two signals 20 ms apart from a thread
# while the command sleeps in the model's function.
STOPPING = """
import gc, os, signal, threading, time
import flax.linen as nn

class M(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(16)(nn.Embed(16, 8)(tokens))

def model():
    pid, mode = os.getpid(), os.environ["STOP_MODE"]
    if mode == "gc":
        def callback(phase, info, sent=[]):
            if not sent:
                sent.append(os.kill(pid, signal.SIGTERM))
        gc.callbacks.append(callback)
        gc.collect()
        gc.callbacks.remove(callback)
    else:
        first, second = (signal.SIGINT, getattr(signal, mode))
        def send():
            os.kill(pid, first)
            time.sleep(0.02)
            os.kill(pid, second)
        threading.Thread(target=send).start()
        time.sleep(10)
    return M()
"""


@pytest.mark.parametrize("mode, signum", [("gc", signal.SIGTERM), ("SIGINT", signal.SIGINT),
                                          ("SIGTERM", signal.SIGINT)])
def test_a_signal_swallowed_or_repeated_still_stops_in_one_line(tmp_path, mode, signum):
    """A stop raised inside a callback that swallows it is raised again (no report, 143);
    a second signal, of either kind, 20 ms after the first: the first's one line and
    status, no traceback, no abort."""
    path, report = tmp_path / "stopping.py", tmp_path / "report.json"
    path.write_text(STOPPING)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "remat_kit.cli", "compare", "--model",
                           f"{path}:model", "--batch", "2", "--seq", "8", "--policies", "none",
                           "--json", report], cwd=REPO, env={**ENV, "STOP_MODE": mode},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signum, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"remat-kit compare: stopped by {signal.Signals(signum).name}; ")
    assert not report.exists() and time.perf_counter() - start < 60


# Runs experiments.train with a hook: right after the last checkpoint's save starts
# (its write still going on in the background), the process sends itself a signal.
HOOKED = """
import os, sys
from absl import app
from experiments import checkpoint, common, train
real = checkpoint.Checkpoints.save
def save(self, step, *args):
    real(self, step, *args)
    if step == int(os.environ["LAST_STEP"]):
        os.kill(os.getpid(), int(os.environ["STOP_SIGNAL"]))
checkpoint.Checkpoints.save = save
app.run(train.main, flags_parser=common.parse_flags)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_the_last_save_keeps_a_whole_run(data, tmp_path, signum):  # noqa: F811
    steps = 2
    flags = [f"--config.{k}={v}" for k, v in {
        "num_steps": steps, "seq_len": 32, "batch_size": 4, "num_layers": 1, "remat": "none",
        "eval_every": 2, "eval_batches": 1, "warmup_steps": 1, "checkpoint_every": 2,
        "data": data}.items()]
    proc = subprocess.run(
        [sys.executable, "-c", HOOKED, "--config=experiments/configs/tiny.py",
         f"--workdir={tmp_path}", *flags], cwd=REPO, capture_output=True, text=True,
        timeout=180, env={**ENV, "LAST_STEP": str(steps), "STOP_SIGNAL": str(int(signum))})
    assert proc.returncode == 128 + signum, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stopped: {signal.Signals(signum).name} after the last step {steps}: the run "
        f"finished; checkpoint {steps} and summary.json are written in {tmp_path}")
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "summary.json").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(steps)]


def test_a_read_only_checkpoint_folder_stops_at_once(data, workdir):  # noqa: F811
    folder = workdir / "checkpoints"
    mounted = subprocess.run(f"mount --bind {folder} {folder} && "
                             f"mount -o remount,bind,ro {folder}", shell=True,
                             capture_output=True, text=True)
    if mounted.returncode:
        subprocess.run(["umount", str(folder)], capture_output=True)
        pytest.skip(f"cannot mount read-only: {mounted.stderr.strip()}")
    metrics = (workdir / "metrics.jsonl").read_text()
    try:
        with pytest.raises(train.BadInput) as e:
            train.train_and_evaluate(_config(data, num_steps=N + 2, **EVERY), str(workdir))
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert str(e.value) == (
        f"checkpoint folder {str(folder.absolute())!r} cannot be written (Read-only file "
        f"system); checkpoint {N} is intact; make it writable or use another workdir")
    assert (workdir / "metrics.jsonl").read_text() == metrics  # nothing trained


def test_a_metrics_file_that_is_a_folder_is_one_line(data, tmp_path):  # noqa: F811
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(train.BadInput) as e:
        train.train_and_evaluate(_config(data, num_steps=2), str(tmp_path))
    assert str(e.value) == (
        f"--workdir: {str(tmp_path / 'metrics.jsonl')!r} is a folder, not a regular file; "
        "the run writes metrics.jsonl there: move it away or use another workdir")


def test_what_a_stopped_plan_keeps_names_only_a_plan_cache_that_exists(tmp_path):
    import argparse

    import jax

    from remat_kit.cli import stops
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    cache = tmp_path / "x.json"
    args = argparse.Namespace(command="plan", cache=str(cache))
    try:
        assert stops.kept(args) == "nothing was kept (no cache folder is set)"
        cache.write_text("{}")
        assert stops.kept(args) == (f"kept: what was compiled or planned before it, in the "
                                    f"plan cache {str(cache)!r}; no report was written")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_signal_the_process_ignores_stays_ignored():
    """A shell's background job starts with SIGINT ignored: a command does not take it up."""
    from remat_kit.cli import stops
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stops.catching():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
