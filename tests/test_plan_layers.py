"""Planner v2: tags inside jitted calls, the base rule, and decisions per layer group."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.decide.cost_model import PLANNED_BASES, CostModel
from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.decide.plan import Planner, cost_model
from remat_kit.api.configs import config_planner, resolve_config
from tests.test_plan import _brute_force

BATCH, SEQ = 2, 32


@pytest.fixture(scope="module")
def planner():
    """The tiny GPT-2 (2 layers) planned with one decision per tag and layer."""
    return config_planner(get_config("tiny"), BATCH, SEQ, cache=None, groups="layers")


def _jitted_loss(w, x):
    @jax.jit
    def block(w, x):  # the tags live inside a jitted call, as under nn.jit / nnx.jit
        h = rk.tag(x @ w, "mlpwi")
        a = rk.tag(jnp.tanh(h), "mlp_act")
        return rk.tag(a @ w.T, "mlpwo")
    return jnp.sum(block(w, x) ** 2)


def test_tags_inside_jit_are_planned():
    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    model = cost_model(_jitted_loss, w, x)
    assert model.tags == ("mlpwi", "mlp_act", "mlpwo")
    assert model.parents == {"mlpwi": set(), "mlp_act": {"mlpwi"}, "mlpwo": {"mlp_act"}}
    assert model.flops["mlpwi"] == 2 * 32 * 64 * 256
    # Under dots the matmul outputs are saved by the base rule: mlpwi costs no bytes
    # and no recompute, mlp_act's segment is the tanh alone.
    dots = cost_model(_jitted_loss, w, x, base="dots")
    assert dots.nbytes["mlpwi"] == 0 and dots.flops["mlpwi"] == 0
    assert dots.nbytes["mlp_act"] == 32 * 256 * 4
    p = Planner(_jitted_loss, w, x, cache=None)
    full, none = p.minimum()
    plan = p.plan((full + none) // 2)
    assert plan.spec != "full" and plan.measured_bytes <= plan.budget_bytes
    assert plan.measured_flops < p.measure(rk.parse("full")).flops


def test_loose_budget_tries_dots_uncompiled(planner):
    """dots is compiled by the planner itself, and at a budget it fits it is never beaten
    by a plan with more FLOPs."""
    assert "dots" not in planner.records
    none = planner.measure(rk.parse("none"))
    plan = planner.plan(0.95)
    dots = planner.records["dots"]
    assert dots.memory_bytes <= plan.budget_bytes  # dots fits this budget on tiny
    assert plan.measured_flops <= dots.flops and plan.measured_bytes <= plan.budget_bytes
    assert plan.measured_flops < planner.measure(rk.parse("full")).flops
    for base in PLANNED_BASES:  # never worse than a base rule alone that fits
        r = planner.records["full" if base == "nothing" else base]
        if r.memory_bytes <= plan.budget_bytes:
            assert plan.measured_flops <= r.flops
    assert none.flops <= plan.measured_flops


def test_groups_split_layers(planner):
    program = planner.program
    assert program.per_layer is None and len(program.layers) == 2
    assert planner.group_count() == (2, None)
    model = planner.model_for("nothing", 2)
    uniform = planner.model
    # Per group, each tag holds half the bytes and FLOPs of the uniform decision.
    for t in uniform.tags:
        assert model.nbytes[(t, 0)] + model.nbytes[(t, 1)] == uniform.nbytes[t]
        assert model.flops[(t, 0)] + model.flops[(t, 1)] == pytest.approx(uniform.flops[t])
        assert {p for p, _ in model.parents[(t, 0)]} == uniform.parents[t]
    scanned = config_planner(get_config("tiny", scan_layers=True), BATCH, SEQ, cache=None,
                             groups=2)
    groups, note = scanned.group_count()
    assert groups == 1 and "one scan body" in note


def test_grouped_milp_matches_brute_force(planner):
    """On a 2-group model with the tags cut to the MLP's and attention's outputs
    (2^10 subsets), the MILP's optimum equals a brute force over its model, per base."""
    keep = {"attn_probs", "context", "mlpwi", "mlp_act", "out_proj"}
    for base in PLANNED_BASES:
        full = planner.model_for(base, 2)
        items = tuple(t for t in full.tags if t[0] in keep)
        sub = CostModel(items, {t: full.nbytes[t] for t in items},
                        {t: full.flops[t] for t in items},
                        {t: full.parents[t] & set(items) for t in items},
                        frozenset(full.needed & set(items)), base=base)
        total = sum(sub.nbytes.values())
        for room in (0, 0.1 * total, 0.3 * total, 0.5 * total, 0.8 * total):
            saved, _, status = sub.solve(room)
            assert "Optimal" in status
            assert sub.cost(saved)[::-1] == pytest.approx(_brute_force(sub, room), rel=1e-9)


@pytest.fixture(scope="module")
def layered(planner):
    """Layer 0 saves the MLP's tags, layer 1 nothing: compiled through the rewrite."""
    policies = (rk.Policy(save={"mlpwi", "mlp_act"}), rk.Policy())
    return policies, planner.record_of(policies)


def test_per_layer_program_is_the_models(planner, layered):
    """The rewritten program compiles as the model with layer_remat does, and its
    saved tag bytes are the cost model's prediction."""
    policies, record = layered
    cfg = get_config("tiny", layer_remat=tuple(map(str, policies)))
    [ref] = rk.measure_config(cfg, BATCH, SEQ, policies=["none"], per_layer=False)
    assert record.temp_size_in_bytes == ref.temp_size_in_bytes
    assert record.flops == ref.flops
    free = set(planner.measure(rk.parse("full")).residual_bytes_by_tag)
    saved = {("mlpwi", 0), ("mlp_act", 0)}
    model = planner.model_for("nothing", 2)
    stored = sum(b for t, b in record.residual_bytes_by_tag.items() if t not in free)
    assert stored == sum(model.nbytes[t] for t in saved) == \
        2 * BATCH * SEQ * get_config("tiny").mlp_dim * 4
    # What the estimate counts of them: the measured share of a saved byte.
    assert model.cost(saved)[0] == round(planner.byte_share * stored)


def test_per_layer_grads_equal_no_remat(planner, layered):
    policies, _ = layered
    cfg = get_config("tiny")
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, cfg.vocab_size)
    params = Transformer(cfg).init(jax.random.key(0), tokens)["params"]
    key = jax.random.key(2)
    ref = jax.jit(jax.grad(make_loss_fn(Transformer(cfg), True)))(params, tokens, tokens, key)
    layered_cfg = cfg.replace(layer_remat=tuple(map(str, policies)))
    got = jax.jit(jax.grad(make_loss_fn(Transformer(layered_cfg), True)))(params, tokens,
                                                                          tokens, key)
    rewritten = planner.loss_of(policies)  # the rewrite (`with_region_policies`) of full's
    got_rewritten = jax.jit(jax.grad(rewritten))(params, tokens, tokens, key)
    for g in (got, got_rewritten):
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_per_layer_plan_and_config(planner, layered, tmp_path, monkeypatch):
    """A budget between saving the MLP in no layer and in both: the per-layer plan
    fits, beats the best uniform policy compiled, and applies as layer_remat, also
    through auto:budget= (resolve_config)."""
    _, record = layered
    path = str(tmp_path / "plans.json")
    monkeypatch.setattr(planner, "cache", path)
    plan = planner.plan(record.temp_size_in_bytes)
    assert plan.measured_bytes <= plan.budget_bytes
    uniform = [r for k, r in planner.records.items() if "/" not in k
               and r.memory_bytes <= plan.budget_bytes]
    assert plan.measured_flops <= min(r.flops for r in uniform)
    assert plan.measured_flops <= record.flops
    if plan.layer_specs:
        assert plan.groups == 2 and len(plan.layer_specs) == 2
        cfg = get_config("tiny", layer_remat=plan.layer_specs)
        [r] = rk.measure_config(cfg, BATCH, SEQ, policies=["none"], per_layer=False)
        assert r.temp_size_in_bytes == plan.measured_bytes
    auto = get_config("tiny", remat=f"auto:budget={record.temp_size_in_bytes}B")
    resolved = resolve_config(auto, BATCH, SEQ, cache=path, groups="layers")  # cached
    assert resolved.layer_remat == plan.layer_specs
    assert resolved.remat == ("none" if plan.layer_specs else plan.spec)


@pytest.mark.parametrize("argv, message", [
    (["--groups", "0"], "--groups '0': give a whole number of layer groups from 1 to 2"),
    (["--groups", "3"], "from 1 to 2"), (["--groups", "x"], "from 1 to 2"),
    (["--objective", "speed"], "--objective 'speed': use one of flops, time"),
])
def test_cli_plan_bad_groups_objective(argv, message, capsys):
    assert cli.main(["plan", "--config", "tiny", "--budgets", "0.5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("groups", [0, -1, 3])
def test_api_bad_group_count(groups):
    """A group count outside 1..layers fails when the Planner is made, naming the
    value and the range; the default is one group per layer."""
    ws = [(jax.ShapeDtypeStruct((64, 64), jnp.float32),) * 2] * 2
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    with pytest.raises(ValueError, match=f"groups={groups}: give a whole number of layer "
                                         "groups from 1 to 2"):
        Planner(_two_layer_factory, ws, x, cache=None, groups=groups)
    with pytest.raises(ValueError, match="groups=3: give a whole number"):
        rk.plan(_two_layer_factory, ws, x, budget=0.5, cache=None, groups=3)
    assert Planner(_two_layer_factory, ws, x, cache=None).group_count() == (2, None)


@pytest.fixture(scope="module")
def llama_planner():
    return config_planner(get_config("tiny_llama"), BATCH, SEQ, cache=None)


@pytest.mark.parametrize("which", ["planner", "llama_planner"])
def test_solver_optimum_equals_brute_force(which, request):
    """On tiny and tiny_llama, for each base rule, at 5 budgets: the MILP's optimum
    equals the best of every subset of tags under its own model (2^tags subsets)."""
    p = request.getfixturevalue(which)
    for base in PLANNED_BASES:
        model = p.model_for(base, 1)
        costs = [model.cost(frozenset(saved)) for k in range(len(model.tags) + 1)
                 for saved in itertools.combinations(model.tags, k)]
        total = sum(model.nbytes.values())
        for frac in (0.05, 0.2, 0.4, 0.6, 0.9):
            room = frac * total
            best = min((f, b) for b, f in costs if b <= room)
            saved, _, status = model.solve(room)
            assert "Optimal" in status
            assert model.cost(saved)[::-1] == pytest.approx(best, rel=1e-9), (base, frac)


def _two_layer_factory(policy):
    """Two residual MLP layers, each its own remat region under `policy` (or none)."""
    def layer(h, w):
        z = rk.tag(h @ w[0], "mlpwi")
        a = rk.tag(jnp.tanh(z), "mlp_act")
        return h + a @ w[1]
    step = jax.checkpoint(layer, policy=policy.to_jax()) if policy.remat else layer

    def loss(ws, x):
        for w in ws:
            x = step(x, w)
        return jnp.sum(x ** 2)
    return loss


def test_plan_is_the_best_compiled_policy_of_its_space():
    """benchmarks/plan_optimality.py's check on a 2-layer model: at 3 budgets the
    verified per-layer plan is within 0.5% of the FLOPs of the best fitting policy
    among all 48 (2 tags per layer x 2 layers x 3 base rules), each compiled."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plan_optimality.py")
    spec = importlib.util.spec_from_file_location("plan_optimality", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ws = [(jax.ShapeDtypeStruct((64, 256), jnp.float32),
           jax.ShapeDtypeStruct((256, 64), jnp.float32))] * 2
    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)

    def make(**kw):
        return Planner(_two_layer_factory, ws, x, cache=None, groups=2, offload=False,
                       objective="flops", **kw)
    tags = ("mlpwi", "mlp_act")
    policies = bench.space(tags, 2)
    assert len(policies) == 48
    limits = bench.budgets(make(), n=3)
    rows = bench.check(make, policies, limits, tags)
    assert all(r["ok"] for r in rows), rows
    assert any(r["plan_flops"] > 0 for r in rows)  # a budget that needs remat
