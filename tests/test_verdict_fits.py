"""The verdict on a chip of known memory: the fastest policy whose peak fits the chip less
the margin ("no remat needed" where no remat fits), --budget in its place, the Pareto pick
only where the chip's memory is unknown; and the memory each target holds."""

import pytest

from remat_kit.cli import verdict
from remat_kit.measure import targets
from tests.test_first_contact import TPU, tpu_rows

GIB = 2**30


def test_a_chip_that_holds_no_remat_gets_no_remat():
    # v5e: 16 GiB HBM, 14.40 GiB less 10%; none's peak is 5.42 GiB.
    target = targets.parse_target(TPU)
    choice = verdict.pick_compare(tpu_rows(), target.memory)
    assert verdict.verdict(choice, target, asked_target=True)[0] == (
        "tpu:v5e:1x1: use none: peak 5.42 GiB (1.000 x none), no remat needed "
        "(fits 14.40 GiB: 16.00 GiB HBM per chip, less 10%)")


@pytest.mark.parametrize("budget, name, why", [
    # dots (2.70 GiB, +0.40%) is the fastest under 3e9 B; full (2.14 GiB, +33%) under 2.5e9.
    (3_000_000_000, "dots", "the least pred. step of the policies that fit --budget 2.79 GiB"),
    (2_500_000_000, "full", "the least pred. step of the policies that fit --budget 2.33 GiB"),
    (1_000_000_000, "full", "no policy fits --budget 953.67 MiB; this one needs the least")])
def test_a_budget_takes_the_chips_place(budget, name, why):
    choice = verdict.pick_compare(tpu_rows(), targets.parse_target(TPU).memory, budget)
    assert (choice.name, choice.why) == (name, why)


def test_the_pareto_pick_where_the_chip_is_unknown():
    choice = verdict.pick_compare(tpu_rows(), None)
    assert (choice.name, choice.why) == ("dots", "Pareto: least memory x pred. step")
    assert verdict.verdict(choice, targets.parse_target("cpu"), asked_target=True)[2] == (
        "note: CPU steps predicted from this machine's measured roofline; another machine "
        "may pick otherwise")
    assert len(verdict.verdict(choice, targets.parse_target(TPU), asked_target=True)) == 2


def test_each_chip_holds_what_its_maker_says(monkeypatch):
    assert targets.parse_target("tpu:v5p:2x2x1").memory == (95 * GIB, "95.00 GiB HBM per chip")
    assert targets.parse_target("cpu").memory is None
    assert targets.parse_target("tpu:v3:2x2").memory is None  # a size not listed
    # An H100's 84,942,979,072 bytes (its description), of which JAX takes 75% by default.
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert targets.parse_target("gpu:h100").memory == (
        int(84942979072 * 0.75),
        "75% of 79.11 GiB, JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert targets.parse_target("gpu:h100").memory == (
        int(84942979072 * 0.9), "90% of 79.11 GiB, XLA_PYTHON_CLIENT_MEM_FRACTION as set")


@pytest.mark.parametrize("target, mesh, n", [
    ("tpu:v5p:2x2x1", None, 4), ("tpu:v5p:2x2x1:slices=2", None, 8), ("gpu:h100:8", None, 8),
    ("cpu", "data:2", 2), ("tpu:v5e:1x1", "data:2,fsdp:2", 4), ("tpu:nope", None, 1)])
def test_host_devices_as_many_as_the_target_has_chips(target, mesh, n, monkeypatch):
    # A model that builds its mesh from jax.devices() at import finds the target's chips.
    import argparse

    from remat_kit import mesh as rk_mesh
    from remat_kit.cli.common import make_host_devices
    asked = []
    monkeypatch.setattr(rk_mesh, "host_devices", asked.append)
    make_host_devices(argparse.Namespace(target=target, mesh=mesh))
    assert asked == [n]


def test_splash_without_named_residuals_says_its_forward_reruns():
    from remat_kit.measure import kernels
    priced = kernels.Priced((
        kernels.Kernel("splash_mha_fwd_no_residuals", 4, 1e9, 1e6, None, "shapes"),
        kernels.Kernel("splash_mha_dq_no_residuals", 2, 1e9, 1e6, None, "shapes"),
        kernels.Kernel("splash_mha_dkv_no_residuals", 2, 2e9, 1e6, None, "shapes")))
    assert priced.notes()[-1] == (
        "splash attention's forward runs 4 times for 2 backward: the backward reruns it, as "
        "the kernel's residuals (its output and logsumexp) are not named: give splash "
        "residual_checkpoint_name=\"context\", so saving `context` cannot keep them")


@pytest.mark.parametrize("notes, text, target, added", [
    (("attn_logits: fused attention (one op): its scores never exist",), None, TPU,
     ["minimal_with_context"]),
    (("attn_logits: fused attention (one op): its scores never exist",), None, "cpu", []),
    (("attn_logits: fused attention (one op): its scores never exist",), "none,full", TPU, []),
    ((), None, TPU, [])])
def test_a_fused_kernel_adds_minimal_with_context_to_the_default(notes, text, target, added):
    import types

    from remat_kit.cli.compare import default_policies, with_fused_attention
    found = [targets.parse_target(target)]
    specs = default_policies(text, found)
    assert with_fused_attention(text, found, types.SimpleNamespace(notes=notes), specs) == added


@pytest.mark.parametrize("text, parsed", [
    ("tpu:v5p-8", "tpu:v5p:2x2x1"), ("tpu:v5p-128", "tpu:v5p:4x4x4"),
    ("tpu:v5litepod-16", "tpu:v5e:4x4"), ("tpu:v6e-8", "tpu:v6e:2x4"), ("tpu:v4-8", "tpu:v4:2x2x1"),
    ("tpu:v5p-16:slices=2", "tpu:v5p:2x2x2:slices=2")])
def test_cloud_tpu_types_name_their_topology(text, parsed):
    assert str(targets.parse_target(text)) == parsed


def test_a_cloud_type_that_is_no_slice_is_refused_with_the_rule():
    with pytest.raises(targets.TargetError, match=r"'v5p-4' names no slice: v5p types count "
                       r"cores, two per chip, in powers of two from v5p-8"):
        targets.parse_target("tpu:v5p-4")


def test_the_chips_an_own_mesh_leaves_unused_are_named():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from remat_kit.cli.compare import unused_chips
    own = Mesh(np.array(jax.devices()[:4]).reshape(1, 4, 1), ("replica", "shard", "model"))
    assert unused_chips(own, targets.parse_target("tpu:v5p:2x2x1:slices=2")) == (
        "note: the model's own mesh (replica:1,shard:4,model:1) uses 4 of "
        "tpu:v5p:2x2x1:slices=2's 8 chips; the other 4 are unused, and the figures are those "
        "of its 4; build the mesh over all of them (or name a smaller --target) to measure "
        "the slice")
    assert unused_chips(own, targets.parse_target("tpu:v5p:2x2x1")) is None
    assert unused_chips(None, targets.parse_target("tpu:v5p:2x2x1:slices=2")) is None


def test_help_names_slices_cloud_types_and_own_axes(capsys):
    from remat_kit.cli import commands as cli
    try:
        cli.main(["compare", "--help"])
    except SystemExit:  # argparse's exit after the help
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert ":slices=N" in text and "tpu:v5p-8" in text and "its own axes" in text


def test_each_note_names_its_policies():
    from remat_kit.cli.compare import policy_notes
    rows = [{"names": ["none"], "error": None, "notes": ["kernels priced"]},
            {"names": ["full", "save_nothing"], "error": None,
             "notes": ["kernels priced", "cuDNN attention's forward runs 4 times"]},
            {"names": ["save:zz"], "error": None,
             "notes": ["kernels priced", "save:zz: none of the tags this policy keeps"]}]
    assert policy_notes(rows) == [
        "note (every policy): kernels priced",
        "note (full): cuDNN attention's forward runs 4 times",
        "note (save:zz): none of the tags this policy keeps"]


def test_wide_keeps_preset_names_whole_at_100_columns():
    from rich.console import Console

    from remat_kit.ui import report
    from tests.test_first_contact import tpu_rows
    rows = [dict(d, names=["minimal"]) if d["policy"] == "none" else d for d in tpu_rows()]
    console = Console(width=100, record=True)
    console.print(report.table(rows, "", wide=True))
    assert "│ minimal " in console.export_text()


def test_a_long_device_order_is_summarized():
    import types

    import numpy as np

    from remat_kit import mesh as rk_mesh

    class Mesh128(dict):  # 128 devices in reverse order, as {axis: size} with devices
        devices = np.array([types.SimpleNamespace(id=i) for i in range(127, -1, -1)])
        shape = property(dict)
    assert rk_mesh.origin(Mesh128(data=128), "its mesh") == (
        "its mesh (1 axis data:128; device order [127, 126, 125, 124, ... 0])")


def test_a_folder_named_like_the_package_beside_a_script_does_not_shadow_it(tmp_path):
    """A script in the folder that holds a checkout named remat_kit: with the checkout on
    sys.path (what the Makefile's compat editable install's .pth adds) Python's path search
    finds the package; setuptools' default import hook, consulted after that search, would
    find the checkout first, as an empty namespace package."""
    import pathlib
    import subprocess
    import sys

    from remat_kit import errors
    root = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "remat_kit").mkdir()  # the checkout, as the folder holding it sees it
    found = subprocess.run(
        [sys.executable, "-S", "-c", "import importlib.util, sys; "
         f"sys.path.insert(0, {str(tmp_path)!r}); sys.path.append({str(root)!r}); "
         "print(importlib.util.find_spec('remat_kit').origin)"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert found == str(root / "remat_kit" / "__init__.py")
    assert f"-e '.[tpu]' {errors.EDITABLE_MODE}" in (root / "Makefile").read_text()


def test_a_budget_over_what_jax_leaves_on_a_gpu_is_named(monkeypatch):
    from remat_kit.cli.fit import over_the_chip
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert over_the_chip(80 * GIB, targets.parse_target("gpu:h100")) == (
        "note: --budget 80.00 GiB is more than gpu:h100 holds for a program, 59.33 GiB (75% "
        "of 79.11 GiB, JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION); set "
        "XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. .95) to let JAX take more")
    assert over_the_chip(50 * GIB, targets.parse_target("gpu:h100")) is None
    assert over_the_chip(80 * GIB, targets.parse_target("cpu")) is None


def test_fit_budget_defaults_to_what_the_device_holds(monkeypatch, capsys):
    import argparse

    from remat_kit.ui.inputs import BadInput
    from remat_kit.cli.fit import default_budget
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    args = argparse.Namespace(budget=None)
    assert default_budget(args, targets.parse_target("gpu:h100")) == 63707234304
    assert args.budget == "63707234304B"  # an auto row's budget too
    assert capsys.readouterr().err == (
        "budget: 59.33 GiB per device, what gpu:h100 holds for a program (75% of 79.11 GiB, "
        "JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION); set XLA_PYTHON_CLIENT_MEM_FRACTION "
        "(e.g. .9) or --budget to change it\n")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert default_budget(argparse.Namespace(budget=None), targets.parse_target("gpu:h100")) \
        == int(84942979072 * 0.9)
    v5e = targets.parse_target(TPU)
    assert default_budget(argparse.Namespace(budget=None), v5e) == 16 * GIB
    assert default_budget(argparse.Namespace(budget="1GiB"), v5e) == GIB
    with pytest.raises(BadInput, match="^fit needs --budget on target cpu"):
        default_budget(argparse.Namespace(budget=None), targets.parse_target("cpu"))


def test_a_fit_row_over_xlas_gpu_limit_says_xla_would_remat_there(monkeypatch):
    from remat_kit.decide.fit_estimate import gpu_own_remat
    from remat_kit.decide.step import StepMemory
    from remat_kit.measure import chip_memory
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    h100 = targets.parse_target("gpu:h100")

    def step(total):  # arguments 2 GiB + outputs 2 GiB, 1.5 GiB of them aliased
        return StepMemory(total, "peak_memory_in_bytes", 1, 1, 1, 1, 0, 2 * GIB, 2 * GIB,
                          3 * GIB // 2, total, 1.0, 0.0)
    # XLA's limit: (59.33 GiB JAX takes - 2.5 GiB) x 95%: 53.99 GiB.
    assert chip_memory.gpu_remat_limit(63707234304, 5 * GIB // 2) == 57971735756
    assert gpu_own_remat(4096, step(57971735756), h100) is None
    assert gpu_own_remat(4096, step(58 * GIB), h100) == (
        "XLA would rematerialize on its own at 4096: the step's 58.00 GiB is over the 53.99 "
        "GiB XLA:GPU holds a program to (95% of 59.33 GiB JAX takes, less 2.50 GiB of "
        "arguments and outputs; XLA_FLAGS=--xla_gpu_memory_limit_slop_factor): recompute "
        "beyond the policy, not counted here")
    assert gpu_own_remat(4096, step(58 * GIB), targets.parse_target(TPU)) is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=110")
    assert gpu_own_remat(4096, step(58 * GIB), h100) is None  # limit 62.52 GiB


def test_the_time_left_is_the_mean_of_this_models_compiles():
    from remat_kit.cli.compare import progress_line
    from remat_kit.measure.record import Record
    done = Record("none", ("none",), "XLA TPU compile", TPU, compile_seconds=150.0)
    assert progress_line(1, 5, done, [150.0]) == (
        "[1/5] tpu:v5e:1x1: none: 150.0 s; about 10 min left")
    assert progress_line(5, 5, done, [150.0] * 5) == "[5/5] tpu:v5e:1x1: none: 150.0 s"
    quick = Record("none", ("none",), "XLA CPU compile", "cpu", compile_seconds=2.0)
    assert progress_line(1, 5, quick, [2.0]) == "[1/5] cpu: none: 2.0 s"


def test_xla_rematerializing_on_its_own_is_named():
    import types

    from remat_kit.measure.costs import xla_remat_note
    text = ("ENTRY %main {\n  %fusion.3 = f32[8] fusion(%p)\n  %fusion.3.remat = f32[8] "
            "fusion(%p)\n  fusion.7.remat2 = f32[8] fusion(%p)\n  ROOT %t = tuple(%fusion.3)\n}")
    compiled = types.SimpleNamespace(as_text=lambda: text)
    assert xla_remat_note(compiled, "gpu") == (
        "XLA rematerialized 2 instructions on its own to fit the device's memory (its remat "
        "pass, beyond the policy): this row's peak and FLOPs are after it",)
    assert xla_remat_note(compiled, "cpu") == ()
    plain = types.SimpleNamespace(as_text=lambda: text.replace(".remat", ""))
    assert xla_remat_note(plain, "tpu") == ()


@pytest.mark.skipif(not targets._cuda_plugin_installed(), reason="the CUDA plugin is not "
                    "installed")
def test_xla_gpu_rematerializes_on_its_own_past_its_limit_unless_held_off(tmp_path):
    # An H100 described with 4 MiB: ahead of time XLA holds a program to (80% of it - its
    # arguments and outputs) x 95%, and rematerializes on its own past that.
    import jax
    import jax.numpy as jnp

    from remat_kit.measure import lowering
    from remat_kit.measure.costs import xla_remat_note
    spec = tmp_path / "h100_4mib.txtpb"
    spec.write_text(targets._gpu_config_text("h100").replace(
        "device_memory_size: 84942979072", "device_memory_size: 4194304"))
    gpu = targets.parse_target(f"gpu:{spec}")

    def f(x):  # eight 256 KiB values the gradient keeps: 6 MiB of temp
        return sum(jnp.sum(jnp.exp(x * i) @ jnp.exp(x * i).T) for i in range(1, 9))
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    lowered = lowering.lower(jax.grad(f), lowering.place([x], gpu), gpu)
    own, held = (lowering.compile_lowered(lowered, lowering.compile_options(gpu, True, r), gpu)
                 for r in (True, False))
    assert xla_remat_note(own, "gpu")[0].startswith("XLA rematerialized ")
    assert xla_remat_note(held, "gpu") == ()
    assert held.memory_analysis().temp_size_in_bytes == 5767424


def test_no_remat_where_it_fits_even_beside_a_row_predicted_faster():
    rows = tpu_rows()
    for d in rows:  # full predicted 1% under none: the time model's artefact
        if d["policy"] == "full":
            d["predicted_ratio_to_none"] = 0.99
    assert verdict.pick_compare(rows, targets.parse_target(TPU).memory).name == "none"
