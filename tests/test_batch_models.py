"""Models that are not token LMs: a ViT on images (NNX, dropout), a DiT
on latents and timesteps (linen, adaLN), a BERT-style encoder on a dict batch (linen).

Each is given as `--model FILE.py:build` gives it, `(model, batch, loss)`
(`rk.batch_model.workload`). Compare's rows mean what their names say (`full` under
`none` in temp, over it in FLOPs), `minimal` saves the roles the dataflow finds in
each block (exact sets), `rk.remat_model` compiles to compare's row for none, full,
minimal and selective (bytes and FLOPs), gradients equal the plain model's, fit varies
the batch, and bad input is one line.
"""

import importlib
import json
import math
import pathlib

import chex
import jax
import pytest
from flax import nnx

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.flax import batch_model
from remat_kit.flax.from_model import ModelError
from remat_kit.measure import lowering
from remat_kit.trace.roles import ROLES

POLICIES = ("none", "full", "minimal", "selective")
ATTENTION = {"attn_logits", "attn_probs", "context", "out_proj"}
MLP = {"mlp_norm", "mlpwi", "mlp_act", "mlpwo"}
# The roles in one block, by the dataflow: the ViT and BERT write query, key and value
# apart; the DiT fuses them (one Dense to 3 x DIM, as DiT's own code does). BERT is
# post-norm: a layer's query/key/value read its input, the previous layer's last norm,
# which lies outside the block, so it has no attn_norm of its own.
BLOCK_ROLES = {
    "vit_nnx": ATTENTION | MLP | {"attn_norm", "query_proj", "key_proj", "value_proj"},
    "dit_linen": ATTENTION | MLP | {"attn_norm", "qkv_proj"},
    "bert_linen": ATTENTION | MLP | {"query_proj", "key_proj", "value_proj"},
}
# What `minimal` keeps of a block: its definition's roles the backward pass reads. The
# ViT's mlpwo reaches the block's output through dropout and the residual add, whose
# backward passes never read it: nothing to save.
MINIMAL_SAVES = {
    "vit_nnx": {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi"},
    "dit_linen": {"qkv_proj", "out_proj", "mlpwi", "mlpwo"},
    "bert_linen": {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo"},
}
CLASSES = {"vit_nnx": "EncoderBlock", "dit_linen": "DiTBlock", "bert_linen": "BertLayer"}


@pytest.fixture(scope="module", params=sorted(BLOCK_ROLES))
def zoo(request):
    """(name, zoo module, model, batch, loss, workload, compare's records by policy)."""
    module = importlib.import_module(f"tests.zoo.{request.param}")
    model, batch, loss = module.build()
    work = rk.batch_model.workload(model, batch, loss)
    records = {r.names[0]: r for r in rk.measure(work, policies=list(POLICIES))}
    return request.param, module, model, batch, loss, work, records


def test_the_blocks_and_their_roles(zoo):
    name, _, _, batch, _, work, _ = zoo
    assert (work.block_name, work.num_layers) == (CLASSES[name], 2)
    assert work.batch == 2 and work.seq == (16 if name == "bert_linen" else None)
    rows = rk.explain("minimal", work).rows
    assert {r.name for r in rows if r.kind == "tag"} & set(ROLES) == BLOCK_ROLES[name]
    assert {r.name for r in rows if r.kind == "tag" and r.decision == "saved"} & set(
        ROLES) == MINIMAL_SAVES[name]


def test_the_dit_s_adaln_matmul_is_no_mlp_of_its_block():
    """c = MLP(timestep embedding) is made outside the blocks; each block's Dense of
    silu(c) into shift, scale and gate is not its MLP: the MLP is fc1 -> gelu -> fc2
    (before the fix, silu(c) [2, 32] was mlp_act and adaLN's output mlpwo)."""
    module = importlib.import_module("tests.zoo.dit_linen")
    rows = rk.explain("minimal", rk.batch_model.workload(*module.build())).rows
    shapes = {(r.name, r.shape) for r in rows if r.kind == "tag"}
    assert {s for s in shapes if s[0] in ("mlp_act", "mlpwo", "mlpwi")} == {
        ("mlpwi", (2, 16, 128)), ("mlp_act", (2, 16, 128)), ("mlpwo", (2, 16, 32))}
    assert ("blocks_0/adaLN_modulation", (2, 192)) in shapes


def test_the_rows_mean_what_their_names_say(zoo):
    _, _, _, _, _, _, records = zoo
    none, full = records["none"], records["full"]
    assert full.memory_bytes < none.memory_bytes
    assert none.flops < records["minimal"].flops < full.flops
    assert none.flops < records["selective"].flops < full.flops


def _wrapped_loss(model, wrapped, loss):
    """loss(params, batch, other variables) of `wrapped` (`model`, or rk.remat_model's
    model of it) called on the batch as `model` takes it, its arguments as the
    workload's. NNX: merged with copies of the state (`copy=True`), which the call
    updates (dropout's RNG counts) at the trace level of jax.grad, not of the jit
    around it (flax refuses that write: TraceContextError, with or without remat_kit)."""
    if isinstance(wrapped, nnx.Module):
        graphdef, _, _ = nnx.split(wrapped, nnx.Param, ...)

        def run(p, b, r):
            args, kwargs = batch_model.call_args(model, b)
            return loss(nnx.merge(graphdef, p, r, copy=True)(*args, **kwargs), b)
        return run

    def run(p, b, r):
        args, kwargs = batch_model.call_args(model, b)
        return loss(wrapped.apply({"params": p, **r}, *args, **kwargs), b)
    return run


@pytest.mark.parametrize("spec", POLICIES)
def test_remat_model_compiles_to_compare_s_row(zoo, spec):
    _, _, model, _, loss, work, records = zoo
    compiled = lowering.compile_for(
        lambda *a: jax.value_and_grad(_wrapped_loss(model, rk.remat_model(model, spec), loss))(
            *a),
        *work.args)
    assert (compiled.memory["temp_size_in_bytes"], compiled.flops) == (
        records[spec].memory_bytes, records[spec].flops)


def test_gradients_equal_the_plain_model(zoo):
    """Dropout too (the ViT's): the wrapped copy starts from the same RNG state."""
    _, _, model, batch, loss, _, _ = zoo
    if isinstance(model, nnx.Module):
        _, params, rest = nnx.split(model, nnx.Param, ...)
    else:
        args, kwargs = batch_model.call_args(model, batch)
        params, rest = model.init(jax.random.key(0), *args, **kwargs)["params"], {}
    # The plain model, no remat_kit: its own call, the zoo's loss.
    plain = _wrapped_loss(model, model, loss)
    losses = {spec: _wrapped_loss(model, rk.remat_model(model, spec), loss)
              for spec in ("full", "minimal", "selective")}
    got, want = jax.jit(lambda p, b, r: ({s: jax.grad(f)(p, b, r) for s, f in losses.items()},
                                         jax.grad(plain)(p, b, r)))(params, batch, rest)
    for spec, grads in got.items():
        chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6, custom_message=spec)


def test_the_batch_resizes_along_every_leading_axis(zoo):
    name, _, _, _, _, work, _ = zoo
    shapes = jax.tree.map(lambda x: x.shape, work.at(batch=5).args[1])
    assert shapes == {"vit_nnx": {"image": (5, 16, 16, 3), "label": (5,)},
                      "dit_linen": ((5, 8, 8, 4), (5,), (5, 8, 8, 4)),
                      "bert_linen": dict.fromkeys(("attention_mask", "input_ids", "labels"),
                                                  (5, 16))}[name]


def test_fit_varies_the_batch():
    """On the DiT (latents, timesteps, noise): full remat fits a larger batch than none
    within one budget, and fit's per-token FLOPs are per example (no sequence axis)."""
    module = importlib.import_module("tests.zoo.dit_linen")
    work = rk.batch_model.workload(*module.build())
    none, full = rk.fit(work, "1MiB", vary="batch", policies=["none", "full"]).rows
    assert (none.size, full.size) == (3, 6)
    with pytest.raises(ValueError, match="has no sequence axis"):
        rk.fit(work, "1MiB", vary="seq")


def test_a_sequence_axis_is_resized_where_the_batch_has_one():
    module = importlib.import_module("tests.zoo.bert_linen")
    work = rk.batch_model.workload(*module.build()).at(batch=3, seq=24)
    assert {k: v.shape for k, v in work.args[1].items()} == {
        "input_ids": (3, 24), "attention_mask": (3, 24), "labels": (3, 24)}


# ---------------------------------------------------------------------------
# bad input: one line each
# ---------------------------------------------------------------------------

MODELS = '''
import jax, jax.numpy as jnp
from tests.zoo import dit_linen

def no_loss():
    return dit_linen.DiT(), dit_linen.batch()

def four():
    return dit_linen.DiT(), dit_linen.batch(), dit_linen.loss, 1

def uneven():
    latents, _, noise = dit_linen.batch()
    return dit_linen.DiT(), (latents, jnp.int32(5), noise), dit_linen.loss

def vector_loss():
    return dit_linen.DiT(), dit_linen.batch(), lambda out, batch: (out - batch[2]).mean(0)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "batches.py"
    path.write_text(MODELS)
    return path


def _error(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 2
    [line] = capsys.readouterr().err.splitlines()
    return line


def test_a_function_returning_another_form_names_the_accepted_ones(models, capsys):
    line = _error(capsys, "compare", "--model", f"{models}:four", "--policies", "none")
    assert line.endswith("four() must return a flax.linen or flax.nnx Module, (model, batch) or "
                         "(model, batch, loss): batch a pytree of arrays or "
                         "jax.ShapeDtypeStructs, loss(output, batch) -> scalar; it returned a "
                         "tuple (DiT, tuple, function, int)")


def test_a_batch_that_is_not_tokens_needs_a_loss(models, capsys):
    line = _error(capsys, "compare", "--model", f"{models}:no_loss", "--policies", "none")
    assert line.endswith("no_loss(): the batch (float32[2, 8, 8, 4], int32[2], float32[2, 8, "
                         "8, 4]) is not one int array of tokens [batch, seq], so there is no "
                         "default loss: give loss(output, batch) -> scalar")


def test_vary_seq_without_a_sequence_axis(capsys):
    line = _error(capsys, "fit", "--model", "tests/zoo/vit_nnx.py:build", "--vary", "seq",
                  "--budget", "4MiB")
    assert line == ("remat-kit fit: error: --vary seq: the batch of --model "
                    "tests/zoo/vit_nnx.py:build has no sequence axis (no int leaf [batch, seq]; "
                    "its leaves: float32[2, 16, 16, 3], int32[2]); search the batch with "
                    "--vary batch")


def test_vary_batch_without_a_common_leading_axis(models, capsys):
    line = _error(capsys, "fit", "--model", f"{models}:uneven", "--vary", "batch", "--budget",
                  "4MiB")
    assert line == (f"remat-kit fit: error: --vary batch: the leaves of the batch of --model "
                    f"{models}:uneven share no leading (batch) axis (float32[2, 8, 8, 4], "
                    "int32[], float32[2, 8, 8, 4]), so it cannot be resized; make every leaf "
                    "[batch, ...]")


def test_a_loss_that_is_not_a_scalar(models, capsys):
    line = _error(capsys, "compare", "--model", f"{models}:vector_loss", "--policies", "none")
    assert line.endswith("loss '<lambda>' must return a float scalar, it returned "
                         "float32[8, 8, 4]")


def test_the_library_refuses_alike():
    module = importlib.import_module("tests.zoo.vit_nnx")
    model, batch, loss = module.build()
    with pytest.raises(ModelError, match=r"^the batch has no sequence axis"):
        rk.batch_model.workload(model, batch, loss, seq=8)
    with pytest.raises(ModelError, match=r"^batch\['label'\] is int 3, not an array"):
        rk.batch_model.workload(model, {**batch, "label": 3}, loss)


def test_train_runs_the_vit_on_synthetic_batches(tmp_path, capsys):
    """experiments.train --model: batches of the declared shapes, dropout keyed per step,
    and the compiled step is the one fit prices (equal temp bytes)."""
    import types

    from experiments import own_model, train
    from experiments.configs import tiny

    config = tiny.get_config()
    config.update(dict(model=f"{pathlib.Path(__file__).parent}/zoo/vit_nnx.py:build",
                       num_steps=3, batch_size=4, warmup_steps=1, log_every=1, eval_every=3,
                       eval_batches=1, checkpoint_every=3, remat="minimal"))
    summary = train.train_and_evaluate(config, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["train_loss"]) for line in lines)
    assert math.isfinite(summary["eval_loss"]) and summary["policy"] == str(rk.parse("minimal"))
    assert summary["compiled"]["predicted"]["temp_equal"] is True
    # Images: the model's own loss over examples, no bytes or tokens.
    assert summary["eval_bits_per_byte"] is None and summary["median_examples_per_second"] > 0
    assert all(line["examples_per_second"] > 0 for line in lines)
    out = capsys.readouterr().out
    assert "(the model's loss)" in out and "median examples/s" in out
    assert "nats/byte" not in out and "tok/s" not in out and "tokens" not in out
    vit = types.SimpleNamespace(model=importlib.import_module("tests.zoo.vit_nnx").build()[0])
    keys = [jax.random.key_data(v.value) for s in (0, 1) for v in jax.tree.leaves(
        own_model.rng_state(vit, 0, s), is_leaf=lambda v: isinstance(v, nnx.RngKey))
            if isinstance(v, nnx.RngKey)]
    assert len(keys) == 4 and len({tuple(k.tolist()) for k in keys}) == 4


def test_a_linen_model_that_asks_for_dropout_rngs_is_refused_in_its_own_terms():
    """A (model, batch, loss) model is applied to its batch, not to tokens: the refusal
    says so and names the way that trains with dropout (NNX's carried RNG state)."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, images):
            return nn.Dropout(0.1, deterministic=False)(nn.Dense(4)(images))

    images = jax.ShapeDtypeStruct((2, 8), jax.numpy.float32)
    with pytest.raises(ModelError) as e:
        rk.batch_model.workload(Net(), images, lambda out, b: out.mean())
    assert "applies it to its batch with no rngs, under the FUNCTION's loss" in str(e.value)
    assert "flax.nnx" in str(e.value) and "tokens" not in str(e.value)


def test_a_batch_of_tokens_without_a_loss_is_the_next_token_workload():
    """(model, tokens) keeps a token LM's default: from_model's next-token loss, the same
    program."""
    from tests.zoo import gpt_linen

    model = gpt_linen.model()
    tokens = jax.ShapeDtypeStruct((2, 16), jax.numpy.int32)
    work, want = rk.batch_model.workload(model, tokens), rk.from_model.workload(model, 2, 16)
    assert (work.batch, work.seq, work.block_name) == (2, 16, want.block_name)
    assert jax.tree.map(lambda x: x.shape, work.args) == jax.tree.map(lambda x: x.shape,
                                                                      want.args)
    with pytest.raises(ModelError, match="vocab chunks"):
        rk.batch_model.workload(model, {"tokens": tokens}, lambda out, b: out.logits.mean(),
                                vocab_chunks=2)


def test_compare_and_explain_on_the_command_line(tmp_path, capsys):
    """The declared shapes are measured with no flag; a batch of images has no seq."""
    out = tmp_path / "vit.json"
    assert cli.main(["compare", "--model", "tests/zoo/vit_nnx.py:build", "--policies",
                     "none,minimal", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["context"]["batch"], data["context"]["seq"]) == (2, None)
    assert ("vit_nnx.py:build: batch 2, float32, loss: your loss (XLA CPU compile)"
            in capsys.readouterr().out)
    assert cli.main(["explain", "--model", "tests/zoo/dit_linen.py:build", "--policy",
                     "minimal"]) == 0
    assert "qkv_proj (blocks_0/attn/qkv)" in capsys.readouterr().out


def test_a_call_that_cannot_take_the_batch():
    module = importlib.import_module("tests.zoo.dit_linen")
    model, (latents, _, _), loss = module.build()
    with pytest.raises(ModelError, match=r"^DiT.__call__ cannot take the batch \(missing a "
                                         r"required argument: 'timesteps'\): a tuple is passed "
                                         r"as model\(\*batch\)"):
        rk.batch_model.workload(model, (latents,), loss)
