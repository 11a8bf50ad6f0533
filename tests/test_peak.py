"""remat_kit.measure.peak: what holds a compiled program's peak, from XLA's own buffer assignment."""

import importlib.util

import pytest

from remat_kit.measure import peak, targets
from remat_kit.api.answers import measure
from remat_kit.models import get_config
from remat_kit.models.program import workload

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")
LOGITS = "logits and their gradient"
CPU = targets.parse_target("cpu")


def _records(policies, target="cpu", scan=False, vocab=None, seq=64):
    cfg = get_config("tiny", scan_layers=scan)
    cfg = cfg.replace(vocab_size=vocab) if vocab else cfg
    return measure(workload(cfg, 8, seq), policies=policies, target=targets.parse_target(target),
                   peak=True)


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
    [plain] = measure(workload(get_config("tiny"), 8, 16), policies=["full"], target=CPU)
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
    # The logits are the largest part here, but 2 chunks (all that 256 / 128 allows) lower
    # nothing: the line names no chunk count.
    assert "logits and their gradient 512.00 KiB" in out and "--vocab-chunks" not in out


VOCAB_CONFIG = """import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.model = "tiny"
    config.vocab_size = 8192
    return config
"""


def test_vocab_chunks_for_picks_a_divisor_that_lowers_the_logits():
    def found(parts, vocab):
        return {"bytes": sum(parts.values()), "parts": parts, "logits_shape": [8, 1024, vocab]}
    # GPT-2's vocabulary, 50257 = 29 x 1733: 29 is the only count at most 50257 / 128.
    assert peak.vocab_chunks_for(found({LOGITS: 3 << 30, "parameters": 1 << 30}, 50257)) == 29
    # The smallest divisor leaving the logits at most an eighth of the rest: 32 >= 8 x 4.
    assert peak.vocab_chunks_for(found({LOGITS: 32, "parameters": 8}, 8192)) == 32
    assert peak.vocab_chunks_for(found({LOGITS: 32, "parameters": 1}, 8192)) == 64  # at most
    assert peak.vocab_chunks_for(found({"parameters": 9, LOGITS: 8}, 8192)) is None  # not top
    assert peak.vocab_chunks_for(found({LOGITS: 9, "parameters": 8}, 131)) is None  # a prime
    assert peak.vocab_chunks_for({**found({LOGITS: 9}, 8192), "logits_shape": None}) is None


def test_fit_below_the_minimum_breaks_down_the_step_and_names_the_chunks(tmp_path, capsys):
    """fit where no policy fits the smallest size, on a model whose vocabulary holds
    the most of the step: the step's breakdown (its parts summing to the step's
    memory, the optimizer state at its bytes) and --vocab-chunks 32 with the step
    memory it compiles to."""
    import json

    from remat_kit.cli import main
    from remat_kit.decide.floor import tree_bytes, train_state
    from remat_kit.decide.step import default_optimizer
    from remat_kit.api.configs import step_memory
    from remat_kit.units import fmt_bytes
    config, path = tmp_path / "vocab.py", tmp_path / "fit.json"
    config.write_text(VOCAB_CONFIG)
    assert main(["fit", "--config", str(config), "--budget", "8MiB", "--batch", "4",
                 "--multiple", "32", "--policies", "full", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    found = json.loads(path.read_text())
    [row] = found["rows"]
    assert row["size"] == 0 and row["probes"][0][0] == 32
    held = found["minimum_peak"]
    assert sum(held["parts"].values()) == held["bytes"] == row["probes"][0][1]
    cfg = get_config("tiny").replace(vocab_size=8192)
    _, opt_state, _ = train_state(workload(cfg, 4, 32), default_optimizer())
    assert held["parts"]["optimizer state"] == tree_bytes(opt_state)
    assert next(iter(held["parts"])) == LOGITS and held["parts"][LOGITS] >= 4 * 32 * 8192 * 4
    chunks = peak.vocab_chunks_for(held)
    assert chunks == 16  # the logits 8 MiB, the rest 7.6 MiB: 16 x 7.6 >= 8 x 8 > 8 x 7.6
    chunked = step_memory(cfg.replace(vocab_chunks=chunks), 4, 32, "full").total_bytes
    assert held["bytes"] - chunked > 0.5 * held["parts"][LOGITS]  # 15.59 -> 10.72 MiB
    assert found["below_minimum"] == (
        f"at seq 32, full remat's step memory {peak.summary(held)}; no layer policy lowers "
        f"the {LOGITS}; --vocab-chunks 16 (the loss over 16 vocabulary chunks) lowers them, "
        f"to {fmt_bytes(chunked)}")
    assert f"below the minimum: {found['below_minimum']}\n" in out


def test_fit_below_the_minimum_where_the_layers_hold_it_names_no_chunks():
    from remat_kit.api.configs import fit
    result = fit(get_config("tiny"), "3MiB", batch=8, multiple=64, policies=["full"])
    held = result.minimum_peak
    assert result.rows[0].size == 0 and sum(held["parts"].values()) == held["bytes"]
    assert next(iter(held["parts"])) == "recomputed values"
    assert result.below_minimum == f"at seq 64, full remat's step memory {peak.summary(held)}"


def test_plan_below_the_minimum_names_the_chunks_where_the_logits_hold_it(tmp_path, capsys):
    import json

    from remat_kit.cli import main
    from remat_kit.api.answers import measure
    from remat_kit.units import fmt_bytes
    config, path = tmp_path / "vocab.py", tmp_path / "plan.json"
    config.write_text(VOCAB_CONFIG)
    assert main(["plan", "--config", str(config), "--batch", "4", "--seq", "32", "--budgets",
                 "1KiB", "--no-presets", "--cache", "", "--json", str(path)]) == 1
    context = json.loads(path.read_text())["context"]
    held = context["minimum_peak"]
    assert held["bytes"] == context["minimum_bytes"] == sum(held["parts"].values())
    # The temp holds neither parameters nor optimizer state: the rest is small, 64 chunks.
    assert next(iter(held["parts"])) == LOGITS and peak.vocab_chunks_for(held) == 64
    cfg = get_config("tiny").replace(vocab_size=8192, vocab_chunks=64)
    [chunked] = measure(workload(cfg, 4, 32), policies=["full"], target=CPU)
    assert chunked.memory_bytes < 0.5 * held["bytes"]
    assert context["below_minimum"] == (
        f"full remat's temp {peak.summary(held)}; no layer policy lowers the {LOGITS}; "
        f"--vocab-chunks 64 (the loss over 64 vocabulary chunks) lowers them, to "
        f"{fmt_bytes(chunked.memory_bytes)}")
    assert f"below the minimum: {context['below_minimum']}\n" in capsys.readouterr().out


def test_logits_of_a_model_not_ours_are_found_where_the_loss_slices_them():
    """A model returning logits [batch, seq, vocab], whose next-token loss reads
    [batch, seq - 1, vocab] of them (`from_model.next_token_loss`): its own logits and
    their gradient are grouped as logits, not as backward temporaries."""
    import flax.linen as nn

    from remat_kit.flax.from_model import workload as model_workload

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(32)(nn.tanh(nn.Dense(32)(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(8192, 32)(tokens)
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(8192)(x)

    [full] = measure(model_workload(Model(), 8, 64), policies=["full"], target=CPU, peak=True)
    _check_sums(full, "temp_size_in_bytes", 0.05)
    parts = full.peak["parts"]
    assert full.peak["logits_shape"] == [8, 63, 8192]
    assert next(iter(parts)) == LOGITS and parts[LOGITS] >= 2 * 8 * 64 * 8192 * 4, parts


def test_plan_below_the_minimum_where_the_layers_hold_it_names_no_chunks(tmp_path, capsys):
    import json

    from remat_kit.cli import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--config", "tiny", "--batch", "8", "--seq", "64", "--budgets", "1KiB",
                 "--no-presets", "--cache", "", "--json", str(path)]) == 1
    context = json.loads(path.read_text())["context"]
    held = context["minimum_peak"]
    assert next(iter(held["parts"])) == "recomputed values"
    assert context["below_minimum"] == f"full remat's temp {peak.summary(held)}"
    assert f"below the minimum: {context['below_minimum']}\n" in capsys.readouterr().out


def test_the_attention_scores_are_named_where_they_hold_the_peak():
    """tiny_llama (einsum attention, 4 heads) at batch 2, seq 256 under full remat: the
    s x s scores recomputed for the backward pass are the most of the temp, named
    attn_probs (the softmax's output and its exp, [2, 4, 256, 256] f32 each), and the
    note says no remat policy removes them."""
    import io

    from rich.console import Console

    from remat_kit.ui.report import print_peaks
    [full] = measure(workload(get_config("tiny_llama"), 2, 256), policies=["full"],
                     target=CPU, peak=True)
    _check_sums(full, "temp_size_in_bytes", 0.10)
    found, scores = full.peak, 2 * 4 * 256 * 256 * 4
    recomputed = found["roles"]["recomputed values"]
    assert next(iter(recomputed)) == "attn_probs" and recomputed["attn_probs"] == 2 * scores
    # The logits are not live at the peak; the softmax's exp and output are, each named
    # attn_probs (the exp computes nothing else).
    assert "attn_logits" not in recomputed
    assert peak.summary(found).startswith(
        "9.13 MiB: recomputed values 6.38 MiB (attn_probs, mlpwi_0, mlpwi_1), ")
    note = ("the s x s attention scores hold the most of it (attn_probs 4.00 MiB of 9.13 MiB), "
            "which no remat policy removes: a fused attention kernel (splash, cuDNN, "
            "jax.nn.dot_product_attention) never stores them")
    assert peak.scores_note(found) == note
    # plan's and fit's line where no policy fits says it too.
    assert peak.held_line(found, "full remat's temp") == (
        f"full remat's temp {peak.summary(found)}; {note}")
    out = io.StringIO()
    print_peaks([{"names": ["full"], "peak": found}], Console(file=out, width=100))
    assert out.getvalue() == f"temp of full: {peak.summary(found)}\n  {note}\n"
    # Where the rest of a part outweighs the scores, or a policy saved them: no note.
    assert peak.scores_note({**found, "parts": {**found["parts"], "parameters": 5 << 20}}) is None
    assert peak.scores_note({**found, "roles": {}}) is None
