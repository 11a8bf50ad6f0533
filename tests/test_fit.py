"""remat_kit.fit: the largest sequence / batch per policy within a budget, and `remat-kit fit`."""

import importlib
import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit import cli
from remat_kit.errors import BudgetError
from remat_kit.fit import StepMemory, fit, step_memory
from remat_kit.models import Transformer, get_config

fit_mod = importlib.import_module("remat_kit.fit")  # rk.fit is the function
# Two layers: with one, full remat recomputes the whole layer at once and
# peaks as high as no remat.
CFG = get_config("tiny")
BUDGET = 24 * 2**20


@pytest.fixture(scope="module")
def seq_fit():
    return fit(CFG, BUDGET, vary="seq", policies=["none", "minimal", "full"], multiple=128)


def test_seq_boundary_is_exact(seq_fit):
    # Separate compiles, outside fit's cache: size fits, size + multiple does not.
    for row in seq_fit.rows:
        assert row.error is None and row.size > 0, row
        assert row.memory.total_bytes <= BUDGET
    for row in (seq_fit.rows[0], seq_fit.rows[2]):  # none and full
        assert step_memory(CFG, 1, row.size, row.policy).total_bytes <= BUDGET
        assert step_memory(CFG, 1, row.size + 128, row.policy).total_bytes > BUDGET


def test_seq_order_and_flop_overhead(seq_fit):
    size = {r.policy: r.size for r in seq_fit.rows}
    assert size["full"] >= size["minimal"] >= size["none"]
    assert size["full"] > size["none"]  # remat buys context, or the test shows nothing
    rows = {r.policy: r for r in seq_fit.rows}
    assert rows["none"].flop_overhead == pytest.approx(1.0)
    assert rows["none"].none_fits is True
    # Full remat runs the forward twice: more FLOPs than none at the same length.
    assert 1.0 < rows["full"].flop_overhead < 1.5
    assert rows["full"].none_fits is False and rows["full"].none_flops == "compiled"
    m = rows["full"].memory
    assert m.source == "argument + temp + output - alias"
    assert m.total_bytes == (m.argument_size_in_bytes + m.temp_size_in_bytes
                             + m.output_size_in_bytes - m.alias_size_in_bytes)
    assert rows["full"].flops_per_token == pytest.approx(m.flops / rows["full"].size)


def test_floor_is_params_plus_adamw_state():
    # Counted independently: AdamW keeps two moments per parameter and an int32 step count.
    params = jax.eval_shape(lambda: Transformer(CFG).init(
        jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    with pytest.raises(BudgetError, match=f"{3 * 4 * n + 4} bytes") as e:
        fit(CFG, 3 * 4 * n, policies=["full"])
    assert e.value.minimum_bytes == 3 * 4 * n + 4


def fake_step(monkeypatch, bytes_at, error_at=None):
    """Replaces the compile with a memory model: total = bytes_at(batch * seq)."""
    calls = []

    def step(cfg, batch, seq, policy, optimizer=None, target=None, mesh=None):
        calls.append((policy, batch, seq))
        if error_at is not None and batch * seq >= error_at[0]:
            raise error_at[1]
        total = bytes_at(batch * seq)
        return StepMemory(total, "fake", 1, 1, 2, total - 4, total, 0, 0, 0, None,
                          float(batch * seq), 0.0)

    monkeypatch.setattr(fit_mod, "step_memory", step)
    return calls


# Budgets above the floor (parameters + AdamW state, 1.5 MB); the first fits nothing.
@pytest.mark.parametrize("budget", [1_600_001, 3 * 2**20, 10**7, 5 * 10**8, 2**31])
def test_search_matches_brute_force_within_12_compiles(monkeypatch, budget):
    model = lambda s: 1_600_000 + 300 * s + s * s // 7  # quadratic, like attention scores
    calls = fake_step(monkeypatch, model)
    (row,) = fit(CFG, budget, policies=["full"], multiple=128).rows
    best = max((k * 128 for k in range(1, 2**13 + 1) if model(k * 128) <= budget), default=0)
    assert row.size == best
    assert len([c for c in calls if c[0] == "full"]) <= 12


def test_out_of_memory_compile_means_does_not_fit(monkeypatch):
    oom = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
    fake_step(monkeypatch, lambda s: s, error_at=(1024, oom))
    (row,) = fit(CFG, 10**9, policies=["full"], multiple=128).rows
    assert row.size == 896 and row.error is None
    assert row.none_flops == "compiled"


def test_other_compile_errors_are_reported_not_taken_for_no_fit(monkeypatch):
    fake_step(monkeypatch, lambda s: s, error_at=(1024, RuntimeError("INTERNAL: bad fusion")))
    (row,) = fit(CFG, 10**9, policies=["full"], multiple=128).rows
    assert row.error == "RuntimeError: INTERNAL: bad fusion"


def test_vary_batch_and_capped(monkeypatch):
    fake_step(monkeypatch, lambda tokens: 2 * 10**6 + 1000 * tokens)
    (row,) = fit(CFG, 2 * 10**6 + 64_000, vary="batch", seq=8, policies=["none"]).rows
    assert row.size == 8 and not row.capped
    (row,) = fit(CFG, 10**12, vary="batch", seq=8, max_size=50, policies=["none"]).rows
    assert row.size == 50 and row.capped


@pytest.mark.parametrize("kwargs, message", [
    ({"vary": "length"}, "vary must be one of \\['seq', 'batch'\\], got 'length'"),
    ({"multiple": 0}, "multiple must be a positive int, got 0"),
    ({"batch": -1}, "batch must be a positive int, got -1"),
    ({"policies": ["minimall"]}, "did you mean 'minimal'"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit(CFG, BUDGET, **kwargs)


@pytest.mark.parametrize("budget, message", [
    ("lots", "a budget must be"), ("-3GiB", "a budget must be"), (0, "positive"),
    ("0.5", "fit needs a budget in bytes"), ("25%", "fit needs a budget in bytes")])
def test_bad_budgets(budget, message):
    with pytest.raises(BudgetError, match=message):
        fit(CFG, budget)


def test_cli_fit_table_and_json(monkeypatch, capsys, tmp_path):
    fake_step(monkeypatch, lambda tokens: 10**6 + 100 * tokens)
    out = tmp_path / "fit.json"
    code = cli.main(["fit", "--config", "tiny", "--budget", "2MB", "--policies", "none,full",
                     "--json", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0
    assert "max seq" in stdout and "none" in stdout
    doc = json.loads(out.read_text())
    assert doc["budget_bytes"] == 2 * 10**6 and doc["vary"] == "seq"
    assert [r["size"] for r in doc["rows"]] == [9984, 9984]  # 1e6 + 100 * 9984 <= 2e6


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "--budget: a budget must be"),
    (["--budget", "0.3"], "--budget must be a size such as 16GiB, not a fraction"),
    (["--budget", "1GiB", "--target", "tpu:v9:1x1"], "tpu:v9:1x1"),
    (["--budget", "1KiB"], "is below the parameters plus optimizer state alone"),
    (["--budget", "1GiB", "--vary", "x"], "invalid choice: 'x'"),
    (["--budget", "1GiB", "--multiple", "0"], "--multiple: must be a positive int"),
    (["--budget", "1GiB", "--vary", "batch", "--seq", "4096"], "exceeds the model's max_len"),
])
def test_cli_fit_errors(capsys, argv, message):
    assert cli.main(["fit", "--config", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_step_memory_on_a_tpu_target_uses_its_peak():
    # The TPU compiler reports the step's peak itself; its FLOPs match the CPU's.
    tpu = step_memory(CFG, 1, 128, "full", target="tpu:v5e:1x1")
    cpu = step_memory(CFG, 1, 128, "full")
    assert tpu.source == "peak_memory_in_bytes" and tpu.total_bytes == tpu.peak_memory_in_bytes
    assert tpu.total_bytes != cpu.total_bytes
    assert tpu.params_bytes == cpu.params_bytes and tpu.opt_state_bytes == cpu.opt_state_bytes
    assert tpu.flops == pytest.approx(cpu.flops, rel=0.025)


def test_long_context_config_checks_its_budget_before_training(tmp_path):
    from experiments import train
    from experiments.configs import long_context

    def config(remat):
        c = long_context.get_config()
        c.update(remat=remat, num_steps=1, warmup_steps=0, eval_every=1, eval_batches=1)
        return c

    with pytest.raises(cli.BadInput, match=r"memory_budget=96MiB \(100663296 bytes per device\)"
                                           r": the compiled train step under remat=none holds"):
        train.train_and_evaluate(config("none"), str(tmp_path / "none"))
    budget = train.train_and_evaluate(config("selective"), str(tmp_path / "sel"))["memory_budget"]
    assert budget["bytes"] == 96 * 2**20 and budget["step_bytes"] <= budget["bytes"]
    assert not budget["none_fits"] and budget["none_step_bytes"] > budget["bytes"]


@pytest.mark.parametrize("call, error, message", [
    (lambda: step_memory(CFG, 0, 16, "full"), ValueError, "batch must be a positive int, got 0"),
    (lambda: step_memory(CFG, 2, 16.0, "full"), ValueError, "seq must be a positive int"),
    (lambda: step_memory("tiny", 2, 16, "full"), TypeError, "cfg must be a remat_kit.models"),
    (lambda: step_memory(CFG, 2, 16, "full", optimizer="adam"), TypeError, "optax"),
    (lambda: step_memory(CFG, 2, 16, "auto:budget=0.5"), rk.RematSpecError,
     "step_memory compiles one policy, not auto:budget=0.5"),
    (lambda: fit(CFG, BUDGET, policies=["full@every:99"]), ValueError, "99 is out of range"),
    (lambda: fit(CFG, BUDGET, target=["cpu"]), ValueError, "a target is a string"),
])
def test_bad_calls_fail_before_compiling(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_later_policies_start_at_the_size_found_so_far(monkeypatch):
    model = lambda s: 1_600_000 + 300 * s + s * s // 7
    calls = fake_step(monkeypatch, model)
    rows = fit(CFG, 10**7, policies=["none", "full"], multiple=128).rows
    assert rows[0].size == rows[1].size == 6656
    # full: the start (fits), then size + multiple (does not), cached "none" compiles aside.
    assert [c[2] for c in calls if c[0] == "full"] == [6656, 6784]
