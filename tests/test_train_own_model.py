"""experiments.train on a user's own model (--model FILE.py:FUNCTION / config.model):
the policy applied with rk.remat_model, auto:budget= planned on the model's
workload, the compiled step's memory equal to remat_kit.decide.step's
prediction, resume with the same losses, and --model's refusals as one line."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

import remat_kit as rk
from experiments import own_model, train
from experiments.configs import tiny
from remat_kit.cli.inputs import BadInput
from remat_kit.flax import user_model

REPO = pathlib.Path(__file__).resolve().parents[1]
ZOO = REPO / "tests" / "zoo"
TEXT = "".join(f"def h{i}(z):\n    return z + {i} * {i % 3}\n\n" for i in range(300))
BATCH, SEQ, STEPS = 2, 16, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(data file, model file): the zoo GPT (2 layers, width 32) at a byte vocab."""
    folder = tmp_path_factory.mktemp("own")
    (folder / "text.txt").write_text(TEXT)
    (folder / "gpt256.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ZOO)!r})\n"
        "from gpt_linen import GPT, GPTConfig\n\n\n"
        "def model():\n    return GPT(GPTConfig(vocab=256, max_len=16))\n")
    return folder / "text.txt", folder / "gpt256.py"


def _config(files, **fields):
    config = tiny.get_config()
    config.update(dict(model=f"{files[1]}:model", data=str(files[0]), num_steps=STEPS,
                       batch_size=BATCH, seq_len=SEQ, warmup_steps=1, log_every=1,
                       eval_every=STEPS, eval_batches=1, checkpoint_every=2,
                       remat="minimal") | fields)
    return config


def _losses(workdir: pathlib.Path) -> list:
    return [(line["step"], line["train_loss"]) for line in
            map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def minimal(files, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("minimal")
    return workdir, train.train_and_evaluate(_config(files), str(workdir))


def test_compiled_step_equals_step_memory_prediction(files, minimal):
    _, summary = minimal
    config = _config(files)
    model = user_model.load(config.model)[1].model
    predicted = rk.step_memory(rk.from_model.workload(model, BATCH, SEQ), BATCH, SEQ,
                               "minimal", optimizer=train.make_optimizer(config)[0])
    compiled = summary["compiled"]
    assert compiled["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert compiled["predicted"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert compiled["predicted"]["temp_equal"] is True
    # The run's step also carries TrainState.step (int32) and the PRNG key (2 x uint32).
    assert compiled["policy"]["step_bytes"] - predicted.total_bytes == 4 + 8
    assert summary["policy"] == str(rk.parse("minimal"))
    assert [s for s, _ in _losses(minimal[0])] == [1, 2, 3, 4]


def test_resume_from_checkpoint_gives_the_same_losses(files, minimal, tmp_path):
    reference, _ = minimal
    workdir = tmp_path / "resumed"
    shutil.copytree(reference, workdir)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))  # as if stopped after checkpoint 2
    (workdir / "summary.json").unlink()
    summary = train.train_and_evaluate(_config(files), str(workdir))
    assert summary["start_step"] == 2
    assert _losses(workdir) == _losses(reference)


def test_auto_budget_is_planned_on_the_models_workload(files, tmp_path):
    config = _config(files, remat="auto:budget=0.8", num_steps=2, checkpoint_every=2)
    summary = train.train_and_evaluate(config, str(tmp_path))
    model = user_model.load(config.model)[1].model
    # The run's plan cache answers only for this very program (it is keyed by it).
    plan = rk.Planner(rk.from_model.workload(model, BATCH, SEQ),
                      cache=str(tmp_path / "plans.json")).plan("0.8")
    spec = " | ".join(plan.layer_specs) if plan.layer_specs else plan.spec
    assert summary["policy"] == spec
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == \
        summary["compiled"]["predicted"]["temp_size_in_bytes"]
    assert summary["compiled"]["predicted"]["temp_equal"] is True
    assert (tmp_path / "plans.json").exists()  # a restart reads the plan back


def test_a_model_with_a_small_vocab_is_refused_in_one_line(files, tmp_path):
    config = _config(files, model=f"{ZOO / 'gpt_linen.py'}:model")
    with pytest.raises(BadInput) as e:
        train.train_and_evaluate(config, str(tmp_path))
    assert str(e.value) == (f"--model {config.model!r}: its logits have vocab 64; the data is "
                            "bytes, one token per byte value: the model needs a vocab of at "
                            "least 256")
    assert not (tmp_path / "checkpoints").exists()


def test_reference_sizes_with_a_user_model_are_refused(files, tmp_path):
    with pytest.raises(BadInput, match=r"^config.num_layers size the reference model"):
        train.train_and_evaluate(_config(files, num_layers=2), str(tmp_path))


def test_bad_model_flag_is_one_line_exit_2(files, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
         "--model=nowhere.py:model", f"--config.data={files[0]}", f"--workdir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --model 'nowhere.py:model': file 'nowhere.py' not found"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_is_own_tells_specs_from_config_names():
    assert own_model.is_own("tests/zoo/gpt_linen.py:model")
    assert not own_model.is_own("tiny")


def test_sweep_measures_the_users_model_as_compare_does(files, tmp_path):
    from experiments import sweep

    config = _config(files, model=f"{ZOO / 'gpt_linen.py'}:model")
    rows = sweep.sweep(config, str(tmp_path), "none,minimal", steps=1)
    model = user_model.load(config.model)[1].model
    records = rk.measure(rk.from_model.workload(model, BATCH, SEQ), policies=["none", "minimal"])
    assert {r["policy"]: r["temp_size_in_bytes"] for r in rows} == {
        r.policy: r.temp_size_in_bytes for r in records}
    assert json.loads((tmp_path / "records.json").read_text())["context"]["config"] == \
        config.model


def test_sweep_refuses_a_bad_model_in_one_line(files, tmp_path):
    from experiments import sweep

    with pytest.raises(BadInput, match=r"^--model 'nowhere.py:model': file 'nowhere.py' "
                                        r"not found$"):
        sweep.sweep(_config(files, model="nowhere.py:model"), str(tmp_path), "none", steps=1)
