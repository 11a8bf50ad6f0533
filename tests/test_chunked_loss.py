"""The cross-entropy over vocabulary chunks: grads equal to the
plain loss's (f32, rtol 1e-5) in the reference models and in the loss `--model`
builds, a smaller compiled peak where the vocabulary dominates, and bad chunk
counts refused in one line."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from remat_kit.cli import commands as cli
from remat_kit.flax.chunked_loss import chunked_head_loss, chunked_logits_loss
from remat_kit.flax.from_model import ModelError
from remat_kit.flax.from_model import workload as model_workload
from remat_kit.measure.lowering import compile_for
from remat_kit.models import Transformer, get_config, make_loss_fn
from remat_kit.models import nnx_transformer as nt
from remat_kit.policy.spec import parse


def _close(a, b):
    """Equal to rtol 1e-5; atol 1e-6 for elements near 0 (f32 sums in another order;
    the gradients here are of order 0.1)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _vg(fn, argnums=0):
    return jax.jit(jax.value_and_grad(fn, argnums))


def test_chunked_losses_equal_optax():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (2, 5, 16))
    w = jax.random.normal(k[1], (16, 24))
    t = jax.random.randint(k[2], (2, 5), 0, 24)
    plain = lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, t).mean()  # noqa: E731
    want = _vg(plain, (0, 1))(x, w)
    for chunks in (3, 24):
        _close(want, _vg(lambda x, w: chunked_head_loss(x, w, t, chunks), (0, 1))(x, w))
        tied = _vg(lambda x, e: chunked_head_loss(x, e, t, chunks, vocab_axis=0), (0, 1))(x, w.T)
        _close(want, (tied[0], (tied[1][0], tied[1][1].T)))
        _close(_vg(lambda z: plain(z, jnp.eye(24)))(x @ w),
               _vg(lambda z: chunked_logits_loss(z, t, chunks))(x @ w))


@pytest.mark.parametrize("name", ["tiny", "tiny_llama"])  # a tied and an untied head
def test_reference_model_grads_equal_the_plain_loss(name):
    """Chunked under full remat against the plain loss without remat."""
    cfg = get_config(name)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    params = nn.unbox(Transformer(cfg).init(jax.random.key(0), tokens)["params"])
    args = (params, tokens, targets, jax.random.key(3))
    want = _vg(make_loss_fn(Transformer(cfg)))(*args)
    got = _vg(make_loss_fn(Transformer(cfg.replace(vocab_chunks=8, remat="full"))))(*args)
    _close(want, got)


@pytest.mark.parametrize("name", ["tiny", "tiny_llama"])
def test_nnx_reference_model_grads_equal_the_plain_loss(name):
    """The NNX twin takes config.vocab_chunks as linen does: chunked under full
    remat, the loss and grads at the same parameters equal the plain loss's."""
    from flax import nnx
    cfg = get_config(name).replace(vocab_size=96)  # no other axis is 96 long
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    plain, params = nt.make_loss_fn(nt.Transformer(cfg, rngs=nnx.Rngs(0)))
    chunked, _ = nt.make_loss_fn(nt.Transformer(cfg.replace(vocab_chunks=8, remat="full"),
                                                rngs=nnx.Rngs(1)))
    want, got = _vg(plain)(params, tokens, targets), _vg(chunked)(params, tokens, targets)
    _close(want, got)
    # The chunked program has no [batch, seq, vocab] value: the logits never exist whole.
    jaxpr = jax.make_jaxpr(jax.grad(chunked))(params, tokens, targets)
    shapes = {tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars}
    assert (2, 16, cfg.vocab_size) not in shapes
    assert (2, 16, cfg.vocab_size) in {tuple(v.aval.shape) for e in jax.make_jaxpr(
        jax.grad(plain))(params, tokens, targets).eqns for v in e.outvars}


def test_built_loss_of_a_user_model_grads_equal():
    zoo = importlib.import_module("tests.zoo.gpt_linen")
    model = zoo.model()
    plain = model_workload(model, 2, 16)
    chunked = model_workload(model, 2, 16, vocab_chunks=4)
    params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape, s.dtype),
                          plain.args[0])
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    args = (params, tokens, *plain.args[2:])
    _close(_vg(plain.loss_for_policy(parse("full")))(*args),
           _vg(chunked.loss_for_policy(parse("full")))(*args))
    with pytest.raises(ModelError, match="vocab chunks 5 does not divide the vocabulary "
                                         "of 64; valid counts nearest it: 2, 4, 8"):
        model_workload(model, 2, 16, vocab_chunks=5)


def test_chunks_lower_the_peak_the_logits_hold():
    """Full remat of a model whose vocabulary dominates: chunked, the compiled temp
    is down by more than the float32 logits [2, 64, 4096] (2 MiB; XLA CPU, jax
    0.12: 4,293,376 -> 1,270,240 bytes)."""
    cfg = get_config("tiny", vocab_size=4096, remat="full")
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(Transformer(cfg).init(
        jax.random.key(0), jnp.zeros((2, 64), jnp.int32))["params"]))
    key = jax.eval_shape(lambda: jax.random.key(0))

    def temp(c):
        step = jax.value_and_grad(make_loss_fn(Transformer(c)))
        return compile_for(step, params, tokens, tokens, key, target="cpu").memory[
            "temp_size_in_bytes"]

    logits = 2 * 64 * 4096 * 4
    plain, chunked = temp(cfg), temp(cfg.replace(vocab_chunks=16))
    assert plain - chunked >= logits, (plain, chunked)


_BAD = [
    (["--config", "tiny", "--vocab-chunks", "3"],
     "--vocab-chunks 3: vocab chunks 3 does not divide the vocabulary of 256; valid counts "
     "nearest it: 1, 2, 4"),
    (["--config", "tiny", "--vocab-chunks", "0"],
     "argument --vocab-chunks: must be a positive int"),
    (["--model", "tests/zoo/gpt_linen.py:model", "--vocab-chunks", "5"],
     "vocab chunks 5 does not divide the vocabulary of 64"),
]


# fit searches the seq from 128, past the zoo GPT's 32 positions: its --config cases only
@pytest.mark.parametrize("command, argv, message",
                         [(c, *bad) for c in ("compare", "plan", "fit") for bad in _BAD
                          if c != "fit" or "--config" in bad[0]])
def test_bad_chunk_counts_are_one_line_and_exit_2(capsys, command, argv, message):
    more = {"compare": ["--seq", "16"], "plan": ["--seq", "16", "--budgets", "0.5"],
            "fit": ["--budget", "1GiB"]}[command]  # fit searches the seq
    try:
        code = cli.main([command, *argv, "--batch", "2", *more])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"remat-kit {command}: error: ") and message in err


def test_next_token_loss_holds_no_float32_copy_of_the_logits_on_tpu():
    """The label's logit by a one-hot contraction (as MaxText's loss takes it), not a
    gather: equal to optax's loss and gradient, and on tpu:v5p:2x2x1 (fsdp:4, float32
    logits of a bf16 matmul, 2 x 128 x 512 a chip) the step's peak is 726,048 bytes a
    chip, where optax's gather holds its own float32 copy of them: 953,888."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from remat_kit.flax.lm_loss import next_token_loss
    from remat_kit.measure import targets

    def gathered(logits, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()

    k = jax.random.split(jax.random.key(0), 2)
    x, t = jax.random.normal(k[0], (2, 6, 24)), jax.random.randint(k[1], (2, 6), 0, 24)
    _close(_vg(gathered)(x, t), _vg(next_token_loss)(x, t))
    target = targets.parse_target("tpu:v5p:2x2x1")
    mesh = targets.make_mesh(target, {"fsdp": 4})
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in (
        ((64, 512), jnp.bfloat16, P()), ((8, 128, 64), jnp.bfloat16, P("fsdp")),
        ((8, 128), jnp.int32, P("fsdp")))]
    peaks = [compile_for(jax.value_and_grad(lambda w, x, t, f=f: f(
        (x @ w).astype(jnp.float32), t)), *args, target=target).memory["peak_memory_in_bytes"]
        for f in (next_token_loss, gathered)]
    assert peaks == [726_048, 953_888]
