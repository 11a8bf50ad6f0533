"""The model map: every stack, layer, structure and own remat of a model written
the way model libraries write them (tests/zoo: a BERT with `gradient_checkpointing`, a
Griffin-like hybrid of recurrent and local-attention blocks, a MaxText-like scanned decoder
under its own `jax.checkpoint`, a T5-like encoder-decoder whose first layers hold a relative
position bias), asserted exactly; a model's own remat of whole layers taken over, so `none`
is no remat and `full` full remat; `rk.remat_model` compiles to compare's rows."""

import chex
import jax
import pytest

import remat_kit as rk
from remat_kit.flax.from_model import logits_of, next_token_loss
from remat_kit.measure import lowering
from tests.zoo import bert_remat_linen, hybrid_linen, maxtext_scan_linen, t5_linen

B, T = 2, 8
MODELS = {"bert": bert_remat_linen.model, "hybrid": hybrid_linen.model,
          "hybrid_remat": hybrid_linen.remat_model, "maxtext": maxtext_scan_linen.model,
          "t5": t5_linen.model}
TAKEN = "2 x jax.checkpoint({}) around each layer, taken over"
MUL = "the model's own call: 1 op (mul), "  # Griffin's x * sqrt(width), T5's tied-head scale
LINES = {
    "bert": "2 x BertLayer, scanned: no; own remat: " + TAKEN.format("nothing_saveable")
            + "; outside: word_embeddings, position_embeddings, embeddings_LayerNorm, "
              "predictions_transform, predictions_LayerNorm, the model's own call: 9 ops (add, "
              "integer_pow, mul, tanh), loss",  # the head's gelu, in BertModel's own call
    "hybrid": "2 x ResidualBlock (recurrent_block, attention_block: 2 structures), scanned: "
              "no; own remat: none; outside: embedder, final_norm, " + MUL + "loss",
    "hybrid_remat": "2 x ResidualBlock (recurrent_block, attention_block: 2 structures), "
                    "scanned: no; own remat: " + TAKEN.format("nothing_saveable")
                    + "; outside: embedder, final_norm, " + MUL + "loss",
    "maxtext": "2 x DecoderLayer, scanned: yes; own remat: "
               + TAKEN.format("save_only_these_names")
               + "; outside: token_embedder, decoder_norm, logits_dense, loss",
    "t5": "encoder: 2 x T5Block (relative_attention_bias, no relative_attention_bias: 2 "
          "structures), decoder: 2 x T5Block (relative_attention_bias, no "
          "relative_attention_bias: 2 structures), scanned: no; own remat: none; outside: "
          "shared, encoder/final_layer_norm, decoder/final_layer_norm, " + MUL + "loss",
}


@pytest.fixture(scope="module", params=list(MODELS))
def zoo(request):
    model = MODELS[request.param]()
    return request.param, model, rk.from_model.workload(model, B, T)


def test_the_map_of_each_model(zoo):
    name, _, work = zoo
    assert work.model_map.line() == LINES[name]
    layers = [(x.path, x.cls, x.structure, x.copies) for x in work.model_map.layers]
    assert layers == {
        "bert": [("encoder/0", "BertLayer", 0, 1), ("encoder/1", "BertLayer", 0, 1)],
        "hybrid": [("blocks_0", "ResidualBlock", 0, 1), ("blocks_1", "ResidualBlock", 1, 1)],
        "hybrid_remat": [("blocks_0", "ResidualBlock", 0, 1),
                         ("blocks_1", "ResidualBlock", 1, 1)],
        "maxtext": [("layers", "DecoderLayer", 0, 2)],
        "t5": [("encoder/0", "T5Block", 0, 1), ("encoder/1", "T5Block", 1, 1),
               ("decoder/0", "T5Block", 2, 1), ("decoder/1", "T5Block", 3, 1)],
    }[name]
    assert work.num_layers == work.model_map.num_layers
    assert not [n for n in work.notes if "own remat" in n or "already" in n]


def _loss(wrapped):
    def loss(p, tokens, rest):
        return next_token_loss(logits_of(wrapped.apply({"params": p, **rest}, tokens), B, T),
                               tokens)
    return loss


def _compiled(loss, args):
    compiled = lowering.compile_for(lambda *a: jax.value_and_grad(loss)(*a), *args)
    return compiled.memory["temp_size_in_bytes"], compiled.flops


def test_every_row_means_its_name_and_rk_remat_model_runs_it(zoo):
    """Where the model had its own remat, `none` is no remat (fewer FLOPs and more temp
    than `full`); each row is what rk.remat_model compiles."""
    name, model, work = zoo
    policies = ("none", "full", "minimal", "selective") if name in (
        "bert", "maxtext") else ("none", "full")
    rows = {r.names[0]: r for r in rk.measure(work, policies=list(policies))}
    assert rows["none"].flops < rows["full"].flops
    assert rows["full"].memory_bytes < rows["none"].memory_bytes
    for policy in policies:
        assert _compiled(_loss(rk.remat_model(model, policy)), work.args) == (
            rows[policy].memory_bytes, rows[policy].flops), policy


@pytest.mark.parametrize("name", ["bert", "hybrid_remat", "maxtext"])
def test_gradients_equal_the_plain_model(name):
    model = MODELS[name]()
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 64)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    want = jax.jit(jax.grad(_loss(model)))(params, tokens, {})
    for policy in ("none", "minimal"):
        got = jax.jit(jax.grad(_loss(rk.remat_model(model, policy))))(params, tokens, {})
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


BAD = '''import flax.linen as nn
from flax import nnx


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        return nn.Dense(4)(x) * mask


class Missing(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(8, 4)(tokens)
        x = Layer()(x)
        return nn.Dense(8)(Layer()(x))


class NLayer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, mask):
        return self.w(x) * mask


class NMissing(nnx.Module):
    def __init__(self, rngs=nnx.Rngs(0)):
        self.e = nnx.Embed(8, 4, rngs=rngs)
        self.blocks = nnx.List([NLayer(rngs), NLayer(rngs)])

    def __call__(self, tokens):
        x = self.e(tokens)
        for b in self.blocks:
            x = b(x)
        return x


def linen():
    return Missing()


def nnx_model():
    return NMissing()


def raises():
    return {}["no such key"]
'''


@pytest.mark.parametrize("function, what", [
    ("linen", "TypeError at {}:{} on int32 tokens [2, 8]: Layer.__call__() missing 1 "
                  "required positional argument: 'mask'"),
    ("nnx_model", "TypeError at {}:{} on int32 tokens [2, 8]: NLayer.__call__() missing "
                      "1 required positional argument: 'mask'"),
])
def test_the_user_s_exception_is_the_user_s(tmp_path, capsys, function, what):
    """An error raised in the model's own code names its file and line, in one line; no
    "remat_kit bug" (the call passed through remat_kit's interceptors)."""
    from remat_kit.cli.commands import main
    path = tmp_path / "bad.py"
    path.write_text(BAD)
    assert main(["compare", "--model", f"{path}:{function}", "--batch", "2", "--seq", "8",
                 "--policies", "none"]) == 2
    [err] = capsys.readouterr().err.splitlines()
    calls = {"linen": "        x = Layer()(x)", "nnx_model": "            x = b(x)"}[function]
    where = BAD.splitlines().index(calls) + 1  # the model's own call that failed
    assert f"the model raised {what.format(path, where)}" in err and "remat_kit bug" not in err
    assert main(["compare", "--model", f"{path}:raises"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:raises': raises() raised KeyError at "
        f"{path}:{BAD.splitlines().index('    return {}[\"no such key\"]') + 1}: 'no such key'"]


def test_own_remat_of_part_of_a_layer_is_kept_and_said_on_every_row():
    """nn.remat around the MLP alone (not a whole layer) cannot be taken over: the map
    line and every row's notes say it stays, never a warning alone."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.gelu(nn.Dense(32)(x)))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + nn.Dense(8, name="attn")(nn.LayerNorm()(x))
            return x + nn.remat(MLP)(name="mlp")(nn.LayerNorm()(x))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(16, 8, name="wte")(tokens)
            for i in range(2):
                x = Block(name=f"h_{i}")(x)
            return nn.Dense(16, name="head")(x)

    work = rk.from_model.workload(LM(), B, T)
    kept = ("2 x jax.checkpoint(nothing_saveable) inside a layer, kept under every policy "
            "(not a whole layer)")
    assert work.model_map.line() == (f"2 x Block, scanned: no; own remat: {kept}; outside: "
                                     "wte, head, loss")
    note = f"own remat kept: the model runs {kept}, so `none` here is not no remat"
    for row in rk.measure(work, policies=["none", "full"]):
        assert note in row.notes, row.notes
    with pytest.warns(UserWarning, match="own remat kept"):
        jax.eval_shape(rk.remat_model(LM(), "full").apply,
                       jax.eval_shape(LM().init, jax.random.key(0),
                                      jax.ShapeDtypeStruct((B, T), "int32")),
                       jax.ShapeDtypeStruct((B, T), "int32"))


def test_every_report_opens_with_the_map_line_and_json_carries_the_map(capsys, tmp_path):
    from remat_kit.cli.commands import main
    model = "tests/zoo/hybrid_linen.py:remat_model"
    sizes = ["--batch", "2", "--seq", "8"]
    assert main(["compare", "--model", model, *sizes, "--policies", "none",
                 "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"model map: {LINES['hybrid_remat']}"
    import json
    the_map = json.loads((tmp_path / "c.json").read_text())["context"]["model_map"]
    assert the_map["line"] == LINES["hybrid_remat"] and the_map["num_layers"] == 2
    assert the_map["own_remat"] == [{"policy": "nothing_saveable", "count": 2,
                                     "where": "each layer", "merged": False,
                                     "taken_over": True}]
    assert main(["explain", "--model", model, *sizes, "--map"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"model map: {LINES['hybrid_remat']}",
        "  layer 0: blocks_0 ResidualBlock, structure 0 (recurrent_block), 11,840 parameters",
        "  layer 1: blocks_1 ResidualBlock, structure 1 (attention_block), 10,496 parameters"]
    assert main(["explain", "--model", model, *sizes, "--policy", "full"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"model map: {LINES['hybrid_remat']}"


def test_our_reference_configs_have_a_map():
    work = rk.models.workload(rk.models.get_config("tiny"), 2, 8)
    assert work.model_map.line() == ("2 x DecoderLayer, scanned: no; own remat: none; outside: "
                                     "embed, final_norm, pos_embed, logits, loss")
    assert [x.path for x in work.model_map.layers] == ["layers_0", "layers_1"]


def test_a_per_layer_plan_on_a_scanned_stack_is_refused_in_one_line():
    model = maxtext_scan_linen.model()
    params = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((B, T), "int32"))
    wrapped = rk.remat_model(model, ("full", "minimal"))
    with pytest.raises(rk.RematSpecError, match=r"^the model runs its 2 blocks as 1 scan body, "
                                                r"which takes one policy for every layer"):
        jax.eval_shape(wrapped.apply, params, jax.ShapeDtypeStruct((B, T), "int32"))


@pytest.mark.remat_modes
def test_own_remat_is_taken_over_under_either_remat_mode():
    """jax_remat3 stages the model's nn.remat as a hi-primitive: found and taken over all
    the same."""
    work = rk.from_model.workload(bert_remat_linen.model(), B, T)
    assert work.model_map.line() == LINES["bert"]
    rows = {r.names[0]: r for r in rk.measure(work, policies=["none", "full"])}
    assert rows["none"].flops < rows["full"].flops
    assert rows["full"].memory_bytes < rows["none"].memory_bytes


def _lax_scanned_gpt(param_axis: int):
    """NNX layers made by nnx.vmap with each parameter's layer axis at `param_axis`
    (MaxText's `param_scan_axis` is 1), run by a plain jax.lax.scan (the axis moved to
    the front, as MaxText's decoder does) whose body is under jax.checkpoint."""
    from flax import nnx

    from tests.zoo import scan_nnx

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(scan_nnx.VOCAB, scan_nnx.DIM, rngs=rngs)

            @nnx.split_rngs(splits=scan_nnx.LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=nnx.StateAxes({nnx.Param: param_axis, ...: 0}))
            def blocks(rngs):
                return scan_nnx.Block(rngs)
            self.blocks = blocks(rngs)
            self.head = nnx.Linear(scan_nnx.DIM, scan_nnx.VOCAB, rngs=rngs)

        def __call__(self, tokens):
            graphdef, params, rest = nnx.split(self.blocks, nnx.Param, ...)
            params = jax.tree.map(lambda x: jax.numpy.moveaxis(x, param_axis, 0), params)

            def step(x, s):
                return jax.checkpoint(lambda x, s: nnx.merge(graphdef, *s)(x))(x, s), None
            return self.head(jax.lax.scan(step, self.embed(tokens), (params, rest))[0])

    return nnx.eval_shape(lambda: GPT(nnx.Rngs(0)))


SCANNED = ("2 x Block, scanned: yes; own remat: 2 x jax.checkpoint(nothing_saveable) around "
           "each layer, taken over; outside: embed, head, loss")


def test_a_stack_with_its_layer_axis_inside_each_parameter_is_found():
    """MaxText stacks its scanned layers' parameters on axis 1 ([embed, layers, mlp]):
    the layer count is read there too (traced only, no compile); the moves of that axis
    to the front run outside the layers, as the map says."""
    work = rk.from_model.workload(_lax_scanned_gpt(1), B, T)
    assert work.model_map.line() == SCANNED.replace(
        "head, loss", "head, the model's own call: 8 ops (transpose), loss")


def test_a_stack_run_by_jax_lax_scan_under_jax_checkpoint_is_found_and_taken_over():
    """NNX layers made by nnx.vmap, run by a plain jax.lax.scan whose body is under
    jax.checkpoint: one scanned stack, its own remat taken over, no --block."""
    work = rk.from_model.workload(_lax_scanned_gpt(0), B, T)
    assert work.model_map.line() == SCANNED
    rows = {r.names[0]: r for r in rk.measure(work, policies=["none", "full"])}
    assert rows["none"].flops < rows["full"].flops
    assert rows["full"].memory_bytes < rows["none"].memory_bytes


def _pick(tree: dict) -> list[str]:
    """The layer paths `blocks.pick_block` finds in {path: (class name, size)}."""
    from remat_kit.flax.blocks import Instance, pick_block
    classes: dict = {}
    found = [Instance(tuple(p.split("/")), classes.setdefault(c, type(c, (), {})), (), n)
             for p, (c, n) in tree.items()]
    return [x.path for x in pick_block(found).layers]


def test_a_stack_around_a_block_collection_is_no_layer_and_experts_are_no_stack():
    """HF's T5: each stack holds a block collection holding the blocks: the blocks are
    the layers. A block holding its experts beside its attention: the block is."""
    t5 = {}
    for stack in ("encoder", "decoder"):
        for b in ("0", "1"):
            base = f"{stack}/block/{b}"
            t5 |= {f"{base}/attn/q": ("Dense", 10), f"{base}/attn": ("Attn", 10),
                   f"{base}/w": ("Dense", 10), base: ("Block", 20)}
        t5 |= {f"{stack}/block": ("Collection", 40), f"{stack}/norm": ("Norm", 1),
               stack: ("Stack", 41)}
    assert _pick(t5) == ["encoder/block/0", "encoder/block/1", "decoder/block/0",
                         "decoder/block/1"]
    moe = {}
    for b in ("layers_0", "layers_1"):
        moe |= {f"{b}/attn/q": ("Dense", 10), f"{b}/attn": ("Attn", 10), f"{b}/n": ("Norm", 1)}
        for e in range(4):
            moe |= {f"{b}/expert_{e}/w": ("Dense", 10), f"{b}/expert_{e}": ("Expert", 10)}
        moe |= {b: ("Block", 51)}
    assert _pick(moe) == ["layers_0", "layers_1"]


def test_what_the_models_own_call_computes_is_named():
    """Nothing outside every layer goes unnamed. A tied head `x @ embed.T` in
    an NNX model's own call, and GPT-2's position add in a linen one's, hold no module;
    the map names their ops from the one trace. Constants (an iota) are not counted."""
    from tests.zoo import gpt_linen, graph_nnx
    nnx_map = rk.from_model.workload(graph_nnx.model(), B, T).model_map
    # The root's every op, as linen's: the transpose of the tied embedding too.
    assert nnx_map.outside == ("embed", "norm_f", "the model's own call: 2 ops (transpose, "
                               "dot_general)", "loss")
    linen_map = rk.from_model.workload(gpt_linen.model(), B, T).model_map
    assert linen_map.outside == ("wte", "ln_f", "wpe", "the model's own call: 3 ops (slice, "
                                 "broadcast_in_dim, add)", "loss")
    assert linen_map.to_dict()["outside"] == list(linen_map.outside)


def test_the_wrappers_take_over_a_remat_of_the_whole_block_inside_its_call():
    """A block whose own call runs all its work under `nn.remat` (a remat of the whole
    block, from inside): `rk.linen.apply_remat` under a role preset compiles to the
    program of the block without it, with no own-remat note."""
    import warnings

    import flax.linen as nn
    import jax.numpy as jnp

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))

    class Block(nn.Module):
        own: bool

        @nn.compact
        def __call__(self, x):
            return (nn.remat(Inner) if self.own else Inner)(name="inner")(x)

    class Net(nn.Module):
        own: bool

        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = Block(self.own, name=f"b{i}")(x)
            return x.sum()

    x = jnp.ones((4, 16))
    params = Net(False).init(jax.random.key(0), x)["params"]

    def compiled(own):
        wrapped = rk.linen.apply_remat(Net(own), {"Block": "minimal"})
        grad = jax.jit(jax.grad(lambda p: wrapped.apply({"params": p}, x)))
        c = grad.lower(params).compile()
        return grad(params), c.cost_analysis()["flops"], c.memory_analysis().temp_size_in_bytes

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (g_own, *own), (g_plain, *plain) = compiled(True), compiled(False)
    assert own == plain
    chex.assert_trees_all_close(g_own, g_plain)
    assert not [w for w in caught if "of its own" in str(w.message)]
