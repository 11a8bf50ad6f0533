"""Fused attention kernels priced from their shapes (remat_kit.measure.kernels), named
`context`, and planned: splash (causal, local, grouped-query heads, segment ids) and the
TPU flash kernel compiled for a TPU ahead of time; MaxText's decoder on splash through
`compare --model`; splash's gradients in interpret mode on the CPU, and
dot_product_attention's XLA path's, equal no remat's."""

import json

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_kit as rk
from remat_kit import cli
from remat_kit.measure import kernels, lowering
from remat_kit.trace.validate import policy_notes
from tests.zoo import kernel_nnx

B, T = 1, 512
HEADS, KV, D = 2, 1, 128
# F: one layer's forward attention FLOPs unmasked, 4 b h s s d (query heads).
F = 4 * B * HEADS * T * T * D


def _priced(**config) -> kernels.Priced:
    """The kernels of one zoo layer's value-and-grad, priced."""
    c = kernel_nnx.KernelConfig(heads=HEADS, kv_heads=KV, head_dim=D, **config)
    q = jax.ShapeDtypeStruct((B, T, HEADS, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, KV, D), jnp.bfloat16)
    loss = lambda q, k, v: kernel_nnx.attend(c, q, k, v).astype(jnp.float32).sum()
    return kernels.price(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv), "tpu")


@pytest.mark.parametrize("window, blocks", [(None, 10), (128, 7)])
def test_splash_is_priced_by_its_block_mask(window, blocks):
    """Causal: 10 of the 4 x 4 blocks of 128 computed; a 128-key local window: 7.
    Forward F, dq 1.5 F, dk/dv 2 F (FlashAttention-2's matmuls per kernel)."""
    got = {k.name.split("_")[2]: k for k in _priced(window=window).kernels}
    fwd = F * blocks / 16
    assert got["fwd"].flops == fwd and got["dq"].flops == 1.5 * fwd
    assert got["dkv"].flops == 2 * fwd
    assert all(k.how == "shapes" and not k.counted and k.calls == 1 for k in got.values())


def test_splash_built_inside_a_codebase_s_own_jit_wrapper_is_priced_by_its_mask():
    """MaxText's attention_op builds splash inside a `jax.jit` with the mask static (its
    arrays the jit's constants, not the step's), constrains them to its mesh and hands them
    to a `shard_map`: the block mask read there too, causal 10 of 16 blocks."""
    from functools import partial
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(jax.devices()[:1], ("fsdp",))
    sizes = splash.BlockSizes(*(128,) * 8)

    @partial(jax.jit, static_argnames=["mask"])
    def wrapped(mask):
        return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)

    def attention(q, k, v):
        kernel = wrapped(masks.MultiHeadMask([masks.CausalMask((T, T))] * HEADS))
        spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, None)))
        kernel = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P())), kernel)
        run = jax.shard_map(lambda kern, q, k, v: jax.vmap(kern)(q, k, v), mesh=mesh,
                            in_specs=(spec, P(), P(), P()), out_specs=P(), check_vma=False)
        return run(kernel, q, k, v).astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((B, HEADS, T, D), jnp.bfloat16)
    found = kernels.price(jax.make_jaxpr(jax.grad(attention, argnums=(0, 1, 2)))(q, q, q),
                          "tpu")
    fwd = F * 10 / 16
    got = {k.name.split("_")[2]: k for k in found.kernels}
    assert got["fwd"].flops == fwd and got["dq"].flops == 1.5 * fwd
    assert got["dkv"].flops == 2 * fwd and all(not k.mask for k in found.kernels)


def test_flash_uses_its_cost_estimate_and_prices_its_backward():
    found = _priced(attention="flash").kernels
    assert [k.how for k in found] == ["cost_estimate", "shapes", "shapes"]
    assert found[0].counted and abs(found[0].flops - F) / F < 0.02
    assert [k.flops for k in found[1:]] == [2 * F, 1.5 * F]
    assert "mask not read" in found[1].mask


def test_the_pallas_gpu_kernel_is_priced_at_its_batch_seq_heads_layout():
    """Pallas GPU `mha` ([batch, seq, heads, d]): forward F, one backward kernel for dq,
    dk and dv 2.5 F, its preprocessing 2 FLOPs per element of o; traced only (no GPU)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention
    q = jax.ShapeDtypeStruct((1, 256, HEADS, 64), jnp.float16)
    loss = lambda q, k, v: gpu_attention.mha(q, k, v, segment_ids=None).astype(
        jnp.float32).sum()
    found = kernels.price(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q), "gpu")
    f = 4 * HEADS * 256 * 256 * 64
    assert [(k.name, k.flops) for k in found.kernels] == [
        ("mha_forward", f), ("mha_preprocess_backward", 2 * 256 * HEADS * 64),
        ("mha_backward", 2.5 * f)]


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_dot_product_attention_on_xla_is_ordinary_ops(implementation):
    """jax.nn.dot_product_attention's XLA path: dots and a softmax XLA counts itself (no
    kernel to price), its roles those of written-out attention."""
    model, _, _ = kernel_nnx.make(B, 128, abstract=True, attention="dpa",
                                  implementation=implementation)
    work = rk.from_model.workload(model, B, 128)
    loss, *args = _traced(work)
    assert kernels.price(jax.make_jaxpr(jax.grad(loss))(*args), "tpu").kernels == ()
    assert {"attn_logits", "attn_probs", "context", "out_proj"} <= set(
        rk.emitted_tags(loss, *args))


def test_an_unknown_custom_call_is_named_and_the_total_a_lower_bound():
    def loss(x):
        y = jax.ffi.ffi_call("my_op", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        return y.sum()

    priced = kernels.price(jax.make_jaxpr(loss)(jnp.ones((4, 8))), "tpu")
    assert priced.unpriced == ("my_op",) and priced.added_flops == 0
    assert priced.notes() == ("FLOPs are a lower bound: custom calls left unpriced (no "
                              "cost_estimate, and not a kernel priced from its shapes): "
                              "my_op",)
    found, notes = kernels.added(({"flops": 10.0}, ()), priced)
    assert found == {"flops": 10.0} and "lower bound" in notes[0]
    # Only a program holding a custom call that is not an annotation is traced again.
    assert kernels.has_kernels('%0 = stablehlo.custom_call @tpu_custom_call(%arg0)')
    assert not kernels.has_kernels('%0 = stablehlo.custom_call @Sharding(%arg0)')


@pytest.mark.parametrize("estimate", [None, 268e6])
def test_an_attention_kernel_of_unknown_layout_is_priced_by_its_estimate_or_named(estimate):
    """A Pallas kernel named like attention whose q/k/v are [b, s, h, d]: its layout is not
    guessed from its name (read as [.., h, s, d] it took the heads for the keys); its
    cost_estimate prices it, or it is named unpriced."""
    from jax.experimental import pallas as pl

    def body(q_ref, k_ref, o_ref):
        o_ref[...] = q_ref[...] + k_ref[...]

    def loss(q, k):
        cost = None if estimate is None else pl.CostEstimate(
            flops=int(estimate), transcendentals=0, bytes_accessed=0)
        return pl.pallas_call(body, name="my_attention_fwd", cost_estimate=cost,
                              out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k).sum()

    q = jax.ShapeDtypeStruct((2, 512, 8, 64), jnp.float32)
    priced = kernels.price(jax.make_jaxpr(loss)(q, q), "gpu")
    (kernel,) = priced.kernels
    if estimate is None:
        assert (kernel.how, kernel.flops, priced.unpriced) == (
            "unpriced", 0.0, ("my_attention_fwd",))
        assert "my_attention_fwd" in priced.notes()[-1] and "cost_estimate" in priced.notes()[-1]
    else:
        assert (kernel.how, kernel.flops) == ("cost_estimate", estimate)


def test_compile_for_counts_the_kernel_as_fit_and_plan_read_it():
    """`lowering.compile_for` (the train step fit and the planner compile): the kernel's
    FLOPs in `flops`, its time in `kernel_seconds`."""
    c = kernel_nnx.KernelConfig(heads=HEADS, kv_heads=KV, head_dim=D)
    loss = lambda q, k, v: kernel_nnx.attend(c, q, k, v).astype(jnp.float32).sum()
    q = jax.ShapeDtypeStruct((B, T, HEADS, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, KV, D), jnp.bfloat16)
    compiled = lowering.compile_for(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv,
                                    target="tpu:v5e:1x1")
    kernel = F * 10 / 16 * (1 + 1.5 + 2)
    assert kernel <= compiled.flops < 1.02 * kernel
    peak = rk.targets.parse_target("tpu:v5e:1x1").roofline.bf16_flops
    assert compiled.kernel_seconds == pytest.approx(kernel / peak)


# The compiled model: seq 256, 2 x 2 blocks of which splash computes 3 (causal).
T_TPU, CAUSAL = 256, 3 / 4
F_TPU = 4 * B * HEADS * T_TPU * T_TPU * D


@pytest.fixture(scope="module")
def on_tpu():
    """Records of the splash zoo model (2 layers) and its einsum twin on TPU v5e,
    compiled ahead of time; and the splash model's Workload."""
    out = {}
    for attention, specs in (("splash", ["none", "full", "offload:context"]),
                             ("einsum", ["none"])):
        model, _, _ = kernel_nnx.make(B, T_TPU, abstract=True, attention=attention)
        work = out[f"{attention} workload"] = rk.from_model.workload(model, B, T_TPU)
        out[attention] = {r.names[0]: r for r in rk.measure(work, policies=specs,
                                                             target="tpu:v5e:1x1")}
    return out


def test_the_kernel_is_in_the_flops_and_the_step(on_tpu):
    splash, einsum = on_tpu["splash"], on_tpu["einsum"]["none"]
    kernel = 2 * F_TPU * CAUSAL * (1 + 1.5 + 2)  # two layers: forward, dq, dk/dv
    none = splash["none"]
    assert any(n.startswith("kernels priced from shapes") and "splash_mqa_fwd" in n
               for n in none.notes), none.notes
    assert none.kernel_flops == kernel and einsum.kernel_flops == 0
    # Beside the einsum twin (forward 2 and backward 4 unmasked matmuls, 1.5 F x 2), the
    # rest of the step is the same program: within 2% once attention is taken out.
    rest, twin_rest = none.flops - kernel, einsum.flops - 2 * 3 * F_TPU
    assert abs(rest - twin_rest) / twin_rest < 0.02, (rest, twin_rest)
    # full recomputes the layer's forward, kernel included.
    assert splash["full"].flops - none.flops >= 2 * F_TPU * CAUSAL
    assert none.predicted_seconds > kernel / rk.targets.parse_target(
        "tpu:v5e:1x1").roofline.bf16_flops


def test_context_is_found_saved_and_selective_explained(on_tpu):
    work = on_tpu["splash workload"]
    # minimal_with_context saves, per layer, what splash's residual_checkpoint_name names
    # (its result [b, kv, group, s, d] and logsumexp [b, kv, group, s], float32 here) and
    # the out projection's input the roles tag (the result transposed, [b, s, h x d]).
    saved = [r for r in rk.residuals(work.loss_for_policy(rk.parse(
        "maxtext:minimal_with_context")), *work.args) if r.name == "context"]
    result = B * T_TPU * HEADS * D * 4
    assert sorted(r.nbytes for r in saved) == [B * T_TPU * HEADS * 4] * 2 + [result] * 4, saved
    notes = policy_notes(rk.parse("selective"), rk.emitted_tags(
        *_traced(on_tpu["splash workload"])), on_tpu["splash workload"].notes)
    assert any("finds no such values here" in n and "splash_mqa_fwd" in n for n in notes), notes


def test_offloading_the_kernels_residuals_compiles(on_tpu):
    """jax #25841 (offloading a splash residual errors) does not reach this JAX: the
    result and logsumexp splash names `context` go to host memory, the result's
    transposed copy the out projection reads too (`context` tagged by the roles)."""
    offloaded = on_tpu["splash"]["offload:context"]
    assert offloaded.error is None
    assert offloaded.offloaded_bytes == 2 * (B * T_TPU * HEADS * 4 + 2 * B * T_TPU * HEADS * D * 4)
    assert offloaded.host_temp_size_in_bytes >= offloaded.offloaded_bytes


def _traced(work):
    return work.loss_for_policy(rk.parse("full")), *work.args


@pytest.mark.parametrize("config", [
    {"attention": "splash", "interpret": True},
    # the cuDNN call cannot run on a CPU (its stand-in prices, never runs): its XLA path
    {"attention": "dpa", "implementation": "xla", "head_dim": 64}])
def test_grads_on_the_cpu_equal_no_remat(config):
    """Splash in interpret mode, and dot_product_attention's XLA path."""
    model, params, forward = kernel_nnx.make(B, 128, **config)
    work = rk.from_model.workload(model, B, 128)
    tokens = jax.random.randint(jax.random.key(1), (B, 128), 0, 128, jnp.int32)
    rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), work.args[2])

    def reference(p):
        logits = forward(p, tokens)[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    losses = {spec: work.loss_for_policy(rk.parse(spec))
              for spec in ("full", "maxtext:minimal_with_context")}
    want, got = jax.jit(lambda p, t, r: (jax.grad(reference)(p), {  # one compile
        s: jax.grad(loss)(p, t, r) for s, loss in losses.items()}))(params, tokens, rest)
    for spec, grads in got.items():
        chex.assert_trees_all_close(grads, want, rtol=1e-4, atol=1e-5, custom_message=spec)


def test_maxtexts_decoder_on_splash_through_compare(tmp_path):
    """MaxText's production TPU attention (flash: splash, `residual_checkpoint_name=
    "context"`, a segment-id mask, scanned layers) through `compare --model`:
    minimal_with_context keeps the kernel's result and logsumexp (and the out projection's
    input, the result transposed), so it runs the kernel's forward once a layer;
    save_out_proj keeps none of them and reruns it."""
    out = tmp_path / "records.json"
    assert cli.main(["compare", "--model", "tests/zoo/kernel_nnx.py:maxtext_splash",
                     "--target", "tpu:v5e:1x1", "--batch", str(B), "--seq", str(T_TPU),
                     "--policies", "maxtext:minimal_with_context,save_out_proj",
                     "--json", str(out)]) == 0
    rows = {r["names"][0]: r for r in json.loads(out.read_text())["records"]}
    kept, out_proj = rows["maxtext:minimal_with_context"], rows["save_out_proj"]
    result, lse = B * T_TPU * HEADS * D * 2, B * T_TPU * HEADS * 4  # bf16 result, f32 lse
    assert kept["residual_bytes_by_tag"]["context"] == 2 * (2 * result + lse)
    assert "context" not in out_proj["residual_bytes_by_tag"]
    once = 2 * F_TPU * CAUSAL * (1 + 1.5 + 2)  # two layers: forward, dq, dk/dv
    assert kept["kernel_flops"] == once and kept["kernel_flops"] <= kept["flops"]
    assert out_proj["kernel_flops"] == once + 2 * F_TPU * CAUSAL


def test_explains_block_reads_the_splash_mask_as_the_whole_program_does():
    """`rk.explain` prices one block (`Regions.block`): splash's block mask, an int8
    constant of the loss, is closed over as in the loss, so the block's kernels are priced
    causal (10 of 16 blocks at seq 512) as compare's are, not unmasked."""
    from remat_kit.policy.spec import parse
    model, _, _ = kernel_nnx.make(B, T, abstract=True)
    work = rk.from_model.workload(model, B, T)
    block, args = work.block(parse("minimal"))
    found = kernels.price(jax.make_jaxpr(jax.value_and_grad(block))(*args), "tpu").kernels
    fwd = [k for k in found if "fwd" in k.name]
    assert fwd and all(k.mask == "" and k.flops == F * 10 / 16 for k in fwd)
