"""remat_kit.measure.peak: what holds a compiled program's peak, from XLA's own buffer assignment."""

import importlib.util

import pytest

from remat_kit.measure import peak
from remat_kit.measure.measure import measure
from remat_kit.models import get_config
from remat_kit.models.program import workload

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")
LOGITS = "logits and their gradient"


def _records(policies, target="cpu", scan=False, vocab=None, seq=64):
    cfg = get_config("tiny", scan_layers=scan)
    cfg = cfg.replace(vocab_size=vocab) if vocab else cfg
    return measure(workload(cfg, 8, seq), policies=policies, target=target, peak=True)


def _check_sums(record, figure, most_own):
    found = record.peak
    assert record.error is None and found["figure"] == figure and found["bytes"] == getattr(record, figure)
    # The parts are the compiler's figure split up: "compiler's own" is what no buffer
    # live at the peak explains (the heap's packing), small and never negative.
    assert sum(found["parts"].values()) == found["bytes"]
    own = found["parts"]["compiler's own"]
    assert 0 <= own <= most_own * found["bytes"], found


def test_cpu_parts_sum_to_temp_and_name_each_saved_tag():
    full, saved = _records(["full", "save_dot_except_mlp"], scan=True)
    for r in (full, saved):
        _check_sums(r, "temp_size_in_bytes", 0.10)
    # Every saved tag is found in the scanned stack's loop state, at exactly its bytes:
    # by its op's mark, or (the layers' inputs, which no op computes) by its shape.
    assert _tags(full) == full.residual_bytes_by_tag == {"decoder_layer_input": 262144}
    assert _tags(saved) == saved.residual_bytes_by_tag == {
        "decoder_layer_input": 262144, "query_proj": 262144, "key_proj": 262144,
        "value_proj": 262144, "out_proj": 262144}


def _tags(record):
    return {g[len("residual "):]: b for g, b in record.peak["parts"].items()
            if g.startswith("residual ")}


def test_peak_is_asked_for():
    [plain] = measure(workload(get_config("tiny"), 8, 16), policies=["full"], target="cpu")
    assert plain.peak is None and plain.to_dict()["peak"] is None


def test_logits_hold_a_vocab_dominated_peak():
    [full] = _records(["full"], vocab=8192)
    _check_sums(full, "temp_size_in_bytes", 0.05)
    parts = full.peak["parts"]
    logits = 8 * 64 * 8192 * 4  # f32 [batch, seq, vocab]
    assert next(iter(parts)) == LOGITS and parts[LOGITS] >= logits
    assert peak.summary(full.peak).startswith(f"{full.temp_size_in_bytes / 2**20:.2f} MiB: "
                                              f"{LOGITS} ")


@needs_libtpu
def test_tpu_parts_sum_to_the_compilers_peak():
    [full] = _records(["full"], target="tpu:v5e:1x1", vocab=32768, seq=128)
    _check_sums(full, "peak_memory_in_bytes", 0.05)
    parts = full.peak["parts"]
    assert parts["program code"] == full.to_dict()["peak"]["parts"]["program code"] > 0
    assert next(iter(parts)) == LOGITS and parts[LOGITS] >= 8 * 128 * 32768 * 4


def test_compare_peak_writes_the_breakdown_and_a_line(tmp_path, capsys):
    from remat_kit.cli import main
    path = tmp_path / "c.json"
    assert main(["compare", "--config", "tiny", "--batch", "8", "--seq", "16",
                 "--policies", "full", "--peak", "--json", str(path)]) == 0
    [row] = __import__("json").loads(path.read_text())["records"]
    assert sum(row["peak"]["parts"].values()) == row["peak"]["bytes"] == row["memory_bytes"]
    assert f"temp of full: {peak.summary(row['peak'])}" in capsys.readouterr().out


def test_plan_below_the_minimum_says_what_holds_it(capsys):
    from remat_kit.cli import main
    assert main(["plan", "--config", "tiny", "--batch", "8", "--seq", "16", "--budgets",
                 "0.01", "--no-presets", "--cache", ""]) == 1
    out = capsys.readouterr().out
    assert "below the minimum: full remat's temp " in out, out
