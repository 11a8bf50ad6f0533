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


# ml_collections loads the config file with importlib's load_module (deprecated); a
# process started with -m does not show a DeprecationWarning, so neither does this test.
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated")
@pytest.mark.parametrize("flag, bad", [
    ("--config.remat=minimall", "minimall"),
    ("--config.remat=save:foo_bar", "foo_bar"),
    ("--config.data=/nonexistent", "/nonexistent"),
    ("--config.seq_len=abc", "seq_len"),
    ("--config.vocab_size=100", "vocab_size must be at least 256"),
    ("--config.model=tiny_lama", "tiny_llama"),
    ("--workdir=", "--workdir is empty"),
])
def test_bad_input_is_one_line_and_exit_2(flag, bad, tmp_path, capsys, monkeypatch):
    # In this process, as `app.run` calls them: the flags of sys.argv (ml_collections
    # reads --config.FIELD overrides there), then main. A whole process's exit 2 and
    # one line: test_bad_config_file_is_one_line_and_exit_2.
    from absl import flags
    argv = ["train", "--config=experiments/configs/tiny.py", f"--workdir={tmp_path}", flag]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        with pytest.raises(SystemExit) as exited:
            train.main(train.parse_flags(list(argv)))
    finally:  # the next test parses its own, and ml_collections defines its overrides again
        flags.FLAGS.unparse_flags()
        for name in [n for n in flags.FLAGS if n.startswith("config.")]:
            delattr(flags.FLAGS, name)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert bad in err and "Traceback" not in err


def _script(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, bad", [
    (["--steps=abc", "--workdir=W"], "--steps=abc"),
    ([], "--workdir must have a value"),
    (["--workdir=W", "--config.bogus=1"], "unknown config field 'bogus'"),
    (["--workdir=W", "extra"], "unexpected arguments ['extra']"),
])
def test_sweep_bad_flags_are_one_line_and_exit_2(args, bad, tmp_path):
    args = [a.replace("W", str(tmp_path / "out")) for a in args]
    proc = _script("experiments.sweep", "--config=experiments/configs/tiny.py", *args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert bad in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("policies, steps, fields, message", [
    ("full,,none", 1, {}, "empty policy at item 2 of 'full,,none'"),
    ("", 1, {}, "--policies is empty"),
    ("full", 0, {}, "--steps must be a positive int"),
    ("full", 1, {"seq_len": 100_000}, "batch_size=8, seq_len=100000 do not fit"),
])
def test_sweep_rejects_before_measuring(policies, steps, fields, message, tmp_path):
    from experiments.sweep import sweep

    config = tiny.get_config()
    config.update(fields)
    with pytest.raises(train.BadInput, match=message):
        sweep(config, str(tmp_path / "out"), policies, steps)


@pytest.mark.parametrize("module, source, bad", [
    ("experiments.train", "raise RuntimeError('boom')", "failed to load: RuntimeError: boom"),
    ("experiments.sweep", "def get_config(:", "has a syntax error"),
])
def test_bad_config_file_is_one_line_and_exit_2(module, source, bad, tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(source + "\n")
    proc = _script(module, f"--config={path}", f"--workdir={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"config file '{path}' {bad}" in proc.stderr


@pytest.mark.parametrize("field, value, message", [
    ("seed", -1, "config.seed must be an int >= 0"),
    ("learning_rate", float("nan"), "config.learning_rate must be a number in (0, inf), got nan"),
    ("learning_rate", -1.0, "config.learning_rate must be a number in (0, inf)"),
    ("warmup_steps", -1, "config.warmup_steps must be an int >= 0"),
    ("warmup_steps", 100, "config.warmup_steps (100) must be at most config.num_steps (20)"),
    ("b2", 1.0, "config.b2 must be a number in [0, 1)"),
    ("batch_size", 2**40, "config.batch_size must be a positive int (at most 2147483647)"),
    ("checkpoint_every", 0, "config.checkpoint_every must be a positive int"),
    ("hang_after_step", -1, "config.hang_after_step must be an int >= 0"),
])
def test_bad_fields_are_rejected_before_the_workdir(field, value, message, tmp_path):
    config = tiny.get_config()
    config[field] = value
    with pytest.raises(train.BadInput) as e:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("field, value, message", [
    ("seq_len", 100_000, "seq_len=100000 do not fit: one layer's attention scores"),
    ("batch_size", 1_000_000, "batch_size=1000000, seq_len=64 do not fit"),
    ("data", "binary", "is not text"),
])
def test_sizes_and_data_are_checked_before_compiling(field, value, message, tmp_path):
    config = tiny.get_config()
    if value == "binary":
        value = str(tmp_path / "blob.bin")
        pathlib.Path(value).write_bytes(bytes(range(256)) * 64)
    config[field] = value
    with pytest.raises(train.BadInput, match=message):
        train.train_and_evaluate(config, str(tmp_path / "run"))


@pytest.mark.parametrize("workdir, message", [
    ("file", "is a file, not a folder"),
    ("/proc/remat_kit_x", "cannot write in folder '/proc/remat_kit_x'"),
])
def test_unusable_workdir_is_bad_input(workdir, message, tmp_path):
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(train.BadInput, match=message):
        train.train_and_evaluate(tiny.get_config(), str(tmp_path / workdir))
    assert (tmp_path / "file").read_text() == "keep me"


def test_empty_data_folder_is_bad_input(tmp_path):
    config = tiny.get_config()
    config.data = str(tmp_path)
    with pytest.raises(train.BadInput, match="holds no text"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
