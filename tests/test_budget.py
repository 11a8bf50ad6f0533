"""Budgets say what they mean: a bare number needs a unit, and a budget below
what no policy frees (remat_kit.decide.floor) is refused before anything compiles."""

import importlib.util
import math

import jax
import optax
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.decide import floor
from remat_kit.policy.budget import Budget, parse_budget
from remat_kit.models import get_config

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")
UNIT = "add a unit: 24GiB, 24MiB, or 24B for bytes"
CFG = get_config("tiny")


@pytest.fixture
def no_compiles(monkeypatch):
    """Fails the test if anything is compiled."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the budget was checked")
    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def test_a_bare_number_needs_a_unit():
    with pytest.raises(rk.BudgetError, match=f"{UNIT}; got '24'"):
        parse_budget("24")
    assert parse_budget("24B") == Budget(bytes=24)
    assert parse_budget("1") == Budget(fraction=1.0)  # numbers <= 1 are fractions, as before
    assert parse_budget(24) == Budget(bytes=24)  # from Python an int is a byte count


@pytest.mark.parametrize("text, bytes_", [("16Gb", "16GB"), ("512mb", "512MB"), ("2kb", "2KB")])
def test_a_unit_of_bits_is_refused_naming_the_byte_units(text, bytes_):
    """A lowercase b is bits (16Gb is 2 GB): never read as bytes."""
    with pytest.raises(rk.BudgetError, match=f"reads as bits; a budget is in bytes: {bytes_} "):
        parse_budget(text)
    assert parse_budget("16GB") == Budget(bytes=16 * 10**9)


@pytest.mark.parametrize("argv", [
    ["fit", "--config", "tiny", "--budget", "24"],
    ["plan", "--config", "tiny", "--budgets", "0.5,24"],
    ["compare", "--config", "tiny", "--policies", "none,auto:budget=24"],
])
def test_cli_refuses_a_bare_number(argv, capsys, no_compiles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # fit takes no fraction: it offers sizes only, without the fraction's reading.
    wanted = ("fit needs a budget in bytes: a number and a unit, such as 16GiB"
              if argv[0] == "fit" else UNIT)
    assert wanted in err and err.count("\n") == 1


def test_a_malformed_auto_spec_never_suggests_a_bad_budget():
    with pytest.raises(rk.RematSpecError) as raised:
        rk.parse("auto:Budget=24")
    assert "auto:budget=24'" not in str(raised.value)
    assert "auto:budget=6GiB" in str(raised.value)


def test_step_floor_is_parameters_plus_adamw_state():
    n = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
        rk.models.workload(CFG, 1, 1).params))
    # AdamW keeps two moments per parameter (float32 like tiny's parameters) and a count.
    assert floor.step_floor(rk.models.workload(CFG, 1, 1), optax.adamw(1e-4)) == 3 * n + 4
    assert floor.planner_floor(rk.models.workload(CFG, 1, 1), "tpu") == floor.planner_floor(rk.models.workload(CFG, 1, 1), "gpu") == 2 * n
    assert floor.planner_floor(rk.models.workload(CFG, 1, 1), "cpu") is None  # the CPU figure, temp, holds neither


def test_floor_check_names_the_floor():
    with pytest.raises(rk.BudgetError, match=r"budget 96 B is below the "
                       r"parameters plus gradients, 1000 B \(per device\)") as raised:
        floor.check(96, 1000, "the parameters plus gradients")
    assert raised.value.minimum_bytes == 1000
    floor.check(1000, 1000, "x")
    floor.check(1, None, "x")


@needs_libtpu
@pytest.mark.parametrize("argv", [
    ["plan", "--budgets", "0.5,1KiB"],
    ["compare", "--policies", "none,auto:budget=1KiB"],
])
def test_tpu_planner_budget_below_the_floor_fails_before_compiling(argv, capsys, no_compiles):
    assert cli.main([*argv, "--config", "tiny", "--target", "tpu:v5e:1x1"]) == 2
    err = capsys.readouterr().err
    least = floor.planner_floor(rk.models.workload(CFG, 1, 1), "tpu")
    assert "below the parameters plus gradients" in err and f"({least:,} bytes per device)" in err
    assert err.count("\n") == 1


def test_plan_exits_nonzero_when_no_budget_is_met(capsys):
    code = cli.main(["plan", "--config", "tiny", "--batch", "1", "--seq", "16",
                     "--budgets", "1KiB,2KiB", "--no-presets", "--cache", ""])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.count("below the minimum (") == 2  # a table row per budget
    assert out.count("below the minimum: ") == 1  # and once, what holds the minimum
    assert "error: no budget can be met" in err


def _train_config(tmp_path, budget):
    from experiments.configs import tiny
    config = tiny.get_config()
    config.update(data=str(tmp_path / "missing.txt"), memory_budget=budget)
    return config


def test_train_memory_budget_below_the_floor_fails_before_the_data(tmp_path, no_compiles):
    from experiments import train, train_setup
    from remat_kit.models import from_config_dict
    config = _train_config(tmp_path, "1GiB")
    least = floor.step_floor(rk.models.workload(from_config_dict(config), 1, 1),
                             train_setup.make_optimizer(config)[0])
    with pytest.raises(cli.BadInput, match=rf"^config.memory_budget: budget 96 B is below the "
                       rf"parameters plus optimizer state, .* \({least:,} bytes per device\)"):
        train.train_and_evaluate(_train_config(tmp_path, "96B"), str(tmp_path / "run"))
    with pytest.raises(cli.BadInput, match="add a unit: 96GiB, 96MiB, or 96B for bytes"):
        train.train_and_evaluate(_train_config(tmp_path, "96"), str(tmp_path / "run"))
