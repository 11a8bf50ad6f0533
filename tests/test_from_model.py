"""Any Flax language model as a Workload (remat_kit.flax.from_model): models that are not ours.

The zoo (tests/zoo) holds models written as libraries write them and one from PyPI
(nano-moe-jax). On each: gradients under full, minimal and selective equal no remat; each
MaxText/Megatron preset saves exactly its definition's roles, of those the backward
pass reads; and the CLI's compare, explain, plan and fit take it as --model.
"""

import importlib
import json

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.trace.roles import ROLES
from remat_kit.policy.presets import PRESET_TABLE
from tests.test_remat import _design_saved

B, T = 2, 8
ZOO = ("gemma_linen", "gpt_linen", "llama_nnx", "fused_nnx", "nano_moe", "hf_llama_linen")
# Presets that save by name (no offload, which the CPU cannot show): every MaxText one.
PRESETS = tuple(f"maxtext:{name}" for cb, name, *_ in PRESET_TABLE
                if cb == "maxtext" and "offload" not in name) + ("selective",
                                                                   "praxis:save_context")


@pytest.fixture(scope="module", params=ZOO)
def zoo(request):
    """(name, model, concrete params, forward, workload, roles the backward pass reads)
    of one zoo model."""
    module = importlib.import_module(f"tests.zoo.{request.param}")
    model, params, forward = module.make(B, T)
    work = rk.from_model.workload(model, B, T)
    read = _saved_roles(work, "save:" + ",".join(ROLES))  # every role kept
    return request.param, model, params, forward, work, read


def test_finds_the_block_and_its_roles(zoo):
    name, _, _, _, work, _ = zoo
    assert work.num_layers == 2
    tags = set(rk.emitted_tags(work.loss_for_policy(rk.parse("full")), *work.args))
    roles = tags & set(ROLES)
    assert {"attn_norm", "attn_logits", "attn_probs", "context", "out_proj", "mlp_norm",
            "mlpwo"} <= roles, name


def test_fused_attention_has_context_only():
    """One fused attention op (a kernel): its scores never exist, and the notes say so."""
    fused = importlib.import_module("tests.zoo.fused_nnx")
    model, _, _ = fused.make(B, T, attention=fused.one_op_attention, abstract=True)
    work = rk.from_model.workload(model, B, T)
    tags = set(rk.emitted_tags(work.loss_for_policy(rk.parse("full")), *work.args))
    assert "context" in tags and not tags & {"attn_logits", "attn_probs"}
    assert any(n.startswith("attn_logits:") for n in work.notes), work.notes


def test_grads_equal_no_remat(zoo):
    name, _, params, forward, work, _ = zoo
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 32, jnp.int32)
    rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), work.args[2])

    def reference(p):  # the zoo's own forward and the next-token loss, no remat_kit
        logits = forward(p, tokens)[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    want = jax.jit(jax.grad(reference))(params)
    # The three specs' grads in one program (one compile); each remat region's recompute
    # stays behind its optimization barrier, apart from the other specs' forward passes.
    losses = {spec: work.loss_for_policy(rk.parse(spec)) for spec in ("full", "minimal",
                                                                        "selective")}
    got = jax.jit(lambda p, t, r: {s: jax.grad(loss)(p, t, r) for s, loss in losses.items()})(
        params, tokens, rest)
    for spec, grads in got.items():
        chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6, custom_message=spec)


def _saved_roles(work, spec):
    found = rk.residuals(work.loss_for_policy(rk.parse(spec)), *work.args)
    return {r.name for r in found if r.kind == "tag"} & set(ROLES)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_saves_its_roles(zoo, preset):
    """What a preset saves on a model not ours is its definition, of the roles the
    backward pass reads (those saved when every role is kept)."""
    _, _, _, _, work, read = zoo
    assert read, "no role is read by the backward pass"
    assert _saved_roles(work, preset) == _design_saved(preset.split(":")[-1], None) & read


def test_path_globs_reach_to_jax():
    """A path glob saves what it names; one that names nothing is said so."""
    module = importlib.import_module("tests.zoo.llama_nnx")
    model, _, _ = module.make(B, T, abstract=True)
    work = rk.from_model.workload(model, B, T)
    paths = {t for t in rk.emitted_tags(work.loss_for_policy(rk.parse("full")), *work.args)
             if "/" in t}
    wq = sorted(t for t in paths if t.endswith("attention/wq"))
    assert len(wq) == 2, paths
    inside = {t for t in _saved_names(work, "save:*/attention/wq") if "/attention" in t}
    assert inside == set(wq)  # of the blocks' values, just the named ones
    (rec,) = rk.measure(work, policies=["save:*/attention/nothing_here"])
    assert any("emitted" in n for n in rec.notes), rec.notes


def test_explain_lists_a_value_once_under_its_role(zoo):
    """A value tagged by path and by role is one row, its path an alias; the totals
    count each value once."""
    name, _, _, _, work, _ = zoo
    layer = rk.explain("minimal", work)
    rows = {r.name for r in layer.rows if r.kind == "tag"}
    assert not rows & {a for r in layer.rows for a in r.aliases}
    assert {"attn_norm", "out_proj", "mlp_norm"} <= rows  # roles name the rows
    if name == "gpt_linen":  # fused qkv `c_attn`, `c_proj` under the attention module
        by_name = {r.name: r for r in layer.rows}
        assert by_name["qkv_proj"].aliases == ("h_0/attn/c_attn",)
        assert by_name["qkv_proj"].decision == "saved"
        assert "h_0/attn/c_attn" not in by_name
    assert layer.recomputed_bytes == sum(r.nbytes for r in layer.rows
                                         if r.decision == "recomputed")


def test_block_input_is_decoder_layer_input(zoo):
    """The blocks' residual-stream input is named as our DecoderLayer names it, so
    Levanter's `offload` keeps it in host memory there too."""
    _, _, _, _, work, _ = zoo
    assert "decoder_layer_input" in rk.emitted_tags(work.loss_for_policy(rk.parse("full")),
                                                    *work.args)
    found = rk.residuals(work.loss_for_policy(rk.parse("levanter:offload")), *work.args)
    host = [r for r in found if r.memory == "host"]
    assert {r.name for r in host} == {"decoder_layer_input"}
    assert len(host) == work.num_layers
    assert all(r.shape[:2] == (B, T) for r in host)


def _saved_names(work, spec):
    return {r.name for r in rk.residuals(work.loss_for_policy(rk.parse(spec)), *work.args)
            if r.kind == "tag"}


def test_no_repeated_block_and_bad_block_are_one_line():
    import flax.linen as nn

    class One(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            return nn.Dense(8)(nn.Embed(8, 4)(tokens))

    # No layer at all: the report still comes out, its map line saying so, every row `none`.
    one = rk.from_model.workload(One(), B, T)
    assert one.model_map.line() == ("no layers found: nothing to remat, every policy runs as "
                                    "none; own remat: none; outside: Embed_0, Dense_0, loss")
    assert one.num_layers is None and one.notes[-1].startswith("no layers found")
    [row] = rk.measure(one, policies=["none", "full"])  # one program: one row for both
    assert row.names == ("none", "full") and row.error is None
    module = importlib.import_module("tests.zoo.gpt_linen")
    model, _, _ = module.make(B, T, abstract=True)
    with pytest.raises(rk.UnknownModuleError, match="got 'Blok'.*did you mean 'Block'"):
        rk.from_model.workload(model, B, T, block="Blok")

    class Layer(nn.Module):  # holds layers of its own: a block
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(4, name="wo")(nn.Dense(4, name="wi")(x))

    class NoLogits(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(8, 4)(tokens)
            return Layer()(Layer()(x)).sum()  # two blocks, no logits

    with pytest.raises(rk.from_model.ModelError, match="expected logits"):
        rk.from_model.workload(NoLogits(), B, T)

    class Encoder(nn.Module):  # needs a mask beside the tokens, as ablanx's encoder does
        @nn.compact
        def __call__(self, tokens, mask):
            return NoLogits()(tokens) * mask

    with pytest.raises(rk.from_model.ModelError, match=r"^Encoder.__call__ does not take the "
                       r"tokens alone \(missing a required argument: 'mask'\); .*Workload"):
        rk.from_model.workload(Encoder(), B, T)

    class OneLayer(nn.Module):  # one block whose four Dense share a shape: not blocks
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(8, 4)(tokens)
            x = Layer()(x + nn.Dense(4)(nn.Dense(4)(x)))
            return nn.Dense(8)(x)

    assert rk.from_model.workload(OneLayer(), B, T).model_map.stacks == ()
    assert rk.from_model.workload(OneLayer(), B, T, block="Layer").num_layers == 1


MODEL = "tests/zoo/gpt_linen.py:model"


@pytest.mark.parametrize("argv, message", [
    (["compare", "--model", "tests/zoo/none.py:model"], "not found"),
    (["compare", "--model", "tests/zoo/gpt_linen.py:nothing"], "has no 'nothing'"),
    (["compare", "--model", "tests/zoo/gpt_linen.py:GPTConfig"], "must return a flax"),
    (["compare", "--model", MODEL, "--seq", "16", "--block", "Nope"], "matches no module"),
    (["compare", "--model", "gpt_linen"], "takes FILE.py:FUNCTION"),
    (["compare", "--model", MODEL, "--dtype", "bfloat16"], "--dtype is for --config"),
    (["compare", "--config", "tiny", "--block", "Block"], "--block names the repeated"),
    (["explain", "--config", "tiny", "--policy", "selective,full"], "compare takes several"),
])
def test_bad_model_flags_are_one_line(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_compare_explain_plan_fit_on_a_model(capsys, tmp_path):
    common = ["--model", MODEL, "--batch", "2", "--seq", "16"]
    assert cli.main(["compare", *common, "--policies", "none,full,minimal",
                     "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "gpt_linen.py:model: batch 2, seq 16" in out and "minimal" in out
    # The verdict on a zoo model: minimal, its ratio that of the JSON.
    minimal = next(r for r in json.loads((tmp_path / "c.json").read_text())["records"]
                   if r["names"] == ["minimal"])
    assert out.splitlines()[1].startswith(
        f"cpu: use minimal: temp {rk.units.fmt_bytes(minimal['memory_bytes'])} "
        f"({minimal['memory_ratio_to_none']:.3f} x none), "
        f"{minimal['flops_ratio_to_none'] - 1:+.2%} FLOPs, ")
    assert out.splitlines()[2] == (
        'paste: rk.remat_model(model, "minimal")  or  --config.remat=minimal')
    assert cli.main(["explain", *common, "--policy", "minimal"]) == 0
    out = capsys.readouterr().out
    assert "qkv_proj" in out and "saved" in out
    assert cli.main(["plan", *common, "--budgets", "0.9", "--presets", "full,dots",
                     "--cache", ""]) == 0
    out = capsys.readouterr().out
    assert "planned 1 budget" in out and "(plan for 0.9: fewest FLOPs within " in out
    assert cli.main(["fit", "--model", MODEL, "--batch", "2", "--budget", "64MiB",
                     "--policies", "full", "--multiple", "16",
                     "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert "longest seq within 64.00 MiB" in out
    # The model learns 32 positions: the search stops at its limit, not at an error row.
    assert "32 (model's limit)" in out
    [row] = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert row["size"] == 32 and row["capped"] and row["error"] is None
    assert out.splitlines()[1:3] == [
        f"cpu: use full: seq 32 in 64.00 MiB per device, {row['flop_overhead'] - 1:+.2%} "
        "FLOPs (largest seq)", 'paste: rk.remat_model(model, "full")  or  --config.remat=full']
    assert "Incompatible shapes for broadcasting" in row["limit"]
    assert all(size <= 32 for size, _ in row["probes"])
    # A refused size bounds the bracket: the search bisects to the limit, not walks down to it.
    assert len(row["probes"]) <= 3, row["probes"]


def test_a_file_named_like_the_package_it_imports_loads(tmp_path):
    # nano_moe.py doing `from nano_moe.model import NanoMoE` (the PyPI package): the file's
    # folder must not shadow the package it wraps.
    (tmp_path / "nano_moe.py").write_text(
        "from nano_moe.config import NanoMoEConfig\n"
        "from nano_moe.model import NanoMoE\n\n"
        "def model():\n"
        "    return NanoMoE(NanoMoEConfig(vocab_size=64, n_layers=2, n_heads=4, d_model=32,\n"
        "                   d_ff=64, n_experts=2, top_k=1, block_size=32, dropout_rate=0.0))\n")
    from remat_kit.flax import user_model
    label, make = user_model.load(f"{tmp_path}/nano_moe.py:model")
    work = make(2, 16)
    assert work.num_layers == 2 and label == "nano_moe.py:model"


def test_a_workload_function_takes_a_one_chip_target(capsys, tmp_path):
    # The one-chip target's implicit data:1 mesh shards nothing; a real mesh is refused.
    (tmp_path / "wl.py").write_text(
        "import jax, jax.numpy as jnp\nimport remat_kit as rk\n\n"
        "def workload(batch, seq):\n"
        "    def loss_for(policy):\n"
        "        f = lambda w, x: rk.tag(jnp.tanh(x @ w), 'mlpwi').sum()\n"
        "        return jax.checkpoint(f, policy=policy.to_jax()) if policy.remat else f\n"
        "    return rk.Workload(loss_for, (jax.ShapeDtypeStruct((8, 8), jnp.float32),\n"
        "                                  jax.ShapeDtypeStruct((batch * seq, 8), jnp.float32)))\n")
    spec = f"{tmp_path}/wl.py:workload"
    out = tmp_path / "c.json"
    assert cli.main(["compare", "--model", spec, "--batch", "2", "--seq", "4", "--policies",
                     "none,full", "--target", "tpu:v5e:1x1", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["error"] for r in records] == [None, None]
    assert cli.main(["compare", "--model", spec, "--batch", "2", "--seq", "4",
                     "--mesh", "data:2"]) == 2
    assert "--mesh is for a model" in capsys.readouterr().err


HF_LLAMA = "tests/zoo/hf_llama_linen.py:model"
# Presets whose roles the HF-style Llama emits: each compiles to a program of its own.
HF_PRESETS = ("none", "full", "minimal", "selective", "save_qkv_proj")


def test_cli_compare_gives_each_preset_its_own_row_on_an_hf_style_model(tmp_path):
    assert cli.main(["compare", "--model", HF_LLAMA, "--batch", "2", "--seq", "16",
                     "--policies", ",".join(HF_PRESETS), "--json", str(tmp_path / "c.json")]) == 0
    records = {r["names"][0]: r for r in json.loads((tmp_path / "c.json").read_text())["records"]}
    assert sorted(records) == sorted(HF_PRESETS)
    assert all(r["names"] == [n] and r["error"] is None for n, r in records.items())
    figures = {(r["temp_size_in_bytes"], r["flops"]) for r in records.values()}
    assert len(figures) == len(HF_PRESETS), figures  # no preset collapses into another
    temp = {n: r["temp_size_in_bytes"] for n, r in records.items()}
    flops = {n: r["flops"] for n, r in records.items()}
    assert max(temp, key=temp.get) == "none" and temp["minimal"] < temp["selective"]
    assert flops["none"] < flops["minimal"] < flops["save_qkv_proj"] < flops["full"]


def test_cli_plan_on_an_hf_style_model(capsys, tmp_path):
    assert cli.main(["plan", "--model", HF_LLAMA, "--batch", "2", "--seq", "16",
                     "--budgets", "0.6", "--presets", "full,minimal,selective", "--cache", "",
                     "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "planned 1 budget" in out and "(plan for 0.6: fewest FLOPs within " in out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert sorted(r["names"] for r in doc["presets"]) == [["full"], ["minimal"], ["selective"]]
    (budget,) = doc["budgets"]
    plan = budget["plan"]
    assert plan["measured_bytes"] <= budget["budget_bytes"] == int(0.6 * plan["none_bytes"])
    assert plan["measured_flops"] < next(r["flops"] for r in doc["presets"]
                                         if r["names"] == ["full"])


def test_grads_with_a_padding_mask_under_apply_remat():
    """rk.linen.apply_remat(model, {"LlamaDecoderLayer": "minimal"}) on the HF-style
    Llama, called as that library's users call it (attention_mask as a keyword): its
    gradients are the plain model's, with the last 3 tokens of one row padded."""
    module = importlib.import_module("tests.zoo.hf_llama_linen")
    model, params, _ = module.make(B, T)
    wrapped = rk.linen.apply_remat(model, {"LlamaDecoderLayer": "minimal"})
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 64, jnp.int32)
    mask = jnp.ones((B, T), jnp.int32).at[1, -3:].set(0)

    def logits(m, p, attention_mask):
        return m.apply({"params": p}, tokens, attention_mask=attention_mask).logits

    def grad(m):
        return jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            logits(m, p, mask)[:, :-1], tokens[:, 1:]).mean())(params)

    got, want, padded, plain = jax.jit(lambda: (grad(wrapped), grad(model),
                                                logits(model, params, mask),
                                                logits(model, params, None)))()
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    # The mask changes the padded row's logits (its padded queries), not the other row's.
    assert jnp.array_equal(padded[0], plain[0]) and not jnp.allclose(padded[1], plain[1])
