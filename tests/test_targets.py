"""remat_kit.measure.targets: TPU (libtpu) and GPU compiles ahead of time, --target, error paths."""

import csv
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.api import answers
from remat_kit.cli import commands as cli
from remat_kit.ui import report
from remat_kit.measure import targets
from remat_kit.measure import lowering
from remat_kit.policy.budget import parse_budget
from remat_kit.api.configs import layer_residuals
from remat_kit.measure.record import PEAK, TEMP
from remat_kit.models import get_config
from remat_kit.api.configs import config_planner
from remat_kit.policy.spec import parse

# The module, not rk.measure (the function the package exports under that name).
measure = importlib.import_module("remat_kit.measure.measure")
from remat_kit.api import configs  # noqa: E402
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed "
                                  "(pip install 'remat-kit[tpu]'; `make test` installs it)")
HAS_CUDA_PLUGIN = targets._cuda_plugin_installed()

B, S = 8, 16
POLICIES = "none,full,minimal"


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- parsing, no compile ----------------------------------------------------------

@pytest.mark.parametrize("text, platform, topology", [
    ("cpu", "cpu", None), ("CPU", "cpu", None), ("tpu", "tpu", None), ("gpu", "gpu", None),
    ("tpu:v5e:2x2", "tpu", "v5e:2x2"), ("tpu:V5P:2x2x1", "tpu", "v5p:2x2x1"),
    ("gpu:h100", "gpu", "h100"), ("gpu:H100:8", "gpu", "h100:8"), ("gpu:H200", "gpu", "h200"),
])
def test_parse_target(text, platform, topology):
    target = targets.parse_target(text)
    assert (target.platform, target.topology) == (platform, topology)
    assert target.aot == (topology is not None)
    assert targets.parse_target(str(target)) == target


def test_labels_name_the_compiler_and_the_topology():
    assert targets.parse_target("cpu").label == "XLA CPU compile"
    assert targets.parse_target("tpu:v5e:2x2").label == "XLA TPU compile (v5e:2x2, AOT)"
    assert targets.parse_targets("cpu, tpu:v5e:1x1,cpu") == [
        targets.Target("cpu"), targets.Target("tpu", "v5e:1x1")]


@pytest.mark.parametrize("text, message", [
    ("xpu", "unknown target 'xpu'; did you mean 'tpu'?; valid: cpu, tpu, tpu:<topology>"),
    ("tpu:v5f:2x2", "unknown TPU generation 'v5f' in target 'tpu:v5f:2x2'; did you mean "
                    "'v5p'?; valid: v2, v3, v4, v5e, v5p, v6e, tpu7x"),
    ("tpu:v5e:2", "bad TPU topology 'v5e:2' in target 'tpu:v5e:2'"),
    ("tpu:v5e", "bad TPU topology 'v5e'"),
    ("gpu:h10", "unknown GPU 'h10' in target 'gpu:h10'; did you mean 'h100'?; valid: a100, h100, h200"),
    ("gpu:h100:0", "bad GPU target 'gpu:h100:0'"),
    # libtpu aborts the process past 512 slices; a trailing ':' or a non-ASCII digit is
    # no count at all.
    ("tpu:v5p:4x4x4:slices=1000", "bad TPU topology 'v5p:4x4x4:slices=1000' in target "
     "'tpu:v5p:4x4x4:slices=1000': after the shape give slices=N with N a number of slices "
     "from 1 to 512 (libtpu's most)"),
    ("tpu:v5e:1x1:", "target 'tpu:v5e:1x1:' ends in ':'; valid: cpu, tpu"),
    ("cpu:", "target 'cpu:' ends in ':'; valid: cpu, tpu"),
    ("tpu:v5e:1x\u0662", "bad TPU topology 'v5e:1x\u0662'"),
    ("tpu:v5p:2x2x1:slices=\u0662", "bad TPU topology 'v5p:2x2x1:slices=\u0662'"),
    ("gpu:/no/such.txtpb", "GPU target config file '/no/such.txtpb' in target"),
])
def test_bad_targets_list_the_valid_ones(text, message):
    with pytest.raises(targets.TargetError, match="^" + message.replace("?", r"\?")
                       .replace("(", r"\(").replace(")", r"\)")):
        targets.parse_target(text)


def test_missing_libtpu_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    targets._topology_devices.cache_clear()
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[tpu\]'"):
        targets.devices("tpu:v5e:7x7")
    targets._topology_devices.cache_clear()


@pytest.mark.skipif(HAS_CUDA_PLUGIN, reason="the CUDA plugin is installed")
def test_missing_cuda_plugin_says_what_to_install():
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[cuda\]'"):
        targets.devices("gpu:h100")


# -- TPU, ahead of time -----------------------------------------------------------

@needs_libtpu
def test_libtpu_rejects_a_topology_with_the_valid_form():
    with pytest.raises(targets.TargetError, match=r"libtpu rejects TPU topology 'v5e:3x3': "
                       r".*not divisible.*valid: <generation>:<shape>"):
        targets.devices("tpu:v5e:3x3")


@needs_libtpu
def test_mesh_larger_than_the_topology_names_both_numbers():
    assert len(targets.devices("tpu:v5e:2x2")) == 4
    with pytest.raises(targets.TargetError,
                       match="mesh data:8 needs 8 devices; target tpu:v5e:2x2 has 4"):
        targets.make_mesh("tpu:v5e:2x2", {"data": 8})


@needs_libtpu
def test_no_libtpu_warnings_at_jax_start_or_aot_compile():
    """A fresh process without the TPU variables set: importing remat_kit sets them, so
    neither JAX's start (which tries the TPU backend) nor the topology prints a word."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPU_", "ALLOW_MULTIPLE_LIBTPU", "JAX_PLATFORMS"))}
    code = ("import remat_kit, jax; from remat_kit.measure import targets; "
            "print(jax.devices()[0].platform); "
            "print(len(targets.devices('tpu:v5e:2x2')))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "4"]
    assert done.stderr == ""


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """One CLI run: tiny on CPU and TPU v5e side by side, JSON and plots."""
    tmp = tmp_path_factory.mktemp("targets")
    argv = ["compare", "--config", "tiny", "--batch", str(B), "--seq", str(S), "--policies",
            POLICIES, "--target", "cpu,tpu:v5e:1x1", "--json", str(tmp / "c.json"),
            "--plot", str(tmp / "p.png")]
    if not HAS_LIBTPU:
        pytest.skip("libtpu is not installed")
    code = cli.main(argv)
    assert code == 0
    doc = json.loads((tmp / "c.json").read_text())
    by = {}
    for r in doc["records"]:
        by.setdefault(r["target"], {})[r["policy"]] = r
    return doc, by, tmp


def test_tpu_saves_the_same_tags_and_needs_other_temp_bytes(side_by_side):
    _, by, _ = side_by_side
    cpu, tpu = by["cpu"], by["tpu:v5e:1x1"]
    assert set(cpu) == set(tpu) and len(cpu) == 3
    for policy in cpu:
        # What is saved is decided before any compiler runs: the same tags, the same bytes.
        assert tpu[policy]["residual_bytes_by_tag"] == cpu[policy]["residual_bytes_by_tag"]
        assert tpu[policy]["temp_size_in_bytes"] != cpu[policy]["temp_size_in_bytes"]
        assert tpu[policy]["error"] is None
        # Both compilers count the same 51 matmuls. The TPU cost model counts elementwise
        # ops its own way (3.4x the transcendentals: divides become reciprocals), which on
        # tiny (d_model 64, where elementwise work weighs most) adds 1.3% to 2.1%.
        assert tpu[policy]["flops"] == pytest.approx(cpu[policy]["flops"], rel=0.025)
    minimal = str(parse("minimal"))
    assert set(tpu["none"]["residual_bytes_by_tag"]) != set(tpu[minimal]["residual_bytes_by_tag"])
    assert tpu[minimal]["flops_ratio_to_none"] == pytest.approx(
        cpu[minimal]["flops_ratio_to_none"], rel=0.01)


def test_records_say_what_they_measured(side_by_side):
    doc, by, tmp = side_by_side
    tpu = by["tpu:v5e:1x1"]["none"]
    assert tpu["platform"] == "XLA TPU compile (v5e:1x1, AOT)"
    assert tpu["jax_version"] == jax.__version__
    assert tpu["compiler_version"] == f"libtpu {importlib.metadata.version('libtpu')}"
    assert by["cpu"]["none"]["compiler_version"] == f"jaxlib {jax.__version__}"
    assert tpu["compile_seconds"] > 0
    assert [t["target"] for t in doc["context"]["targets"]] == ["cpu", "tpu:v5e:1x1"]
    assert doc["context"]["target"] == "cpu"
    # One Pareto plot per target.
    assert (tmp / "p_cpu.png").stat().st_size > 0
    assert (tmp / "p_tpu_v5e_1x1.png").stat().st_size > 0
    rows = [r for r in doc["records"] if r["target"] == "tpu:v5e:1x1"]
    assert report.compiled_by(rows) == (f"XLA TPU compile (v5e:1x1, AOT); jax {jax.__version__}, "
                                        f"libtpu {importlib.metadata.version('libtpu')}")
    path = tmp / "t.csv"
    report.write_csv(path, rows)
    with open(path) as f:
        first = next(csv.DictReader(f))
    assert first["target"] == "tpu:v5e:1x1" and first["compiler_version"].startswith("libtpu")


def test_tpu_rows_rank_by_the_peak(side_by_side):
    """On tiny the TPU's temp figure ranks full and minimal above no remat; its peak,
    which the rows, ratios and Pareto front follow, ranks them below."""
    doc, by, _ = side_by_side
    tpu_rows = [r for r in doc["records"] if r["target"] == "tpu:v5e:1x1"]
    tpu, minimal = by["tpu:v5e:1x1"], str(parse("minimal"))
    assert [r["policy"] for r in tpu_rows] == ["full", minimal, "none"]
    assert [r["memory_kind"] for r in tpu_rows] == [PEAK] * 3
    assert [r["memory_bytes"] for r in tpu_rows] == [r["peak_memory_in_bytes"] for r in tpu_rows]
    assert tpu["full"]["temp_size_in_bytes"] > tpu["none"]["temp_size_in_bytes"]
    for policy in ("full", minimal):
        assert tpu[policy]["memory_ratio_to_none"] == (tpu[policy]["peak_memory_in_bytes"]
                                                       / tpu["none"]["peak_memory_in_bytes"]) < 1
    # CPU rows are still ranked by temp.
    cpu = by["cpu"]
    assert all(r["memory_kind"] == TEMP for r in cpu.values())
    assert cpu["full"]["memory_ratio_to_none"] == cpu["full"]["temp_ratio_to_none"] < 1


@needs_libtpu
def test_planner_budgets_the_peak_on_tpu(tmp_path):
    """A budget no remat's temp fits but its peak does not: the planner must remat, within
    the peak; a plan cached for another figure is never returned."""
    cache = tmp_path / "plans.json"
    planner = config_planner(get_config("tiny"), B, S, target="tpu:v5e:1x1", cache=str(cache),
                             groups=1, offload=False)
    none, full = planner.measure(rk.parse("none")), planner.measure(rk.parse("full"))
    assert planner.memory_kind == PEAK
    budget = (none.peak_memory_in_bytes + full.peak_memory_in_bytes) // 2
    assert none.temp_size_in_bytes < full.peak_memory_in_bytes < budget < none.peak_memory_in_bytes
    p = planner.plan(budget)
    assert p.spec != "none" and p.memory_kind == PEAK
    assert p.measured_bytes == planner.records[p.spec].peak_memory_in_bytes <= budget
    assert (p.minimum_bytes, p.none_bytes) == planner.minimum()
    assert p.none_bytes == none.peak_memory_in_bytes
    assert p.minimum_bytes <= full.peak_memory_in_bytes
    assert p.measured_flops < full.flops  # it saves something, within the budget
    # Fractions are of no remat's peak: all of it holds no remat.
    whole = planner.plan(1.0)
    assert (whole.spec, whole.budget_bytes) == ("none", none.peak_memory_in_bytes)
    # The cache key names the figure: plant a "none" plan under this budget's key as it
    # would be for temp, and as keys were before; the planner plans again.
    entries = json.loads(cache.read_text())
    (key,) = [k for k in entries if f"|{parse_budget(budget)}|" in k]
    assert f"|{PEAK}|" in key
    stale = entries[key] | {"spec": "none", "policy": "none", "memory_kind": TEMP}
    cache.write_text(json.dumps({key.replace(PEAK, TEMP): stale,
                                 key.replace(f"|{PEAK}", ""): stale}))
    again = planner.plan(budget)
    assert not again.cached and again.spec == p.spec


@needs_libtpu
def test_slice_gives_per_device_figures(side_by_side):
    """On v5e:2x2 the batch splits over 4 chips: per-chip residuals are a quarter of one
    chip's, and so (within 2%) are the FLOPs."""
    _, by, _ = side_by_side
    one = by["tpu:v5e:1x1"][str(parse("minimal"))]
    records = configs.measure_config(get_config("tiny"), B, S, ["minimal"],
                                     target="tpu:v5e:2x2", per_layer=False)
    (four,) = records
    assert four.error is None and four.target == "tpu:v5e:2x2"
    assert four.residual_bytes_by_tag == {k: v // 4
                                          for k, v in one["residual_bytes_by_tag"].items()}
    assert four.flops == pytest.approx(one["flops"] / 4, rel=0.02)


@needs_libtpu
def test_a_failed_aot_compile_is_a_row_with_the_compilers_message():
    def loss(x):  # a 8 GiB argument and its 8 GiB gradient: more than a v5e's 16 GiB HBM
        return jnp.sum(jnp.tanh(x) * jnp.sin(x))

    x = jax.ShapeDtypeStruct((1 << 17, 1 << 14), jnp.float32)
    records = answers.measure(loss, x, policies=["none", "full"],
                              target=targets.parse_target("tpu:v5e:1x1"))
    assert len(records) == 2
    for r in records:
        assert r.error.startswith("JaxRuntimeError: RESOURCE_EXHAUSTED")
        assert "Ran out of memory on HBM" in r.error and r.temp_size_in_bytes is None


@needs_libtpu
def test_rk_measure_parses_its_target_once_and_derives_what_it_carries_once(monkeypatch):
    """The walk of rk.measure with a target as text parses it once (decide/resolve);
    lowering, the figure cache and the time model read the Target's devices, versions
    and roofline, each worked out once for all the programs."""
    import remat_kit as rk

    calls = {}

    def counted(name):
        real = getattr(targets, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(targets, name, wrapper)

    for name in ("parse_target", "_devices_of", "_versions_of", "of_chip"):
        counted(name)

    def loss(w, x):
        return jnp.sum(jnp.tanh(jax.ad_checkpoint.checkpoint_name(x @ w, "mlpwi")) ** 2)

    w, x = jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)
    records = rk.measure(loss, w, x, policies=["none", "full", "save:mlpwi"],
                         target="tpu:v5e:1x1")
    assert [r.error for r in records] == [None] * len(records) and len(records) >= 2
    assert {r.target for r in records} == {"tpu:v5e:1x1"}
    assert calls == {"parse_target": 1, "_devices_of": 1, "_versions_of": 1, "of_chip": 1}


@needs_libtpu
def test_explain_compiles_one_layer_for_the_target():
    cfg = get_config("tiny")
    tpu = layer_residuals(cfg, 2, S, "minimal", target="tpu:v5e:1x1").compiled
    cpu = layer_residuals(cfg, 2, S, "minimal", target="cpu").compiled
    assert tpu.target == targets.Target("tpu", "v5e:1x1") and tpu.seconds > 0
    assert set(tpu.memory) >= {"temp_size_in_bytes", "argument_size_in_bytes"}
    assert tpu.memory["argument_size_in_bytes"] > 0
    assert tpu.flops == pytest.approx(cpu.flops, rel=0.02)


@needs_libtpu
def test_scanned_layers_count_every_trip_on_tpu():
    """The TPU compiler drops the while loop's known_trip_count; the loop's condition
    (i < 4, i from 0 by 1) still gives it, so TPU FLOPs count all 4 trips, as
    the TPU compile of the same layers unrolled does, with no note."""
    def loss(w, x, scanned=True):
        if scanned:
            x, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=4)
        else:
            for _ in range(4):
                x = jnp.tanh(x @ w)
        return jnp.sum(x)

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    # Both gradients: a scan computes the carry's cotangent, which unrolled layers
    # would drop for x alone.
    scanned = lowering.compile_for(jax.value_and_grad(loss, (0, 1)), w, x, target="tpu:v5e:1x1")
    unrolled = lowering.compile_for(jax.value_and_grad(lambda w, x: loss(w, x, False), (0, 1)),
                                    w, x, target="tpu:v5e:1x1")
    matmuls = 4 * 3 * 2 * 8 * 64 * 64  # 4 trips of a matmul and its two grads
    # XLA's own count of the scanned program gives the body once: 211,973 FLOPs. The
    # loop's own work (slicing and stacking per trip) adds 3% on these small layers.
    assert matmuls <= scanned.flops == pytest.approx(unrolled.flops, rel=0.05)
    assert scanned.notes == ()


# -- the command ------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--target", "xpu"], "unknown target 'xpu'"),
    (["--target", "cpu,"], "--target needs comma-separated targets"),
    (["--target", "tpu:v5e:1x1", "--time", "2"], "--time runs steps"),
    (["--target", "tpu:v5e:2x2", "--mesh", "data:8"],
     "mesh data:8 needs 8 devices; target tpu:v5e:2x2 has 4"),
    (["--target", "tpu:v5e:2x2", "--batch", "2"],
     "target tpu:v5e:2x2 (data:4): batch 2 does not split over the 4 data-parallel devices"),
])
def test_bad_targets_are_one_line_and_exit_2(capsys, argv, message):
    if any(a.startswith("tpu:") for a in argv) and not HAS_LIBTPU:
        pytest.skip("libtpu is not installed")
    code, out, err = run(capsys, "compare", "--config", "tiny", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert out == ""


def test_gpu_descriptions_are_read_without_the_plugin():
    assert targets.gpu_description("gpu:h200") == {
        "device_description_str": "NVIDIA H200", "core_count": 132, "clock_rate_ghz": 1.98,
        "memory_bandwidth": 4_800_000_000_000, "l2_cache_size": 50 * 2**20,
        "device_memory_size": 143220 * 2**20}
    h100 = targets.gpu_description("gpu:h100:8")
    assert (h100["device_description_str"], h100["device_memory_size"]) == (
        "NVIDIA H100 80GB HBM3", 84_942_979_072)
    with pytest.raises(targets.TargetError, match="^target 'cpu' has no GPU description"):
        targets.gpu_description("cpu")


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="the CUDA plugin is not installed "
                    "(pip install 'remat-kit[cuda]', about 200 MB)")
@pytest.mark.parametrize("gpu, kind", [("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")])
def test_gpu_targets_compile_without_a_gpu(gpu, kind):
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    assert targets.devices(f"gpu:{gpu}")[0].device_kind == kind
    compiled = lowering.compile_for(jax.value_and_grad(loss), w, x, target=f"gpu:{gpu}")
    assert compiled.memory["argument_size_in_bytes"] == 2 * (256 * 256 + 64 * 256)
    assert compiled.flops is not None and any("XLA CPU compile" in n for n in compiled.notes)
    uncounted = lowering.compile_for(jax.value_and_grad(loss), w, x, target=f"gpu:{gpu}",
                                    count_flops=False)
    assert (uncounted.flops, uncounted.notes) == (None, ())


@needs_libtpu
def test_plan_verifies_on_the_target(capsys):
    # The planner compiles none and full for the TPU and budgets against their figures.
    code, out, err = run(capsys, "plan", "--config", "tiny", "--batch", "2", "--seq", "16",
                         "--budgets", "1.0", "--no-presets", "--cache", "",
                         "--target", "tpu:v5e:1x1")
    assert code == 0, err
    assert "XLA TPU compile (v5e:1x1, AOT)" in out
    assert "compiled none" in err and "compiled full" in err
    assert "memory: compiled peak_memory_in_bytes" in out  # budgets are of the peak


@needs_libtpu
def test_a_one_chip_mesh_measures_as_no_mesh_staging_each_policy_once(monkeypatch):
    # A one-chip target's data:1 mesh: the program is the per-device program.
    staged = []
    real = measure.stage
    monkeypatch.setattr(measure, "stage", lambda *a: staged.append(1) or real(*a))
    cfg, tpu = get_config("tiny", num_layers=1), targets.parse_target("tpu:v5e:1x1")
    alone = configs.measure_config(cfg, 2, 16, ["none", "full"], target=tpu, per_layer=False)
    assert len(staged) == 2
    on_mesh = configs.measure_config(cfg, 2, 16, ["none", "full"], target=tpu, per_layer=False,
                                     mesh=targets.make_mesh(tpu, {"data": 1}))
    assert len(staged) == 4  # once per policy, not again for a per-device program
    strip = lambda rs: [dataclasses.replace(r, compile_seconds=None) for r in rs]  # noqa: E731
    assert strip(on_mesh) == strip(alone)
    assert all(r.error is None and r.peak_memory_in_bytes for r in on_mesh)
