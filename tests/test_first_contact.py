"""What a first-time accelerator user reads: the verdict (the policy, what it
gives and costs, what to paste) and the CPU note, a default table that fits 100
columns with --wide for the rest, the chips in --help, the install command where the
user is, names refused at the call, and the note for a plan run at other shapes."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.ui import report
from remat_kit.cli import verdict
from remat_kit import errors as rk_errors
from remat_kit.measure import targets
from remat_kit.measure.record import Record
from tests.zoo import gpt_linen

TPU = "tpu:v5e:1x1"
# (policy, names, peak bytes, FLOPs, predicted seconds), shaped like a user's TPU run.
ROWS = [("none", ("none",), 5_820_000_000, 1.00e12, 1.000),
        ("full", ("full", "save_nothing"), 2_300_000_000, 1.33e12, 1.330),
        ("dots", ("dots", "save_dot_only"), 2_900_000_000, 1.0056e12, 1.004),
        ("save:query_proj,key_proj,value_proj,out_proj,mlpwi,mlpwo,context,attn_logits",
         ("save:query_proj,key_proj,value_proj,out_proj,mlpwi,mlpwo,context,attn_logits",),
         4_100_000_000, 1.002e12, 1.003)]


def tpu_rows(timed=False):
    target = targets.parse_target(TPU)
    return report.rows([Record(p, names, target.label, TPU, temp_size_in_bytes=peak // 2,
                               peak_memory_in_bytes=peak, flops=flops,
                               predicted_seconds=seconds, compile_seconds=40.0,
                               jax_version="0.12", compiler_version="libtpu 0.0.52")
                        for p, names, peak, flops, seconds in ROWS])


def test_the_verdict_names_the_chip_the_policy_its_cost_and_the_snippet():
    choice = verdict.pick_compare(tpu_rows())
    # dots: 0.498 x none's peak for +0.40% predicted step, the least product (full 0.525).
    lines = verdict.verdict(choice, targets.parse_target(TPU), asked_target=True)
    assert lines == [
        "tpu:v5e:1x1: use dots: peak 2.70 GiB (0.498 x none), +0.56% FLOPs, +0.40% pred. step "
        "(Pareto: least memory x pred. step)",
        'paste: rk.remat_model(model, "dots")  or  --config.remat=dots']


def test_the_cpu_note_only_where_no_target_was_given():
    choice = verdict.Choice("selective", "temp 1 MiB", "+3.00% FLOPs", "why")
    cpu = targets.parse_target("cpu")
    assert verdict.verdict(choice, cpu, asked_target=False)[2] == (
        "note: CPU figures (no --target); TPU and GPU compilers rank policies differently: "
        "--target tpu:v5p:1x1x1 or gpu:h100")
    assert len(verdict.verdict(choice, cpu, asked_target=True)) == 2
    assert len(verdict.verdict(choice, targets.parse_target(TPU), asked_target=False)) == 2


def test_a_spec_with_shell_characters_is_quoted_in_the_flag():
    spec = "0-2 save:query_proj / 3 full"
    assert verdict.snippet(verdict.Choice(spec, "", "", "")) == (
        f'rk.remat_model(model, "{spec}")  or  \'--config.remat={spec}\'')
    assert verdict.snippet(verdict.Choice("plan.json", "", "", "", budget="0.5",
                                          spec="full")) == (
        'rk.remat_model(model, "plan.json", budget="0.5")  or  --config.remat=full')


def _render(table, width):
    console = Console(width=width, record=True)
    console.print(table)
    return console.export_text().splitlines()


def test_the_default_table_fits_100_columns_and_wide_has_every_column():
    rows = tpu_rows()
    narrow = report.table(rows, "a title")
    assert [c.header for c in narrow.columns] == [
        "", "policy", "peak", "peak x none", "FLOPs x none", "pred. step", "pred. x none"]
    # At 100 columns nothing wraps but the long spec, which folds in its own column.
    at_100, at_200 = _render(narrow, 100), _render(narrow, 200)
    assert max(map(len, at_100)) <= 100 and at_100 == at_200
    assert "docs/compare.md" in narrow.caption and "--wide" in narrow.caption
    wide = report.table(rows, "a title", wide=True)
    # Every column with a figure; Korthikanti's are empty on every row here, so left out.
    assert [c.header for c in wide.columns] == [
        "", "policy", "peak", "peak x none", "residuals (traced)", "FLOPs", "FLOPs x none",
        "pred. step", "pred. x none", "temp", "compile s"]
    assert max(map(len, _render(wide, 300))) > 100


def test_side_by_side_fits_100_columns_for_two_targets():
    cpu = report.rows([Record(p, names, "XLA CPU compile", "cpu", temp_size_in_bytes=peak,
                              flops=flops, predicted_seconds=seconds)
                       for p, names, peak, flops, seconds in ROWS])
    table = report.side_by_side([("cpu", cpu), (TPU, tpu_rows())])
    lines = _render(table, 100)
    assert max(map(len, lines)) <= 100
    body = lines[:[line[:1] for line in lines].index("└") + 1]  # the caption fills the width
    assert body == _render(table, 200)[:len(body)]


def test_compare_picks_five_policies_on_an_accelerator_and_says_what_it_will_take():
    from remat_kit.cli.compare import ACCELERATOR_POLICIES, default_policies, estimate_line
    from remat_kit.ui.inputs import preset_policies
    tpu, cpu = targets.parse_target(TPU), targets.parse_target("cpu")
    assert default_policies(None, [tpu]) == list(ACCELERATOR_POLICIES)
    assert default_policies(None, [cpu]) == default_policies("all", [tpu]) == preset_policies()
    assert default_policies("none,full", [tpu]) == ["none", "full"]
    assert estimate_line(ACCELERATOR_POLICIES, [tpu]) == (
        "compiling 5 programs for tpu:v5e:1x1 (policies that compile alike are compiled "
        "once); a TPU or GPU compile takes seconds for a small model, a minute or more for a "
        "large one at a long sequence: after the first, each line gives the time left at this "
        "model's own pace (a repeat is read from the compile cache)")
    assert "min" not in estimate_line(["none"], [cpu])


def test_help_names_the_chips_and_the_install_command_fits_a_checkout(capsys):
    cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "gpu:h100" in text and "tpu:v5p:1x1x1" in text and "--wide" in text
    root = os.path.dirname(os.path.dirname(os.path.abspath(rk.__file__)))
    assert rk_errors.install_command("cuda") == (
        f"cd {root} && pip install -e '.[cuda]' --config-settings editable_mode=compat")


def test_a_misspelt_tag_is_refused_at_the_call():
    model = gpt_linen.model()
    with pytest.raises(rk.UnknownTagError, match="too close to 'attn_logits'") as info:
        rk.remat_model(model, "save:attn_logit")
    assert info.value.closest == "attn_logits"
    rk.remat_model(model, "save:my_own_tag")  # maybe the model's own: checked at its first call


def test_a_plan_run_at_other_shapes_says_so(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"context": {"batch": 8, "seq": 1024}, "budgets": [
        {"budget": "0.5", "plan": {"spec": "full", "layer_specs": []}}]}))
    model = gpt_linen.model()
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    trained = rk.remat_model(model, str(path))
    with pytest.warns(UserWarning, match=r"made at batch 8, seq 1024; this call runs batch 2, "
                                         r"seq 16: what it saves depends on the shapes"):
        jax.eval_shape(trained.apply, {"params": params}, tokens)
    path.write_text(json.dumps({"context": {"batch": 2, "seq": 16}, "budgets": [
        {"budget": "0.5", "plan": {"spec": "full", "layer_specs": []}}]}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at its own shapes: no warning
        jax.eval_shape(rk.remat_model(model, str(path)).apply, {"params": params}, tokens)


def test_the_screenshots_are_on_the_page_and_fit_their_width():
    """docs/compare.md and docs/models.md hold each of scripts/screenshots.py's renderings,
    no table wider than the columns it was rendered at, each opening with the map, the
    verdict and the paste."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "screenshots.py")
    spec = importlib.util.spec_from_file_location("screenshots", path)
    shots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shots)
    found = {m["name"]: m[0] for page in ("compare.md", "models.md")
             for m in shots.BLOCK.finditer((shots.ROOT / "docs" / page).read_text())}
    assert set(found) == set(shots.SHOTS)
    for name, (_, columns, argv) in shots.SHOTS.items():
        lines = found[name].splitlines()[2:-2]  # the fence's body
        assert lines[0].startswith(f"$ COLUMNS={columns} .venv/bin/remat-kit {argv[0]} ")
        assert lines[1].startswith("model map: ") and lines[2].startswith("cpu: use ")
        assert lines[3].startswith('paste: rk.remat_model(model, "')
        table = [line for line in lines if line[:1] in "┏┃┡│└"]
        assert len(table) > 4 and max(map(len, table)) <= columns, name
        if columns >= 120:  # the verdict on one line there
            assert len(lines[2]) <= columns


@pytest.mark.parametrize("label, shown", [("XLA CPU compile", False),
                                          ("XLA TPU compile (v5e:1x1, AOT)", True)])
def test_the_training_summary_drops_the_cpu_peak_row(label, shown):
    """XLA CPU's peak figure, alike under every policy, read as remat saving nothing."""
    from experiments import train_report
    figures = {"temp_size_in_bytes": 2 << 20, "peak_memory_in_bytes": 7 << 20,
               "step_bytes": 9 << 20, "flops": 1e9, "step_bytes_source": "argument + temp"}
    summary = {"model": "demo", "remat": "selective", "eval_bits_per_byte": 2.5,
               "eval_loss": 1.7, "final_train_loss": 1.8, "median_step_seconds": 0.4,
               "median_tokens_per_second": 1e4, "wall_seconds": 100.0,
               "policies": [{"remat": "selective", "from_step": 0}],
               "checkpoint": {"step": 250, "bytes": 1 << 20, "write_seconds": 0.1,
                              "blocking_seconds": 0.01},
               "compiled": {"label": label, "policy": figures, "none": figures},
               "memory_budget": None}
    console = Console(width=120, record=True)
    train_report.print_summary(console, summary)
    text = console.export_text()
    assert "temp_size_in_bytes" in text and ("peak_memory_in_bytes │" in text) == shown
    assert ("leaves temp buffers out, is not shown" in text) == (not shown)
