"""experiments.train on a user's own model (--model FILE.py:FUNCTION / config.model),
linen and NNX: the policy applied with rk.remat_model, auto:budget= planned on
the model's workload, the compiled step's memory equal to remat_kit.decide.step's
prediction, resume with the same losses, and --model's refusals as one line."""

import json
import pathlib
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_kit as rk
from experiments import data, own_model, train, train_setup
from experiments.common import one_line_warnings
from experiments.configs import tiny
from remat_kit.ui.inputs import BadInput
from remat_kit.flax import user_model
from remat_kit.decide import step as stepping
from remat_kit.flax.from_model import next_token_loss
from remat_kit.measure import targets

REPO = pathlib.Path(__file__).resolve().parents[1]
ZOO = REPO / "tests" / "zoo"
TEXT = "".join(f"def h{i}(z):\n    return z + {i} * {i % 3}\n\n" for i in range(300))
BATCH, SEQ, STEPS = 2, 16, 4


# The zoo models at a byte vocab (2 layers, width 32): FUNCTION bodies of a model file.
MODELS = {
    "gpt256": "from gpt_linen import GPT, GPTConfig\n\n\n"
              "def model():\n    return GPT(GPTConfig(vocab=256, max_len=16))\n",
    "llama256": "from flax import nnx\nfrom llama_nnx import Llama, LlamaConfig\n\n\n"
                "def model():\n    return Llama(LlamaConfig(vocab=256), rngs=nnx.Rngs(0))\n\n\n"
                "class Counted(Llama):\n    def __call__(self, tokens):\n"
                "        self.seen[...] += 1\n        return super().__call__(tokens)\n\n\n"
                "def with_stat():\n    m = Counted(LlamaConfig(vocab=256), rngs=nnx.Rngs(0))\n"
                "    m.seen = nnx.BatchStat(jnp.zeros(()))\n    return m\n",
    # Dropouts at rate 0 holding nnx.Rngs, pytree=False modules (dantinox's way).
    "graph256": "import graph_nnx\n\ngraph_nnx.VOCAB = 256\n\n\n"
                "def model():\n    return graph_nnx.model()\n",
    "scan256": "from flax import nnx\nimport scan_nnx\n\nscan_nnx.VOCAB = 256\n\n\n"
               "def model():\n    return scan_nnx.GPT(True, rngs=nnx.Rngs(0))\n",
    # Its own mesh over 2 of the 8 host devices: 8-device steps crawl on 2 busy cores.
    "mesh256": "import jax\nimport numpy as np\nfrom jax.sharding import Mesh\nimport mesh_linen\n\n"
               "mesh_linen.MESH = Mesh(np.array(jax.devices()[:2]), ('data',))\n\n\n"
               "def model():\n    return mesh_linen.Model(vocab=256)\n",
    # Logical axes and rules on its boxes, over its own mesh in device order [0, 2, 1, 3].
    "ordered256": "import dataclasses\nimport logical_linen\n\n\n"
                  "def model():\n    m = logical_linen.ordered()\n"
                  "    return m.clone(cfg=dataclasses.replace(m.cfg, vocab=256))\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(data file, the linen GPT's file, the folder holding every MODELS file)."""
    folder = tmp_path_factory.mktemp("own")
    (folder / "text.txt").write_text(TEXT)
    for name, body in MODELS.items():
        (folder / f"{name}.py").write_text(
            # Appended, not first: tests/zoo/nano_moe.py would shadow the nano_moe package
            # for the rest of the process (test_roles imports the package).
            f"import sys\nsys.path.append({str(ZOO)!r})\nimport jax.numpy as jnp\n{body}")
    return folder / "text.txt", folder / "gpt256.py", folder


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


def _resumed(reference: pathlib.Path, workdir: pathlib.Path, config) -> dict:
    """The run of `reference` started again as if stopped after its second-to-last
    checkpoint: that run's summary."""
    shutil.copytree(reference, workdir)
    last = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    shutil.rmtree(workdir / "checkpoints" / str(last))
    (workdir / "summary.json").unlink()
    return train.train_and_evaluate(config, str(workdir))


def _prediction(config, policy="minimal"):
    """rk.step_memory of config.model under `policy` with the run's optimizer."""
    model = user_model.load(config.model)[1].model
    return rk.step_memory(rk.from_model.workload(model, BATCH, SEQ), BATCH, SEQ, policy,
                          optimizer=train_setup.make_optimizer(config)[0])


@pytest.fixture(scope="module")
def minimal(files, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("minimal")
    return workdir, train.train_and_evaluate(_config(files), str(workdir))


def test_the_step_0_line_says_the_figure_is_fits_with_the_optimizer_update():
    predicted = stepping.StepMemory(
        total_bytes=3 << 20, source="peak_memory_in_bytes", params_bytes=1 << 20,
        grads_bytes=1 << 20, opt_state_bytes=0, other_bytes=1 << 20, temp_size_in_bytes=1 << 20,
        argument_size_in_bytes=None, output_size_in_bytes=None, alias_size_in_bytes=None,
        peak_memory_in_bytes=None, flops=7.0, compile_seconds=0.1)
    line, entry = own_model.check_line({"temp_size_in_bytes": 1 << 20,
                                        "step_bytes": (3 << 20) + 12}, predicted, step=4)
    assert line == ("step 4: compiled train step (value, grad and optimizer update) temp "
                    "1.000 MiB, in use 3.000 MiB; predicted (remat_kit.decide.step, as fit "
                    "prices it: same policy, shape and optimizer) temp 1.000 MiB, in use "
                    "3.000 MiB: temp equal")
    assert entry == {"temp_size_in_bytes": 1 << 20, "step_bytes": 3 << 20, "flops": 7.0,
                     "temp_equal": True}


def test_compiled_step_equals_step_memory_prediction(files, minimal):
    _, summary = minimal
    predicted = _prediction(_config(files))
    compiled = summary["compiled"]
    assert compiled["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert compiled["predicted"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert compiled["predicted"]["temp_equal"] is True
    # The run's step also carries TrainState.step (int32) and the PRNG key (2 x uint32).
    assert compiled["policy"]["step_bytes"] - predicted.total_bytes == 4 + 8
    assert compiled["policy"]["flops"] == predicted.flops + 1  # TrainState's step + 1
    assert summary["policy"] == str(rk.parse("minimal"))
    assert [s for s, _ in _losses(minimal[0])] == [1, 2, 3, 4]


def test_resume_from_checkpoint_gives_the_same_losses(files, minimal, tmp_path):
    reference, _ = minimal
    workdir = tmp_path / "resumed"
    summary = _resumed(reference, workdir, _config(files))
    assert summary["start_step"] == 2
    assert _losses(workdir) == _losses(reference)


def test_auto_budget_is_planned_on_the_models_workload_and_resumes(files, tmp_path):
    config = _config(files, remat="auto:budget=0.8", num_steps=3, checkpoint_every=2)
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
    model = user_model.load(config.model)[1].model
    # The run's plan cache answers only for this very program (it is keyed by it).
    plan = rk.Planner(rk.from_model.workload(model, BATCH, SEQ),
                      cache=str(tmp_path / "run" / "plans.json")).plan("0.8")
    spec = " | ".join(plan.layer_specs) if plan.layer_specs else plan.spec
    assert summary["policy"] == spec
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == \
        summary["compiled"]["predicted"]["temp_size_in_bytes"]
    assert summary["compiled"]["predicted"]["temp_equal"] is True
    assert (tmp_path / "run" / "plans.json").exists()  # a restart reads the plan back
    resumed = _resumed(tmp_path / "run", tmp_path / "resumed", config)
    assert resumed["start_step"] == 2 and resumed["policy"] == spec
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "run")
    assert resumed["eval_loss"] == summary["eval_loss"]


def _nnx(files, function="llama256.py:model", **fields):
    return _config(files, model=f"{files[2] / function}", **fields)


@pytest.fixture(scope="module")
def llama(files, tmp_path_factory):
    """(workdir, config, summary) of 3 steps of the zoo NNX Llama under minimal."""
    workdir = tmp_path_factory.mktemp("llama")
    config = _nnx(files, num_steps=3)
    return workdir, config, train.train_and_evaluate(config, str(workdir))


def test_nnx_model_trains_its_own_arrays_under_the_predicted_program(files, llama):
    workdir, config, summary = llama
    predicted = _prediction(config)
    compiled = summary["compiled"]
    assert compiled["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert compiled["predicted"]["temp_equal"] is True
    assert compiled["policy"]["step_bytes"] - predicted.total_bytes == 4 + 8
    assert compiled["policy"]["flops"] == predicted.flops + 1  # TrainState's step + 1
    assert [s for s, _ in _losses(workdir)] == [1, 2, 3]
    # Step 1's loss is the built model's own (no remat, its arrays) on batch 0.
    model = user_model.load(config.model)[1].model
    inputs, _ = data.train_batches(data.load_corpus(config.data).train, BATCH, SEQ,
                                   config.seed)(0)
    own = next_token_loss(model(jnp.asarray(inputs)), jnp.asarray(inputs))
    assert _losses(workdir)[0][1] == pytest.approx(float(own), rel=1e-6)
    assert summary["num_params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model,
                                                                                  nnx.Param)))


def test_nnx_model_resumes_with_the_same_losses(llama, tmp_path):
    reference, config, summary = llama
    resumed = _resumed(reference, tmp_path / "resumed", config)
    assert resumed["start_step"] == 2
    assert _losses(tmp_path / "resumed") == _losses(reference)
    assert resumed["eval_loss"] == summary["eval_loss"]


def test_nnx_model_resumes_under_another_policy(llama, tmp_path):
    reference, config, _ = llama
    full = config.copy_and_resolve_references()
    full.remat = "full"
    resumed = _resumed(reference, tmp_path / "resumed", full)
    assert [(p["from_step"], p["remat"]) for p in resumed["policies"]] == [(0, "minimal"),
                                                                          (2, "full")]
    # Recomputing changes no value: step 3's loss as the run that stayed on minimal.
    (step, loss), (ref_step, ref_loss) = _losses(tmp_path / "resumed")[-1], _losses(reference)[-1]
    assert step == ref_step == 3 and loss == pytest.approx(ref_loss, rel=1e-6)


def test_nnx_checkpoint_of_another_model_is_refused_in_one_line(files, llama, tmp_path):
    shutil.copytree(llama[0], tmp_path / "run")
    with pytest.raises(BadInput, match=r"^checkpoint .*/3 has no parameter 'blocks/.*/value' "
                                       r"\(this model's is .*\); it holds another model's"):
        train.train_and_evaluate(_nnx(files, "scan256.py:model", num_steps=3),
                                 str(tmp_path / "run"))


def test_nnx_auto_budget_is_planned_on_the_models_workload(files, tmp_path):
    config = _nnx(files, remat="auto:budget=0.8", num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path))
    model = user_model.load(config.model)[1].model
    plan = rk.Planner(rk.from_model.workload(model, BATCH, SEQ),
                      cache=str(tmp_path / "plans.json")).plan("0.8")
    assert summary["policy"] == (" | ".join(plan.layer_specs) if plan.layer_specs
                                 else plan.spec)
    assert summary["compiled"]["predicted"]["temp_equal"] is True


def _plan_file(folder: pathlib.Path, layers: int = 2) -> pathlib.Path:
    """A `remat-kit plan --json` file of two per-layer plans for the zoo NNX Llama."""
    folder.mkdir(exist_ok=True)
    path = folder / "plan.json"
    path.write_text(json.dumps({
        "context": {"block": "TransformerBlock", "num_layers": layers},
        "budgets": [{"budget": "0.5", "plan": {"spec": "full", "layer_specs": ["full"] * 2}},
                    {"budget": "0.8", "plan": {"spec": "none",
                                               "layer_specs": ["full", "minimal"]}}]}))
    return path


def test_nnx_model_trains_a_per_layer_plan_file(files, tmp_path):
    config = _nnx(files, remat=f"{_plan_file(tmp_path)}@0.8", num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
    model = user_model.load(config.model)[1].model
    predicted = stepping.compile_step(rk.from_model.workload(model, BATCH, SEQ),
                                      ("full", "minimal"), train_setup.make_optimizer(config)[0],
                                      targets.parse_target(None))
    assert summary["policy"] == "full | minimal"
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes


@pytest.mark.parametrize("remat, message", [
    ("{plan}", "config.remat='{plan}' holds plans for budgets 0.5, 0.8: pick one as "
               "{plan}@BUDGET"),
    ("{plan}@0.3", "config.remat: budget '0.3' is not in plan file '{plan}'"),
    ("{other}@0.8", "config.remat='{other}@0.8': the plan was made for a model of 3 "
                    "blocks (TransformerBlock); this model runs 2 TransformerBlock blocks")])
def test_a_plan_file_that_does_not_fit_is_refused_in_one_line(files, tmp_path, remat,
                                                              message):
    names = {"plan": _plan_file(tmp_path), "other": _plan_file(tmp_path / "x", layers=3)}
    config = _nnx(files, remat=remat.format(**names))
    with pytest.raises(BadInput) as e:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(e.value).startswith(message.format(**names))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_scanned_nnx_model_trains_the_program_predicted(files, tmp_path):
    config = _nnx(files, "scan256.py:model", num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == \
        _prediction(config).temp_size_in_bytes


def test_a_model_with_its_own_mesh_trains_the_program_predicted(files, tmp_path):
    """tests/zoo/mesh_linen.py constrains its activations to a mesh of its own (here over
    2 host devices): the run places its state and batches on that mesh as the
    prediction's arguments are (parameters whole, tokens over its data axis), so the
    compiled step is the one predicted (it was 64 temp bytes and 9 FLOPs apart with the
    state on one device)."""
    config = _config(files, model=f"{files[2] / 'mesh256.py'}:model", num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path))
    compiled = summary["compiled"]
    assert compiled["predicted"]["temp_equal"] is True
    # As on one device: the run's step counter (one add) and its PRNG key (12 bytes).
    assert compiled["policy"]["flops"] == compiled["predicted"]["flops"] + 1
    assert compiled["policy"]["step_bytes"] == compiled["predicted"]["step_bytes"] + 12


def test_a_model_s_own_partitioning_trains_as_predicted(files, tmp_path):
    """tests/zoo/logical_linen.py's `ordered` names its parameters' logical axes and rules
    and builds its own mesh (data:2 x fsdp:2 over devices [0, 2, 1, 3]): the run shards
    its parameters, AdamW moments and batch as the prediction's arguments are."""
    config = _config(files, model=f"{files[2] / 'ordered256.py'}:model", num_steps=1,
                     batch_size=4)
    summary = train.train_and_evaluate(config, str(tmp_path))
    work = rk.from_model.workload(user_model.load(config.model)[1].model, 4, SEQ)
    predicted = rk.step_memory(work, 4, SEQ, "minimal",
                               optimizer=train_setup.make_optimizer(config)[0])
    compiled = summary["compiled"]
    assert compiled["predicted"]["temp_equal"] is True
    assert compiled["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    leaves = jax.tree.leaves(work.params)
    shard = sum(rk.mesh.local_shape(x).size * x.dtype.itemsize for x in leaves)
    assert predicted.params_bytes == shard < sum(x.size * x.dtype.itemsize for x in leaves)


def test_nnx_model_trains_on_a_mesh_as_predicted(files, tmp_path):
    # The tests' 8 host devices (conftest): the batch split over all of them.
    config = _nnx(files, mesh="data:8", batch_size=8, num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path))
    model = user_model.load(config.model)[1].model
    mesh = rk.mesh.make("data:8")
    predicted = rk.step_memory(rk.from_model.workload(model, 8, SEQ, mesh=mesh), 8, SEQ,
                               "minimal", optimizer=train_setup.make_optimizer(config)[0])
    assert summary["mesh"] == "data:8"
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes


def test_nnx_state_the_call_leaves_alone_trains_held_fixed(files, tmp_path):
    """graph_nnx's Dropouts (rate 0) hold RNG streams its call never draws from: they
    stay as built, and the step is the program predicted."""
    config = _nnx(files, "graph256.py:model", num_steps=1)
    summary = train.train_and_evaluate(config, str(tmp_path))
    predicted = _prediction(config)
    assert summary["compiled"]["policy"]["temp_size_in_bytes"] == predicted.temp_size_in_bytes
    assert summary["compiled"]["predicted"]["temp_equal"] is True
    model = user_model.load(config.model)[1].model
    inputs, _ = data.train_batches(data.load_corpus(config.data).train, BATCH, SEQ,
                                   config.seed)(0)
    own = next_token_loss(model(jnp.asarray(inputs)), jnp.asarray(inputs))
    assert _losses(tmp_path) == [(1, pytest.approx(float(own), rel=1e-6))]


@pytest.mark.parametrize("function, message", [
    ("llama256.py:with_stat", "its call updates its NNX state ['BatchStat seen']: state "
                              "besides the parameters that changes as the model runs is not "
                              "trained here yet; give a model whose other state stays as built"),
    (None, "its parameters are abstract (nnx.eval_shape); experiments.train trains the "
           "model's arrays: return the built model")])
def test_nnx_models_it_cannot_train_are_refused_in_one_line(files, tmp_path, function,
                                                            message):
    config = (_nnx(files, function) if function else
              _config(files, model=f"{ZOO / 'scan_nnx.py'}:model"))
    with pytest.raises(BadInput) as e:
        train.train_and_evaluate(config, str(tmp_path))
    assert str(e.value) == f"--model {config.model!r}: {message}"
    assert not (tmp_path / "checkpoints").exists()


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


@pytest.mark.parametrize("spec", ["gpt_linen.py:model", "scan_nnx.py:model"])
def test_sweep_measures_the_users_model_as_compare_does(files, tmp_path, spec):
    from experiments import sweep

    config = _config(files, model=f"{ZOO / spec}")
    rows = sweep.sweep(config, str(tmp_path), "none,minimal", steps=1)
    model = user_model.load(config.model)[1].model
    records = rk.measure(rk.from_model.workload(model, BATCH, SEQ), policies=["none", "minimal"])
    assert {r["policy"]: r["temp_size_in_bytes"] for r in rows} == {
        r.policy: r.temp_size_in_bytes for r in records}
    context = json.loads((tmp_path / "records.json").read_text())["context"]
    assert context["config"] == config.model
    assert context["model_map"]["line"] == rk.from_model.workload(model, BATCH,
                                                                  SEQ).model_map.line()


def test_sweep_refuses_a_bad_model_in_one_line(files, tmp_path):
    from experiments import sweep

    with pytest.raises(BadInput, match=r"^--model 'nowhere.py:model': file 'nowhere.py' "
                                        r"not found$"):
        sweep.sweep(_config(files, model="nowhere.py:model"), str(tmp_path), "none", steps=1)


def test_warnings_print_as_one_line_under_the_scripts(capsys):
    with one_line_warnings():
        warnings.warn("rk.remat_model: a note\nover two lines")
    assert capsys.readouterr().err == "warning: rk.remat_model: a note over two lines\n"
