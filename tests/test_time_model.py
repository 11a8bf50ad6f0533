"""The time model: a roofline per compiled op (a fusion one op) and per jaxpr
equation on XLA's own figures, a recompute segment priced as one fusion, and
the target peaks."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from remat_kit.measure import chip_peaks, targets
from remat_kit.measure import lowering
from remat_kit.measure import time_model
from remat_kit.decide.cost_model import Program
from remat_kit.decide.plan import Planner
from remat_kit.measure.time_checks import CHECKS, time_check
from remat_kit.measure.time_model import (Roofline, compiled_ops, compiled_seconds, eqn_costs,
                                  program_seconds)

LINE = Roofline(bf16_flops=2e12, f32_flops=1e12, bandwidth=1e11)


def test_matmul_roofline():
    m, k, n = 64, 128, 32
    for dtype, size, peak in ((jnp.float32, 4, LINE.f32_flops), (jnp.bfloat16, 2, LINE.bf16_flops)):
        jaxpr = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((m, k), dtype), jnp.ones((k, n), dtype))
        [eqn] = jaxpr.jaxpr.eqns
        flops, nbytes = eqn_costs(eqn, {})
        assert flops == 2 * m * k * n  # a multiply and an add per term
        assert nbytes == size * (m * k + k * n + m * n)  # both operands read, the result written
        hand = max(2 * m * k * n / peak, size * (m * k + k * n + m * n) / LINE.bandwidth)
        assert program_seconds(jaxpr.jaxpr, LINE, {}) == pytest.approx(hand, rel=1e-12)


def test_softmax_roofline():
    """Softmax over [8, 128] f32: the exp and the sum, by hand; the whole softmax is
    the sum of its equations' rooflines (memory-bound here: bytes / bandwidth)."""
    n, k = 8, 128
    jaxpr = jax.make_jaxpr(jax.nn.softmax)(jnp.ones((n, k), jnp.float32)).jaxpr
    by_name = {e.primitive.name: e for e in jaxpr.eqns}
    # exp: a transcendental, no FLOPs; reads and writes [n, k].
    assert eqn_costs(by_name["exp"], {}) == (0.0, 4 * 2 * n * k)
    # reduce_sum: k - 1 adds per row; reads [n, k] and the init value, writes [n].
    assert eqn_costs(by_name["reduce_sum"], {}) == (n * (k - 1), 4 * (n * k + 1 + n))
    total = sum(max(f / LINE.f32_flops, b / LINE.bandwidth)
                for f, b in (eqn_costs(e, {}) for e in jaxpr.eqns))
    assert program_seconds(jaxpr, LINE, {}) == pytest.approx(total, rel=1e-12)
    assert total == pytest.approx(sum(eqn_costs(e, {})[1] for e in jaxpr.eqns) / LINE.bandwidth)


def test_compiled_matmul_is_one_op_priced_by_hand():
    """a @ b compiled: one op (XLA CPU's dot fusion) of 2mkn FLOPs that reads both
    operands and writes the result; bf16 halves the bytes and takes bf16's peak."""
    m, k, n = 64, 128, 32
    for dtype, size, peak in ((jnp.float32, 4, LINE.f32_flops), (jnp.bfloat16, 2, LINE.bf16_flops)):
        compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((m, k), dtype),
                                                     jnp.ones((k, n), dtype)).compile()
        [op] = compiled_ops(compiled)
        assert (op.flops, op.transcendentals, op.trips) == (2 * m * k * n, 0, 1)
        assert op.nbytes == size * (m * k + k * n + m * n)
        hand = max(2 * m * k * n / peak, size * (m * k + k * n + m * n) / LINE.bandwidth)
        assert compiled_seconds(compiled, LINE) == pytest.approx(hand, rel=1e-12)


def test_compiled_softmax_counts_bytes_at_fusion_boundaries():
    """Softmax over [8, 128] f32 as XLA CPU compiles it: six fusions, each reading
    and writing only its boundary values, by hand (FLOPs, transcendentals, bytes):
    the max in two steps (a 32-wide window to [8, 4], then to [8]), exp(x - max),
    the sum in two steps, 1 / sum, and x times it. The values inside a fusion
    (x - max) are never charged, so the total is below the per-equation count,
    and the figures add up to XLA's own cost analysis of the module."""
    n, k = 8, 128
    x, row, part = 4 * n * k, 4 * n, 4 * n * 4  # bytes of [8,128], [8], [8,4]
    compiled = jax.jit(jax.nn.softmax).lower(jnp.ones((n, k), jnp.float32)).compile()
    ops = compiled_ops(compiled)
    window = (n * k - n * 4, 0, x + 4 + part)   # reduce-window: adds, reads x and its init
    assert sorted((op.flops, op.transcendentals, op.nbytes) for op in ops) == sorted([
        window, (n * 4 - n, 0, part + 4 + row),  # reduce [8,4] -> [8] (max)
        (n * k, n * k, x + row + x),             # subtract, exp: reads x and the max
        window,                                  # the sum's window
        (n * 4 - n + n, 0, part + row),          # reduce to [8] and 1 / sum, fused
        (n * k, 0, x + row + x)])                # x * (1 / sum)
    xla = compiled.cost_analysis()
    assert sum(op.flops for op in ops) == xla["flops"]
    assert sum(op.nbytes for op in ops) == xla["bytes accessed"]
    jaxpr = jax.make_jaxpr(jax.nn.softmax)(jnp.ones((n, k), jnp.float32)).jaxpr
    assert sum(op.nbytes for op in ops) < sum(eqn_costs(e, {})[1] for e in jaxpr.eqns)
    assert compiled_seconds(compiled, LINE) == pytest.approx(
        sum(max(op.flops / LINE.f32_flops, op.nbytes / LINE.bandwidth) for op in ops))


def test_compiled_loop_body_counts_per_trip():
    """A scan of 3 trips of a [16,16] matmul and tanh: the body's ops run 3 times,
    with the loop counter's add and the condition's compare (a FLOP each)."""
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0]

    compiled = jax.jit(f).lower(jnp.ones((16, 16)), jnp.ones((16, 16))).compile()
    ops = compiled_ops(compiled)
    assert sum(op.trips * op.flops for op in ops) == 3 * (2 * 16**3 + 2)
    assert sum(op.trips * op.transcendentals for op in ops) == 3 * 16 * 16


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_tpu_convolutions_count_the_dots_flops():
    """XLA:TPU writes dots as convolutions, batched ones with padded windows: their
    FLOPs are the dot's, not kernel size x output (which counts padding taps)."""
    tpu = targets.parse_target("tpu:v5e:1x1")
    b, h, s, d = 4, 4, 256, 64
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((h * d, 512), jnp.bfloat16)

    def f(q, w):  # a batched dot (scores) and a plain one (a projection), with their grads
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, q)
        return jnp.sum(scores.astype(jnp.float32)) + jnp.sum(q.reshape(b, s, h * d) @ w)

    structs = lowering.place((q, w), tpu)
    compiled = lowering.lower(jax.value_and_grad(f, argnums=(0, 1)), list(structs), tpu).compile()
    assert "lhs_dilate" in time_model.hlo_module(compiled).to_string()  # a dilated one too
    # forward: scores 2bhs^2d, projection 2bs(hd)512; backward: twice each.
    dots = 3 * (2 * b * h * s * s * d + 2 * b * s * h * d * 512)
    total = sum(o.trips * o.flops for o in compiled_ops(compiled))
    assert dots <= total <= 1.005 * dots  # the rest: a few elementwise ops
    assert total == pytest.approx(compiled.cost_analysis()["flops"], rel=1e-6)


def test_recompute_segment_is_priced_as_one_fusion():
    """Recomputing b = tanh(exp(a)) from the saved tag a reads a and writes b once:
    2 x 4 x [32, 64] bytes, not the 4 of two separate ops; FLOPs are the dot's
    none here (a is saved), so the segment is memory-bound."""
    def loss(w, x):
        a = jax.ad_checkpoint.checkpoint_name(x @ w, "a")
        b = jax.ad_checkpoint.checkpoint_name(jnp.tanh(jnp.exp(a)), "b")
        return jnp.sum(b @ w.T)

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    model = Program(jax.make_jaxpr(loss)(w, x).jaxpr).model(needed=["a", "b"], roofline=LINE)
    assert model.parents["b"] == {"a"}
    assert model.seconds["b"] == pytest.approx(2 * 4 * 32 * 64 / LINE.bandwidth, rel=1e-12)
    # a's segment is the matmul: compute-bound at this line's peaks.
    assert model.seconds["a"] == pytest.approx(max(2 * 32 * 64 * 64 / LINE.f32_flops,
                                                   4 * (32 * 64 + 64 * 64 + 32 * 64)
                                                   / LINE.bandwidth), rel=1e-12)


# A TPU program as XLA:TPU's memory-space assignment leaves it: a prefetch of p into VMEM
# (S(1)) and a sliced prefetch of 64 of its rows, each read there by a negate.
_TPU_DMAS = """HloModule m

ENTRY %main (p: f32[256,128]) -> (f32[256,128], f32[64,128]) {
  %p = f32[256,128]{1,0} parameter(0)
  %cs = (f32[256,128]{1,0:S(1)}, f32[256,128]{1,0}, u32[]{:S(2)}) copy-start(f32[256,128]{1,0} %p)
  %cd = f32[256,128]{1,0:S(1)} copy-done((f32[256,128]{1,0:S(1)}, f32[256,128]{1,0}, u32[]{:S(2)}) %cs)
  %ss = ((f32[256,128]{1,0}), f32[64,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(f32[256,128]{1,0} %p), slice={[0:64], [0:128]}
  %sd = f32[64,128]{1,0:S(1)} slice-done(((f32[256,128]{1,0}), f32[64,128]{1,0:S(1)}, s32[]{:S(2)}) %ss)
  %n = f32[256,128]{1,0} negate(f32[256,128]{1,0:S(1)} %cd)
  %r = f32[64,128]{1,0} negate(f32[64,128]{1,0:S(1)} %sd)
  ROOT %t = (f32[256,128]{1,0}, f32[64,128]{1,0}) tuple(%n, %r)
}
"""


class _Text:
    """A compiled program known only by its HLO text, as an AOT target's is."""

    def __init__(self, text):
        self.text = text

    def runtime_executable(self):
        raise RuntimeError("no runtime half")

    def as_text(self):
        return self.text


def test_tpu_dmas_and_vmem_cost_their_hbm_bytes_once():
    """A DMA costs the HBM bytes of its ends once, at its start (its done is a wait);
    an operand in VMEM costs no HBM bytes. Counting every start, done and VMEM read
    priced gpt2_small's no remat below full remat on tpu:v5e."""
    ops = [(op.opcode, op.nbytes) for op in compiled_ops(_Text(_TPU_DMAS))]
    whole, rows = 256 * 128 * 4, 64 * 128 * 4
    assert ops == [("kCopyStart", whole), ("kAsyncStart", rows),  # read from HBM, into VMEM
                   ("kNegate", whole), ("kNegate", rows)]  # read from VMEM, written to HBM


# A fusion reading one layer of a stacked [4, 64, 128] value through a nested fusion's
# dynamic-slice (how XLA:TPU reads a scan's stacked residual), writing into VMEM, and an
# AllocateBuffer (a loop's output buffer, not yet filled).
_TPU_NESTED_SLICE = """HloModule m

%inner (p0: f32[4,64,128], p1: s32[]) -> f32[64,128] {
  %p0 = f32[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %b = f32[64,128]{1,0} bitcast(%ds)
}

%outer (q0: f32[4,64,128], q1: s32[], q2: f32[64,128]) -> f32[64,128] {
  %q0 = f32[4,64,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[64,128]{1,0} parameter(2)
  %f = f32[64,128]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner
  ROOT %m = f32[64,128]{1,0:S(1)} multiply(%f, %q2)
}

ENTRY %main (a: f32[4,64,128], i: s32[], v: f32[64,128]) -> f32[64,128] {
  %a = f32[4,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %v = f32[64,128]{1,0} parameter(2)
  %buf = f32[4,64,128]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  %o = f32[64,128]{1,0:S(1)} fusion(%a, %i, %v), kind=kLoop, calls=%outer
  ROOT %n = f32[64,128]{1,0} negate(%o)
}
"""


def test_tpu_nested_slice_reads_one_layer_and_vmem_bytes_are_counted():
    """A stacked operand sliced inside a nested fusion reads the slice, not the stack
    (counting the stack priced no remat's scanned backward at twice its HBM traffic); an
    AllocateBuffer moves nothing; VMEM operands and outputs are counted apart."""
    ops = [(op.opcode, op.nbytes, op.vmem_bytes) for op in compiled_ops(_Text(_TPU_NESTED_SLICE))]
    layer = 64 * 128 * 4
    assert ops == [("kCustomCall", 0.0, 0.0),
                   ("kFusion", layer + 4 + layer, layer),  # one layer, the index, v; into VMEM
                   ("kNegate", layer, layer)]  # read from VMEM, written to HBM


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_tpu_vmem_resident_ops_are_priced_at_vmem_bandwidth():
    """XLA:TPU keeps a softmax's small buffers in VMEM: ops that move no HBM bytes cost
    their VMEM bytes at the chip's VMEM bandwidth (22x HBM's), not nothing."""
    tpu = targets.parse_target("tpu:v5e:1x1")
    line = tpu.roofline
    assert line.vmem_bandwidth == 22 * line.bandwidth

    def f(x, w):
        return jnp.sum(jax.nn.softmax(jax.nn.softmax(x @ w) @ w.T))

    structs = lowering.place((jax.ShapeDtypeStruct((1024, 256), jnp.float32),
                              jax.ShapeDtypeStruct((256, 256), jnp.float32)), tpu)
    compiled = lowering.lower(jax.value_and_grad(f, argnums=(0, 1)), list(structs), tpu).compile()
    ops = compiled_ops(compiled)
    on_chip = [op for op in ops if op.nbytes == 0 and op.vmem_bytes > 0]
    bound = [op for op in on_chip if op.vmem_bytes / line.vmem_bandwidth
             > op.flops / line.f32_flops]  # moving them takes longer than their math
    assert bound  # the softmax's reductions and divides
    for op in bound:
        seconds = line.seconds(op.flops, op.nbytes, op.dtype, op.vmem_bytes)
        assert seconds == pytest.approx(op.vmem_bytes / line.vmem_bandwidth, rel=1e-12)
        # The same bytes in HBM would take 22x as long; priced as before, only the math.
        assert seconds == pytest.approx(line.seconds(op.flops, op.vmem_bytes, op.dtype) / 22)
        assert seconds > line.seconds(op.flops, 0.0, op.dtype)
    terms = time_model.step_terms(compiled, line)
    assert terms["vmem_bytes"] == sum(op.trips * op.vmem_bytes for op in ops) > terms["hbm_bytes"]
    assert terms["seconds"] == pytest.approx(sum(
        op.trips * line.seconds(op.flops, op.nbytes, op.dtype, op.vmem_bytes) for op in ops))


def test_target_peaks():
    assert targets.peaks("cpu") is None
    a100 = time_model.roofline("gpu:a100")
    assert (a100.bf16_flops, a100.f32_flops, a100.bandwidth) == (312e12, 156e12, 2.039e12)
    assert targets.chip("gpu:a100:8") == "gpu:a100" and targets.chip("cpu") == "cpu"
    v5e = time_model.roofline("tpu:v5e:1x1")
    assert (v5e.bf16_flops, v5e.bandwidth) == (197e12, 819e9)
    assert targets.peaks("tpu:v5p:2x2x1")["bandwidth"] == 2765e9
    assert targets.peaks("gpu:h100")["bf16_flops"] == 989e12
    assert (targets.PEAKS["gpu:h200"]["bandwidth"], targets.PEAKS["gpu:h200"]["bf16_flops"]) == (
        4.3e12, 790e12)  # measured on one: docs/gpu.md


def test_cpu_calibration_is_cached(tmp_path, monkeypatch):
    path = tmp_path / "roofline.json"
    path.write_text('{"f32_flops": 1.0, "bandwidth": 1.0, "source": "an older calibration"}')
    first = chip_peaks.calibrate_cpu(str(path))  # an unversioned figure is measured again
    assert first.f32_flops > 1e8 and first.bandwidth > 1e8
    monkeypatch.setattr(jax, "jit", None)  # a second measurement would fail
    assert chip_peaks.calibrate_cpu(str(path)) == first


def test_time_objective_on_cpu():
    """Asked for, the time objective ranks by predicted seconds: the plan is the
    fitting compiled policy with the least."""
    def loss(w, x):
        h = jax.ad_checkpoint.checkpoint_name(x @ w, "mlpwi")
        a = jax.ad_checkpoint.checkpoint_name(jnp.tanh(h), "mlp_act")
        return jnp.sum(jax.ad_checkpoint.checkpoint_name(a @ w.T, "mlpwo") ** 2)

    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    p = Planner(loss, w, x, cache=None, objective="time")
    full, none = p.minimum()
    plan = p.plan((full + none) // 2)
    assert plan.objective == "time" and plan.predicted_seconds is not None
    fitting = [r for r in p.compiled_records() if r.memory_bytes <= plan.budget_bytes]
    assert plan.predicted_seconds == pytest.approx(min(p.seconds(p.policy_of(r))
                                                       for r in fitting))
    with pytest.raises(ValueError, match="objective must be one of flops, time"):
        Planner(loss, w, x, cache=None, objective="speed")


def test_objective_defaults_to_flops_where_the_time_model_is_unchecked():
    """Time is the default only where predictions came within reach of measured step
    times; no TPU or GPU target's did (docs/plan.md, "Checked against published step
    times"), and the planner says how far each was checked."""
    w, x = jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((2, 8), jnp.float32)
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
    assert Planner(loss, w, x, cache=None, target="cpu").objective == "flops"
    tpu = Planner(loss, w, x, cache=None, target="tpu:v5e:1x1")
    assert tpu.objective == "flops"
    assert tpu.time_check.startswith("the tpu:v5e time model is checked against no measured")
    assert Planner(loss, w, x, cache=None, target="tpu:v5e:1x1",
                   objective="time").objective == "time"
    assert Planner(loss, w, x, cache=None, target="cpu", objective="time").objective == "time"
    assert time_check(targets.parse_target("gpu:a100")) == (False, CHECKS["gpu:a100"][1])
    assert time_check(targets.parse_target("tpu:v5p:2x2x1"))[1] == (
        "the tpu:v5p time model is checked against no measured step time: predicted times "
        "are an unchecked roofline")
    assert all(text.count("\n") == 0 for _, text in CHECKS.values())  # one line each
