"""The caches: what is read back is checked, and what keys an entry is
all that changes it. Each test failed on the tree before the fix.

Item 1: the plan cache ignored $XLA_FLAGS. Item 2: the CPU roofline was measured
anew on every call where its file could not be written. Items 6 and 13: a
damaged figure, roofline or plan entry was shown as it was. Item 8:
REMAT_KIT_COMPILE_CACHE=/dev/null made /dev/null-figures. Small: a failed
store left its temporary file for good.
"""

import errno
import json
import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.decide.plan import Planner
from remat_kit.measure import chip_peaks, figure_cache, sealed
from test_compile_cache import empty_cache  # noqa: F401 - a fixture

W = jax.ShapeDtypeStruct((32, 32), jnp.float32)
X = jax.ShapeDtypeStruct((8, 32), jnp.float32)


def loss(w, x):
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.tanh(h @ w) ** 2)


def test_plan_cache_key_holds_the_compiler_flags(tmp_path, monkeypatch):
    cache = str(tmp_path / "plans.json")
    first = Planner(loss, W, X, cache=cache).plan(1.0)
    assert not first.cached and Planner(loss, W, X, cache=cache).plan(1.0).cached
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_disable_hlo_passes=fusion")
    again = Planner(loss, W, X, cache=cache)
    assert not again.plan(1.0).cached  # planned anew under the other flags
    assert len(json.loads(pathlib.Path(cache).read_text())) == 2


def test_a_roofline_that_cannot_be_kept_is_measured_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(blocker / "remat_kit" / "cpu_roofline.json")  # a folder under a file
    with pytest.warns(UserWarning, match="cannot be kept at .* measured once for this run"):
        first = chip_peaks.calibrate_cpu(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not at every call
        assert chip_peaks.calibrate_cpu(path) is first


@pytest.mark.parametrize("damage", ["negative", "nan", "string", "missing", "unsealed"])
def test_a_damaged_roofline_is_measured_again_and_rewritten(tmp_path, damage):
    path = tmp_path / "cpu_roofline.json"
    good = {"version": 3, "f32_flops": 1e11, "bandwidth": 1e10, "source": "test"}
    bad = {"negative": {**good, "f32_flops": -1e11}, "nan": {**good, "bandwidth": float("nan")},
           "string": {**good, "bandwidth": "fast"},
           "missing": {k: v for k, v in good.items() if k != "bandwidth"}}.get(damage, good)
    path.write_text(json.dumps(good if damage == "unsealed" else sealed.seal(bad)))
    line = chip_peaks.calibrate_cpu(str(path))
    assert line.f32_flops > 0 and line.bandwidth > 0 and line.source != "test"
    kept = sealed.unseal(json.loads(path.read_text()), chip_peaks._KEPT)
    assert kept["f32_flops"] == line.f32_flops and kept["bandwidth"] == line.bandwidth


def _flip_temp(entry):  # a changed digit, the checksum left as it was
    entry["entry"]["memory"]["temp_size_in_bytes"] += 90_000


DAMAGES = {
    "flipped digit": _flip_temp,
    "negative temp": lambda e: e.update(sealed.seal({**e["entry"], "memory": {
        **e["entry"]["memory"], "temp_size_in_bytes": -5}})),
    "deleted field": lambda e: e.update(sealed.seal(
        {k: v for k, v in e["entry"].items() if k != "flops"})),
    "string notes": lambda e: e.update(sealed.seal({**e["entry"], "cost_notes": "abc"})),
    "memory null": lambda e: e.update(sealed.seal({**e["entry"], "memory": None})),
    "empty object": lambda e: (e.clear()),
    # As an older version wrote it: read back, the row would lack its audit, or the bytes its
    # sharding claim is checked against.
    "no audit facts": lambda e: e.update(sealed.seal(
        {k: v for k, v in e["entry"].items() if k != "compiled_audit"})),
    "no parameter bytes": lambda e: e.update(sealed.seal(
        {k: v for k, v in e["entry"].items() if k != "parameter_bytes"})),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_figure_entry_is_a_miss_and_is_rewritten(empty_cache, damage):  # noqa: F811
    [fresh] = rk.measure(loss, W, X, policies=["none"])
    [path] = pathlib.Path(figure_cache.folder()).glob("*.json")
    entry = json.loads(path.read_text())
    DAMAGES[damage](entry)
    path.write_text(json.dumps(entry))
    [again] = rk.measure(loss, W, X, policies=["none"])
    assert (again.temp_size_in_bytes, again.flops, again.notes, again.audit,
            again.parameter_bytes_per_device) == (
        fresh.temp_size_in_bytes, fresh.flops, fresh.notes, fresh.audit,
        fresh.parameter_bytes_per_device)
    assert fresh.parameter_bytes_per_device > 0
    assert not any("figure cache" in line for line in again.audit["unchecked"])
    assert sealed.unseal(json.loads(path.read_text()), figure_cache.MEASURED) is not None


@pytest.mark.parametrize("text", ["[]", "1", '"a"'])
def test_a_figure_entry_of_another_shape_is_a_miss(empty_cache, text):  # noqa: F811
    figure_cache.store("k", {"i": 1})
    pathlib.Path(figure_cache.folder(), "k.json").write_text(text)
    assert figure_cache.load("k") is None


def test_a_damaged_plan_is_planned_again_and_overwritten(tmp_path):
    cache = tmp_path / "plans.json"
    first = Planner(loss, W, X, cache=str(cache)).plan(1.0)
    [(key, entry)] = json.loads(cache.read_text()).items()
    entry["entry"]["measured_bytes"] = -8128  # and the checksum left as it was
    cache.write_text(json.dumps({key: entry}))
    again = Planner(loss, W, X, cache=str(cache)).plan(1.0)
    assert not again.cached and again.measured_bytes == first.measured_bytes
    assert Planner(loss, W, X, cache=str(cache)).plan(1.0).cached


def test_a_compile_cache_that_is_not_a_folder_is_refused(tmp_path, monkeypatch, capsys):
    not_a_folder = tmp_path / "null"
    not_a_folder.write_text("")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("REMAT_KIT_COMPILE_CACHE", str(not_a_folder))
    before = jax.config.jax_compilation_cache_dir
    try:
        code = cli.main(["compare", "--config", "tiny", "--batch", "1", "--seq", "8",
                         "--policies", "none"])
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: REMAT_KIT_COMPILE_CACHE={str(not_a_folder)!r} is not a "
        "folder; give a folder for the compile cache, or an empty value for none"]
    assert not (tmp_path / "null-figures").exists()


def test_a_failed_store_leaves_no_temporary_file(empty_cache, monkeypatch):  # noqa: F811
    figure_cache.store("old", {"i": 0})
    folder = pathlib.Path(figure_cache.folder())
    stale = folder / "dead.json.123.tmp"  # left by a writer killed long ago
    stale.write_text("{")
    os.utime(stale, (0, 0))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(figure_cache.json, "dump", full)
    figure_cache.store("new", {"i": 1})
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["dead.json.123.tmp", "old.json"]
    figure_cache.store("new", {"i": 1})  # pruning removes what a dead writer left
    assert sorted(p.name for p in folder.iterdir()) == ["new.json", "old.json"]
