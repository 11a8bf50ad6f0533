"""The `remat-kit` command: compare, explain, and one-line errors with exit status 2."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from remat_kit.cli import commands as cli
from remat_kit.ui import inputs, sources
from remat_kit.ui.report import SCHEMA_VERSION
from remat_kit.units import fmt_bytes


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["compare", "--config", "tiny", "--policies", "full,full@every:99"],
     "--policies 'full@every:99': TransformerConfig: layer schedule every:99: 99 is out of "
     "range for 2 layers"),
    (["explain", "--config", "tiny", "--policy", "full@every:2"],
     "explain shows one layer under one policy"),
    (["plan", "--config", "tiny", "--budgets", "1", "--cache", "experiments/configs/tiny.py"],
     "'experiments/configs/tiny.py' is not a plan cache"),
    (["plan", "--config", "tiny", "--budgets", "1", "--presets", "nested:7"],
     "group size 7 does not divide 2 layers"),
    (["fit", "--config", "tiny", "--budget", "4MiB", "--policies", "auto:budget=0.5"],
     "in fit, auto's budget is the fit budget"),
    (["explain", "--config", "tiny", "--policy", "full", "--target", "tpu:v5e:0x1"],
     "bad TPU topology 'v5e:0x1'"),
    (["compare", "--config", "gpt3"], "unknown model config 'gpt3'; valid: tiny, tiny_llama, "
     "gpt2_small, llama_1b, or a .py config file with get_config()"),
    (["compare", "--config", "gpt2_smal"], "config file with get_config(); did you mean "
     "'gpt2_small'?"),
    # argparse alone would take a value starting with '-' for an option.
    (["fit", "--config", "tiny", "--budget", "-1GiB"], "a budget must be positive"),
    (["plan", "--config", "tiny", "--budgets", "-0.5"], "got '-0.5'"),
    (["compare", "--config", "tiny", "--batch", "0"], "--batch: must be a positive int"),
    (["compare", "--config", "tiny", "--batch", "abc"], "--batch: must be a positive int"),
    (["compare", "--config", "tiny", "--seq", "-3"], "--seq: must be a positive int"),
    (["compare", "--config", "tiny", "--batch", "\u0662"], "--batch: must be a positive int"),
    (["compare", "--config", "tiny", "--policies", "0 full / 1 none"],
     "--policies '0 full / 1 none' is a per-layer plan (plan's paste), which rk.remat_model "
     "and --config.remat= run"),
    (["compare", "--config", "tiny", "--seq", "\uff11\uff16"], "--seq: must be a positive int"),
    (["compare", "--config", "tiny", "--seq", "129"], "exceeds the model's max_len 128"),
    (["compare", "--config", "tiny", "--policies", "none,minimall"], "did you mean 'minimal'"),
    (["compare", "--config", "tiny", "--mesh", "model:2"], "unknown axis 'model'"),
    (["compare", "--config", "missing.py"], "config file 'missing.py' not found"),
    (["explain", "--config", "tiny", "--policy", "save:query_prj"], "did you mean 'query_proj'"),
    (["explain", "--config", "tiny", "--dtype", "int8"], "invalid choice: 'int8'"),
    (["explain", "--config", "tiny", "--seq", "1000"], "--seq 1000 exceeds the model's max_len 128"),
    (["compare", "--config", "tiny", "--batch", "99999999999999999999"], "at most 2147483647"),
    (["compare", "--config", "tiny", "--policies", ""], "--policies is empty"),
    (["compare", "--config", "tiny", "--policies", ","], "empty policy at item 1 of ','"),
    (["compare", "--config", "tiny", "--policies", "full,"], "empty policy at item 2 of 'full,'"),
    (["compare", "--config", "tiny", "--policies", "full,,none"],
     "empty policy at item 2 of 'full,,none'"),
    (["compare", "--config", "tiny", "--policies", "full,mlpwo"],
     "policy at item 2 of 'full,mlpwo'"),
    # Checked before JAX starts: creating a million host devices would hang.
    (["compare", "--config", "tiny", "--mesh", "data:1000000"], "more than the 1024 supported"),
    (["compare", "--config", "tiny", "--mesh", "data:3"], "batch 8 does not split over the 3"),
    (["compare", "--config", "tiny", "--mesh", "tensor:3"],
     "num_heads=4 is not divisible by the tensor axis of size 3"),
    (["compare", "--config", "tiny", "--json", "/nonexistent/out.json"],
     "folder '/nonexistent' does not exist"),
    (["compare", "--config", "tiny", "--json", "/proc/out.json"], "cannot write in folder '/proc'"),
    (["compare", "--config", "tiny", "--json", "tests"], "'tests' is a folder"),
    (["compare", "--config", "tiny", "--plot", "/proc/x.png"], "cannot write in folder '/proc'"),
    (["compare", "--config", "tiny", "--plot", "pareto.jpg"], "must end in .png"),
    (["compare", "--config", "tiny", "--time", "-1"], "must be 0 or a positive int"),
    (["plan", "--config", "tiny", "--budgets", "0.5", "--presets", ""], "--presets is empty"),
    (["compare", "--config", "tiny", "--policies", "full@first:2|selective"],
     "write the schedule once, at the end: full|selective@first:2"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert out == ""  # every check comes before measuring: no table, no progress


@pytest.mark.parametrize("source, message", [
    ("raise RuntimeError('boom')", "failed to load: RuntimeError: boom"),
    ("import no_such_module_x", "failed to load: ModuleNotFoundError"),
    ("def get_config(:", "has a syntax error"),
    ("def get_config(name):\n    pass", "get_config(name) must take no arguments"),
    ("get_config = 3", "get_config must be a function, got 3"),
    ("def get_config():\n    1 / 0", "get_config() raised ZeroDivisionError"),
    ("def get_config():\n    pass", "must return an ml_collections.ConfigDict, it returned None"),
    ("def get_config():\n    return {'model': 'tiny'}", "it returned a dict"),
    ("import ml_collections\ndef get_config():\n"
     "    return ml_collections.ConfigDict({'model': 'tiny', 'batch_size': '8'})",
     "batch_size in config file '{path}' must be a positive int"),
    ("import ml_collections\ndef get_config():\n"
     "    return ml_collections.ConfigDict({'model': 'tiny', 'seq_len': 0})",
     "seq_len in config file '{path}' must be a positive int"),
])
def test_bad_config_files_name_the_file_and_the_problem(capsys, tmp_path, source, message):
    path = tmp_path / "bad.py"
    path.write_text(source + "\n")
    code, out, err = run(capsys, "explain", "--config", str(path))
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert f"config file '{path}'" in err and message.format(path=path) in err


@pytest.mark.parametrize("name", ["tiny", "demo", "gpt2_small"])
def test_a_config_file_gives_the_model_train_builds(name):
    """`compare --config experiments/configs/X.py` measures the model `experiments.train` trains."""
    import importlib

    from remat_kit.models import from_config_dict

    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    cfg, label, sizes = sources.load_config(f"experiments/configs/{name}.py")
    assert cfg == from_config_dict(config) and label == f"{name}.py"
    assert cfg.vocab_size == 256 and cfg.max_len == config.seq_len  # byte-level data
    assert sizes == {"batch": config.batch_size, "seq": config.seq_len}


@pytest.mark.parametrize("fields, error, message", [
    ({"num_layers": 3}, ValueError, "no 'model' field"),
    ({"model": "tiny_lama"}, KeyError, "did you mean 'tiny_llama'"),
    ({"model": 3}, TypeError, "config field 'model' must be a str"),
    ({"model": "tiny", "num_layers": "3"}, TypeError, "num_layers must be int"),
    ({"model": "tiny", "seq_len": 0}, ValueError, "'seq_len'"),
    ({"model": "tiny", "remat": "fulll"}, ValueError, "fulll"),
])
def test_from_config_dict_errors_name_the_field(fields, error, message):
    from remat_kit.models import from_config_dict

    with pytest.raises(error, match=message):
        from_config_dict(fields)


def test_from_config_dict_overrides():
    from remat_kit.models import from_config_dict, get_config

    fields = {"model": "tiny_llama", "d_model": None, "num_layers": 3, "seq_len": 32,
              "remat": "full", "learning_rate": 1e-3}
    assert from_config_dict(fields) == get_config("tiny_llama", num_layers=3, max_len=32,
                                                  remat="full")
    assert from_config_dict(fields | {"max_len": 64}, remat="none").max_len == 64
    assert from_config_dict(fields, remat="none").remat == "none"


def test_too_few_devices_for_the_mesh(capsys):
    jax.devices()  # JAX has started: the command cannot add host devices now
    code, _, err = run(capsys, "compare", "--config", "tiny", "--batch", "64", "--mesh",
                       "data:16,tensor:4")
    assert code == 2 and err.count("\n") == 1
    assert "needs 64 devices, found" in err and "xla_force_host_platform_device_count=64" in err


def test_split_policies_keeps_tag_lists_together():
    assert inputs.split_policies("minimal,save:query_proj,key_proj,mlp*,full") == [
        "minimal", "save:query_proj,key_proj,mlp*", "full"]
    assert inputs.split_policies("recompute:core_attn,mlp,none") == ["recompute:core_attn,mlp", "none"]
    # A tag after a spec with no tag list starts a policy of its own.
    with pytest.raises(cli.BadInput, match="item 2 of 'full,mlp'"):
        inputs.split_policies("full,mlp")


def test_out_of_memory_names_the_sizes():
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3845799065476 bytes.\nmore")
    message = str(inputs.out_of_memory(error, "batch_size=8, seq_len=100000"))
    assert message == ("out of memory with batch_size=8, seq_len=100000: "
                       "Out of memory allocating 3845799065476 bytes.")
    assert inputs.out_of_memory(ValueError("other"), "batch_size=8") is None


def test_default_policies_cover_every_preset():
    from remat_kit.policy.presets import PRESET_TABLE
    from remat_kit.policy.spec import parse
    specs = inputs.preset_policies()
    assert len(specs) == len(PRESET_TABLE)
    assert "minimal" in specs and "maxtext:full" in specs and "megatron:selective" in specs
    assert [str(parse(s)) for s in specs] == [str(parse(row[2])) for row in PRESET_TABLE]


_TYPES = {
    "policy": str, "names": list, "platform": str, "target": str, "jax_version": str,
    "compiler_version": str, "residual_bytes_by_tag": dict,
    "residual_bytes_by_primitive": dict, "residual_bytes_by_argument": dict,
    "activation_residual_bytes": int, "offloaded_bytes": int, "temp_size_in_bytes": int,
    "argument_size_in_bytes": int, "output_size_in_bytes": int, "alias_size_in_bytes": int,
    "host_temp_size_in_bytes": int, "host_argument_size_in_bytes": int,
    "host_output_size_in_bytes": int,
    "flops": float, "transcendentals": float, "compile_seconds": float,
    "layer_residual_bytes": int, "layers_residual_bytes": int, "notes": list,
    "temp_ratio_to_none": float, "flops_ratio_to_none": float, "pareto": bool,
    "memory_kind": str, "memory_bytes": int, "memory_ratio_to_none": float,
    "predicted_seconds": float, "predicted_ratio_to_none": float, "kernel_flops": (int, float),
    "audit": dict, "parameter_bytes_per_device": int,
}
_NULLABLE = ("peak_memory_in_bytes", "step_time", "error", "formula_bytes", "formula_sp_bytes",
             "peak", "train_step_bytes")  # peak: with --peak only; the other: plan --step train


def test_compare_table_json_and_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the footnote wraps at the width
    out_json, out_png = tmp_path / "out.json", tmp_path / "pareto.png"
    code, out, err = run(capsys, "compare", "--config", "tiny", "--batch", "2", "--seq", "16",
                         "--policies", "none,full,save_nothing,save_transformer_layer_output",
                         "--json", str(out_json),
                         "--plot", str(out_png), "--wide")
    assert code == 0, err
    assert ("tiny: batch 2, seq 16, float32, loss: remat-kit's mean next-token cross-entropy "
            "of the logits (XLA CPU compile)") in out
    assert "full, save_nothing" in out and "its constants (the same in every layer" in out
    # Progress counts compiled programs: three decision sets lower to two programs.
    assert "[2/2]" in err and "/3]" not in err
    doc = json.loads(out_json.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION
    cpu = {"target": "cpu", "platform": "XLA CPU compile", "devices": 1,
           "jax_version": jax.__version__, "compiler_version": f"jaxlib {jax.__version__}",
           "step": "value-and-grad"}  # what was compiled: one device, no optimizer
    the_map = doc["context"].pop("model_map")  # what the layers are
    assert the_map["line"] == ("2 x DecoderLayer, scanned: no; own remat: none; outside: "
                               "embed, final_norm, pos_embed, logits, loss")
    assert out.splitlines()[0] == f"model map: {the_map['line']}"
    # No placement: the tiny model states no sharding of its own.
    plain = {"mesh": None, "mesh_origin": None, "placement": None}
    assert doc["context"] == {"config": "tiny", "batch": 2, "seq": 16, "dtype": "float32",
                              **plain, **cpu, "targets": [{**cpu, **plain}]}
    # Saving the layer output changes nothing (the next layer keeps it anyway):
    # it lowers to full's program and joins full's row.
    assert [r["names"] for r in doc["records"]] == [
        ["full", "save_nothing", "save_transformer_layer_output"], ["none"]]
    for r in doc["records"]:
        assert set(r) == set(_TYPES) | set(_NULLABLE)
        for key, typ in _TYPES.items():
            assert isinstance(r[key], typ), key
        assert r["error"] is None and r["step_time"] is None
        assert all(isinstance(v, int) for v in r["residual_bytes_by_tag"].values())
        # One device holds every parameter; the other arguments are the int32 inputs and
        # targets, [2, 16] each.
        assert r["argument_size_in_bytes"] - r["parameter_bytes_per_device"] == 2 * 2 * 16 * 4
    # Predicted step time beside FLOPs: full remat's recompute costs time, as it costs FLOPs.
    assert "pred. step" in out and "pred. x none" in out
    full, none = doc["records"]
    # The verdict under the map line: full, the Pareto row with the least memory
    # x predicted step, its figures those of the JSON; the CPU note, no --target given.
    assert full["temp_ratio_to_none"] * full["predicted_ratio_to_none"] < 1
    assert out.splitlines()[1:5] == [
        f"cpu: use full: temp {fmt_bytes(full['temp_size_in_bytes'])} "
        f"({full['temp_ratio_to_none']:.3f} x none), {full['flops_ratio_to_none'] - 1:+.2%} "
        f"FLOPs, {full['predicted_ratio_to_none'] - 1:+.2%} pred. step (Pareto: least memory "
        "x pred. step)",
        'paste: rk.remat_model(model, "full")  or  --config.remat=full',
        "note: CPU steps predicted from this machine's measured roofline; another machine "
        "may pick otherwise",
        "note: CPU figures (no --target); TPU and GPU compilers rank policies differently: "
        "--target tpu:v5p:1x1x1 or gpu:h100"]
    assert [(v["target"], v["name"], v["paste"]) for v in doc["verdicts"]] == [
        ("cpu", "full", 'rk.remat_model(model, "full")  or  --config.remat=full')]
    assert none["predicted_ratio_to_none"] == 1.0
    assert full["predicted_ratio_to_none"] == full["predicted_seconds"] / none["predicted_seconds"]
    assert 1.0 < full["predicted_ratio_to_none"] < 1.5 and full["flops_ratio_to_none"] > 1.0
    full, none = doc["records"]
    assert full["temp_size_in_bytes"] < none["temp_size_in_bytes"]
    assert full["formula_bytes"] == 16 * 2 * 64 * 4 * 2  # sbh x 4 bytes (f32) x 2 layers
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_explain_from_a_config_file(capsys, tmp_path):
    path = tmp_path / "small.py"
    path.write_text(textwrap.dedent("""
        import ml_collections

        def get_config():
            c = ml_collections.ConfigDict()
            c.model = "tiny"
            c.num_layers = 3
            c.d_model = None
            c.remat = "selective"
            c.batch_size = 2
            c.seq_len = 8
            return c
    """))
    code, out, err = run(capsys, "explain", "--config", str(path))
    assert code == 0, err
    assert "batch 2, seq 8, float32" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ ")}
    # attn_logits: [batch, heads, seq, seq] f32 = 2*4*8*8*4 bytes, recomputed.
    assert "[2, 4, 8, 8]" in lines["attn_logits"] and "2.00 KiB" in lines["attn_logits"]
    assert "recomputed" in lines["attn_logits"]
    assert "saved" in lines["query_proj"] and "[2, 8, 4, 16]" in lines["query_proj"]
    assert "model (3 layers)" in out
    assert out.splitlines()[0] == ("model map: 3 x DecoderLayer, scanned: no; own remat: none; "
                                   "outside: embed, final_norm, pos_embed, logits, loss")


def test_mesh_gives_per_device_numbers(tmp_path):
    """In a fresh process JAX can still be given 2 host devices."""
    out_json = tmp_path / "mesh.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", "compare", "--config", "tiny", "--batch", "4",
         "--seq", "16", "--policies", "maxtext:minimal", "--mesh", "data:2",
         "--json", str(out_json)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "per device of 2" in done.stdout
    (rec,) = json.loads(out_json.read_text())["records"]
    # Per device: half the global batch of 4; tiny has 4 heads of 16, 2 layers, f32.
    assert rec["residual_bytes_by_tag"]["query_proj"] == 2 * 16 * 4 * 16 * 4 * 2
    assert rec["layer_residual_bytes"] > 0 and rec["error"] is None


def test_sweep_writes_json_csv_and_plot(capsys, tmp_path):
    from experiments.configs import tiny
    from experiments.sweep import sweep

    config = tiny.get_config()
    config.batch_size, config.seq_len = 2, 16
    rows = sweep(config, str(tmp_path), "none,full", steps=2)
    assert [d["names"] for d in rows] == [["full"], ["none"]]
    assert all(d["step_time"]["steps"] == 2 and d["step_time"]["median_s"] > 0 for d in rows)
    assert rows[1]["step_time"]["ratio_to_none"] == 1.0
    doc = json.loads((tmp_path / "records.json").read_text())
    assert doc["records"] == rows
    line = ("2 x DecoderLayer, scanned: no; own remat: none; outside: embed, final_norm, "
            "pos_embed, logits, loss")
    assert doc["context"]["model_map"]["line"] == line
    assert capsys.readouterr().out.splitlines()[0] == f"model map: {line}"
    csv_lines = (tmp_path / "records.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("policy,names,temp_size_in_bytes")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000


# Break-test faults: output paths, plan caches, policy lists.

@pytest.mark.parametrize("argv", [
    ["compare", "--policies", "full", "--json", "/dev/full"],
    ["compare", "--policies", "full", "--plot", "{tmp}/link.png"],  # a symlink to /dev/full
    ["plan", "--budgets", "0.5", "--no-presets", "--cache", "", "--json", "/dev/full"],
    ["fit", "--budget", "64MiB", "--policies", "full", "--json", "/dev/full"],
])
def test_an_output_that_cannot_take_a_file_fails_before_compiling(capsys, tmp_path, argv):
    """Fault 6: /dev/full opened fine and failed at the end, after every compile."""
    os.symlink("/dev/full", tmp_path / "link.png")
    argv = [a.format(tmp=tmp_path) for a in argv]
    flags = ["--config", "tiny", "--batch", "2"] + ([] if argv[0] == "fit" else ["--seq", "64"])
    code, out, err = run(capsys, argv[0], *flags, *argv[1:])
    flag, path = argv[-2:]
    assert code == 2 and out == "", err  # no table, no progress: nothing compiled
    assert err == (f"remat-kit {argv[0]}: error: {flag}: '{path}' is a character device, not a regular "
                   "file; give a file path\n")


def test_a_failed_write_is_one_line_and_keeps_the_old_file(tmp_path):
    """Fault 6: a write that fails at the end (here the file size limit, as a full disk
    would) is one line and exit 1, and the file written before is left whole."""
    out = tmp_path / "out.json"
    out.write_text("old\n")
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        from remat_kit.cli import commands as cli
        sys.exit(cli.main(["compare", "--config", "tiny", "--batch", "2", "--seq", "16",
                           "--policies", "full", "--json", {str(out)!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == (f"remat-kit compare: error: cannot write '{out}': File too large; nothing "
                         "was written, the old file is left as it was")
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["out.json"]  # no temp left


def test_special_files_are_refused_as_plan_caches(capsys, tmp_path):
    """Fault 7: --cache /dev/full read zeros forever, a FIFO blocked on open."""
    fifo = tmp_path / "cache.fifo"
    os.mkfifo(fifo)
    for path, kind in (("/dev/full", "a character device"), (str(fifo), "a FIFO"),
                       (str(tmp_path), "a folder")):
        code, out, err = run(capsys, "plan", "--config", "tiny", "--batch", "2", "--seq", "64",
                             "--budgets", "0.5", "--cache", path)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err == (f"remat-kit plan: error: --cache: '{path}' is {kind}"
                       + (" (named pipe)" if "FIFO" in kind else "")
                       + ", not a regular file; give a plan cache file, or '' for none\n")


@pytest.mark.parametrize("spec", [
    "save:query_proj,key_proj;recompute:attn_probs", "save:context,out_proj;dots",
    "save:query_proj,key_proj|save:mlpwo", "save:*/attn/query,*/attn/key;recompute:*",
])
def test_split_policies_keeps_every_spec_parse_accepts(spec):
    """Fault 9: a comma inside a spec's tag list split it, before a ';' or '|'."""
    from remat_kit.policy.spec import parse

    parse(spec)
    assert inputs.split_policies(spec) == [spec]
    assert inputs.split_policies(f"minimal,{spec},full") == ["minimal", spec, "full"]


def test_compare_exits_1_where_no_policy_compiles(capsys, monkeypatch, tmp_path):
    """Every row an error (here each compile runs out of memory): the verdict says so, the
    report is written, and the status is 1, for scripts and CI."""
    from remat_kit.measure import figure_cache, lowering

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")

    monkeypatch.setattr(lowering, "compile_lowered", out_of_memory)
    # Every row compiled: figures kept from an earlier run of these programs would skip it.
    monkeypatch.setattr(figure_cache, "folder", lambda: None)
    monkeypatch.setenv("REMAT_KIT_COMPILE_CACHE", "")
    report = tmp_path / "r.json"
    code, out, err = run(capsys, "compare", "--config", "tiny", "--batch", "1", "--seq", "16",
                         "--policies", "none,full", "--json", str(report))
    assert code == 1 and "cpu: no policy compiled; each row below says why" in out
    assert [r["error"].split(":")[0] for r in json.loads(report.read_text())["records"]] == [
        "RuntimeError", "RuntimeError"]
