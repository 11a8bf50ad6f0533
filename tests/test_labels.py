"""Every label true: a table's dtype is the model's (activations', and parameters'
where they differ), an all-error table says what failed, `layer x L` is per chip
on a mesh, and a scanned stack refuses a policy per layer in one line."""

import importlib
import importlib.util
import textwrap

import jax
import pytest
from rich.console import Console

import remat_kit as rk
from remat_kit.api import answers
from remat_kit.cli import commands as cli
from remat_kit.ui import labels, report
from remat_kit.flax import from_model
from remat_kit.measure import targets
from remat_kit.measure.record import Record
from tests.zoo import scan_linen

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")

# A linen model computing in bfloat16 with float32 parameters, as mixed precision does.
MIXED = textwrap.dedent('''
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(32, dtype=jnp.bfloat16)(nn.gelu(nn.Dense(64, dtype=jnp.bfloat16)(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 32, dtype=jnp.bfloat16)(tokens)
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(64, dtype=jnp.float32)(x)

    def model():
        return Model()
''')


def test_dtype_label_names_both_where_they_differ():
    assert labels.dtype_label("float32", "float32") == "float32"
    assert labels.dtype_label("float32", "bfloat16") == "bfloat16 activations, float32 parameters"
    assert labels.dtype_label(None, "bfloat16") == "bfloat16"
    assert labels.dtype_label(None, None) == "-"


def test_a_bf16_model_is_titled_by_its_dtypes(tmp_path, capsys):
    path = tmp_path / "mixed.py"
    path.write_text(MIXED)
    work = rk.from_model.workload(_load(path).model(), 2, 8)
    # Every parameter is float32; 4 of the 5 matmuls are bf16 (the head computes in f32).
    assert labels.params_dtype(work.params) == "float32"
    assert labels.activation_dtype(work) == "bfloat16"
    assert cli.main(["compare", "--model", f"{path}:model", "--batch", "2", "--seq", "8",
                     "--policies", "full"]) == 0
    out = capsys.readouterr().out
    assert ("batch 2, seq 8, bfloat16 activations, float32 parameters, loss: remat-kit's "
            "mean next-token cross-entropy of the logits "
            "(XLA CPU compile)") in out


def test_a_config_titles_both_dtypes_where_they_differ(capsys):
    assert cli.main(["compare", "--config", "tiny", "--batch", "2", "--seq", "8",
                     "--dtype", "bfloat16", "--policies", "full"]) == 0
    assert "batch 2, seq 8, bfloat16 activations, float32 parameters" in capsys.readouterr().out


def _load(path):
    spec = importlib.util.spec_from_file_location("mixed_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _caption(rows) -> str:
    console = Console(width=400, record=True)
    console.print(report.table(rows))
    return console.export_text()


def test_an_all_error_table_says_what_failed_on_its_target():
    rows = report.rows([Record(p, (p,), "XLA TPU compile (v5e:1x1, AOT)", "tpu:v5e:1x1",
                               jax_version="0.12", compiler_version="libtpu 0.0.52",
                               error=f"JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: Ran out of "
                                     f"memory on HBM ({g}G)")
                        for p, g in (("none", 67), ("full", 43))])
    text = _caption(rows)
    assert ("no policy compiled (XLA TPU compile (v5e:1x1, AOT); jax 0.12, libtpu 0.0.52): "
            "none, full: JaxRuntimeError: RESOURCE_EXHAUSTED: E1000 (each row gives the whole "
            "message)") in " ".join(text.split())
    assert "ranked by" not in text and "XLA CPU" not in text
    assert report.memory_kind_of(rows) == "peak_memory_in_bytes"  # the TPU's figure
    assert labels.failed_caption(rows[:1] + [dict(rows[1], error=None)], "x") is None


def test_layer_x_l_is_per_chip_on_a_mesh():
    """scan_linen, fsdp:4 over 4 host devices, batch 8, seq 16: full remat keeps each
    layer's input, [2, 16, 32] float32 per chip (batch 8 / 4), 2 layers."""
    mesh = rk.mesh.make("fsdp:4", jax.devices()[:4])
    work = from_model.workload(scan_linen.model(), 8, 16, mesh=mesh)
    here = targets.parse_target(None)
    [full] = answers.measure(work, policies=["full"], per_layer=True, target=here)
    assert full.layers_residual_bytes == scan_linen.LAYERS * 2 * 16 * scan_linen.EMBED * 4
    [alone] = answers.measure(from_model.workload(scan_linen.model(), 8, 16), policies=["full"],
                              per_layer=True, target=here)
    assert alone.layers_residual_bytes == 4 * full.layers_residual_bytes


SCANNED = textwrap.dedent('''
    import ml_collections

    def get_config():
        return ml_collections.ConfigDict({"model": "tiny_llama", "scan_layers": True})
''')


def test_a_scanned_stack_refuses_a_policy_per_layer_in_one_line(capsys, tmp_path):
    config = tmp_path / "scanned.py"
    config.write_text(SCANNED)
    for argv, message in [
            (["compare", "--model", "tests/zoo/scan_linen.py:model", "--policies",
              "full,full@every:2"],
             "--policies 'full@every:2': the model runs its 2 blocks as 1 scan body, which "
             "takes one policy for every layer; got 2 different policies (full, none); give "
             "one policy"),
            (["plan", "--config", str(config), "--budgets", "0.5", "--groups", "2",
              "--no-presets", "--cache", ""],
             "--groups 2: not possible, the layers are one scan body, which takes one policy "
             "for every layer; give --groups 1 or leave it out")]:
        assert cli.main([*argv, "--batch", "2", "--seq", "8"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(message) and len(err.splitlines()) == 1
