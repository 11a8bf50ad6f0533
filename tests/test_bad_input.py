"""Bad input, found by trying to break remat_kit as a user would: each
test failed on the tree before its fix. A model with an integer parameter (a step
count) was a bare jax.jvp traceback; a linen model with dropout or batch
statistics was called "a remat_kit bug"; a scalar output was described as a
DynamicJaxprTracer; `rk.remat_model(model, spec, budget=...)` dropped the budget
silently; a hand-edited plan file (a field of the wrong type, an auto spec) was a
TypeError or a wrong count, and a budget plan could not meet was "not in the
file"; `rk.measure(work, policies="full")` measured "f"; `rk.explain(workload,
policy)` printed a 20,000-character repr; `explain` said nothing where `compare`
notes a policy that selects nothing; training, the sweep and fit told a user to
fix their shapes with flags they do not take; `--config` with a training config
of the user's own model said "unknown model config"; `rk.measure_config("tiny",
...)` was an AttributeError.
"""

import json

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from experiments import own_model, sweep
from experiments.configs import tiny
from remat_kit.cli import commands as cli
from remat_kit.ui.inputs import BadInput
from remat_kit.trace.workload import has_gradient_path
from zoo import gpt_linen

# A 2-block linen model; `kind` picks what it does besides: an integer parameter, a
# dropout or batch-norm layer after each block, a scalar output.
MODEL = """
import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(8)(nn.relu(nn.Dense(16)(h)))


class Model(nn.Module):
    kind: str = "plain"

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(64, 8)(tokens)
        for _ in range(2):
            h = Block()(h)
            if self.kind == "dropout":
                h = nn.Dropout(0.5, deterministic=False)(h)
            if self.kind == "batchnorm":
                h = nn.BatchNorm(use_running_average=False)(h)
        if self.kind == "scalar":
            return h.sum()
        logits = nn.Dense(64)(h)
        if self.kind == "counter":
            return logits + self.param("count", lambda key: jnp.zeros((), jnp.int32))
        return logits


def counter():
    return Model("counter")


def dropout():
    return Model("dropout")


def batchnorm():
    return Model("batchnorm")


def scalar():
    return Model("scalar")
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "odd.py"
    path.write_text(MODEL)
    return path


def _compare(path, function, capsys):
    code = cli.main(["compare", "--model", f"{path}:{function}", "--batch", "2", "--seq", "8",
                     "--policies", "none"])
    return code, capsys.readouterr()


def test_an_integer_parameter_has_no_tangent_but_the_rest_do():
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    count = jax.ShapeDtypeStruct((), jnp.int32)
    x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    assert has_gradient_path(lambda p, x: jnp.sum(x @ p["w"]) + p["n"], {"w": w, "n": count}, x)
    assert not has_gradient_path(lambda p, x: jnp.sum(x) + p["n"], {"w": w, "n": count}, x)


def test_a_model_with_an_integer_parameter_is_measured(model_file, capsys):
    code, out = _compare(model_file, "counter", capsys)
    assert code == 0, out.err
    assert "Traceback" not in out.err and "│ * │ none" in out.out


@pytest.mark.parametrize("function, line", [
    ("dropout", "the model asks for a PRNG stream (Dropout_0 needs PRNG for \"dropout\"): "
                "remat_kit applies it to tokens with no rngs, as its loss has no dropout; build "
                "it deterministic (e.g. deterministic=True), or give a function (batch, seq) -> "
                "rk.Workload whose loss passes rngs"),
    ("batchnorm", "the model updates its variables (Cannot update variable \"mean\" in "
                  "\"/BatchNorm_0\" because collection \"batch_stats\" is immutable): remat_kit "
                  "applies it with every collection read-only; build it not to update them "
                  "(e.g. BatchNorm(use_running_average=True)), or give a function (batch, seq) "
                  "-> rk.Workload"),
    ("scalar", "the model's output is an array float32[]; expected logits [batch=2, seq=8, "
               "vocab], or a dict or object with a 'logits' entry. For another output or your own "
               "loss, return (model, batch, loss) from --model FILE:FUNCTION, loss(output, "
               "batch) -> scalar, or give a function (batch, seq) -> rk.Workload"),
])
def test_a_model_it_cannot_apply_plainly_is_named_not_called_our_bug(model_file, capsys,
                                                                      function, line):
    code, out = _compare(model_file, function, capsys)
    assert code == 2
    assert out.err.splitlines() == [
        f"remat-kit compare: error: --model '{model_file}:{function}': {line}"]


def test_training_names_its_own_size_fields():
    config = tiny.get_config()
    config.update(model=f"{gpt_linen.__file__}:model", batch_size=2, seq_len=64)
    with pytest.raises(BadInput) as e:
        own_model.load(config, None, None)
    assert str(e.value).endswith("if it takes other shapes (e.g. fewer positions), "
                                 "give them with config.batch_size and config.seq_len")


def test_a_budget_without_a_plan_file_is_refused():
    with pytest.raises(rk.RematSpecError) as e:
        rk.remat_model(gpt_linen.model(), "full", budget="0.5")
    assert str(e.value) == ("budget= picks one plan of a remat-kit plan --json file; 'full' "
                            "is not one: drop budget=; got '0.5'")


GOOD_PLAN = {"context": {"block": "Block", "num_layers": 2},
             "budgets": [{"budget": "0.5", "plan": {"spec": "full", "layer_specs": []}}]}


@pytest.mark.parametrize("edit, why", [
    (lambda d: d["context"].update(num_layers="2"),
     "context 'num_layers' must be a positive int, got '2'"),
    (lambda d: d["context"].update(num_layers=-1),
     "context 'num_layers' must be a positive int, got -1"),
    (lambda d: d["context"].update(parameters="1e6"),
     "context 'parameters' must be a positive int, got '1e6'"),
    (lambda d: d["context"].update(block=123), "context 'block' must be a class name, got 123"),
    (lambda d: d.update(context=[1]), "'context' must be an object, got list"),
    (lambda d: d["budgets"][0]["plan"].update(layer_specs="full"),
     "'layer_specs' must be a list of spec strings, one per layer, got 'full'"),
    (lambda d: d["budgets"][0]["plan"].update(layer_specs=[1, 2]),
     "'layer_specs' must be a list of spec strings, one per layer, got [1, 2]"),
    (lambda d: d["budgets"][0]["plan"].update(spec=5), "'spec' must be a spec string, got int 5"),
    (lambda d: d["budgets"][0].update(plan=["full"]),
     "is not remat-kit plan --json output: its plan is list, not an object"),
])
def test_a_hand_edited_plan_file_names_the_field(tmp_path, edit, why):
    good, path = tmp_path / "good.json", tmp_path / "plan.json"
    good.write_text(json.dumps(GOOD_PLAN))
    rk.remat_model(gpt_linen.model(), str(good))  # the file as written is taken
    data = json.loads(json.dumps(GOOD_PLAN))
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(rk.RematSpecError) as e:
        rk.remat_model(gpt_linen.model(), str(path))
    sep = " " if why.startswith("is not") else ": "
    assert str(e.value).startswith(f"plan file {str(path)!r}{sep}{why}")


def test_an_auto_spec_in_a_plan_file_is_refused_as_a_spec_is(tmp_path):
    data = json.loads(json.dumps(GOOD_PLAN))
    data["budgets"][0]["plan"]["spec"] = "auto:budget=0.5"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(rk.RematSpecError, match=r"^auto:budget=0.5 is planned for a model at "
                                                r"its shapes: plan it first"):
        rk.remat_model(gpt_linen.model(), str(path))


@pytest.fixture(scope="module")
def gpt():
    return rk.from_model.workload(gpt_linen.model(), 2, 8)


def test_measure_takes_one_spec_as_fit_does(gpt):
    [record] = rk.measure(gpt, policies="full")
    assert record.names == ("full",) and record.error is None


def test_explain_with_the_workload_first_says_the_order(gpt):
    with pytest.raises(TypeError) as e:
        rk.explain(gpt, "full")
    assert str(e.value) == ("rk.explain takes (policy, workload): got the workload 'GPT' "
                            "first; write rk.explain('full', workload)")


def test_explain_notes_a_policy_that_selects_nothing_as_compare_does(gpt, capsys):
    assert rk.explain("save:zz/*", gpt).notes == (
        "none of the tags this policy keeps (zz/*) is emitted by the model: it compiles as "
        "its base rule 'nothing'",)
    assert rk.explain("minimal", gpt).notes == ()
    assert cli.main(["explain", "--config", "tiny", "--batch", "1", "--seq", "8",
                     "--policy", "save:zz/*"]) == 0
    assert ("note: save:zz/*: none of the tags this policy keeps (zz/*) is emitted by the "
            "model: it compiles as its base rule 'nothing'") in capsys.readouterr().out


def test_fit_names_the_flags_of_its_search_where_the_first_size_fails(capsys):
    # The zoo GPT learns 32 positions; fit --vary seq starts at its --multiple, 128.
    code = cli.main(["fit", "--model", f"{gpt_linen.__file__}:model", "--batch", "2",
                     "--budget", "64MiB", "--policies", "none"])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2 and line.startswith("remat-kit fit: error: --model ")
    # The model's own failure, at its own line.
    where = f"{gpt_linen.__file__}:"
    assert f"the model raised ValueError at {where}" in line
    assert line.endswith(" on int32 tokens [2, 128]: Incompatible shapes for broadcasting: "
                         "shapes=[(2, 128, 32), (32, 32)]; if it takes other shapes (e.g. "
                         "fewer positions), give them with --batch and --multiple (fit --vary "
                         "seq tries multiples of it)")


def test_a_training_config_of_the_users_model_is_told_to_use_model(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text("import ml_collections\n\n\ndef get_config():\n"
                    "    c = ml_collections.ConfigDict()\n    c.model = 'my_gpt.py:model'\n"
                    "    c.batch_size, c.seq_len = 4, 32\n    return c\n")
    assert cli.main(["compare", "--config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: config file {str(path)!r}: config.model 'my_gpt.py:model' "
        "is your own model, which --config does not build; give it as --model "
        "my_gpt.py:model --batch 4 --seq 32"]


def test_sweep_names_its_own_size_fields(tmp_path):
    config = tiny.get_config()
    config.update(model=f"{gpt_linen.__file__}:model", batch_size=2, seq_len=64)
    with pytest.raises(BadInput) as e:
        sweep.sweep(config, str(tmp_path), policies="none", steps=1)
    assert str(e.value).endswith("give them with config.batch_size and config.seq_len")


def test_a_budget_plan_could_not_meet_is_said_to_have_no_plan(tmp_path):
    # remat-kit plan --json writes a budget no policy fit with "plan": null.
    data = json.loads(json.dumps(GOOD_PLAN))
    data["budgets"].append({"budget": "0.1", "plan": None})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(rk.RematSpecError) as e:
        rk.remat_model(gpt_linen.model(), str(path), budget="0.1")
    assert str(e.value) == (f"plan file {str(path)!r} has no plan for budget 0.1: no policy "
                            "fit it when it was planned; give a budget that was met; got "
                            "'0.1'; did you mean '0.5'?; valid choices: 0.5")
    data["budgets"] = data["budgets"][1:]
    path.write_text(json.dumps(data))
    with pytest.raises(rk.RematSpecError) as e:
        rk.remat_model(gpt_linen.model(), str(path))
    assert str(e.value) == (f"plan file {str(path)!r} holds no plan: no policy fit its budgets "
                            f"(0.1) when they were planned; plan a larger budget; got "
                            f"{str(path)!r}")


@pytest.mark.parametrize("name, call", [
    ("measure_config", lambda cfg: rk.measure_config(cfg, 1, 8, ["full"])),
    ("layer_residuals", lambda cfg: rk.layer_residuals(cfg, 1, 8, "full"))])
def test_the_config_shortcuts_refuse_a_name_as_step_memory_does(name, call):
    with pytest.raises(TypeError) as e:
        call("tiny")
    assert str(e.value) == (f"{name} takes a TransformerConfig (rk.models.get_config('tiny')), "
                            "got str 'tiny'")


@pytest.mark.parametrize("command", ["compare", "plan"])
def test_a_plan_file_given_as_a_policy_says_where_plan_files_go(capsys, command):
    flag = "--policies" if command == "compare" else "--presets"
    assert cli.main([command, "--config", "tiny", "--batch", "2", "--seq", "8", flag,
                     "full,plan.json", *(["--budgets", "0.5"] if command == "plan" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"remat-kit {command}: error: ") and len(err.splitlines()) == 1
    assert ("'plan.json' is a plan file, not a policy spec: apply it with "
            "rk.remat_model(model, PATH.json) or train with --config.remat=PATH.json "
            "(docs/models.md)") in err


def test_fit_names_a_mesh_given_as_text():
    import remat_kit as rk
    from remat_kit.models import get_config
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*'data:2'"):
        rk.fit(get_config("tiny"), "24MiB", policies=["full"], mesh="data:2")


def test_planner_names_must_be_one_a_policy():
    import jax.numpy as jnp
    import remat_kit as rk
    planner = rk.Planner(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 8)),
                         jnp.ones((4, 8)), cache=None)
    with pytest.raises(ValueError, match="0 names for 1 policies"):
        planner.measure_all([rk.parse("full")], names=[])


def test_an_output_onto_a_module_the_model_imports_from_beside_it_is_refused(tmp_path,
                                                                             capsys):
    """`wrapper.py` does `import helpmod`: a --json onto helpmod.py would replace the
    model's own source, as one onto wrapper.py would."""
    (tmp_path / "helpmod_out.py").write_text(MODEL)
    (tmp_path / "wrapper_out.py").write_text(
        "import helpmod_out\n\ndef model():\n    return helpmod_out.Model()\n")
    before = (tmp_path / "helpmod_out.py").read_text()
    code = cli.main(["compare", "--model", f"{tmp_path}/wrapper_out.py:model", "--batch", "2",
                     "--seq", "8", "--policies", "none", "--json",
                     str(tmp_path / "helpmod_out.py")])
    err = capsys.readouterr().err
    assert code == 2 and (tmp_path / "helpmod_out.py").read_text() == before
    assert err == (f"remat-kit compare: error: --json {str(tmp_path / 'helpmod_out.py')!r} is "
                   "the file of module helpmod_out, loaded from beside --model "
                   f"{tmp_path}/wrapper_out.py:model; writing it would replace it: give "
                   "another path\n")
