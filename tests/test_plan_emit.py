"""Plans a training run can use: the model's own tags, the same plan every time, one
decision per tag, the whole train step's budget, and the plan written out for MaxText and JAX."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.decide import emit
from remat_kit.decide.milp import CostModel
from remat_kit.decide.plan import Planner
from remat_kit.decide.plan_cache import Plan
from remat_kit.decide.step import compile_step, default_optimizer
from remat_kit.ui.inputs import device_mesh
from remat_kit.decide.step_records import default_step
from remat_kit.flax import from_model
from remat_kit.measure import figure_cache, targets
from remat_kit.policy.spec import parse
from remat_kit.trace.workload import from_loss
from tests.zoo import own_tags_linen


def _layer(w, x):
    h = rk.tag(x @ w, "mlpwi")
    a = rk.tag(jnp.tanh(h), "mlp_act")
    return x + rk.tag(a @ w.T, "mlpwo")


def _loss_for(policy):
    step = jax.checkpoint(_layer, policy=policy.to_jax()) if policy.remat else _layer

    def loss(ws, x):
        for w in ws:
            x = step(w, x)
        return jnp.sum(x ** 2)
    return loss


_WS = [jax.ShapeDtypeStruct((128, 256), jnp.float32)] * 4
_X = jax.ShapeDtypeStruct((256, 128), jnp.float32)


def _own_tags_workload():
    return from_model.workload(own_tags_linen.model(), 2, 16)


def test_own_names_are_one_decision_with_the_role_on_the_same_value():
    planner = Planner(_own_tags_workload(), cache=None)
    names = planner.program.planned_names()
    # MaxText's attention_out sits on the value the roles call context; module paths
    # on the projections' outputs are planned as the roles.
    assert names["attention_out"] == "context"
    assert names["layers_0/mlp/wi_0"] == "mlpwi_0"
    assert names["layers_1/self_attention/query"] == "query_proj"
    assert names["mlpwo"] == "mlpwo" and names["out_proj"] == "out_proj"
    model = planner.model_for("nothing", 1)
    assert "attention_out" not in model.tags and "attention_out" in model.aliases["context"]
    assert not any("/" in t for t in model.tags)


@pytest.mark.parametrize("offload", [False, True])
def test_own_tags_model_plans_with_and_without_offload(offload):
    planner = Planner(_own_tags_workload(), cache=None, groups=1, offload=offload,
                      bases=("nothing",))
    p = planner.plan(0.8)
    assert p.measured_bytes <= p.budget_bytes
    kept = {t for t in (*p.policy.save, *p.policy.offload)}
    assert kept and kept <= set(rk.TAGS)  # roles, never module paths
    assert ("context" not in kept) or "attention_out" in p.aliases["context"]
    assert (planner.offload_probe is not None) == offload


def _tied(order):
    """Two items of equal bytes and FLOPs (a role and a module path), listed in `order`."""
    tags = tuple(order)
    return CostModel(tags=tags, nbytes={t: 100 for t in tags}, flops={t: 5.0 for t in tags},
                     parents={t: frozenset() for t in tags}, needed=frozenset(tags))


def test_ties_go_by_the_stated_rule_in_any_order():
    # Room for one of three: equal FLOPs and bytes, so the role wins over the model's
    # own name and the module path, whatever order the items come in.
    for order in (["b/wo", "mlpwo", "attention_out"], ["attention_out", "b/wo", "mlpwo"],
                  ["mlpwo", "attention_out", "b/wo"]):
        saved, offloaded, _ = _tied(order).solve(150)
        assert saved == {"mlpwo"} and not offloaded
    saved, _, _ = _tied(["b/wo", "attention_out"]).solve(150)
    assert saved == {"attention_out"}  # the model's own name before a module path


def test_same_plan_cold_and_warm_and_under_other_hash_seeds(tmp_path):
    cache = tmp_path / "plans.json"
    cold = Planner(_loss_for, _WS, _X, cache=str(cache)).plan(0.7)
    warm = Planner(_loss_for, _WS, _X, cache=str(cache)).plan(0.7)
    assert warm.cached and (warm.spec, warm.measured_bytes) == (cold.spec, cold.measured_bytes)
    again = Planner(_loss_for, _WS, _X, cache=None).plan(0.7)  # figures from the figure cache
    assert again.spec == cold.spec
    args = [sys.executable, "-m", "remat_kit.cli", "plan", "--model",
            "tests/zoo/own_tags_linen.py:model", "--batch", "2", "--seq", "16",
            "--budgets", "0.7", "--no-presets", "--cache", "", "--json"]
    specs = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}.json"
        subprocess.run(args + [str(out)], check=True, capture_output=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": seed})
        specs.append(json.loads(out.read_text())["budgets"][0]["plan"]["spec"])
    assert specs[0] == specs[1]


def test_uniform_plan_and_what_it_costs(tmp_path):
    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "remat_kit.cli", "plan", "--model",
                    "tests/zoo/own_tags_linen.py:model", "--batch", "2", "--seq", "16",
                    "--budgets", "0.75", "--no-presets", "--cache", "", "--uniform",
                    "--emit", "maxtext", "--json", str(out)], check=True, capture_output=True)
    entry = json.loads(out.read_text())["budgets"][0]
    plan, per_layer = entry["plan"], entry["per_layer"]
    assert plan["layer_specs"] == [] and plan["groups"] == 1  # one decision per tag
    assert per_layer["groups"] == 2
    cost = entry["uniformity_cost"]
    assert cost["flops"] == pytest.approx(plan["flops_overhead"] - per_layer["flops_overhead"])
    assert cost["flops"] >= -1e-9  # per layer is never worse by FLOPs
    text = entry["emit"]["text"]
    assert entry["emit"]["refused"] is None and text.startswith("remat_policy=custom ")
    settings = dict(kv.split("=") for kv in text.split()[1:])
    assert list(settings) == list(emit.MAXTEXT_TENSORS)
    assert settings["decoder_layer_input"] == "device"
    # attention_out and context are one value: one setting for both.
    assert settings["attention_out"] == settings["context"]


def test_train_step_plan_fits_the_train_step_compile(monkeypatch):
    # Compiled, not read back from kept figures: the time model reads the executable.
    monkeypatch.setattr(figure_cache, "folder", lambda: None)
    work = from_loss(_loss_for, _WS, _X)
    planner = Planner(work, cache=None, step="train", groups=1)
    full = compile_step(work, parse("full"), default_optimizer(), targets.parse_target(None))
    budget = full.total_bytes + 1_200_000  # room above full remat's train step for mlpwi
    p = planner.plan(f"{budget}B")
    assert p.step == "train" and p.memory_kind == "train_step_bytes"
    step = compile_step(work, p.policy, default_optimizer(), targets.parse_target(None))
    assert p.measured_bytes == step.total_bytes <= budget  # fit's figure, at the budget
    assert p.measured_flops == step.flops
    assert p.spec != "full"
    # The time column is the compiled train step's prediction, not the value-and-grad roofline.
    predicted = planner.record_of(p.policy).predicted_seconds
    assert predicted is not None and p.predicted_seconds == predicted > 0


def test_default_step_is_train_where_any_budget_is_a_size_on_an_accelerator():
    tpu, cpu = targets.parse_target("tpu:v5e:1x1"), targets.parse_target("cpu")
    assert default_step(tpu, ["15.75GiB"]) == "train"
    assert default_step(tpu, ["0.5", "15.75GiB"]) == "train"  # 0.5 of none's train step
    assert default_step(tpu, ["0.5", "0.8"]) == "grad"
    assert default_step(cpu, ["6GiB"]) == "grad"


def _plan(spec, layer_specs=(), aliases=None):
    policy = tuple(map(parse, layer_specs)) if layer_specs else parse(spec)
    return Plan(budget="1GiB", budget_bytes=1 << 30, policy=policy, spec=spec,
                predicted_bytes=0, predicted_flops=0.0, measured_bytes=0, measured_flops=1.0,
                none_bytes=1, none_flops=1.0, minimum_bytes=0, status="", iterations=1,
                platform="", memory_kind="peak_memory_in_bytes",
                layer_specs=tuple(layer_specs), aliases=aliases or {})


def test_emit_maxtext_exact_and_its_refusals():
    p = _plan("save:query_proj,key_proj,out_proj;offload:context,mlpwo",
              aliases={"context": ["attention_out", "layers_0/self_attention/attention_op"]})
    assert emit.emit(p, "maxtext") == (
        "remat_policy=custom decoder_layer_input=device indexer_cutoff_threshold=remat "
        "context=offload mlpwi=remat mlpwi_0=remat mlpwi_1=remat mlpwo=offload "
        "moe_mlpwi_0=remat moe_mlpwi_1=remat moe_mlpwo=remat query_proj=device "
        "key_proj=device value_proj=remat kv_proj=remat qkv_proj=remat out_proj=device "
        "query_wa_proj=remat kv_wa_proj=remat mla_q=remat mla_kv=remat "
        "attention_out=offload engram=remat")
    refusals = [
        (_plan("0 save:mlpwo / 1 full", ["save:mlpwo", "full"]), "decides tags per layer"),
        (_plan("save:attn_norm,mlpwo"), "keeps attn_norm, which MaxText's custom policy has no"),
        (_plan("dots;save:context"), "base rule dots"),
        (_plan("none"), "the plan is no remat")]
    for plan, why in refusals:
        with pytest.raises(emit.EmitError, match=why) as e:
            emit.emit(plan, "maxtext")
        assert "\n" not in str(e.value)
    assert emit.emit_entry(_plan("none"), "maxtext")["text"] is None


def test_emit_maxtext_one_setting_for_context_and_attention_out_in_bfloat16():
    # A bfloat16 softmax sums in float32 and casts the sum back; the attention roles were
    # not found there, so attention_out stayed a decision apart from context and
    # --emit maxtext printed context=remat beside attention_out=device.
    cfg = own_tags_linen.DecoderConfig(dtype="bfloat16")
    planner = Planner(from_model.workload(own_tags_linen.Decoder(cfg), 2, 16), cache=None)
    assert planner.program.planned_names()["attention_out"] == "context"
    planner.model_for("nothing", 1)
    p = _plan("save:context,mlpwo", aliases=planner.aliases_of(parse("save:context,mlpwo")))
    assert p.aliases["context"] == ["attention_out"]
    assert emit.emit(p, "maxtext") == (
        "remat_policy=custom decoder_layer_input=device indexer_cutoff_threshold=remat "
        "context=device mlpwi=remat mlpwi_0=remat mlpwi_1=remat mlpwo=device "
        "moe_mlpwi_0=remat moe_mlpwi_1=remat moe_mlpwo=remat query_proj=remat "
        "key_proj=remat value_proj=remat kv_proj=remat qkv_proj=remat out_proj=remat "
        "query_wa_proj=remat kv_wa_proj=remat mla_q=remat mla_kv=remat "
        "attention_out=device engram=remat")


_FRESH = """
import json, sys
import jax
import remat_kit as rk
from remat_kit.measure import lowering
from remat_kit.policy.names import known_tags
from tests.zoo import own_tags_linen
assert "attention_out" not in known_tags()  # no planner ran in this process
model, params, _ = own_tags_linen.make(2, 16)
tokens = jax.numpy.zeros((2, 16), "int32")
out = {}
for policy in sys.argv[1:]:
    wrapped = rk.remat_model(model, policy)
    loss = lambda p: wrapped.apply({"params": p}, tokens).sum()
    compiled = lowering.compile_for(lambda p: jax.value_and_grad(loss)(p), params)
    out[policy] = [compiled.memory["temp_size_in_bytes"], compiled.flops]
print(json.dumps(out))
"""


def test_remat_model_takes_a_plan_naming_an_own_tag_in_a_fresh_process(tmp_path):
    # The model's own attention_out is a tag once the model is traced: a plan file or
    # spec naming it runs where no planner registered it (it raised UnknownTagError).
    work = _own_tags_workload()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "context": {"block": work.block_name, "num_layers": work.num_layers,
                    "parameters": work.parameter_count},
        "budgets": [{"budget": "0.5", "plan": {"spec": "save:attention_out,mlpwo"}}]}))
    run = subprocess.run([sys.executable, "-c", _FRESH, str(path), "save:attention_out,mlpwo",
                          "save:context,mlpwo", "save:mlpwo"],
                         check=True, capture_output=True, text=True)
    figures = json.loads(run.stdout.splitlines()[-1])
    # attention_out is the value the role context names: the same program.
    assert figures[str(path)] == figures["save:attention_out,mlpwo"] == \
        figures["save:context,mlpwo"] != figures["save:mlpwo"]


def test_emit_jax_compiles_to_the_plans_bytes_and_flops():
    planner = Planner(_loss_for, _WS, _X, cache=None, groups=1)
    for bases in (("nothing",), ("nothing", "dots_no_batch", "dots")):
        planner.bases = bases
        p = planner.plan(0.8)
        text = emit.emit(p, "jax")
        assert text.startswith("jax.checkpoint_policies.")
        policy = eval(text, {"jax": jax})  # noqa: S307 - the expression under test
        [record] = rk.measure(lambda ws, x: _own_policy(policy)(ws, x), _WS, _X,
                              policies=["none"])
        assert (record.memory_bytes, record.flops) == (p.measured_bytes, p.measured_flops), text
    assert emit.emit(_plan("none"), "jax") == "jax.checkpoint_policies.everything_saveable"
    with pytest.raises(emit.EmitError, match="module path"):
        emit.emit(_plan("save:b_0/mlp/wo"), "jax")


def _own_policy(policy):
    """The model's loss with each layer under a JAX policy of its own (what a user who
    pastes the --emit jax expression runs)."""
    step = jax.checkpoint(_layer, policy=policy)

    def loss(ws, x):
        for w in ws:
            x = step(w, x)
        return jnp.sum(x ** 2)
    return loss


def test_emit_remat_kit_call():
    assert emit.emit(_plan("save:mlpwi"), "remat_kit") == "rk.remat_model(model, 'save:mlpwi')"
    assert emit.emit(_plan("0 save:mlpwo / 1 full", ["save:mlpwo", "full"]), "remat_kit") == \
        "rk.remat_model(model, ('save:mlpwo', 'full',))"


def test_train_step_plan_of_a_model_on_a_tpu_target():
    # A --model on an AOT target gets a data-parallel mesh whose parameters carry no
    # placement; the train step compiled (it raised in with_sharding_constraint).
    tpu = targets.parse_target("tpu:v5e:1x1")
    work = from_model.workload(own_tags_linen.model(), 2, 16, mesh=device_mesh(None, 2, None, tpu))
    planner = Planner(work, cache=None, target=tpu, step="train", groups=1)
    full = planner.measure(rk.parse("full"))
    assert full.error is None and full.memory_kind == "train_step_bytes"
    assert full.train_step_bytes == full.peak_memory_in_bytes > 0
    p = planner.plan(f"{full.train_step_bytes}B")
    assert p.step == "train" and p.measured_bytes <= full.train_step_bytes


def test_maxtext_plans_never_no_remat():
    # MaxText's config reads remat_policy 'none' as None, which checkpoints every layer:
    # where the budget holds no remat, the plan for it keeps every tensor it names.
    planner = Planner(_own_tags_workload(), cache=None, groups=1, bases=("nothing",),
                      no_remat=False)
    planner.decide = emit.maxtext_taggable(planner.program.planned_names())
    p = planner.plan(1.0)
    assert p.spec == "save:query_proj,key_proj,value_proj,context,out_proj,mlpwi_0,mlpwi_1"
    assert p.measured_bytes < p.none_bytes
    assert emit.emit(p, "maxtext").startswith("remat_policy=custom decoder_layer_input=device")
    assert Planner(_own_tags_workload(), cache=None, groups=1).plan(1.0).spec == "none"


def test_train_plan_for_emit_compiles_no_preset_beyond_none_and_full(monkeypatch, tmp_path):
    from remat_kit.cli import commands
    from remat_kit.decide.planner_compiles import PlannerCompiles
    from remat_kit.ui.inputs import preset_policies
    compiled = []
    own = PlannerCompiles._train_record

    def counted(self, loss, name, key, *rest):
        compiled.append(key)
        return own(self, loss, name, key, *rest)
    monkeypatch.setattr(PlannerCompiles, "_train_record", counted)
    out = tmp_path / "plan.json"
    assert commands.main(["plan", "--model", "tests/zoo/own_tags_linen.py:model", "--batch", "2",
                          "--seq", "16", "--budgets", "0.97", "--cache", "", "--uniform",
                          "--step", "train", "--emit", "maxtext", "--json", str(out)]) == 0
    presets = {str(parse(p)) for p in preset_policies()}
    assert presets & set(compiled) == {"none", "full"}
    assert [r["policy"] for r in json.loads(out.read_text())["presets"]] == ["none", "full"]
    # none and full, then the planner's two plans (every decidable tag saved, for the
    # byte share; the budget's plan), each once.
    assert compiled[:2] == ["none", "full"] and len(set(compiled)) == len(compiled) == 4


def test_emit_maxtext_gives_context_and_attention_out_one_setting_without_the_alias():
    """A plan whose program named no alias for context (the reference model's) still sets
    MaxText's attention_out as its context: one tensor under two names."""
    text = emit.emit(_plan("save:query_proj,context"), "maxtext")
    assert "context=device" in text.split() and "attention_out=device" in text.split()
