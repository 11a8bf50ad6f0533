"""cuDNN attention measured where it cannot be built (remat_kit.trace.stand_in): a model
calling `jax.nn.dot_product_attention(implementation="cudnn")` compared on this CPU (no
CUDA plugin, no cuDNN), its kernel priced from shapes beside its einsum twin; the stand-in's
shapes, dtypes and pricing. The stand-in is for pricing only: its values and gradients
are not attention's (the XLA implementation's gradients under remat: tests/test_kernels.py)."""

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat_kit as rk
from remat_kit import cli
from remat_kit.flax.lm_loss import label_cross_entropy
from remat_kit.measure import kernels, lowering
from remat_kit.trace import stand_in
from tests.zoo import kernel_nnx

B, T, HEADS, KV, D, LAYERS = 1, 256, 2, 1, 64, 2
# One layer's forward attention FLOPs, 4 b h s s d, and the causal share cuDNN computes
# (key j <= query i: 257 of every 512 scores at seq 256).
F, CAUSAL = 4 * B * HEADS * T * T * D, (T + 1) / (2 * T)
MODEL = "tests/zoo/kernel_nnx.py:cudnn"
POLICIES = "none,full,maxtext:minimal_with_context,selective"


def _attention_grad_jaxpr(q_shape=(B, T, HEADS, D), kv_heads=KV, **kwargs):
    q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct(q_shape[:2] + (kv_heads, q_shape[3]), jnp.bfloat16)

    def loss(q, k, v, *bias):
        out = jax.nn.dot_product_attention(q, k, v, *bias, implementation="cudnn", **kwargs)
        return out.astype(jnp.float32).sum()

    with stand_in.cudnn_stand_in(True):
        args = (q, kv, kv) + ((jax.ShapeDtypeStruct((B, HEADS, T, T), jnp.float32),)
                              if kwargs.pop("with_bias", False) else ())
        return jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def test_the_stand_in_has_cudnns_outputs_residuals_and_gradients():
    """Output [b, s, h, d] in q's dtype and the logsumexp [b, h, s] float32 (cuDNN's BNT);
    saved: q, k, v, the output and the logsumexp; dq, dk, dv (and dbias) of their primals'
    shapes and dtypes; a boolean mask gets none. JAX's own call is back on exit."""
    q = jax.ShapeDtypeStruct((B, 128, 4, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, 128, 2, D), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((B, 4, 128, 128), jnp.float32)
    mask = jax.ShapeDtypeStruct((B, 1, 128, 128), jnp.bool_)
    out, stats = jax.eval_shape(functools.partial(stand_in.cudnn_attention,
                                                  return_residual=True), q, k, k)
    assert (out.shape, out.dtype, stats.shape, stats.dtype) == (
        q.shape, q.dtype, (B, 4, 128), jnp.float32)
    saved = rk.residuals(lambda q, k, v: stand_in.cudnn_attention(q, k, v).sum(), q, k, k)
    assert sorted(r.shape for r in saved) == sorted([q.shape, k.shape, k.shape, q.shape,
                                                     (B, 4, 128)])
    grads = jax.eval_shape(jax.grad(lambda q, k, v, b, m: stand_in.cudnn_attention(
        q, k, v, b, m).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3)), q, k, k, bias, mask)
    assert [(g.shape, g.dtype) for g in grads] == [(a.shape, a.dtype) for a in (q, k, k, bias)]
    # Under jax.vmap (over 3 groups of the batch) it stays one call, at the folded batch.
    vmapped = jax.ShapeDtypeStruct((3,) + q.shape, q.dtype)
    assert jax.eval_shape(jax.vmap(stand_in.cudnn_attention, (0, None, None)), vmapped, k,
                          k).shape == vmapped.shape
    priced = kernels.price(jax.make_jaxpr(jax.grad(lambda q, k: jax.vmap(
        stand_in.cudnn_attention, (0, None, None))(q, k, k).astype(jnp.float32).sum()))(
        vmapped, k), "gpu")
    assert [x.flops for x in priced.kernels] == [3 * 4 * B * 4 * 128 * 128 * D * f
                                                 for f in (1, 2.5)]
    if not stand_in.cudnn_buildable():
        with pytest.raises(RuntimeError, match="cuDNN"):
            jax.make_jaxpr(lambda q: jax.nn.dot_product_attention(
                q, q, q, implementation="cudnn"))(q)


@pytest.mark.parametrize("kwargs, fraction, mask", [
    ({"is_causal": True}, CAUSAL, ""),
    # cuDNN's window with a causal mask: keys i - 64 < j <= i (jax passes w + 1 = 64).
    ({"is_causal": True, "local_window_size": (63, 0)}, (64 * 65 / 2 + 192 * 64) / T**2, ""),
    ({"local_window_size": (63, 0)}, (64 * 65 / 2 + 192 * 64) / T**2, ""),  # left: causal too
    ({"with_bias": True}, 1.0, "bias or mask array not read")])
def test_the_stand_in_is_priced_from_its_shapes_and_mask(kwargs, fraction, mask):
    """Forward F x the share of scores computed (grouped-query heads counted at the query's
    2 heads), the backward 2.5 F (FlashAttention-2); named in the notes."""
    priced = kernels.price(_attention_grad_jaxpr(**kwargs), "gpu")
    fwd, bwd = priced.kernels
    assert (fwd.name, bwd.name) == (stand_in.FWD, stand_in.BWD)
    assert fwd.flops == pytest.approx(F * fraction) and bwd.flops == pytest.approx(2.5 * fwd.flops)
    assert fwd.mask == mask and not fwd.counted
    assert any(n.startswith("cuDNN attention stood in for") for n in priced.notes())


def test_compile_for_prices_the_stand_in_as_fit_and_plan_read_it():
    """`lowering.compile_for` (fit's and the planner's train steps) finds the stand-in in the
    lowered text, adds its FLOPs where the compiler counts only its cheap stand-in work."""
    c = kernel_nnx.KernelConfig(heads=HEADS, kv_heads=KV, head_dim=D, attention="dpa",
                                implementation="cudnn")
    loss = lambda q, k, v: kernel_nnx.attend(c, q, k, v).astype(jnp.float32).sum()
    q = jax.ShapeDtypeStruct((B, T, HEADS, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, KV, D), jnp.bfloat16)
    compiled = lowering.compile_for(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, target="cpu")
    kernel = 3.5 * F * CAUSAL
    assert kernel <= compiled.flops < 1.02 * kernel
    assert compiled.kernel_seconds > 0 and any("stood in" in n for n in compiled.notes)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """`compare --model kernel_nnx.py:cudnn` on this CPU (one compile per policy) as JSON
    records by policy; and the einsum twin's `none` record."""
    out = tmp_path_factory.mktemp("cudnn") / "records.json"
    assert cli.main(["compare", "--model", MODEL, "--target", "cpu", "--batch", str(B),
                     "--seq", str(T), "--policies", POLICIES, "--json", str(out)]) == 0
    records = {r["names"][0]: r for r in json.loads(out.read_text())["records"]}
    model, _, _ = kernel_nnx.make(B, T, abstract=True, attention="einsum", head_dim=D,
                                  dtype="bfloat16")
    (twin,) = rk.measure(rk.from_model.workload(model, B, T), policies=["none"],
                         target="cpu")
    return records, twin


def test_the_kernel_is_in_the_flops_beside_its_einsum_twin(compared):
    records, twin = compared
    none, full = records["none"], records["full"]
    kernel = LAYERS * 3.5 * F * CAUSAL  # forward F, backward 2.5 F, causal
    assert none["error"] is None and none["kernel_flops"] == pytest.approx(kernel)
    assert any("cuDNN attention stood in for" in n for n in none["notes"]), none["notes"]
    # The einsum twin's attention is 3 F a layer, unmasked (2 forward matmuls, 4 backward):
    # the rest of both steps is the same program, within 2%.
    rest, twin_rest = none["flops"] - kernel, twin.flops - LAYERS * 3 * F
    assert abs(rest - twin_rest) / twin_rest < 0.02, (rest, twin_rest)
    # full reruns each layer's forward, the kernel's too.
    assert full["kernel_flops"] - none["kernel_flops"] == pytest.approx(LAYERS * F * CAUSAL)
    assert full["flops"] - none["flops"] > LAYERS * F * CAUSAL
    assert none["predicted_seconds"] > 0


def test_context_is_found_saved_and_selective_explained(compared):
    """The kernel's result is `context` (no scores exist); minimal_with_context saves it.
    JAX's cuDNN rule names none of its residuals, so the backward still reruns the
    kernel's forward (as on a GPU): its FLOPs are full's."""
    records, _ = compared
    saved = records["maxtext:minimal_with_context"]
    assert saved["residual_bytes_by_tag"]["context"] == LAYERS * B * T * HEADS * D * 2
    assert saved["kernel_flops"] == records["full"]["kernel_flops"]
    assert any("forward runs 4 times for 2 backward" in n for n in saved["notes"])
    # Under full the rerun is the policy's own: no line blames the kernel's residuals.
    assert not any("forward runs" in n for n in records["none"]["notes"] + records["full"]["notes"])
    assert "attn_logits" not in records["none"]["residual_bytes_by_tag"]
    assert any("finds no such values here" in n and stand_in.FWD in n
               for n in records["selective"]["notes"])


@pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in (
    "jax_cuda12_plugin", "jax_cuda13_plugin")), reason="deviceless GPU needs the [cuda] extra")
def test_a_deviceless_gpu_target_compiles_the_stand_in():
    (none,) = rk.measure(rk.from_model.workload(kernel_nnx.cudnn(), B, T), policies=["none"],
                         target="gpu:h100")
    assert none.error is None and none.kernel_flops == pytest.approx(LAYERS * 3.5 * F * CAUSAL)



def test_remat_model_compiles_to_compares_row_inside_the_stand_in(compared):
    """A user's own train step of `rk.remat_model`'s model, traced inside
    `cudnn_stand_in()` on this CPU: compare's program, FLOPs for FLOPs."""
    records, _ = compared
    with stand_in.cudnn_stand_in():
        model = rk.remat_model(kernel_nnx.cudnn(), "maxtext:minimal_with_context")
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p, tokens):
            logits = nnx.merge(graphdef, p)(tokens)[:, :-1].astype(jnp.float32)
            return label_cross_entropy(logits, tokens[:, 1:]).mean()  # compare's loss

        compiled = lowering.compile_for(jax.value_and_grad(loss), params,
                                        jax.ShapeDtypeStruct((B, T), jnp.int32), target="cpu")
    row = records["maxtext:minimal_with_context"]
    assert compiled.flops == row["flops"]
    assert compiled.memory["temp_size_in_bytes"] == row["temp_size_in_bytes"]


@pytest.mark.parametrize("dtype, head_dim, message", [
    (jnp.float32, 64, "takes a query of float16 or bfloat16, got float32"),
    (jnp.bfloat16, 100, "multiple of 8 and at most 256 .* got 100"),
    (jnp.bfloat16, 512, "got 512"),
    (jnp.float16, 256, None)])
def test_the_stand_in_refuses_what_jaxs_cudnn_call_refuses(dtype, head_dim, message):
    """cuDNN's fused attention takes fp16/bf16 and a head dim a multiple of 8 up to 256
    (Hopper): JAX raises otherwise on a GPU, and so does the stand-in; a target that
    cannot run the kernel at all (a TPU, the CPU) is said in the notes."""
    q = jax.ShapeDtypeStruct((B, 128, HEADS, head_dim), dtype)
    call = lambda: jax.eval_shape(stand_in.cudnn_attention, q, q, q)  # noqa: E731
    if message is None:
        assert call().shape == q.shape
    else:
        with pytest.raises(NotImplementedError, match=message):
            call()
    priced = kernels.price(_attention_grad_jaxpr(is_causal=True), "tpu")
    assert any("runs only on an NVIDIA GPU: on this tpu target" in n for n in priced.notes())
    assert not any("only on an NVIDIA GPU" in n for n in kernels.price(
        _attention_grad_jaxpr(is_causal=True), "gpu").notes())
