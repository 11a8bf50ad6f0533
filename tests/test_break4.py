"""Faults a break test found, one test each (the host devices of --mesh are tested with
the meshes), the offload probe that did not fit its chip,
and what a second sweep of the same surfaces found. Each failed on the tree before."""

import json
import pathlib
import shutil

import pytest

from remat_kit.cli import commands as cli

ZOO = pathlib.Path(__file__).parent / "zoo"


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def mine(tmp_path, monkeypatch):
    """A copy of the zoo's GPT as the user's own mine.py, the folder the cwd."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(ZOO / "gpt_linen.py", tmp_path / "mine.py")
    return tmp_path / "mine.py"


@pytest.mark.parametrize("command", [["compare", "--policies", "full"],
                                     ["plan", "--budgets", "0.5", "--cache", ""],
                                     ["fit", "--budget", "1GiB"]])
def test_row4_an_output_that_is_the_model_file_is_refused(capsys, mine, command):
    before = mine.read_bytes()
    code, _, err = run(capsys, *command, "--model", "mine.py:model", "--json", "./mine.py")
    assert code == 2 and mine.read_bytes() == before
    assert err == (f"remat-kit {command[0]}: error: --json './mine.py' is the file of --model "
                   "mine.py:model; writing it would replace it: give another path\n")


def test_row5_a_report_as_cache_and_one_file_for_both_are_refused(capsys, mine):
    report = mine.parent / "plan.json"
    report.write_text(json.dumps({"schema_version": 1, "context": {}, "budgets": []}))
    before = report.read_bytes()
    code, _, err = run(capsys, "plan", "--model", "mine.py:model", "--budgets", "0.5",
                       "--cache", report)
    assert code == 2 and report.read_bytes() == before
    assert f"--cache {str(report)!r} is not a plan cache" in err and "--json report" in err
    cache = mine.parent / "same.json"
    cache.write_text("{}")
    code, _, err = run(capsys, "plan", "--model", "mine.py:model", "--budgets", "0.5",
                       "--json", "same.json", "--cache", "same.json")
    assert code == 2 and cache.read_text() == "{}"
    assert err == ("remat-kit plan: error: --cache 'same.json' is --json 'same.json'; "
                   "writing it would replace it: give another path\n")


def test_row8_uniform_and_groups_conflict(capsys, mine):
    code, _, err = run(capsys, "plan", "--model", "mine.py:model", "--budgets", "0.5",
                       "--uniform", "--groups", "2", "--cache", "")
    assert code == 2 and err == (
        "remat-kit plan: error: --uniform and --groups 2 conflict: --uniform is one decision "
        "per tag for every layer (--groups 1); give one of them\n")


@pytest.mark.parametrize("version", [99, "1"])
def test_row6_a_plan_file_of_another_schema_version_is_refused(tmp_path, version):
    import remat_kit as rk
    from remat_kit.errors import RematSpecError
    from zoo import gpt_linen
    path = tmp_path / "v99.json"
    path.write_text(json.dumps({"schema_version": version, "context": {},
                                "budgets": [{"budget": "0.7", "plan": {"spec": "full"}}]}))
    with pytest.raises(RematSpecError) as e:
        rk.remat_model(gpt_linen.model(), str(path), budget="0.7")
    assert str(e.value) == (f"plan file {str(path)!r} is not remat-kit plan --json output: its "
                            f"schema_version is {version!r}; this remat_kit reads "
                            f"schema_version 1; got {str(path)!r}")


def test_a_missing_plan_file_says_it_does_not_exist(tmp_path):
    from remat_kit.errors import RematSpecError
    from remat_kit.flax.measured import read_plan
    with pytest.raises(RematSpecError) as e:
        read_plan(tmp_path / "gone.json")
    assert str(e.value) == f"plan file {str(tmp_path / 'gone.json')!r} does not exist"


OOM = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory in memory space hbm. "
       "HLO temporaries (19.22G) exceeds available HBM (15.75G)\n(more lines)")


def test_an_offload_probe_that_does_not_fit_the_chip_is_an_answer(monkeypatch):
    """Was a RuntimeError traceback out of `plan --offload` (a llama2 decoder on v5e)."""
    import dataclasses
    import types

    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from remat_kit.decide import offload_probe
    from remat_kit.decide.plan import Planner

    def loss(w, x):
        for _ in range(2):
            h = checkpoint_name(x @ w, "mlpwi")
            x = checkpoint_name(jnp.tanh(h), "mlp_act") @ w
        return jnp.sum(x ** 2)
    w, x = jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((4, 16), jnp.float32)
    planner = Planner(loss, w, x, cache=None, groups=1, offload=True)
    real = planner.compiles.record_of  # what the offload probe compiles with
    monkeypatch.setattr(offload_probe, "figure_cache", types.SimpleNamespace(
        lookup=lambda *a, **k: ("key", None), store=lambda *a: pytest.fail("cached")))
    monkeypatch.setattr(planner.compiles, "record_of", lambda p: dataclasses.replace(
        real(p), error=OOM, temp_size_in_bytes=None) if not p.offload else real(p))
    probe = planner.offload_probe
    assert (probe.figure, probe.pays, planner.plans_offload) == (0.0, False, False)
    assert probe.note == (
        "offload probe (cpu, unrolled stack, mlpwi, mlp_act): its compile of "
        "'save:mlpwi,mlp_act' gave no memory figure (it does not fit the chip: Ran out of "
        "memory in memory space hbm. HLO temporaries (19.22G) exceeds available HBM (15.75G) "
        "(more lines)), so what offload frees on this model is not measured and offload is "
        "not planned; plan a smaller batch or seq to probe it")


MODELS = '''
import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from zoo import gpt_linen


class Tanh(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return jnp.tanh(tokens.astype(jnp.float32))[..., None] * jnp.ones((1, 1, 8))


class NnxTanh(nnx.Module):
    def __call__(self, tokens):
        return jnp.tanh(tokens.astype(jnp.float32))[..., None] * jnp.ones((1, 1, 8))


def linen_none():
    return Tanh()


def nnx_none():
    return NnxTanh()


def one_argument_loss():
    return gpt_linen.model(), jnp.zeros((2, 8), jnp.int32), lambda o: jnp.mean(o)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(jnp.tanh(nn.Dense(8)(x)))


class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        for _ in range(2):
            x = Block()(x)
        return x


def _scaled(o, b, scale):
    return jnp.mean(o) * scale


def partial_loss():
    import functools
    return gpt_linen.model(), jnp.zeros((2, 8), jnp.int32), functools.partial(_scaled, scale=2.0)


def workload(batch, seq):
    import jax
    import remat_kit as rk

    def loss_for_policy(policy):
        def loss(w, x):
            return jnp.sum((x @ w) @ jnp.ones((3, 3)))
        return loss
    return rk.Workload(loss_for_policy=loss_for_policy,
                       args=(jax.ShapeDtypeStruct((8, 8), jnp.float32),
                             jax.ShapeDtypeStruct((batch, 8), jnp.float32)))


def no_leading_axis():
    return (TwoInputs(), (jnp.zeros((4, 8)), jnp.zeros((3, 8))),
            lambda o, b: jnp.mean((o - b[1]) ** 2))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.gelu(nn.Dense(16)(x)))


class MlpRematBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.remat(MLP)()(nn.LayerNorm()(x))


class Tied(nn.Module):
    block: type = Block

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 8)
        x = embed(tokens)
        for _ in range(2):
            x = self.block()(x)
        return jnp.tanh(x) @ embed.embedding.T


def mlp_remat():
    return Tied(MlpRematBlock)


def linen_own_ops():
    return Tied()


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.l0, self.l1 = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.l1(jnp.tanh(self.l0(x)))


class NnxTied(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 8, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return jnp.tanh(x) @ self.embed.embedding[...].T


def nnx_own_ops():
    return NnxTied(nnx.Rngs(0))


def scanned():
    import scan_nnx
    return scan_nnx.model(scan=True)


def unrolled():
    import scan_nnx
    return scan_nnx.model(scan=False)
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ZOO.parent))
    monkeypatch.syspath_prepend(str(ZOO))
    (tmp_path / "models.py").write_text(MODELS)
    return "models.py"


@pytest.mark.parametrize("function, name", [("linen_none", "Tanh"), ("nnx_none", "NnxTanh")])
def test_row1_a_model_without_parameters_is_one_line(capsys, models, function, name):
    code, _, err = run(capsys, "compare", "--model", f"{models}:{function}", "--batch", 2,
                       "--seq", 8, "--policies", "full")
    assert code == 2 and err == (
        f"remat-kit compare: error: --model 'models.py:{function}': {name} has no parameters: "
        "its loss has no gradient, so there is no backward pass and nothing to "
        "rematerialize\n")


def test_row2_a_loss_of_one_argument_is_named_with_its_line(capsys, models):
    code, _, err = run(capsys, "compare", "--model", f"{models}:one_argument_loss",
                       "--policies", "full")
    line = MODELS.splitlines().index(
        "    return gpt_linen.model(), jnp.zeros((2, 8), jnp.int32), lambda o: jnp.mean(o)") + 1
    assert code == 2 and err == (
        "remat-kit compare: error: --model 'models.py:one_argument_loss': the loss '<lambda>' "
        f"at {pathlib.Path(models).resolve()}:{line} that one_argument_loss() returned takes "
        "(o); it must take (output, batch)\n")


def test_row13_leaves_without_a_leading_axis_are_named_with_or_without_batch(capsys, models):
    code, _, err = run(capsys, "compare", "--model", f"{models}:no_leading_axis",
                       "--policies", "full")
    assert code == 2 and "on the batch (float32[4, 8], float32[3, 8]) as declared" in err
    assert err.endswith("its leaves share no leading (batch) axis, so --batch cannot resize "
                        "it; make every leaf [batch, ...]\n") and "batch None" not in err
    code, _, err = run(capsys, "compare", "--model", f"{models}:no_leading_axis",
                       "--policies", "full", "--batch", 4)
    assert code == 2 and "share no leading (batch) axis (float32[4, 8], float32[3, 8])" in err


SEQ1 = ("seq 1: the next-token loss needs seq >= 2 (at seq 1 no position has a next token: a "
        "mean over nothing, NaN)")


def test_row9_seq_1_is_refused_for_a_next_token_loss(capsys, mine, tmp_path):
    from experiments import train
    from experiments.configs import tiny
    from remat_kit.ui.inputs import BadInput
    code, _, err = run(capsys, "compare", "--model", "mine.py:model", "--batch", 2, "--seq", 1,
                       "--policies", "full")
    assert code == 2 and err == f"remat-kit compare: error: --model 'mine.py:model': {SEQ1}\n"
    (tmp_path / "text.txt").write_text("some text " * 20)
    config = tiny.get_config()
    config.update(model="mine.py:model", data="text.txt", batch_size=2, seq_len=1,
                  num_steps=2, warmup_steps=1, remat="full")
    with pytest.raises(BadInput, match=r"seq 1: the next-token loss needs seq >= 2 \(at"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_row7_emit_jax_refuses_names_only_remat_kit_tags():
    """The model tags nothing itself: `mlpwi` is a role remat_kit infers under
    rk.remat_model, so save_only_these_names(["mlpwi"]) under jax.checkpoint saves nothing."""
    from remat_kit.decide import emit
    from remat_kit.decide.plan_cache import Plan
    from remat_kit.flax import user_model
    from remat_kit.policy.spec import parse

    plain = user_model.load(str(ZOO / "gpt_linen.py") + ":model")[1]
    tagged = user_model.load(str(ZOO / "own_tags_linen.py") + ":model")[1]
    assert user_model.own_tags(plain, 2, 8) == frozenset()
    assert user_model.own_tags(tagged, 2, 8) >= {"attention_out", "mlpwo"}
    plan = Plan(budget="0.5", budget_bytes=1, policy=parse("save:mlpwi,mlpwo"),
                spec="save:mlpwi,mlpwo", predicted_bytes=0, predicted_flops=0.0,
                measured_bytes=0, measured_flops=1.0, none_bytes=1, none_flops=1.0,
                minimum_bytes=0, status="", iterations=1, platform="cpu",
                memory_kind="temp_size_in_bytes")
    entry = emit.emit_entry(plan, "jax", frozenset())
    assert entry["text"] is None and entry["refused"] == (
        "--emit jax: the plan keeps mlpwi, a name remat_kit infers and tags only under "
        "rk.remat_model, not a name the model gives its values (as a jax.checkpoint policy "
        "it would save nothing): --emit remat_kit runs it, "
        "rk.remat_model(model, 'save:mlpwi,mlpwo')")
    # A model that names mlpwi and mlpwo itself gets the expression.
    assert emit.emit(plan, "jax", frozenset({"mlpwi", "mlpwo"})).startswith(
        'jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved='
        '["mlpwi", "mlpwo"]')


def _map(capsys, models, function):
    code, out, err = run(capsys, "explain", "--model", f"{models}:{function}", "--batch", 2,
                         "--seq", 8, "--map")
    assert code == 0, err
    return out.splitlines()


def test_row10_a_remat_around_the_mlp_alone_is_kept_and_said_so(capsys, models):
    [line, *_] = _map(capsys, models, "mlp_remat")
    assert line == ("model map: 2 x MlpRematBlock, scanned: no; own remat: 2 x "
                    "jax.checkpoint(nothing_saveable) inside a layer, kept under every policy "
                    "(not a whole layer); outside: Embed_0, the model's own call: 3 ops (tanh, "
                    "transpose, dot_general), loss")


def test_row11_scanned_and_unrolled_layers_count_parameters_per_layer(capsys, models):
    scan = _map(capsys, models, "scanned")
    plain = _map(capsys, models, "unrolled")
    per_layer = plain[1].rpartition(", ")[2]
    assert per_layer == plain[2].rpartition(", ")[2] and per_layer.endswith(" parameters")
    assert scan[1].endswith(f", {per_layer} each, scanned x2")


def test_row12_nnx_and_linen_maps_name_the_models_own_call_alike(capsys, models):
    own = "outside: {}, the model's own call: 3 ops (tanh, transpose, dot_general), loss"
    assert _map(capsys, models, "linen_own_ops")[0].endswith(own.format("Embed_0"))
    assert _map(capsys, models, "nnx_own_ops")[0].endswith(own.format("embed"))


def test_sweep_a_workload_functions_loss_that_fails_is_one_line(capsys, models):
    """Was a Python traceback: the loss was first run unguarded (the gradient check)."""
    code, _, err = run(capsys, "compare", "--model", f"{models}:workload", "--batch", 2,
                       "--seq", 8, "--policies", "full")
    line = next(i for i, text in enumerate(MODELS.splitlines(), 1) if "jnp.ones((3, 3))" in text)
    assert code == 2 and err.startswith(
        "remat-kit compare: error: --model 'models.py:workload': the loss 'loss' raised "
        f"TypeError at {pathlib.Path(models).resolve()}:{line} on the Workload's args at "
        "workload(2, 8): dot_general requires contracting dimensions")


def test_sweep_a_partial_loss_is_named_as_the_loss(capsys, models):
    code, _, err = run(capsys, "compare", "--model", f"{models}:partial_loss", "--policies",
                       "full")
    assert code == 2 and "the loss '_scaled' raised TypeError at " in err
    assert "mean requires ndarray or scalar arguments" in err


def test_sweep_a_budget_below_one_byte_is_refused(capsys):
    code, _, err = run(capsys, "plan", "--config", "tiny", "--budgets", "1e-30GiB")
    assert code == 2 and err.startswith("remat-kit plan: error: --budgets: a budget must be at "
                                        "least 1 byte (a size") and "got '1e-30GiB'" in err


def test_a_budget_of_1e30_bytes_reads_in_the_largest_unit():
    from remat_kit.units import fmt_bytes
    assert fmt_bytes(10**30) == "827,180.61 YiB" and fmt_bytes(3 * 2**40) == "3.00 TiB"
    assert fmt_bytes(1023) == "1023 B" and fmt_bytes(1536) == "1.50 KiB"


def test_sweep_a_folder_given_as_a_plan_file_is_named_a_folder(tmp_path):
    """Was "IsADirectoryError: [Errno 21] Is a directory: 3" (the file descriptor)."""
    from remat_kit.errors import RematSpecError
    from remat_kit.flax.measured import read_plan
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(RematSpecError) as e:
        read_plan(tmp_path / "plan.json")
    path = str(tmp_path / "plan.json")
    assert str(e.value) == (f"plan file {path!r} is not remat-kit plan --json output: "
                            f"OutputError: {path!r} is a folder, not a regular file; got {path!r}")


def test_sweep_a_link_to_the_model_file_is_the_model_file(capsys, mine):
    (mine.parent / "out.json").symlink_to(mine)
    before = mine.read_bytes()
    code, _, err = run(capsys, "compare", "--model", "mine.py:model", "--policies", "full",
                       "--json", "out.json")
    assert code == 2 and mine.read_bytes() == before and err == (
        "remat-kit compare: error: --json 'out.json' is the file of --model mine.py:model; "
        "writing it would replace it: give another path\n")
