"""The time model: a roofline per equation on XLA's own figures, and the target peaks."""

import jax
import jax.numpy as jnp
import pytest

from remat_kit import targets, time_model
from remat_kit.plan import Planner
from remat_kit.time_model import Roofline, eqn_costs, program_seconds

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


def test_target_peaks():
    assert targets.peaks("cpu") is None
    v5e = time_model.roofline("tpu:v5e:1x1")
    assert (v5e.bf16_flops, v5e.bandwidth) == (197e12, 819e9)
    assert targets.peaks("tpu:v5p:2x2x1")["bandwidth"] == 2765e9
    assert targets.peaks("gpu:h100")["bf16_flops"] == 989e12
    assert targets.PEAKS["gpu:h200"]["bandwidth"] == 4.8e12


def test_cpu_calibration_is_cached(tmp_path, monkeypatch):
    path = str(tmp_path / "roofline.json")
    first = time_model.calibrate_cpu(path)
    assert first.f32_flops > 1e8 and first.bandwidth > 1e8
    monkeypatch.setattr(jax, "jit", None)  # a second measurement would fail
    assert time_model.calibrate_cpu(path) == first


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
    fitting = [r for r in p._compiled() if r.memory_bytes <= plan.budget_bytes]
    assert plan.predicted_seconds == pytest.approx(min(p.seconds(p._policy_of(r))
                                                       for r in fitting))
    with pytest.raises(ValueError, match="objective must be one of flops, time"):
        Planner(loss, w, x, cache=None, objective="speed")
