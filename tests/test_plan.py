"""The budget planner: budgets, the cost model, the MILP against brute force, verification."""

import dataclasses
import importlib
import itertools
import json
import shlex

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.models import Transformer, TransformerConfig, get_config
from remat_kit.policy.budget import Budget, parse_budget
from remat_kit.decide.plan import CostModel, Planner, cost_model
from remat_kit.api.configs import config_planner, resolve_config
from remat_kit.units import fmt_bytes

BATCH, SEQ = 2, 32
plan_module = importlib.import_module("remat_kit.decide.plan")  # rk.plan is the function
# Where the planner compiles (its `measure`, which tests make fail).
compiles_module = importlib.import_module("remat_kit.decide.planner_compiles")


@pytest.fixture(scope="module")
def planner():
    """One planner for the tiny GPT-2, so each policy compiles once for the module."""
    return config_planner(get_config("tiny"), BATCH, SEQ, cache=None, groups=1)


# -- budgets -----------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("6GiB", Budget(bytes=6 * 2**30)), ("512MiB", Budget(bytes=512 * 2**20)),
    ("1.5GB", Budget(bytes=1_500_000_000)), (6_000_000_000, Budget(bytes=6_000_000_000)),
    ("6000000000B", Budget(bytes=6_000_000_000)), (0.25, Budget(fraction=0.25)),
    ("0.25", Budget(fraction=0.25)), ("25%", Budget(fraction=0.25)), (1, Budget(fraction=1.0)),
    ("3.2MiB", Budget(bytes=3355443)),  # 3355443.2 bytes, rounded down
])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text, message", [
    ("abc", "must be a size"), ("-1", "positive"), ("0", "positive"), (0, "positive"),
    ("-2GiB", "positive"), ("6XB", "unknown unit 'XB'"), ("1.5", "add a unit: 1.5GiB or 1.5MiB; got '1.5'"),
    ("24", "above 1 is not a budget .* add a unit: 24GiB, 24MiB, or 24B for bytes; got '24'"),
    ("6000000000", "add a unit: 6000000000GiB"),
    ("1.5B", "whole number"), ("1e400", "finite"),
    ("150%", "at most 100%"), (None, "not a NoneType"), (True, "not a bool"), ("", "a size"),
])
def test_bad_budget(text, message):
    with pytest.raises(rk.BudgetError, match=message):
        parse_budget(text)


def test_auto_spec():
    spec = rk.parse("auto:budget=6GiB")
    assert isinstance(spec, rk.AutoSpec) and str(spec) == "auto:budget=6GiB"
    assert rk.parse(str(spec)) == spec
    with pytest.raises(rk.BudgetError, match="positive"):
        rk.parse("auto:budget=-3")
    with pytest.raises(rk.RematSpecError, match="auto:budget=SIZE"):
        rk.parse("auto:memory=3GiB")
    with pytest.raises(rk.RematSpecError, match="did you mean 'auto:budget=0.5'"):
        rk.parse("auto:Budget=0.5")  # the user's value, in the right form
    cfg = TransformerConfig(remat="auto:budget=0.5")  # a config may hold it...
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(rk.RematSpecError, match="must be resolved"):  # ...but not build it
        Transformer(cfg).init(jax.random.key(0), tokens)


# -- the MILP against brute force ---------------------------------------------

def _brute_force(model: CostModel, room: float) -> tuple[float, int]:
    """The fewest recompute FLOPs (then bytes) over every subset of tags that fits."""
    best = None
    for k in range(len(model.tags) + 1):
        for saved in itertools.combinations(model.tags, k):
            nbytes, flops = model.cost(frozenset(saved))
            if nbytes <= room and (best is None or (flops, nbytes) < best):
                best = (flops, nbytes)
    return best


def test_chain_is_not_a_knapsack():
    """Saving mlpwo's input (mlp_act) alone does not spare mlpwi when GELU's
    backward reads mlpwi: a knapsack over independent tags would save mlp_act."""
    model = CostModel(tags=("mlpwi", "mlp_act"), nbytes={"mlpwi": 4, "mlp_act": 4},
                      flops={"mlpwi": 100.0, "mlp_act": 1.0},
                      parents={"mlpwi": frozenset(), "mlp_act": frozenset({"mlpwi"})},
                      needed=frozenset({"mlpwi", "mlp_act"}))
    assert model.solve(4)[0] == {"mlpwi"}
    assert model.cost(frozenset({"mlp_act"})) == (4, 100.0)  # mlpwi is still recomputed
    assert model.solve(8)[0] == {"mlpwi", "mlp_act"}
    assert model.solve(3)[0] == set()


def test_milp_matches_brute_force(planner):
    model = planner.model
    # The measured structure of the tiny GPT-2: chains between tags.
    assert model.parents["mlp_act"] == {"mlpwi"}
    assert model.parents["context"] == {"attn_probs", "value_proj"}
    assert model.parents["attn_logits"] == {"query_proj", "key_proj"}
    assert "mlpwo" not in model.needed and "mlp_act" in model.needed
    cfg = get_config("tiny")
    layer_mlp = BATCH * SEQ * cfg.mlp_dim
    assert model.nbytes["mlpwi"] == cfg.num_layers * layer_mlp * 4
    # The mlpwi segment in the forward program: the matmul (2 FLOPs per
    # multiply-add) and the bias add.
    assert model.flops["mlpwi"] == cfg.num_layers * (2 * cfg.d_model + 1) * layer_mlp
    total = sum(model.nbytes.values())
    for room in (0, total * 0.05, total * 0.2, total * 0.4, total * 0.7, total):
        saved, _, status = model.solve(room)
        assert "Optimal" in status
        assert model.cost(saved)[::-1] == pytest.approx(_brute_force(model, room), rel=1e-9)


def test_cost_model_predicts_compiled_flops(planner):
    """Predicted FLOPs of two policies against their compiled FLOPs (within 2%)."""
    model, full = planner.model, planner.measure(rk.parse("full"))
    base = full.flops - model.cost(frozenset())[1]
    for saved in ({"mlpwi", "mlp_act"}, {"query_proj", "key_proj", "value_proj", "out_proj"}):
        measured = planner.measure(rk.Policy(save=saved)).flops
        assert base + model.cost(frozenset(saved))[1] == pytest.approx(measured, rel=0.02)


def test_scanned_stack_costs_as_unrolled(planner):
    """A scanned layer stack gives the planner the same tags, bytes, FLOPs and chains
    as the unrolled one (each body tag counts once per layer), so it plans a real
    policy rather than falling back to full."""
    unrolled = planner.model
    # One verifying compile: the first plan fits (a second would only try the slack).
    scanned_planner = config_planner(get_config("tiny", scan_layers=True), BATCH, SEQ, cache=None,
                                     max_iterations=1)
    scanned = scanned_planner.model
    # The stack's boundary differs: unrolled, full keeps each layer's output (the next
    # layer's input); scanned, it keeps the carry, each layer's input.
    inner = set(unrolled.tags) - {"decoder_layer_input"}
    assert set(scanned.tags) == inner | {"decoder_layer_output"}
    assert scanned.needed == unrolled.needed - {"decoder_layer_input"}
    for t in inner:
        assert scanned.nbytes[t] == unrolled.nbytes[t], t
        assert scanned.flops[t] == unrolled.flops[t], t
        assert scanned.parents[t] == unrolled.parents[t] - {"decoder_layer_input"}, t
    plan = scanned_planner.plan(0.5)
    assert plan.spec != "full" and plan.measured_bytes <= plan.budget_bytes
    assert plan.iterations == 1 and f"{plan.spec}: {plan.measured_bytes:,} bytes, fits" in \
        plan.status  # the MILP's own choice, verified; not a base rule alone
    assert plan.measured_flops < scanned_planner.measure(rk.parse("full")).flops


def _out_of_memory(monkeypatch, *policies):
    """Makes `policies` compile as out of the device's memory, as XLA:TPU reports it."""
    real = compiles_module.measure

    def measure(*args, policies: list, **kwargs):
        return [dataclasses.replace(r, error="JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: "
                                    "CompileTimeHbmOom: Ran out of memory on HBM")
                if r.policy in policies_out else r
                for r in real(*args, policies=policies, **kwargs)]
    policies_out = policies
    monkeypatch.setattr(compiles_module, "measure", measure)


def test_plan_when_no_remat_runs_out_of_memory(planner, monkeypatch):
    """On an accelerator, no remat's value-and-grad can outgrow the device at long
    contexts: byte budgets still plan (no remat's FLOPs from the cost model), a
    fraction budget has nothing to be a fraction of, and full out of memory means
    nothing fits."""
    full, none = planner.measure(rk.parse("full")).memory_bytes, planner.measure(rk.parse("none"))
    _out_of_memory(monkeypatch, "none")
    oom = config_planner(get_config("tiny"), BATCH, SEQ, cache=None)
    assert oom.minimum() == (full, None)
    budget = (full + none.memory_bytes) // 2
    plan = oom.plan(budget)
    assert plan.none_out_of_memory and plan.none_bytes is None and plan.memory_fraction is None
    assert plan.measured_bytes <= budget and plan.spec not in ("none", "full")
    assert plan.none_flops == pytest.approx(none.flops, rel=0.02)
    assert "its FLOPs are the cost model's" in plan.status
    with pytest.raises(rk.BudgetError, match="fraction of no remat's memory, but no remat runs"):
        oom.plan(0.5)
    with pytest.raises(rk.BudgetError, match="below the least temp memory.*no remat runs out"):
        oom.plan(oom.minimum()[0] - 1)
    _out_of_memory(monkeypatch, "none", "full")
    with pytest.raises(rk.BudgetError, match="even full remat runs out of"):
        config_planner(get_config("tiny"), BATCH, SEQ, cache=None).plan(budget)


def test_generic_loss():
    """A plain loss: every tag is decided inside one remat region."""
    def loss(w, x):
        h = rk.tag(x @ w, "mlpwi")
        a = rk.tag(jnp.tanh(h), "mlp_act")
        return jnp.sum(rk.tag(a @ w.T, "mlpwo") ** 2)

    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    model = cost_model(loss, w, x)
    assert model.tags == ("mlpwi", "mlp_act", "mlpwo")
    assert model.parents == {"mlpwi": set(), "mlp_act": {"mlpwi"}, "mlpwo": {"mlp_act"}}
    assert model.nbytes == {"mlpwi": 32 * 256 * 4, "mlp_act": 32 * 256 * 4, "mlpwo": 32 * 64 * 4}
    assert model.flops["mlpwi"] == 2 * 32 * 64 * 256
    p = rk.plan(loss, w, x, budget=1.0, cache=None)
    assert p.spec == "none" and p.flops_overhead == 0


# -- verification -------------------------------------------------------------

def test_plan_fits_and_errors(planner):
    full, none = planner.minimum()
    p = planner.plan(0.9)
    assert p.measured_bytes <= p.budget_bytes == int(0.9 * none)
    # The least temp of any policy compiled so far: full's, or less on this tiny model.
    assert p.minimum_bytes == planner.minimum()[0] <= full and p.none_bytes == none
    assert p.measured_bytes == planner.measure(p.policy).temp_size_in_bytes
    # A policy compiled before (here a preset) is a candidate: the plan is never worse.
    minimal = planner.measure(rk.parse("minimal"))
    at_minimal = planner.plan(minimal.temp_size_in_bytes)
    assert at_minimal.measured_flops <= minimal.flops
    assert at_minimal.measured_bytes <= minimal.temp_size_in_bytes
    least = planner.minimum()[0]
    assert least == min(r.temp_size_in_bytes for r in planner.records.values())
    with pytest.raises(rk.BudgetError) as e:
        planner.plan(least - 1)
    assert e.value.minimum_bytes == least
    assert e.value.minimum_fraction == pytest.approx(least / none)
    assert f"{least:,} bytes" in str(e.value) and f"{least / none:.3f}" in str(e.value)


def test_verify_and_tighten(planner, monkeypatch):
    """A compiled policy over budget makes the planner tighten and solve again."""
    none = planner.measure(rk.parse("none"))
    planner.byte_share  # its compile (every tag saved) made honestly, before the patch
    budget = int(0.95 * none.temp_size_in_bytes)
    honest, over = compiles_module.measure, []

    def pessimist(*args, policies, **kwargs):  # the first planned choice compiles over budget
        out = []
        for r in honest(*args, policies=policies, **kwargs):
            if "save:" in r.policy and (not over or over[0] == r.policy):
                over[:1] = [r.policy]
                r = dataclasses.replace(r, temp_size_in_bytes=budget + 2**20)
            out.append(r)
        return out

    monkeypatch.setattr(compiles_module, "measure", pessimist)
    before = dict(planner.records)
    for key in [k for k in planner.records if "save:" in k]:  # earlier tests' plans compile again
        del planner.records[key]
    try:
        p = planner.plan(budget)
    finally:  # the fake record must not outlive this test
        planner.records.clear()
        planner.records.update(before)
    assert over and p.iterations >= 2 and f"{over[0]}: {budget + 2**20:,} bytes, over" in p.status
    assert p.spec != over[0]
    assert p.measured_bytes <= budget


def test_frontier_monotone_and_cache(planner, tmp_path, monkeypatch):
    path = str(tmp_path / "plans.json")
    monkeypatch.setattr(planner, "cache", path)
    plans = planner.frontier([0.9, 0.75, 1.0])
    order = sorted(plans, key=lambda p: p.budget_bytes)
    assert all(a.measured_flops >= b.measured_flops for a, b in zip(order, order[1:]))
    assert all(p.measured_bytes <= p.budget_bytes for p in plans)
    assert plans[2].spec == "none" and plans[2].flops_overhead == 0
    assert len(json.load(open(path))) == 3

    def no_compiles(self, policies, names=None):
        raise AssertionError("a cached plan compiled")

    again = config_planner(get_config("tiny"), BATCH, SEQ, cache=path, groups=1)  # restarted
    monkeypatch.setattr(compiles_module.PlannerCompiles, "measure_all", no_compiles)
    cached = again.plan(0.75)
    assert cached.cached and cached.policy == plans[1].policy


def test_auto_resolves_in_measure_and_config(planner, tmp_path, monkeypatch):
    path = str(tmp_path / "plans.json")
    monkeypatch.setattr(planner, "cache", path)
    monkeypatch.setenv("REMAT_KIT_CACHE", path)  # the default cache of resolve_config, measure
    chosen = planner.plan(0.9)
    cfg = get_config("tiny", remat="auto:budget=0.9")
    assert resolve_config(cfg, BATCH, SEQ).remat == chosen.spec
    [record] = rk.measure_config(cfg, BATCH, SEQ, names=["auto:budget=0.9"], per_layer=False)
    assert record.names == ("auto:budget=0.9",) and record.policy == chosen.spec
    assert record.temp_size_in_bytes == chosen.measured_bytes


# -- remat-kit plan -------------------------------------------------------------

def test_cli_plan(planner, tmp_path, capsys, monkeypatch):
    cache, out = str(tmp_path / "plans.json"), tmp_path / "plan.json"
    monkeypatch.setattr(planner, "cache", cache)
    chosen = planner.plan(0.9)  # cached: the command only compiles none and full
    code = cli.main(["plan", "--config", "tiny", "--batch", str(BATCH), "--seq", str(SEQ),
                     "--budgets", "0.9,0.01", "--presets", "full", "--json", str(out),
                     "--cache", cache, "--groups", "1"])  # the fixture's decision space
    assert code == 0
    doc = json.loads(out.read_text())
    high, low = doc["budgets"]
    assert high["plan"]["spec"] == chosen.spec and high["plan"]["cached"]
    assert high["best_preset"]["names"] == ["full"]
    assert [r["compiled"] for r in doc["presets"]] == [True]  # asked: compiled, none predicted
    assert low["plan"] is None and low["best_preset"] is None
    stdout = capsys.readouterr().out
    assert "below the minimum" in stdout
    # The verdict under the map line: the 0.9 plan, which is no preset's program,
    # as the --json file to paste; its figures those of the JSON.
    plan = high["plan"]
    assert plan["measured_flops"] != doc["presets"][0]["flops"]
    assert (doc["verdict"]["name"], doc["verdict"]["budget"]) == (str(out), "0.9")
    assert stdout.splitlines()[1:3] == [
        f"cpu: use {out}: temp {fmt_bytes(plan['measured_bytes'])} "
        f"({plan['measured_bytes'] / plan['none_bytes']:.3f} x none), "
        f"{plan['measured_flops'] / plan['none_flops'] - 1:+.2%} FLOPs, "
        f"{plan['predicted_seconds'] / plan['none_seconds'] - 1:+.2%} pred. step (plan for "
        f"0.9: fewest FLOPs within {fmt_bytes(high['budget_bytes'])})",
        f'paste: rk.remat_model(model, "{out}", budget="0.9")  or  '
        f"{shlex.quote('--config.remat=' + plan['spec'])}"]


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0.2,abc"], "--budgets"), (["--budgets", ""], "--budgets"),
    (["--budgets", "0.2", "--plot", "x.txt"], ".png"),
    (["--budgets", "0.2", "--no-presets", "--presets", "full"], "not allowed with"),
    (["--budgets", "0.8", "--presets", "full,auto:budget=0.3"],
     "--presets: 'auto:budget=0.3' is a budget for the planner, not a preset"),
])
def test_cli_plan_bad_input(argv, message, capsys):
    assert cli.main(["plan", "--config", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_train_plans_auto_budget(tmp_path):
    """experiments/train.py plans auto:budget= before training; below full remat's
    memory it is one-line bad input naming the minimum."""
    from experiments import train
    from experiments.configs import tiny

    (tmp_path / "text.py").write_text("def f(x):\n    return x + 1\n" * 200)
    config = tiny.get_config()
    config.data, config.remat = str(tmp_path / "text.py"), "auto:budget=1KiB"
    config.seq_len, config.batch_size = SEQ, BATCH
    with pytest.raises(cli.BadInput, match="below the least temp memory .* under full remat"):
        train.train_and_evaluate(config, str(tmp_path / "run"))


def test_train_plans_auto_budget_on_its_mesh(planner, tmp_path):
    """On config.mesh, auto:budget= is planned per device on that mesh: the minimum
    in the refusal is the sharded program's, not the one-device program's. A tensor
    axis splits parameters, which the planner once traced at their shard shapes."""
    from experiments import train
    from experiments.configs import tiny
    from remat_kit.models import from_config_dict

    (tmp_path / "text.py").write_text("def f(x):\n    return x + 1\n" * 200)
    config = tiny.get_config()
    config.data, config.remat, config.mesh = str(tmp_path / "text.py"), "auto:budget=1KiB", \
        "data:2,tensor:4"
    config.seq_len, config.batch_size, config.max_len = SEQ, BATCH, get_config("tiny").max_len
    with pytest.raises(cli.BadInput) as raised:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    cfg = from_config_dict(config, remat="none")
    assert cfg == get_config("tiny")  # the fixture's model, planned on one device
    sharded = config_planner(cfg, BATCH, SEQ, mesh=rk.mesh.make("data:2,tensor:4"),
                             cache=None).minimum()[0]
    assert sharded < planner.minimum()[0]
    assert f"reaches: {sharded:,} bytes" in str(raised.value)


# -- break-test faults ---------------------------------------------

@pytest.mark.parametrize("args, message", [
    ((), "cannot plan a loss called with no arguments: there is nothing to differentiate"),
    ((jnp.arange(3),), "holds no floating-point array (int32)"),
    (({"w": jnp.ones(3, jnp.int8)}, jnp.ones(3)), "holds no floating-point array (int8)"),
    ((jax.ShapeDtypeStruct((3,), jnp.uint8),), "(uint8)"),
])
def test_nothing_to_differentiate_is_refused(args, message):
    """Fault 10: no arguments gave an IndexError; integer ones a `none` plan of 0 bytes."""
    loss = lambda *xs: sum(jnp.sum(x) for x in jax.tree.leaves(xs)).astype(jnp.float32) \
        if xs else jnp.float32(1.0)
    with pytest.raises(ValueError, match="rk.plan\\(loss_fn, params, \\*batch, budget=...\\)") \
            as e:
        rk.plan(loss, *args, budget=0.5, cache=None)
    assert message in str(e.value) and not isinstance(e.value, IndexError)


def test_damaged_and_oversized_caches(tmp_path, monkeypatch):
    """Fault 7: a cache cut short was refused for good; any file was read whole."""
    path = tmp_path / "plans.json"
    path.write_text('{"key": {"spec": "full", "budg')  # a writer killed mid-file
    with pytest.warns(UserWarning, match="plans.json' is damaged .* read as empty"):
        assert plan_module.read_cache(str(path)) == {}
    path.write_text("# not a cache\n")  # some other file: never taken, never overwritten
    assert plan_module.read_cache(str(path)) is None
    path.write_text(json.dumps({"k": {"v": "v" * 1000}}))
    assert plan_module.read_cache(str(path)) == {"k": {"v": "v" * 1000}}
    monkeypatch.setattr(importlib.import_module("remat_kit.decide.plan_cache"), "CACHE_LIMIT", 100)
    assert plan_module.read_cache(str(path)) is None  # over the limit: not read past it


def test_the_planner_takes_policies_and_keeps_the_callers_labels():
    # Its methods take values (CHANGELOG.md, 0.1.0); the CLI passes its preset names as labels.
    planner = Planner(lambda x: jnp.sum(jnp.sin(x) ** 2), jnp.ones(8), cache=None)
    for call in (planner.measure, planner.compiles.peak, planner.seconds,
                 lambda p: planner.measure_all([p])):
        with pytest.raises(TypeError, match=r"Planner\.\w+ takes parsed policies.*'full'"):
            call("full")
    assert planner.records == {}  # refused before any compile
    minimal = rk.parse("minimal")
    [record, full] = planner.measure_all([minimal, rk.Policy()], names=["minimal", "full!"])
    assert record is full and record.names == ("minimal", "full!")  # no tags: one program
    assert set(planner.records) == {str(minimal), "full"}
    assert planner.policy_of(record) == minimal and record.policy == str(minimal)


def test_a_plan_cache_of_another_type_is_named():
    import jax.numpy as jnp

    import remat_kit as rk
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    with pytest.raises(TypeError, match="^cache must be a plan cache path, True for the "
                                        "default one, or None for none; got int 5$"):
        rk.plan(loss, jnp.ones((8, 8)), jnp.ones((4, 8)), budget=1.0, cache=5)
