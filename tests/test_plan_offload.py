"""Offload as the planner's third decision: the MILP with transfers hidden behind
compute, the targets that have host memory, and the compiled effect on TPU v5e."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.measure import targets
from remat_kit.decide.cost_model import CostModel
from remat_kit.models import get_config
from remat_kit.decide.plan import CPU_OFFLOAD_NOTE, Planner
from remat_kit.api.configs import config_planner

needs_libtpu = pytest.mark.skipif(
    __import__("importlib").util.find_spec("libtpu") is None, reason="needs libtpu")


def _model(compute: float) -> CostModel:
    """mlpwi -> mlp_act, 8 bytes each, 1 s to move either one way, one layer group
    with `compute` seconds of forward compute to hide transfers behind."""
    return CostModel(tags=("mlpwi", "mlp_act"), nbytes={"mlpwi": 8, "mlp_act": 8},
                     flops={"mlpwi": 100.0, "mlp_act": 1.0},
                     parents={"mlpwi": frozenset(), "mlp_act": frozenset({"mlpwi"})},
                     needed=frozenset({"mlpwi", "mlp_act"}),
                     seconds={"mlpwi": 3.0, "mlp_act": 0.5},
                     transfer={"mlpwi": 1.0, "mlp_act": 1.0},
                     hide={"mlpwi": 0, "mlp_act": 0}, compute={0: compute}, flop_rate=10.0)


def _brute_force(model: CostModel, room: float, objective: str):
    """The least objective (then stored bytes) over every save/offload/recompute choice."""
    best = None
    for choice in itertools.product("sor", repeat=len(model.tags)):
        saved = frozenset(t for t, c in zip(model.tags, choice) if c == "s")
        offloaded = frozenset(t for t, c in zip(model.tags, choice) if c == "o")
        if model.cost(saved, offloaded)[0] <= room:
            key = model.objective(saved, offloaded, objective)
            best = key if best is None or key < best else best
    return best


def test_transfers_hide_behind_compute():
    hidden, exposed = _model(compute=2.0), _model(compute=0.5)
    both = frozenset({"mlpwi", "mlp_act"})
    assert hidden.excess(both) == 0.0  # 2 s of transfer each way within 2 s of compute
    assert exposed.excess(both) == 2 * 1.5  # each way, 1.5 s past the compute
    assert hidden.cost(frozenset(), both) == (0, 0.0)  # offloaded: no device bytes
    # No room on the device: offload both when they hide, else recompute mlp_act's
    # cheap segment and offload only mlpwi (1 s each way, 0.5 s hidden).
    assert hidden.solve(0, objective="time")[:2] == (frozenset(), both)
    assert exposed.solve(0, objective="time")[:2] == (frozenset(), {"mlpwi"})
    # With room for both, saving beats offloading (fewer transfers at equal cost).
    assert hidden.solve(16, objective="time")[:2] == (both, frozenset())
    for model, objective, room in itertools.product((hidden, exposed), ("flops", "time"),
                                                    (0, 8, 16)):
        saved, offloaded, status = model.solve(room, objective=objective)
        assert "Optimal" in status and model.cost(saved, offloaded)[0] <= room
        assert model.objective(saved, offloaded, objective) == pytest.approx(
            _brute_force(model, room, objective), rel=1e-9), (objective, room)


def test_offload_needs_host_memory(capsys):
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    assert Planner(lambda w: jnp.sum(w ** 2), w, cache=None).host_bandwidth is None  # cpu
    # Asked for only, on every target (XLA's TPU and GPU offload kept device bytes).
    assert Planner(lambda w: jnp.sum(w ** 2), w, cache=None, target="tpu:v5e:1x1",
                   groups=1).host_bandwidth is None
    assert Planner(lambda w: jnp.sum(w ** 2), w, cache=None, target="tpu:v5e:1x1", groups=1,
                   offload=True).host_bandwidth == targets.PEAKS["tpu:v5e"]["host_bandwidth"]
    with pytest.raises(targets.TargetError, match="tpu:v4:2x2x1 lists none; targets with "
                                                  "host memory: tpu:v5e, tpu:v5p"):
        Planner(lambda w: jnp.sum(w ** 2), w, cache=None, target="tpu:v4:2x2x1", offload=True)


@needs_libtpu
def test_cli_offload_without_host_memory(capsys):
    assert cli.main(["plan", "--config", "tiny", "--batch", "2", "--seq", "32", "--budgets",
                     "0.5", "--target", "tpu:v4:2x2x1", "--offload", "--cache", ""]) == 2
    err = capsys.readouterr().err
    assert "offload needs the target's host memory bandwidth" in err
    assert len(err.strip().splitlines()) == 1


MLP = frozenset({"mlpwi", "mlp_act"})


@pytest.fixture(scope="module")
def cpu_planner():
    """The tiny GPT-2 (2 layers, unrolled), batch 2, seq 32, offload asked for on the
    CPU, deciding mlpwi and mlp_act (8 KiB each per layer, f32)."""
    return config_planner(get_config("tiny"), 2, 32, cache=None, groups=1, offload=True,
                          decide=MLP, max_iterations=2)


def _probe_predicts_the_plan(planner, extra):
    """The probe's figure against the compile of another plan than its own: `extra`
    saved beside the offloaded MLP tags, predicted from saving all of them."""
    probe = planner.offload_probe
    saving, plan = planner.measure_all([rk.Policy(save=MLP | extra),
                                        rk.Policy(save=extra, offload=MLP)])
    assert plan.offloaded_bytes == probe.offloaded_bytes  # the same residuals move
    return probe.predict(saving.memory_bytes, plan.offloaded_bytes), plan.memory_bytes


def test_cpu_probe_finds_no_device_bytes_removed(cpu_planner):
    """On the CPU host memory is device memory: offloading the MLP tags gives the
    compile saving them gives (temp 434,176 bytes both), figure 0, and the probe's
    prediction for a plan that also saves attn_norm is that plan's compile."""
    probe = cpu_planner.offload_probe
    cfg = get_config("tiny")
    assert probe.tags == ("mlpwi", "mlp_act") and probe.stack == "unrolled"
    assert probe.offloaded_bytes == 2 * cfg.num_layers * 2 * 32 * cfg.mlp_dim * 4
    assert probe.offloaded_device_bytes == probe.saved_bytes
    assert probe.figure == 0.0 and not probe.pays and not cpu_planner.plans_offload
    predicted, compiled = _probe_predicts_the_plan(cpu_planner, frozenset({"attn_norm"}))
    assert predicted == compiled


def test_plan_does_not_offload_where_the_probe_says_no(cpu_planner):
    """Figure 0: the cost model has no offload choice, the plan at the least budget
    offloads nothing, and its notes give the probe's line and the CPU's reason."""
    assert cpu_planner.model_for("nothing", 1).transfer == {}
    full, _ = cpu_planner.minimum()
    plan = cpu_planner.plan(full)
    assert plan.offloaded_bytes == 0 and not any(p.offload for p in
                                                 (plan.policy if isinstance(plan.policy, tuple)
                                                  else (plan.policy,)))
    assert plan.offload_notes == (cpu_planner.offload_probe.note,)
    assert "0.000 removed per byte offloaded; offload does not pay here and is not " \
        "planned" in plan.offload_notes[0]
    # A compiled preset that offloads is no candidate either (it would be budgeted as saving).
    cpu_planner.measure_all([rk.parse("minimal_offloaded")])
    assert all(not r.offloaded_bytes for r in cpu_planner.compiled_records())


def test_cost_model_charges_offload_its_share():
    """offload_share s: an offloaded item takes s of its bytes in the memory row, so
    with room for one item at s = 0.5 offloading both MLP tags fits (2 x 4 bytes)."""
    model = dataclasses.replace(_model(compute=2.0), offload_share=0.5)
    assert model.cost(frozenset(), MLP) == (8, 0.0)
    assert model.cost({"mlpwi"}, {"mlp_act"}) == (12, 0.0)
    saved, offloaded, _ = model.solve(8)
    assert (saved, offloaded) == (frozenset(), MLP)
    saved, offloaded, _ = model.solve(7)  # no room for both halves: recompute mlp_act
    assert model.cost(saved, offloaded)[0] <= 7 and "mlp_act" not in saved | offloaded


def test_probe_figure_is_kept_in_the_figure_cache(cpu_planner):
    """A second planner of the same loss reads the probe back from the figure cache
    (the suite's, tests/conftest.py): neither probe policy is compiled again."""
    first = cpu_planner.offload_probe
    again = config_planner(get_config("tiny"), 2, 32, cache=None, groups=1, offload=True,
                           decide=MLP)
    assert again.offload_probe == dataclasses.replace(first, cached=True)
    assert set(again.records) == {"full"}  # the cost model's free tags; no probe compile


@pytest.fixture(scope="module")
def tpu_planner():
    """The tiny GPT-2 with its layers scanned (XLA:TPU then keeps the stacked residuals
    in host memory), batch 8, seq 128, deciding mlpwi and mlp_act. The host link is set
    fast enough (1e15 bytes/s) to hide the transfers behind this tiny model's compute;
    a real PCIe link hides them only behind a layer some 30x wider (d_model ~ 2k)."""
    return config_planner(get_config("tiny", scan_layers=True), 8, 128, cache=None,
                          target="tpu:v5e:1x1", offload=1e15, decide={"mlpwi", "mlp_act"})


@needs_libtpu
def test_tpu_probe_figure_predicts_the_plan(tpu_planner):
    """Scanned on TPU v5e, offloading the MLP tags removes 1,964,032 device bytes of
    the 4 MiB offloaded (0.468, libtpu 0.0.52): the probe's figure; the same bytes
    are removed where attn_norm is saved beside them, so the probe predicts that
    plan's compile to the byte."""
    probe = tpu_planner.offload_probe
    cfg = get_config("tiny")
    assert probe.stack == "scanned" and probe.tags == ("mlpwi", "mlp_act")
    assert probe.offloaded_bytes == 2 * cfg.num_layers * 8 * 128 * cfg.mlp_dim * 4
    assert probe.figure == pytest.approx(0.468, abs=0.01) and tpu_planner.plans_offload
    predicted, compiled = _probe_predicts_the_plan(tpu_planner, frozenset({"attn_norm"}))
    assert predicted == compiled
    model = tpu_planner.model_for("nothing", 1)
    assert model.offload_share == 1 - probe.figure
    assert model.cost(frozenset(), MLP)[0] == round((1 - probe.figure) * probe.offloaded_bytes)


@needs_libtpu
def test_tpu_plan_offloads_where_the_probe_pays_and_fits(tpu_planner):
    """At the budget of offloading both MLP tags' compile (below saving either), the
    plan offloads (mlpwi: its dot is not recomputed), and its own compile fits."""
    off, save = tpu_planner.measure_all([rk.Policy(offload=MLP), rk.Policy(save={"mlpwi"})])
    assert save.memory_bytes > off.memory_bytes
    plan = tpu_planner.plan(off.memory_bytes)
    assert plan.policy.offload and plan.offloaded_bytes > 0
    assert plan.measured_bytes <= plan.budget_bytes
    assert plan.measured_flops < tpu_planner.measure(rk.parse("full")).flops
    assert plan.offload_notes[0] == tpu_planner.offload_probe.note
    assert any("the probe predicted 0.468" in n for n in plan.offload_notes)


@needs_libtpu
def test_tpu_unrolled_probe_does_not_pay():
    """Unrolled on TPU v5e the device peak rose by offloading (figure < 0): no offload."""
    planner = config_planner(get_config("tiny"), 8, 128, cache=None, target="tpu:v5e:1x1",
                             groups=1, offload=1e15, decide=MLP)
    probe = planner.offload_probe
    assert probe.stack == "unrolled" and probe.figure < 0 and not planner.plans_offload
    assert planner.model_for("nothing", 1).transfer == {}


