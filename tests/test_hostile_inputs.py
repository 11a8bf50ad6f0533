"""The planner and --model inputs: each test failed on the tree before
the fix. Item 3: `--offload` on the CPU planned negative memory. Item 4: a model
with integer logits was measured with no backward pass. Item 7: `--no-offload`
returned an offload plan. Item 9: os._exit(0) in a model file ended remat-kit
with exit 0 and no output. Item 14: `rk.plan` raised ZeroDivisionError, a weak
reference error, or hid a factory's own error. Small: `--budgets -inf`, a file
of random bytes, docs/plan.md on bytes.
"""

import importlib.util
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import remat_kit as rk
from remat_kit.cli import commands as cli
from remat_kit.decide.plan import Planner
from remat_kit.flax.from_model import workload
from remat_kit.policy.budget import parse_budget
from zoo import gpt_linen

ZOO = pathlib.Path(__file__).parent / "zoo"

W = jax.ShapeDtypeStruct((32, 32), jnp.float32)
X = jax.ShapeDtypeStruct((8, 32), jnp.float32)
REPO = pathlib.Path(__file__).resolve().parents[1]


def loss(w, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)


@pytest.fixture(scope="module")
def gpt():
    return workload(gpt_linen.model(), 2, 8)


def test_offload_on_the_cpu_never_plans_negative_memory(gpt):
    planner = Planner(gpt, cache=None, offload=True, groups=1, max_iterations=1)
    plan = planner.plan(0.8)  # on main: -8,128 bytes, the temp less the offloaded bytes
    # The CPU's offload probe: offloading removes no device bytes, so nothing is
    # offloaded and the plan's bytes are its own compile's.
    assert planner.offload_probe.figure == 0.0 and plan.offloaded_bytes == 0
    assert 0 <= plan.measured_bytes == planner.records[plan.spec].memory_bytes \
        <= plan.budget_bytes


def test_no_offload_never_returns_an_offload_preset(gpt):
    planner = Planner(gpt, cache=None, offload=False, groups=1, max_iterations=1)
    [preset] = planner.measure_all([rk.parse("minimal_offloaded")])
    assert preset.offloaded_bytes > 0
    plan = planner.plan(0.9)
    assert plan.offloaded_bytes == 0 and not plan.policy.offload, plan.spec


INT_LOGITS = """
import flax.linen as nn
import jax.numpy as jnp

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.relu(nn.Dense(32)(x)))

class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(64)(x).astype(jnp.int32)

def model():
    return Model()
"""


def test_integer_logits_are_refused(tmp_path, capsys):
    path = tmp_path / "ints.py"
    path.write_text(INT_LOGITS)
    assert cli.main(["compare", "--model", f"{path}:model", "--batch", "2", "--seq", "8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "remat-kit compare: error: ints.py:model: the loss has no float path to the "
        "parameters (integer or boolean logits? a stop_gradient?): its gradient is zero, so "
        "there is no backward pass to rematerialize; return float logits"]


@pytest.mark.parametrize("where", ["import", "function"])
def test_os_exit_in_a_model_file_is_an_error(tmp_path, capsys, where):
    path = tmp_path / "quits.py"
    body = "os._exit(0)\n" if where == "import" else ""
    path.write_text(f"import os\n{body}\ndef model():\n    os._exit(0)\n")
    assert cli.main(["compare", "--model", f"{path}:model"]) == 2
    said = {"import": f"{path} does not import: ExitCalled:",
            "function": f"model() raised ExitCalled at {path}:4:"}[where]  # the user's line
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:model': {said} it called "
        "os._exit(0), which would end remat-kit with no report"]


def test_plan_arguments_are_named_or_the_users_own_error():
    with pytest.raises(ValueError, match=r"offload must be None, True, False or a host "
                                         r"bandwidth in bytes/s > 0, got 0$"):
        rk.plan(loss, W, X, budget=1.0, cache=None, offload=0)
    with pytest.raises(TypeError, match=r"^loss_fn must be a loss\(\*args\), a policy -> loss "
                                        r"factory or a remat_kit.Workload, got int 5$"):
        rk.plan(5, W, X, budget=1.0, cache=None)

    def factory(policy):
        return 1 / 0  # the user's own bug, not a plain loss
    with pytest.raises(ZeroDivisionError):
        rk.plan(factory, W, X, budget=1.0, cache=None)


def test_a_negative_infinite_budget_names_the_value(capsys):
    code = cli.main(["plan", "--config", "tiny", "--batch", "1", "--seq", "8",
                     "--budgets", "-inf"])
    err = capsys.readouterr().err
    assert code == 2 and "expected one argument" not in err
    assert err.startswith("remat-kit plan: error: --budgets: a budget must be ")
    assert err.endswith("; got '-inf'\n")


def test_random_bytes_are_named_as_the_file(tmp_path, capsys):
    path = tmp_path / "noise.py"
    path.write_bytes(bytes(range(256)) * 4)
    assert cli.main(["compare", "--model", f"{path}:model"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"in {path}" in line and "None" not in line


def test_the_budgets_docs_give_bytes_as_the_code_takes_them():
    row = next(line for line in (REPO / "docs" / "plan.md").read_text().splitlines()
               if line.startswith("| `--budgets`"))
    examples = re.findall(r"`([^`]+)`", row.split("|")[2])
    assert "6000000000B" in examples and examples
    for example in examples:
        parse_budget(example)  # every form the row shows is taken
    with pytest.raises(rk.BudgetError, match="6000000000B"):
        parse_budget("6000000000")  # a bare number above 1, as the row says


UNEVEN = """
import flax.linen as nn

class Block(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.relu(nn.Dense(self.hidden)(x)))

class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for hidden in (64, 128, 128):  # one class, layer 0 narrower
            x = Block(hidden)(x)
        return nn.Dense(64)(x)

def model():
    return Model()
"""


def test_blocks_of_one_class_that_differ_are_said_to(tmp_path, capsys):
    path = tmp_path / "uneven.py"
    path.write_text(UNEVEN)
    out = tmp_path / "records.json"
    assert cli.main(["compare", "--model", f"{path}:model", "--batch", "2", "--seq", "8",
                     "--policies", "none,full", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert all(r["layers_residual_bytes"] is None for r in records)  # not 3 x layer 0
    # Each block's input bytes: [2, 8, 32] f32 activations + its two Dense layers.
    sizes = [2 * 8 * 32 * 4 + 4 * (32 * h + h + h * 32 + 32) for h in (64, 128, 128)]
    said = ("the 3 blocks differ in shape: their inputs (parameters and activations) are "
            f"{', '.join(f'{b:,}' for b in sizes)} bytes")
    assert all(any(n.startswith(said) for n in r["notes"]) for r in records)
    capsys.readouterr()
    assert cli.main(["explain", "--model", f"{path}:model", "--batch", "2", "--seq", "8",
                     "--policy", "full"]) == 0
    shown = capsys.readouterr().out
    assert "model (3 layers)" not in shown and said in " ".join(shown.split())


MIXED = """
import flax.linen as nn
import jax.numpy as jnp

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16)(nn.relu(nn.Dense(32)(x)))

class Model(nn.Module):
    @nn.compact
    def __call__(self, x, y):
        for _ in range(2):
            x = Block()(x)
        return x

def mixed():  # leading axes 4 and 3: no batch axis to split
    batch = {"x": jnp.ones((4, 8, 16)), "y": jnp.ones((3, 8))}
    return Model(), batch, lambda out, batch: (out ** 2).mean()
"""


def test_leaves_with_differing_leading_axes_are_measured_as_declared(tmp_path, capsys):
    path = tmp_path / "mixed.py"
    path.write_text(MIXED)
    assert cli.main(["compare", "--model", f"{path}:mixed", "--policies", "none"]) == 0
    assert "mixed: the batch as declared, float32" in capsys.readouterr().out
    assert cli.main(["compare", "--model", f"{path}:mixed", "--mesh", "fsdp:2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "remat-kit compare: error: --mesh: the batch's leaves share no leading (batch) axis, "
        "so it does not split over the 2 data-parallel devices of mesh fsdp 2 (data x fsdp = "
        "2); make every leaf [batch, ...] or use a mesh without data and fsdp axes"]


@pytest.mark.parametrize("returns, said", [
    ("3", "int 3"),
    ("(out.mean(), {})", "a tuple (float32[], dict); return the scalar alone (no auxiliary "
                         "outputs)")])
def test_a_loss_that_returns_no_array_is_named(tmp_path, capsys, returns, said):
    path = tmp_path / "loss.py"
    path.write_text(MIXED.replace('"y": jnp.ones((3, 8))', '"y": jnp.ones((4, 8))')
                    + f"\ndef odd():\n    return Model(), mixed()[1], lambda out, b: {returns}\n")
    assert cli.main(["compare", "--model", f"{path}:odd"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:odd': loss '<lambda>' must return a float "
        f"scalar, it returned {said}"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_constant_built_under_a_jit_compiles_for_a_tpu_slice(capsys):
    """BERT's labels mask (jnp.where: a jit-ed call, traced under the slice's mesh) is
    not evaluated on this host's CPU: that ran the call on the slice's chips and raised
    AttributeError ('Executable' has no 'local_devices'), said as a remat_kit bug."""
    assert cli.main(["compare", "--model", f"{ZOO / 'bert_linen.py'}:build", "--target",
                     "tpu:v5e:2x2", "--mesh", "fsdp:2", "--batch", "8", "--policies",
                     "none"]) == 0
    out = capsys.readouterr().out
    assert ("build: batch 8, seq 16, float32, loss: your loss (XLA TPU compile (v5e:2x2, AOT), "
            "per device") in out


def test_a_train_step_budget_below_full_remat_says_what_holds_it(capsys):
    """On the CPU a train step's figure is argument + temp + output - alias, which
    had no label: a KeyError traceback where the line says what holds the memory. Full
    remat is the least of the 23 presets here: its program alone gives the same line."""
    assert cli.main(["plan", "--model", f"{ZOO / 'bert_linen.py'}:build", "--budgets",
                     "200KiB", "--step", "train", "--presets", "full"]) == 1
    captured = capsys.readouterr()
    held = [x for x in captured.out.splitlines() if x.startswith("below the minimum")]
    assert held == ["below the minimum: full remat's train step 551.79 KiB: optimizer state "
                    "256.75 KiB, parameters 128.00 KiB, backward temporaries 77.12 KiB, "
                    "recomputed values 41.00 KiB (attn_probs, key_proj), other 48.91 KiB; no layer "
                    "policy lowers the optimizer state"]


ONE_DEVICE = """
import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(x)))

class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        x = nn.Embed(64, 32)(tokens)
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("data")))
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(64)(x)

def model():
    return Model()
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_model_s_own_mesh_on_a_tpu_slice_is_the_mesh_without_mesh(tmp_path, capsys):
    """A TPU slice's chips made a data:4 mesh where --mesh is not given, and the model's
    own one-device mesh was refused against it, naming a flag the user never gave."""
    path = tmp_path / "one.py"
    path.write_text(ONE_DEVICE)
    common = ["compare", "--model", f"{path}:model", "--batch", "4", "--seq", "8",
              "--target", "tpu:v5e:2x2", "--policies", "none"]
    assert cli.main(common) == 0
    title = " ".join(capsys.readouterr().out.split())
    assert "(XLA TPU compile (v5e:2x2, AOT))" in title and "per device of" not in title
    assert cli.main([*common, "--mesh", "data:4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:model': the model builds its own mesh "
        "(data: 1 over 1 cpu devices) and --mesh asks for data:4: drop --mesh to measure on "
        "the model's own, or give --mesh data:1; or build the model over data:4"]


def test_a_loss_that_raises_is_named_as_the_loss(tmp_path, capsys):
    """The loss's own KeyError was said as 'the model raised'."""
    path = tmp_path / "loss.py"
    path.write_text(MIXED.replace('"y": jnp.ones((3, 8))', '"y": jnp.ones((4, 8))')
                    + "\ndef labels(out, batch):\n    return batch['labels']\n\n"
                    + "def odd():\n    return Model(), mixed()[1], labels\n")
    assert cli.main(["compare", "--model", f"{path}:odd"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:odd': the loss 'labels' raised KeyError at "
        f"{path}:22 on the batch (float32[4, 8, 16], float32[4, 8]) at batch 4: 'labels'; if "
        "it takes other shapes (e.g. fewer positions), give them with --batch and --seq"]


def test_a_batch_of_no_examples_is_named(tmp_path, capsys):
    """A leading axis of 0 was said as a remat_kit bug (from_model: batch must be positive)."""
    path = tmp_path / "empty.py"
    path.write_text(MIXED.replace('"y": jnp.ones((3, 8))', '"y": jnp.ones((0, 8))'))
    assert cli.main(["compare", "--model", f"{path}:mixed"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"remat-kit compare: error: --model '{path}:mixed': mixed(): the batch['y'] is "
        "float32[0, 8], an empty batch axis; give it at least one example"]


def test_a_tpu_breakdown_never_has_a_negative_part(capsys):
    # A tiny program's code (2.4 MiB) outgrows its whole TPU peak: it was listed as a part
    # all the same, leaving "other -1.06 MiB". Full's program alone shows it (program code
    # 2.10 MiB, other -1.07 MiB before the fix), without the 22 other presets' compiles.
    code = cli.main(["plan", "--config", "tiny", "--batch", "1", "--seq", "8", "--budgets",
                     "1MiB", "--step", "train", "--target", "tpu:v5e:1x1", "--presets", "full"])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("below the minimum:")]
    assert code == 1 and " -" not in line and "program code" not in line, line
    peak = re.search(r"'s peak ([\d.]+ \w+):", line)
    assert peak is not None, line
