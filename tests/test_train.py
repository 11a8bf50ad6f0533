"""Smoke tests of experiments/train.py: a few steps on a small fixed text, and bad input."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments import train
from experiments.configs import tiny

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Trains tiny for 12 steps; returns (workdir, summary)."""
    tmp = tmp_path_factory.mktemp("train")
    (tmp / "text.py").write_text(TEXT)
    config = tiny.get_config()
    config.data = str(tmp / "text.py")
    config.num_steps, config.log_every, config.eval_every = 12, 2, 5
    config.seq_len, config.batch_size, config.eval_batches = 32, 8, 2
    workdir = tmp / "run"
    return workdir, train.train_and_evaluate(config, str(workdir))


def test_loss_is_finite_and_falls(run):
    workdir, _ = run
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [l["train_loss"] for l in lines]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_metrics_lines_and_keys(run):
    workdir, _ = run
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    # Multiples of log_every=2 or eval_every=5, and the last step.
    assert [l["step"] for l in lines] == [2, 4, 5, 6, 8, 10, 12]
    base = {"step", "train_loss", "lr", "tokens_per_second", "step_seconds"}
    for line in lines:
        assert set(line) == base | ({"eval_loss"} if line["step"] in (5, 10, 12) else set())
        assert line["tokens_per_second"] > 0 and line["step_seconds"] > 0


def test_summary_fields(run):
    workdir, summary = run
    assert json.loads((workdir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert math.isfinite(summary["eval_loss"]) and 0 < summary["eval_loss"] < math.log(256)
    assert summary["median_step_seconds"] > 0
    compiled = summary["compiled"]
    assert compiled["label"] == "XLA CPU compile"
    for which in ("policy", "none"):
        assert compiled[which]["temp_size_in_bytes"] > 0
        assert compiled[which]["flops"] > 0
    # selective remat recomputes the attention scores: more FLOPs, less temp memory.
    assert compiled["policy"]["flops"] > compiled["none"]["flops"]
    assert compiled["policy"]["temp_size_in_bytes"] < compiled["none"]["temp_size_in_bytes"]


@pytest.mark.parametrize("flag, bad", [
    ("--config.remat=minimall", "minimall"),
    ("--config.remat=save:foo_bar", "foo_bar"),
    ("--config.data=/nonexistent", "/nonexistent"),
    ("--config.seq_len=abc", "seq_len"),
    ("--config.vocab_size=100", "vocab_size must be at least 256"),
    ("--config.model=tiny_lama", "tiny_llama"),
])
def test_bad_input_is_one_line_and_exit_2(flag, bad, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
         f"--workdir={tmp_path}", flag],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert bad in proc.stderr and "Traceback" not in proc.stderr


def test_empty_data_folder_is_bad_input(tmp_path):
    config = tiny.get_config()
    config.data = str(tmp_path)
    with pytest.raises(train.BadInput, match="holds no text"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
