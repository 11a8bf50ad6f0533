"""remat_kit.decide.fit: the largest sequence / batch per policy within a budget, and `remat-kit fit`."""

import importlib
import importlib.util
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.ui import sources
from remat_kit.cli import verdict
from remat_kit.errors import BudgetError
from remat_kit.api.configs import fit
from remat_kit.decide.step import StepMemory
from remat_kit.api.configs import step_memory
from remat_kit.models import bounds
from remat_kit.models import Transformer, get_config

fit_mod = importlib.import_module("remat_kit.decide.fit")  # rk.fit is the function
# Two layers: with one, full remat recomputes the whole layer at once and
# peaks as high as no remat.
CFG = get_config("tiny")
BUDGET = 24 * 2**20


@pytest.fixture(scope="module")
def seq_fit():
    return fit(CFG, BUDGET, vary="seq", policies=["none", "minimal", "full", "auto"],
               multiple=128)


def fsdp2():
    return rk.mesh.make("fsdp:2", jax.devices()[:2])


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
    with pytest.raises(BudgetError, match=f"{3 * 4 * n + 4:,} bytes") as e:
        fit(CFG, 3 * 4 * n, policies=["full"])
    assert e.value.minimum_bytes == 3 * 4 * n + 4


def fake_step(monkeypatch, bytes_at, error_at=None, bound=False):
    """Replaces the compile with a memory model: total = bytes_at(batch * seq). Without
    `bound`, fit's size bound (the real model's attention scores) is lifted too: these
    models grow slower than the scores."""
    calls = []
    if not bound:
        monkeypatch.setattr(bounds, "size_bound", lambda *args, **kwargs: (1 << 62, False))

    def step(workload, policy, optimizer, target, xla_remat=True):
        batch, seq = workload.batch, workload.seq
        calls.append((str(policy), batch, seq))
        if error_at is not None and batch * seq >= error_at[0]:
            raise error_at[1]
        total = bytes_at(batch * seq)
        return StepMemory(total, "fake", 1, 1, 2, total - 4, total, 0, 0, 0, None,
                          float(batch * seq), 0.0)

    monkeypatch.setattr(fit_mod, "compile_step", step)
    return calls


# Budgets above the floor (parameters + AdamW state, 1.5 MB); the first fits nothing.
@pytest.mark.parametrize("budget", [1_600_001, 3 * 2**20, 10**7, 5 * 10**8, 2**31])
def test_search_matches_brute_force_within_6_compiles(monkeypatch, budget):
    model = lambda s: 1_600_000 + 300 * s + s * s // 7  # quadratic, like attention scores
    calls = fake_step(monkeypatch, model)
    (row,) = fit(CFG, budget, policies=["full"], multiple=128).rows
    best = max((k * 128 for k in range(1, 2**13 + 1) if model(k * 128) <= budget), default=0)
    assert row.size == best
    assert len([c for c in calls if c[0] == "full"]) <= 6


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
                     "--mesh", "fsdp:2", "--json", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0
    assert "max seq" in stdout and "none" in stdout
    assert "per device of mesh fsdp:2 (2 devices; sizes global), batch 2" in stdout
    assert ("compiled: train step; gradients and optimizer state sharded like the parameters "
            "over fsdp:2") in stdout
    doc = json.loads(out.read_text())
    assert doc["budget_bytes"] == 2 * 10**6 and doc["vary"] == "seq"
    assert doc["mesh"] == "fsdp:2" and doc["devices"] == 2 and doc["fixed"] == 2
    assert doc["step"].startswith("train step; gradients and optimizer state sharded")
    assert [r["size"] for r in doc["rows"]] == [4992, 4992]  # 1e6 + 100 * 2 * 4992 <= 2e6
    assert [r["picked"] for r in doc["rows"]] == [None, None]
    assert (doc["verdict"]["name"], doc["verdict"]["gives"]) == (
        "none", "seq 4992 in 1.91 MiB per device")
    line = ("2 x DecoderLayer, scanned: no; own remat: none; outside: embed, final_norm, "
            "pos_embed, logits, loss")  # the config's map opens fit too
    assert doc["model_map"]["line"] == line and stdout.splitlines()[0] == f"model map: {line}"
    # The verdict under it: both rows reach seq 4992 at the same FLOPs, so no
    # remat, the first; no --target, so the CPU note.
    assert stdout.splitlines()[1:4] == [
        "cpu: use none: seq 4992 in 1.91 MiB per device, +0.00% FLOPs (largest seq)", 'paste: rk.remat_model(model, "none")  or  --config.remat=none',
        verdict.cpu_note()]


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "--budget: fit needs a budget in bytes: a number and a unit"),
    (["--budget", "0.3"], "--budget must be a size such as 16GiB, not a fraction"),
    (["--budget", "1GiB", "--target", "tpu:v9:1x1"], "tpu:v9:1x1"),
    (["--budget", "1KiB"], "is below the parameters plus optimizer state alone"),
    (["--budget", "1GiB", "--vary", "x"], "invalid choice: 'x'"),
    (["--budget", "1GiB", "--multiple", "0"], "--multiple: must be a positive int"),
    (["--budget", "1GiB", "--vary", "batch", "--seq", "4096"], "exceeds the model's max_len"),
    (["--budget", "1GiB", "--seq", "16"], "--seq 16 is what --vary seq searches; fix the --batch"),
    (["--budget", "1GiB", "--multiple", "2000000"], "--multiple 2000000 is above the largest seq"),
    (["--budget", "24MiB", "--policies", "auto:budget=16MiB"],
     "--policies: in fit, auto's budget is the fit budget"),
    (["--budget", "1GiB", "--vary", "batch", "--batch", "2"], "--batch 2 is what --vary batch"),
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
    (lambda: step_memory("tiny", 2, 16, "full"), TypeError, "take a TransformerConfig .* got str"),
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


def test_auto_row_picks_the_cheapest_fitting_policy_at_the_largest_size(seq_fit):
    *fixed, auto = seq_fit.rows
    assert auto.policy == "auto" and auto.error is None and auto.picked is not None
    # It could have picked any fixed row's policy at that row's size: at least the largest.
    assert auto.size == max(r.size for r in fixed) >= fixed[2].size  # full's
    # The picked policy fits there, compiled apart from fit's cache (a per-layer plan
    # as the config's layer_remat)...
    picked = (step_memory(CFG.replace(layer_remat=auto.picked_layers), 1, auto.size, "none")
              if auto.picked_layers else step_memory(CFG, 1, auto.size, auto.picked))
    assert picked.total_bytes == auto.memory.total_bytes <= BUDGET
    # ...and nothing auto tried fits one multiple further.
    over = [b for s, b in auto.probes if s == auto.size + 128]
    assert over and all(b is None or b > BUDGET for b in over)
    # Never more FLOPs than a fixed policy that fits at the same size (full here).
    full_there = step_memory(CFG, 1, auto.size, "full")
    assert full_there.total_bytes <= BUDGET
    assert picked.flops <= full_there.flops
    assert auto.flop_overhead == pytest.approx(picked.flops / step_memory(
        CFG, 1, auto.size, "none").flops)


def test_auto_budget_is_the_fit_budget(capsys):
    with pytest.raises(BudgetError, match="in fit, auto's budget is the fit budget"):
        fit(CFG, BUDGET, policies=["auto:budget=0.5"])
    assert cli.main(["fit", "--config", "tiny", "--budget", "2MB", "--policies",
                     "auto:budget=1GiB"]) == 2
    err = capsys.readouterr().err
    assert "write 'auto' or 'auto:budget=2000000B', not 'auto:budget=1GiB'" in err


def per_device_param_bytes(split: int) -> int:
    """Parameter bytes on one device of an fsdp:`split` mesh, from the logical axes:
    a leaf with an `embed` dimension that `split` divides is cut along it."""
    boxed = jax.eval_shape(lambda: Transformer(CFG).init(
        jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    total = 0
    for leaf in jax.tree.leaves(boxed, is_leaf=lambda x: hasattr(x, "names")):
        names, shape = leaf.names, leaf.value.shape
        cut = any(n == "embed" and d % split == 0 for n, d in zip(names, shape))
        total += math.prod(shape) * 4 // (split if cut else 1)
    return total


def test_mesh_step_figures_are_per_device():
    batch, seq = 2, 128
    whole = step_memory(CFG, batch, seq, "full")
    sharded = step_memory(CFG, batch, seq, "full", mesh=fsdp2())
    p = per_device_param_bytes(2)
    assert whole.params_bytes == per_device_param_bytes(1)
    assert sharded.params_bytes == sharded.grads_bytes == p < whole.params_bytes
    assert sharded.opt_state_bytes == 2 * p + 4  # AdamW's moments follow their params
    # memory_analysis() of the SPMD program is per device: its arguments are one
    # device's shards of the donated state plus its half of the tokens (and the key).
    key = whole.argument_size_in_bytes - whole.params_bytes - whole.opt_state_bytes \
        - 2 * batch * seq * 4
    assert 0 <= key <= 16
    assert sharded.argument_size_in_bytes == 3 * p + 4 + 2 * (batch // 2) * seq * 4 + key
    assert sharded.alias_size_in_bytes == 3 * p + 4  # donated, reused in place
    assert sharded.flops == pytest.approx(whole.flops / 2, rel=0.01)


def test_mesh_floor_is_per_device():
    floor = 3 * per_device_param_bytes(2) + 4
    with pytest.raises(BudgetError, match=f"{floor:,} bytes per device of mesh fsdp:2") as e:
        fit(CFG, floor - 1, policies=["full"], mesh=fsdp2())
    assert e.value.minimum_bytes == floor


def test_mesh_sizes_are_global(monkeypatch):
    calls = fake_step(monkeypatch, lambda tokens: 2 * 10**6 + 1000 * tokens)
    result = fit(CFG, 2 * 10**6 + 64_000, vary="batch", seq=8, policies=["none"], mesh=fsdp2())
    (row,) = result.rows
    assert result.multiple == 2 and result.mesh == "fsdp:2" and result.devices == 2
    assert row.size == 8 and all(b % 2 == 0 for _, b, _ in calls)
    # FLOPs per token over the whole mesh: per-device FLOPs (here batch * seq) x 2 devices.
    assert row.flops_per_token == pytest.approx(2.0)
    before = len(calls)
    (row,) = fit(CFG, 10**9, policies=["none"], mesh=fsdp2(), max_size=256).rows
    assert row.size == 256 and {b for _, b, _ in calls[before:]} == {2}  # data x fsdp


@pytest.mark.parametrize("mesh, kwargs, message", [
    ("tensor:3", {}, "num_heads=4 is not divisible by the tensor axis of size 3"),
    ("fsdp:2", {"batch": 3}, "batch 3 does not split over the 2 data-parallel devices"),
    ("fsdp:2", {"vary": "batch", "multiple": 3}, "multiple 3 does not split over the 2"),
])
def test_mesh_that_does_not_split_fails_before_compiling(mesh, kwargs, message):
    m = rk.mesh.make(mesh, jax.devices()[:math.prod(rk.mesh.parse_spec(mesh).values())])
    with pytest.raises(rk.MeshError, match=message):
        fit(CFG, BUDGET, mesh=m, **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "tensor:3"], "--mesh: num_heads=4 is not divisible"),
    (["--mesh", "fsdp:2", "--vary", "batch", "--multiple", "3", "--seq", "64"],
     "--multiple 3 does not split over the 2 data-parallel devices"),
    (["--mesh", "fsdp:x"], "--mesh: mesh spec 'fsdp:x'"),
])
def test_cli_fit_mesh_errors(capsys, argv, message):
    assert cli.main(["fit", "--config", "tiny", "--budget", "1GiB", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_llama_1b_v5e_config_has_the_parameters_its_docs_state():
    """experiments/configs/llama_1b_v5e.py is llama_1b in bfloat16, scanned: 1.50e9
    parameters (Llama 3.2 1B's shapes, output layer untied), counted from the shapes."""
    cfg, _, defaults = sources.load_config("experiments/configs/llama_1b_v5e.py")
    assert (cfg.family, cfg.vocab_size, cfg.num_layers, cfg.scan_layers) == ("llama", 128256, 16,
                                                                             True)
    assert (cfg.dtype, cfg.param_dtype, defaults) == ("bfloat16", "bfloat16",
                                                      {"batch": 1, "seq": 4096})
    params = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0),
                                                          jnp.zeros((1, 8), jnp.int32)))
    d, q, kv, mlp = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.mlp_dim
    layer = d * q * 2 + d * kv * 2 + 3 * d * mlp + 2 * d  # q, o; k, v; gate, up, down; 2 norms
    expected = 2 * cfg.vocab_size * d + cfg.num_layers * layer + d
    leaves = jax.tree.leaves(nn.unbox(params))
    assert sum(x.size for x in leaves) == expected
    assert round(expected / 1e9, 2) == 1.50
    assert {x.dtype for x in leaves} == {jnp.dtype("bfloat16")}


def test_no_size_past_what_the_scores_allow_is_compiled(monkeypatch):
    """Fault 8: fit --budget 100TiB handed XLA seq 524288, whose [1, 4, s, s] scores crash
    XLA's CPU compiler (SIGFPE). Sizes stop at 2**31 score elements, and at what one
    layer's scores [batch, heads, seq, seq] leave of the budget."""
    floor = fit_mod.tree_bytes(rk.models.workload(CFG, 1, 1).params) * 3 + 4  # params, AdamW
    calls = fake_step(monkeypatch, lambda s: floor + 32 * s * s, bound=True)  # 2 layers' scores
    (row,) = fit(CFG, "100TiB", policies=["full"]).rows
    assert max(4 * b * s * s for _, b, s in calls) <= 2**31
    assert row.size == 23168 and row.capped  # isqrt(2**31 / 4 heads) = 23170, in 128s
    # Within the budget: a step that is one layer's scores reaches the budget's bound,
    # which is its exact answer (1100 cannot fit), not a cap; nothing past it compiles.
    budget = floor + 16 * 1000**2
    assert bounds.size_bound(CFG, "seq", 1, budget, floor) == (1000, True)
    calls = fake_step(monkeypatch, lambda s: floor + 16 * s * s, bound=True)
    (row,) = fit(CFG, budget, policies=["full"], multiple=100).rows
    assert row.size == 1000 and not row.capped and max(s for _, _, s in calls) == 1000
    # A TPU compiles its own way: only the budget bounds the search there.
    assert bounds.size_bound(CFG, "seq", 1, 10**15, floor, platform="tpu")[0] > 10**6


def test_train_step_runs_the_step_that_step_memory_compiles():
    # Remat changes what is stored, not the values: one step under full remat gives no
    # remat's loss and parameters, in less memory.
    from remat_kit.measure import lowering
    from remat_kit.decide.step import TrainStep, step_figures
    from remat_kit.api.configs import train_step
    state = {}
    for policy in ("none", "full"):
        made = train_step(CFG, 2, 16, policy)
        args = made.make_args(jax.random.key(0))
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(args)] == [
            (s.shape, s.dtype) for s in jax.tree.leaves(made.args)]
        c = lowering.compile_for(made.step, *made.args, compile_only=False,
                                donate=TrainStep.DONATED, count_flops=False)
        params, _, loss = c.compiled(*jax.tree.leaves(args))
        state[policy] = (float(loss), params, step_figures(c, made.args))
    assert state["full"][0] == pytest.approx(state["none"][0], rel=1e-6)
    none, full = state["none"][2], state["full"][2]
    assert full.params_bytes == none.params_bytes == 4 * sum(
        x.size for x in jax.tree.leaves(state["none"][1]))
    assert full.temp_size_in_bytes < none.temp_size_in_bytes
    assert math.log(CFG.vocab_size) * 0.9 < state["none"][0] < math.log(CFG.vocab_size) * 1.2
    for a, b in zip(jax.tree.leaves(state["none"][1]), jax.tree.leaves(state["full"][1])):
        assert jnp.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("target, mesh", [
    (None, "fsdp:4"),
    pytest.param("tpu:v5e:2x2", "fsdp:4", marks=pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")),
    pytest.param("tpu:v5e:2x2", "data:4", marks=pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")),
])
def test_a_scanned_config_fits_on_a_mesh(target, mesh):
    """tiny_llama scanned, its step sharded over 4 devices (host CPUs, or a TPU slice
    compiled ahead of time): every trip's FLOPs counted from the compile itself,
    where the TPU compile once fell back to a CPU compile of the whole model at the
    parameters' shard shapes (ScopeParamShapeError) or on the wrong devices."""
    from remat_kit.measure import targets
    cfg = get_config("tiny_llama", scan_layers=True, num_layers=4)
    shape = rk.mesh.parse_spec(mesh)
    m = (rk.mesh.make(mesh, jax.devices()[:4]) if target is None
         else targets.make_mesh(target, shape))
    (row,) = fit(cfg, 48 * 2**20, policies=["full"], batch=4, mesh=m, target=target,
                 max_size=128).rows
    assert row.error is None and row.size == 128 and row.capped
    looped = step_memory(cfg.replace(scan_layers=False), 4, 128, "full", mesh=m, target=target)
    assert row.memory.flops == pytest.approx(looped.flops, rel=0.02)


def test_cli_fit_a_model_on_a_mesh_searches_sharded_steps(capsys):
    """fit --model --mesh compiles every searched step on the mesh (it searched unsharded
    steps before): twice the single device's batch on data:2, per device of the mesh."""
    argv = ["fit", "--model", "tests/zoo/gpt_linen.py:model", "--budget", "1MiB",
            "--policies", "full,minimal", "--vary", "batch", "--seq", "32"]
    batches = {}
    for mesh in (None, "data:2"):
        assert cli.main(argv + (["--mesh", mesh] if mesh else [])) == 0
        stdout = capsys.readouterr().out
        batches[mesh] = [line.split("│")[2].strip() for line in stdout.splitlines()
                         if line.startswith(("│ full", "│ minimal"))]
    assert batches == {None: ["4", "4"], "data:2": ["8", "8"]}
    assert "within 1.00 MiB per device of mesh data:2 (2 devices; sizes global)" in stdout
    # Data parallel: the compiled steps take every parameter whole, and the caption says so.
    assert ("compiled: train step; parameters and gradients and optimizer state whole on every "
            "device of data:2") in stdout


def test_the_verdict_pastes_a_spec_not_an_auto_rows_per_layer_pick():
    import types
    from remat_kit.cli.fit_report import pick_fit
    from remat_kit.decide.fit_search import FitRow
    auto = FitRow("auto:budget=12MiB", 384, flop_overhead=1.017, picked="0 full / 1 dots",
                  picked_layers=("full", "dots"))
    full = FitRow("full", 384, flop_overhead=1.25)
    result = types.SimpleNamespace(rows=[full, auto], vary="seq", budget_bytes=12 << 20)
    assert pick_fit(result).name == "full"
    result.rows = [auto]  # the only row that fits: named as it is
    assert pick_fit(result).name == "auto:budget=12MiB"


def test_cli_fit_says_why_nothing_compiled_below_the_smallest_size(capsys):
    # 1.5 MiB passes the floor (parameters, optimizer state) but not one seq's scores: no
    # compile, so no breakdown below; the verdict says why instead of "(see below)".
    cli.main(["fit", "--config", "tiny", "--budget", "1.5MiB", "--policies", "none,full"])
    stdout = " ".join(capsys.readouterr()[0].split())
    assert ("cpu: no policy fits 1.50 MiB at any seq (none compiled: at seq 128 the largest "
            "buffer alone") in stdout
    assert "see below" not in stdout and "below the minimum" not in stdout


@pytest.mark.parametrize("policies", [None, []])
def test_fit_names_policies_that_are_no_specs(policies):
    from remat_kit.api.configs import fit_rows
    with pytest.raises(TypeError, match="policies must be one spec or a non-empty list"):
        fit_rows(policies, "1GiB")


@pytest.mark.parametrize("budget, message", [
    ("24", "fit needs a budget in bytes: a number and a unit, such as 16GiB, 512MiB or "
           "6000000000B (a bare number above 1 is not a budget); got '24'"),
    ("lots", "fit needs a budget in bytes: a number and a unit, such as 16GiB, 512MiB or "
             "6000000000B (a budget must be a size); got 'lots'"),
    ("1B", "budget 1 B is below the parameters plus optimizer state alone, ")])
def test_fit_budget_errors_offer_sizes_and_say_bytes_once(capsys, budget, message):
    code = cli.main(["fit", "--config", "tiny", "--budget", budget, "--policies", "full"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "fraction" not in err, err


def test_fits_verdict_and_table_explain_a_cap_an_unknown_cost_and_no_memory():
    import types

    from rich.console import Console

    from remat_kit.cli.fit_report import fit_table, pick_fit
    from remat_kit.decide.fit_search import FitRow
    full = FitRow("full", 65536, capped=True)  # no remat compiled: no FLOPs to compare
    result = types.SimpleNamespace(rows=[full], vary="batch", budget_bytes=64 << 30,
                                   mesh=None, devices=1)
    choice = pick_fit(result)
    assert choice.gives == ("batch 65536 (the largest batch searched; larger ones were not "
                            "tried) in 64.00 GiB per device")
    assert choice.cost == "FLOPs over no remat unknown (no remat compiled at no size to " \
                          "count them)"
    console = Console(width=400, record=True)
    console.print(fit_table(result))
    caption = " ".join(console.export_text().split())
    assert "(cap): the largest size searched fits" in caption and "n/a" not in caption
