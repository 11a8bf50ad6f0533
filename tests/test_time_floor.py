"""A time model that obeys physics: while loops priced once per trip on every
target (XLA:TPU drops `known_trip_count`; `measure.loops` reads the loop's
condition), and no predicted step below max(FLOPs / peak, bytes / bandwidth)."""

import importlib
import importlib.util
import operator
import re

import jax
import jax.numpy as jnp
import pytest

from remat_kit.api import answers
from remat_kit import mesh as rk_mesh
from remat_kit._jax_private import hlo
from remat_kit.measure import figure_cache, lowering, targets, time_model
from remat_kit.measure.loops import trip_count
from remat_kit.measure.time_checks import (BelowFloor, FLOOR_SLACK, check_floor, floor_seconds,
                                           written_bytes)
from remat_kit.models import get_config, workload
from remat_kit.policy.presets import PRESET_TABLE

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")
TPU = targets.parse_target("tpu:v5e:2x2")
# Every preset's spec, once (43 names, 23 specs).
PRESET_SPECS = tuple(dict.fromkeys(spec for _, _, spec, _ in PRESET_TABLE))


def _while_loop(start, stop, step, op):
    def f(x):
        cond = lambda c: op(c[0], stop)
        body = lambda c: (c[0] + step, jnp.tanh(c[1] @ c[1]))
        return jax.lax.while_loop(cond, body, (jnp.int32(start), x))[1]
    return f


def _loops(compiled):
    module = hlo.hlo_module_from_text(compiled.as_text())
    comps = {c.name: c for c in module.computations()}
    return [trip_count(i, comps) for c in comps.values() for i in c.instructions()
            if i.opcode.name == "kWhile"]


@needs_libtpu
@pytest.mark.parametrize("start, stop, step, op, trips", [
    (0, 4, 1, operator.lt, 4), (2, 11, 3, operator.lt, 3), (2, 11, 3, operator.le, 4),
    (10, 0, -2, operator.gt, 5), (10, 0, -3, operator.ge, 4),
])
def test_trip_count_is_read_from_the_condition_where_tpu_drops_it(start, stop, step, op,
                                                                   trips):
    x = lowering.place(jax.ShapeDtypeStruct((128, 128), jnp.float32), TPU)
    compiled = lowering.lower(_while_loop(start, stop, step, op), [x], TPU).compile()
    assert "known_trip_count" not in compiled.as_text()
    assert _loops(compiled) == [trips]


def test_a_bound_known_at_run_time_has_no_trip_count():
    def f(x, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1])),
                                  (0, x))[1]
    assert _loops(jax.jit(f).lower(jnp.ones(8), 3).compile()) == [None]


def test_the_floor_and_what_raises_below_it():
    line = time_model.Roofline(bf16_flops=4e14, f32_flops=1e14, bandwidth=1e12, source="s")
    # 8e12 FLOPs at the faster (bf16) peak: 20 ms; 1e10 bytes at 1 TB/s: 10 ms.
    assert floor_seconds(line, 8e12, 1e10) == pytest.approx(0.020)
    assert floor_seconds(line, 8e10, 1e11) == pytest.approx(0.100)
    assert check_floor(0.020 * (1 - FLOOR_SLACK), line, 8e12, 1e10) == 0.020 * (1 - FLOOR_SLACK)
    with pytest.raises(BelowFloor, match=r"^predicted step 19\.2 ms is below the physical floor "
                                         r"20 ms: 8e\+12 FLOPs at 400 TFLOP/s"):
        check_floor(0.0192, line, 8e12, 1e10)


def _matmul_scan(w, x):
    """16 trips of a 512 x 512 matmul: compute-bound on a TPU."""
    y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=16)
    return jnp.sum(y)


@needs_libtpu
def test_a_loop_priced_once_falls_below_the_floor_and_raises(monkeypatch):
    """The bug the floor catches: a compute-bound scan whose body is priced once
    (as when XLA:TPU's dropped trip count was taken for 1) comes out faster than
    the chip; priced once per trip it is above its floor, and `measure` records
    the body-once figure as an error."""
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    grad = jax.value_and_grad(_matmul_scan, (0, 1))
    compiled = lowering.lower(grad, lowering.place((w, x), TPU), TPU).compile()
    line = time_model.roofline(TPU)
    ops = time_model.compiled_ops(compiled)
    flops = sum(o.trips * o.flops for o in ops)
    assert flops >= 16 * 3 * 2 * 1024 * 512 * 512  # every trip's matmul and its two grads
    # The loss (a bf16 scalar) and both gradients: what the program writes at least.
    assert written_bytes(compiled) == 2 + 2 * (512 * 512 + 1024 * 512)
    once = sum(line.seconds(o.flops, o.nbytes, o.dtype, o.vmem_bytes) for o in ops)
    assert check_floor(time_model.compiled_seconds(compiled, line), line, flops, 0) > 2 * once
    with pytest.raises(BelowFloor):
        check_floor(once, line, flops, 0)

    terms = time_model.step_terms

    def body_once(compiled, line):  # what `measure` predicts a step from
        return terms(compiled, line) | {"seconds": sum(
            line.seconds(o.flops, o.nbytes, o.dtype, o.vmem_bytes)
            for o in time_model.compiled_ops(compiled))}
    monkeypatch.setattr(time_model, "step_terms", body_once)
    monkeypatch.setattr(figure_cache, "folder", lambda: None)  # figures kept would hide it
    [record] = answers.measure(_matmul_scan, w, x, policies=["none"], target=TPU)
    assert record.error.startswith("BelowFloor: predicted step")


def _assert_above_floor(records, target):
    """No record raised `BelowFloor` (its outputs' bytes checked as it compiled), and
    each predicted step takes at least its FLOPs at the chip's bf16 peak."""
    line = time_model.roofline(target)
    for r in records:
        assert r.error is None, r.error
        assert r.predicted_seconds >= r.flops / line.bf16_flops


@needs_libtpu
def test_every_preset_of_tiny_llama_is_above_the_floor_on_tpu():
    records = answers.measure(workload(get_config("tiny_llama"), 2, 64),
                              policies=PRESET_SPECS, target=TPU)
    assert {n for r in records for n in r.names} == set(PRESET_SPECS)
    _assert_above_floor(records, TPU)


def _scanned(layers):
    return get_config("tiny_llama", scan_layers=True, num_layers=layers)


@needs_libtpu
def test_a_scanned_config_on_a_tpu_mesh_is_priced_per_layer():
    """tiny_llama scanned, fsdp:4 on v5e:2x2: above the floor, with the FLOPs of
    every layer (those of the same layers unrolled, within 1%), and each layer
    adds the same predicted time: 8 layers less 4 is twice 4 less 2."""
    mesh = rk_mesh.make("fsdp:4", targets.devices(TPU)[:4])
    records = answers.measure(workload(_scanned(4), 4, 128, mesh=mesh),
                              policies=["none", "full", "minimal", "dots"], target=TPU)
    _assert_above_floor(records, TPU)
    unrolled = answers.measure(workload(_scanned(4).replace(scan_layers=False), 4, 128,
                                        mesh=mesh), policies=["full"], target=TPU)[0]
    [full] = [r for r in records if "full" in r.names]
    assert full.flops == pytest.approx(unrolled.flops, rel=0.01)
    step = {n: answers.measure(workload(_scanned(n), 4, 128, mesh=mesh), policies=["full"],
                               target=TPU)[0].predicted_seconds for n in (2, 8)}
    step[4] = full.predicted_seconds
    assert step[8] - step[4] == pytest.approx(2 * (step[4] - step[2]), rel=0.05)
    assert step[4] - step[2] > 0.2 * step[2]


def test_a_scanned_config_on_cpu_prices_its_trips():
    """The CPU compile keeps known_trip_count; the walk scales each body op by it."""
    compiled = jax.jit(jax.value_and_grad(_matmul_scan)).lower(
        jnp.ones((64, 64)), jnp.ones((8, 64))).compile()
    assert re.search(r'"known_trip_count":\{"n":"16"\}', compiled.as_text())
    assert {o.trips for o in time_model.compiled_ops(compiled)} == {1, 16}
