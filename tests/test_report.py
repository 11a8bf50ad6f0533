"""Which memory figure compare ranks by: temp on CPU, the compiler's peak on TPU/GPU.

Records are built by hand from figures measured on tiny (batch 8, seq 16, f32) with
`measure_config(..., target=...)`, so nothing compiles here; tests/test_targets.py
checks the same on real TPU compiles.
"""

import csv

import pytest

from remat_kit.ui import report
from remat_kit.measure import targets
from remat_kit.measure.record import PEAK, TEMP, Record, memory_kind

# (policy, temp_size_in_bytes, peak_memory_in_bytes, flops): XLA:TPU v5e, AOT. temp says
# full and minimal cost more than no remat; the peak says they cost less.
TPU = [("none", 1_245_184, 4_531_200, 96.6e6), ("full", 1_392_640, 3_295_744, 115.0e6),
       ("minimal", 1_359_872, 3_713_024, 97.8e6)]


def record(policy, temp, peak, flops, target="tpu:v5e:1x1"):
    return Record(policy, (policy,), targets.parse_target(target).label, target,
                  temp_size_in_bytes=temp, peak_memory_in_bytes=peak, flops=flops)


def headers(table):
    return [c.header for c in table.columns]


def test_memory_kind_per_platform():
    assert memory_kind("cpu") == TEMP == "temp_size_in_bytes"
    assert memory_kind("tpu") == memory_kind("gpu") == PEAK == "peak_memory_in_bytes"
    tpu = record("none", 10, 40, 1.0)
    assert (tpu.memory_kind, tpu.memory_bytes) == (PEAK, 40)
    cpu = record("none", 10, 3, 1.0, target="cpu")
    assert (cpu.memory_kind, cpu.memory_bytes) == (TEMP, 10)
    # No peak from the compiler, or no target named: temp, as before.
    assert record("none", 10, None, 1.0).memory_bytes == 10
    unnamed = Record("p", ("p",), "x", temp_size_in_bytes=10, peak_memory_in_bytes=40)
    assert unnamed.memory_bytes == 10
    failed = record("none", None, None, None)
    assert failed.memory_bytes is None
    assert tpu.to_dict()["memory_kind"] == PEAK and tpu.to_dict()["memory_bytes"] == 40


def test_tpu_rows_rank_by_the_peak(tmp_path):
    rows = report.rows([record(*r) for r in TPU])
    assert [d["policy"] for d in rows] == ["full", "minimal", "none"]  # by temp: none first
    peak = {p: pk for p, _, pk, _ in TPU}
    for d in rows:
        assert d["memory_kind"] == PEAK and d["memory_bytes"] == peak[d["policy"]]
        assert d["memory_ratio_to_none"] == peak[d["policy"]] / peak["none"]
    full = rows[0]
    assert full["memory_ratio_to_none"] == pytest.approx(0.7273, abs=1e-4)
    assert full["temp_ratio_to_none"] == pytest.approx(1.1184, abs=1e-4)  # kept, not ranked by
    # Each row is cheaper in peak memory or in FLOPs than every other: all Pareto-optimal.
    assert [d["pareto"] for d in rows] == [True, True, True]
    t = report.table(rows)  # the default: temp only with --wide
    assert headers(t) == ["", "policy", "peak", "peak x none", "FLOPs x none"]
    t = report.table(rows, wide=True)
    assert headers(t)[2:4] == ["peak", "peak x none"] and "temp" in headers(t)
    assert "peak_memory_in_bytes" in t.caption
    side = report.side_by_side([("tpu:v5e:1x1", rows)], wide=True)
    assert headers(side)[1:4] == ["peak\ntpu:v5e:1x1", "peak x none", "temp"]
    assert headers(report.side_by_side([("tpu:v5e:1x1", rows)]))[1:] == [
        "peak\ntpu:v5e:1x1", "peak\nx none", "FLOPs\nx none", "pred.\nx none"]
    path = tmp_path / "rows.csv"
    report.write_csv(path, rows)
    with open(path) as f:
        first = next(csv.DictReader(f))
    assert (first["policy"], first["memory_kind"]) == ("full", PEAK)
    assert float(first["memory_ratio_to_none"]) == full["memory_ratio_to_none"]


def test_cpu_rows_still_rank_by_temp():
    # XLA CPU, same shapes: the peak is about arguments + outputs, alike for every policy.
    cpu = [record("none", 3_000_000, 1_300_000, 95.0e6, "cpu"),
           record("full", 900_000, 1_300_000, 114.0e6, "cpu")]
    rows = report.rows(cpu)
    assert [d["policy"] for d in rows] == ["full", "none"]
    assert all(d["memory_kind"] == TEMP for d in rows)
    assert rows[0]["memory_ratio_to_none"] == rows[0]["temp_ratio_to_none"] == 0.3
    t = report.table(rows)
    assert headers(t)[2:4] == ["temp", "temp x none"] and "peak" not in headers(t)
    side = report.side_by_side([("cpu", rows), ("tpu:v5e:1x1", report.rows(
        [record(*r) for r in TPU]))])
    assert headers(side)[1:3] == ["temp\ncpu", "temp\nx none"]
    assert "peak\ntpu:v5e:1x1" in headers(side)


def test_ratio_needs_one_figure():
    """A row whose compiler gave no peak is not divided by none's peak."""
    rows = report.rows([record("none", 10, 40, 1.0), record("full", 5, None, 2.0)])
    full = next(d for d in rows if d["policy"] == "full")
    assert full["memory_kind"] == TEMP and full["memory_ratio_to_none"] is None
    assert report.memory_kind_of(rows) == PEAK
