"""benchmarks/gpu_truth.py: its CPU smoke mode, its no-GPU refusal and its shipped predictions."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from remat_kit.measure import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_truth.py")
_spec = importlib.util.spec_from_file_location("gpu_truth", SCRIPT)
gpu_truth = sys.modules["gpu_truth"] = importlib.util.module_from_spec(_spec)  # dataclasses
_spec.loader.exec_module(gpu_truth)
SHIPPED = gpu_truth._read(gpu_truth.PREDICTIONS)


def run_script(*argv, out=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_CLIENT_MEM")}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_truth")
    done = run_script("--smoke", "--configs", "tiny", "--policies", "none,auto", "--steps", "2",
                      "--warmup", "1", out=out)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out / "gpu_truth.json") as f:
        report = json.load(f)
    return report, (out / "gpu_truth.md").read_text(), done.stdout


def test_smoke_rows_have_the_measured_and_predicted_figures(smoke):
    report, _, _ = smoke
    none, auto = report["rows"]
    shipped = SHIPPED["configs"]["tiny"]["policies"]
    assert (none["policy"], auto["policy"]) == ("none", "auto:budget=0.8")
    # The auto row runs the plan made deviceless for the H200, not a new one.
    assert auto["resolved"] == shipped["auto:budget=0.8"]["resolved"] != "none"
    assert "planned_on" not in auto
    for row in (none, auto):
        assert row["config"] == "tiny" and row["platform"] == "cpu" and "error" not in row
        assert row["step_time"]["steps"] == len(row["step_time"]["times_s"]) == 2
        t = row["step_time"]
        assert t["min_s"] <= t["q1_s"] <= t["median_s"] <= t["q3_s"] <= t["max_s"]
        # the same batch each step: training lowers its loss, from about log(256)
        assert math.log(256) < row["losses"][0] < 2 * math.log(256)
        assert row["losses"][1] < row["losses"][0]
        assert row["deviceless"]["total_bytes"] == shipped[row["policy"]]["total_bytes"]
        compiled = row["device_compile"]
        assert compiled["source"] == "argument + temp + output - alias"  # the CPU's figure
        assert compiled["total_bytes"] == (compiled["argument_size_in_bytes"]
                                           + compiled["temp_size_in_bytes"]
                                           + compiled["output_size_in_bytes"]
                                           - compiled["alias_size_in_bytes"])
        assert row["measured_peak_bytes"] is None  # the CPU client keeps no memory_stats
        assert row["mfu"] is None and row["hfu"] is None  # no peak FLOP/s for a CPU
    # Remat changes what is stored, not the values: the same losses.
    assert auto["losses"] == pytest.approx(none["losses"], rel=1e-5)
    assert none["ratio_to_none"] == 1.0 and none["flop_ratio_to_none"] == 1.0
    assert auto["ratio_to_none"] == auto["step_time"]["median_s"] / none["step_time"]["median_s"]
    assert auto["flop_ratio_to_none"] == (shipped["auto:budget=0.8"]["flops"]
                                          / shipped["none"]["flops"]) > 1.0
    # The time model of the program that ran, and of the deviceless one shipped.
    assert none["predicted_ratio_to_none"] == none["deviceless_ratio_to_none"] == 1.0
    assert none["predicted_seconds"] == none["device_compile"]["time_model_seconds"] > 0


def test_smoke_records_the_measurement_environment(smoke):
    report, _, _ = smoke
    env = report["environment"]
    assert (env["XLA_PYTHON_CLIENT_ALLOCATOR"], env["XLA_PYTHON_CLIENT_PREALLOCATE"],
            env["XLA_CLIENT_MEM_FRACTION"]) == ("bfc", "true", "0.95")
    assert report["versions"]["compiler"].startswith("jaxlib ")
    assert report["predictions"]["target"] == "gpu:h200"
    assert report["peak_flops"] is None and report["smoke"] is True
    assert len(report["differences"]) == 4


def test_smoke_prints_and_writes_the_table(smoke):
    _, table, stdout = smoke
    assert table.startswith("| config | policy | measured peak | device compile | deviceless H200 |")
    assert "| tiny | auto:budget=0.8 → `" in table
    assert "Where a prediction can differ from the measured peak:" in table
    assert "Time model: remat_kit's (a roofline per compiled op" in table
    assert table in stdout


@pytest.mark.skipif(gpu_truth.has_gpu(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    # In this process: the script's exit code is main's (the smoke fixture runs it whole).
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_truth.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("gpu_truth: no GPU is present")
    assert "PYTHONPATH=. python benchmarks/gpu_truth.py --smoke" in err
    assert not os.listdir(tmp_path)


def test_shipped_predictions_are_for_the_runs_and_the_h200_description():
    assert SHIPPED["target"] == "gpu:h200"
    assert SHIPPED["description"] == targets.gpu_description("gpu:h200")
    for name, run in gpu_truth.ALL_RUNS.items():
        entry = SHIPPED["configs"][name]
        assert gpu_truth._matches(entry, run), f"{name}: rerun --predict"
        specs = {s for p in gpu_truth.POLICIES for s in gpu_truth._specs(p, run, True)}
        assert set(entry["policies"]) == specs
        for spec in specs:
            p = entry["policies"][spec]
            assert "error" not in p, (name, spec, p.get("error"))
            assert p["source"] == "peak_memory_in_bytes" and p["flops"] > 0
            assert p["time_model_seconds"] > 0
        by = entry["policies"]
        for auto in getattr(run, "autos", ()):
            assert by["full"]["total_bytes"] <= by[auto]["total_bytes"] < by["none"][
                "total_bytes"]


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert gpu_truth.main(["--smoke", "--configs", "tiny,gpt2_medium"]) == 2
    assert capsys.readouterr() == ("", "gpu_truth: unknown config 'gpt2_medium'; valid: tiny, "
                                       "hf_llama_tiny\n")


# ---------------------------------------------------------------------------
# The H200 run (benchmarks/gpu_truth_h200/: what the device measured, and each
# program it compiled as optimized HLO), against remat_kit's predictions
# ---------------------------------------------------------------------------

MEASURED = os.path.join(ROOT, "benchmarks", "gpu_truth_h200")


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    """The rows the H200 measured, each with the time model of its own program."""
    out = tmp_path_factory.mktemp("h200")
    assert gpu_truth.report_again(MEASURED, str(out), gpu_truth.PREDICTIONS) == 0
    with open(out / "gpu_truth.json") as f:
        return json.load(f)


def _measured(report):
    return [r for r in report["rows"] if "step_time" in r]


def test_h200_peaks_are_predicted_within_10_percent(h200):
    """The device compile's peak and the deviceless one against peak_bytes_in_use."""
    rows = _measured(h200)
    assert len(rows) == 15 and {r["device"] for r in rows} == {"NVIDIA H200"}  # GPT-2 none: OOM
    for r in rows:
        measured = r["measured_peak_bytes"]
        for predicted in (r["device_compile"]["total_bytes"],
                          (r["deviceless"] or {}).get("total_bytes")):
            if predicted is not None:
                assert abs(predicted - measured) <= 0.10 * measured, (r["config"], r["policy"])


def test_h200_step_time_ratios_are_predicted_within_15_percent(h200):
    """The time model's step time of each policy over no remat's, of the programs the
    device ran, against the measured ratio."""
    checked = 0
    for r in _measured(h200):
        if r["ratio_to_none"] and r["policy"] != "none":
            assert r["predicted_ratio_to_none"] == pytest.approx(r["ratio_to_none"], rel=0.15), (
                r["config"], r["policy"])
            checked += 1
    assert checked == 6  # Llama 1B shapes: GPT-2 medium's none did not run


def test_h200_programs_count_the_cublas_products():
    """XLA:GPU runs most dots as cuBLAS custom calls: their FLOPs count, so the time
    model's FLOPs of the Llama step the H200 ran equal XLA's count of that step."""
    import tarfile

    from remat_kit.measure import time_model
    report = gpu_truth._read(os.path.join(MEASURED, "gpu_truth.json"))
    [row] = [r for r in report["results"]["llama_1b"] if r["policy"] == "full"]
    with tarfile.open(os.path.join(MEASURED, gpu_truth.HLO_TAR)) as tar:
        text = tar.extractfile(f"hlo/{row['hlo_file']}").read().decode()
    ops = time_model.compiled_ops(gpu_truth._HloText(text))
    flops = sum(op.trips * op.flops for op in ops)
    xla = SHIPPED["configs"]["llama_1b"]["policies"]["full"]["flops"]  # the CPU compile's count
    assert flops == pytest.approx(xla, rel=0.005)
    assert sum(op.opcode == "kCustomCall" for op in ops) == 27
