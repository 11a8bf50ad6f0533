"""Issue 45, the fourth break test: one test per row of its table (row 3, the host
devices of --mesh, is the mesh issue's), the offload probe that did not fit its chip,
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
    real = planner.record_of
    monkeypatch.setattr(offload_probe, "figure_cache", types.SimpleNamespace(
        lookup=lambda *a, **k: ("key", None), store=lambda *a: pytest.fail("cached")))
    monkeypatch.setattr(planner, "record_of", lambda p: dataclasses.replace(
        real(p), error=OOM, temp_size_in_bytes=None) if not p.offload else real(p))
    probe = planner.offload_probe
    assert (probe.figure, probe.pays, planner.plans_offload) == (0.0, False, False)
    assert probe.note == (
        "offload probe (cpu, unrolled stack, mlpwi, mlp_act): its compile of "
        "'save:mlpwi,mlp_act' gave no memory figure (it does not fit the chip: Ran out of "
        "memory in memory space hbm. HLO temporaries (19.22G) exceeds available HBM (15.75G) "
        "(more lines)), so what offload frees on this model is not measured and offload is "
        "not planned; plan a smaller batch or seq to probe it")
