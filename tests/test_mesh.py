"""Sharded meshes: grads equal one device's, per-device figures, tags, bad input.

Runs on the 8 host devices tests/conftest.py creates.
"""

import functools
import math
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_kit as rk
from remat_kit import mesh as rk_mesh
from remat_kit.errors import MeshError
from remat_kit.models import Transformer, get_config, make_loss_fn

POLICIES = ("full", "selective", "minimal", "dots")
BATCH, SEQ = 8, 16


def _sharded_grad(cfg, mesh, boxed):
    """jit of the grads under every policy in POLICIES at once (one compile per
    mesh), with the parameters sharded by their logical axes on `mesh`."""
    params_sh = rk_mesh.shardings(boxed, mesh)
    batch_sh, key_sh = rk_mesh.batch_sharding(mesh), rk_mesh.replicated(mesh)

    def grads(params, inputs, targets, key):
        return [jax.grad(make_loss_fn(Transformer(cfg.replace(remat=p))))(
            params, inputs, targets, key) for p in POLICIES]
    return jax.jit(grads, in_shardings=(params_sh, batch_sh, batch_sh, key_sh),
                   out_shardings=[params_sh] * len(POLICIES))


@functools.cache
def _reference(model: str):
    """(config, tokens, boxed params, single-device grads without remat) of a model."""
    # One layer: what the mesh changes is inside every layer alike (compile time).
    cfg = get_config(model, num_layers=1)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, cfg.vocab_size)
    boxed = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
    ref = jax.jit(jax.grad(make_loss_fn(Transformer(cfg))))(
        nn.unbox(boxed), tokens, tokens, jax.random.key(2))
    return cfg, tokens, boxed, ref


@pytest.mark.parametrize("model, spec, devices", [
    ("tiny", "data:8", 8),
    ("tiny", "fsdp:8", 8),
    ("tiny", "tensor:4", 4),
    ("tiny_llama", "data:2,fsdp:2,tensor:2", 8),  # grouped-query heads split too
])
def test_sharded_grads_equal_single_device(model, spec, devices):
    cfg, tokens, boxed, ref = _reference(model)
    params, key = nn.unbox(boxed), jax.random.key(2)
    mesh = rk_mesh.make(spec, jax.devices()[:devices])
    with rk_mesh.use(mesh):
        grads = _sharded_grad(cfg, mesh, boxed)(params, tokens, tokens, key)
    for policy, g in zip(POLICIES, grads):
        chex.assert_trees_all_close(g, ref, rtol=1e-5, atol=1e-7, custom_message=policy)
    # The shardings the rules promise: FSDP splits embed, tensor the heads.
    kernel = grads[0]["layers_0"]["attn"]["query"]["kernel"]  # [embed, heads, head_dim]
    expected = {"data:8": (64, 4, 16), "fsdp:8": (8, 4, 16), "tensor:4": (64, 1, 16),
                "data:2,fsdp:2,tensor:2": (32, 2, 16)}[spec]
    assert kernel.addressable_shards[0].data.shape == expected


def test_constraints_are_in_the_program_and_named_by_rules():
    cfg = get_config("tiny")
    mesh = rk_mesh.make("data:2,fsdp:2,tensor:2")
    assert rk_mesh.rules(mesh)[0] == ("batch", ("data", "fsdp"))
    tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
    params = nn.unbox(Transformer(cfg).init(jax.random.key(1), tokens)["params"])
    # JAX caches a function's trace, and `use` is not part of its cache key:
    # trace a fresh function inside it.
    args = (params, tokens, tokens, jax.random.key(0))
    plain = str(jax.make_jaxpr(make_loss_fn(Transformer(cfg)))(*args))
    with rk_mesh.use(mesh):
        sharded = str(jax.make_jaxpr(make_loss_fn(Transformer(cfg)))(*args))
    assert "sharding_constraint" not in plain  # outside `use`, the model is unchanged
    # Per layer: q, k, v, context (heads); mlp hidden; out_proj, mlpwo, in, out (embed).
    assert sharded.count("sharding_constraint") == cfg.num_layers * 9
    assert "P(('data', 'fsdp'), None, 'tensor', None)" in sharded


def test_per_device_temp_under_data_8_is_at_most_a_quarter():
    cfg = get_config("tiny", num_layers=1)
    one = rk.measure_config(cfg, 32, 32, ["none"], per_layer=False)[0]
    eight = rk.measure_config(cfg, 32, 32, ["none"], per_layer=False,
                              mesh=rk_mesh.make("data:8"))[0]
    assert one.error is None and eight.error is None
    assert eight.temp_size_in_bytes <= one.temp_size_in_bytes / 4
    # Residuals are per device: an eighth of the batch, so an eighth of the bytes.
    assert eight.residual_bytes_by_tag["mlpwi"] * 8 == one.residual_bytes_by_tag["mlpwi"]


SPECS = ["none", "full", "selective", "minimal_with_context", "dots", "save:mlp*",
         "recompute:context"]


def test_saved_tags_under_tensor_parallelism_equal_unsharded():
    """Constraints sit before the tags, so each policy keeps the same tagged
    values (global shapes) with and without the mesh. Llama: grouped-query
    heads split too."""
    cfg = get_config("tiny_llama", num_layers=1)
    mesh = rk_mesh.make("data:4,tensor:2")
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(Transformer(cfg).init(
        jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]))
    key = jax.eval_shape(lambda: jax.random.key(0))

    def saved(spec, sharded):
        loss = make_loss_fn(Transformer(cfg.replace(remat=spec)))
        with rk_mesh.use(mesh if sharded else None):
            return sorted((r.name, r.shape) for r in rk.residuals(loss, params, tokens, tokens,
                                                                  key) if r.kind == "tag")
    for spec in SPECS:
        assert saved(spec, True) == saved(spec, False), spec
    assert ("query_proj", (BATCH, SEQ, cfg.num_heads, 16)) in saved("minimal", True)


def test_measure_config_on_three_axes_reports_per_device_residuals():
    cfg = get_config("tiny")
    (rec,) = rk.measure_config(cfg, 8, 16, ["minimal"],
                               mesh=rk_mesh.make("data:2,fsdp:2,tensor:2"))
    assert rec.error is None and rec.temp_size_in_bytes > 0 and rec.flops > 0
    # query_proj per device: batch 8 / (data 2 x fsdp 2), 4 heads / tensor 2, f32, 2 layers.
    assert rec.residual_bytes_by_tag["query_proj"] == 2 * 16 * 2 * 16 * 4 * 2
    # out_proj is embed-wide: whole on each tensor rank (no sequence parallelism).
    assert rec.residual_bytes_by_tag["out_proj"] == 2 * 16 * 64 * 4 * 2
    # The layer measured alone agrees: per layer, q/k/v + out_proj + mlpwi + mlpwo.
    assert rec.layer_residual_bytes == 4 * (2 * 16 * (3 * 32 + 64 + 128 + 64))


def test_shardings_keep_a_dimension_the_mesh_does_not_divide():
    cfg = get_config("tiny", vocab_size=257)  # like GPT-2's 50257
    mesh = rk_mesh.make("data:4,tensor:2")
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(
        jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"])
    sh = rk_mesh.shardings(boxed, mesh)
    assert sh["embed"]["embedding"].spec == jax.sharding.PartitionSpec(None, None)
    assert sh["layers_0"]["mlp"]["wi"]["kernel"].spec == jax.sharding.PartitionSpec(
        None, "tensor")


# The string form, its {axis: size} twin (None: that form cannot say it), the message.
@pytest.mark.parametrize("spec, sizes, message", [
    (None, {"data": 2, "2model": 4}, "unknown axis '2model'; an axis is a name"),
    ("data:2,data:4", None, "axis 'data' is given twice"),
    ("data:0", {"data": 0}, "has size 0; sizes are ints >= 1"),
    ("data=8", None, "term 'data=8' is not AXIS:N"),
    ("data:\u0662", None, "term 'data:\u0662' is not AXIS:N"),  # an Arabic-Indic 2
    ("", None, "mesh spec must be AXIS:N"),
    (None, {}, "names no axis"),
    ("data:2048", {"data": 2048}, "needs 2048 devices, more than the 1024 supported"),
    (None, {"data": -8}, "axis 'data' has size -8"),
    (None, {"data": 2.0}, "axis 'data' has size 2.0; sizes are ints >= 1"),
    (None, {"data": True}, "has size True"),
    (None, {"data": "8"}, "has size '8'"),
    (None, {8: 1}, "unknown axis 8"),
    (None, ["data", 8], "got ['data', 8]"),
])
def test_bad_mesh_spec_string_and_dict(spec, sizes, message):
    """Both forms go through one check: `make` refuses a dict the string form refuses."""
    for form in (f for f in (spec, sizes) if f is not None):
        with pytest.raises(MeshError) as e:
            rk_mesh.parse_spec(form)
        assert message in str(e.value)
        # As many devices as the mesh asks for, so only the spec check can refuse it.
        n = math.prod(form.values()) if isinstance(form, dict) else None
        devices = jax.devices()[:n] if type(n) is int and 0 < n <= len(jax.devices()) else None
        with pytest.raises(MeshError) as e:
            rk_mesh.make(form, devices)
        assert message in str(e.value)


def test_dict_mesh_equals_string_mesh():
    assert rk_mesh.parse_spec({"data": 2, "tensor": np.int64(4)}) == {"data": 2, "tensor": 4}
    assert rk_mesh.make({"data": 2, "tensor": 4}).shape == rk_mesh.make("data:2,tensor:4").shape
    with pytest.raises(MeshError, match=r"mesh data 2 x tensor 2 needs 4 devices, but 8 cpu "):
        rk_mesh.make({"data": 2, "tensor": 2})
    with pytest.raises(MeshError, match="unknown axis 'model'"):
        rk_mesh.check_fits({"data": 2, "model": 4}, get_config("tiny"), 8)


def test_mesh_product_must_match_the_devices():
    with pytest.raises(MeshError, match=r"mesh data 2 x tensor 2 needs 4 devices, but 8 cpu "):
        rk_mesh.make("data:2,tensor:2")
    with pytest.raises(MeshError, match="xla_force_host_platform_device_count=16"):
        rk_mesh.make("data:16")
    d = jax.devices()[0]
    with pytest.raises(MeshError, match=f"device {d} is given twice"):
        rk_mesh.make("data:2", [d, d])


@pytest.mark.parametrize("spec, devices, batch, message", [
    ("data:2,fsdp:2", 4, 6, "batch 6 does not split over the 4 data-parallel devices"),
    ("tensor:8", 8, 8, "num_heads=4 is not divisible by the tensor axis of size 8"),
])
def test_mesh_must_fit_the_model(spec, devices, batch, message):
    with pytest.raises(MeshError, match=message):
        rk_mesh.check_fits(rk_mesh.parse_spec(spec), get_config("tiny"), batch)
    mesh = rk_mesh.make(spec, jax.devices()[:devices])
    with pytest.raises(MeshError, match=message):  # measure_config checks before tracing
        rk.measure_config(get_config("tiny"), batch, 16, ["full"], mesh=mesh)


def test_kv_heads_must_split_over_tensor():
    with pytest.raises(MeshError, match="num_kv_heads=2 is not divisible by the tensor axis of "
                                        "size 4"):
        rk_mesh.check_fits({"tensor": 4}, get_config("tiny_llama"), 8)


def test_missing_coordinator_is_a_clear_timeout():
    """JAX's runtime aborts a process that cannot reach its coordinator; the
    probe turns that into a MeshError. Run apart: distributed state is global."""
    code = textwrap.dedent("""
        import socket
        from remat_kit import mesh
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        try:
            mesh.initialize(f"127.0.0.1:{port}", 2, 1, timeout_s=1)
        except mesh.MeshError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timed out after 1 s: process 1 of 2 found no coordinator at 127.0.0.1:" in done.stdout


@pytest.mark.parametrize("args, message", [
    (("127.0.0.1", 2, 1), "the coordinator must be HOST:PORT"),
    (("127.0.0.1:1234", 2, 2), "process_id must be in [0, num_processes)"),
])
def test_bad_distributed_arguments(args, message):
    with pytest.raises(MeshError) as e:
        rk_mesh.initialize(*args, timeout_s=1)
    assert message in str(e.value)


def test_explain_shows_the_layer_one_device_runs(capsys):
    from remat_kit.cli import commands as cli
    assert cli.main(["explain", "--config", "tiny", "--batch", "8", "--seq", "16", "--policy",
                     "minimal", "--mesh", "data:2,fsdp:2,tensor:2"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith("│ ")}
    # batch 8 / (data 2 x fsdp 2), heads 4 / tensor 2, mlp 256 / tensor 2.
    assert "[2, 16, 2, 16]" in lines["query_proj"] and "saved" in lines["query_proj"]
    assert "[2, 16, 128]" in lines["mlpwi"] and "[2, 16, 64]" in lines["out_proj"]
    assert cli.main(["explain", "--config", "tiny", "--mesh", "fsdp:3"]) == 2
    assert "batch 8 does not split over the 3 data-parallel devices" in capsys.readouterr().err


@pytest.mark.parametrize("call, exc, message", [
    (lambda: rk_mesh.make("data:1", "cpu"), TypeError, "devices must be a list of jax devices"),
    (lambda: rk_mesh.make("data:1", ["cpu"]), TypeError, "devices must be jax devices"),
    (lambda: rk_mesh.make("data:2", []), MeshError, "needs 2 devices, but 0 devices are given"),
    (lambda: rk_mesh.use("data:2").__enter__(), TypeError,
     "rk.mesh.use takes a jax.sharding.Mesh"),
    (lambda: rk_mesh.batch_sharding({"data": 2}), TypeError, "rk.mesh.batch_sharding takes"),
    (lambda: rk_mesh.replicated("data:2"), TypeError, "rk.mesh.replicated takes"),
    (lambda: rk_mesh.axis_size({"data": 2}, "hidden"), MeshError,
     "unknown logical axis 'hidden'; valid: ['batch', 'length'"),
    (lambda: rk_mesh.check_fits({"dta": 8}, get_config("tiny"), 8), MeshError,
     "unknown axis 'dta' for the reference models, which shard over ['data', 'fsdp', "
     "'tensor']; did you mean 'data'?"),
])
def test_mesh_helpers_reject_wrong_types(call, exc, message):
    with pytest.raises(exc) as e:
        call()
    assert message in str(e.value)


def test_host_devices_never_lowers_the_count_a_process_asked_for(monkeypatch):
    # A command's --mesh data:2 must not take the 8 host devices XLA_FLAGS gave the process.
    calls = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    rk.mesh.host_devices(2)
    rk.mesh.host_devices(8)
    assert calls == []
    rk.mesh.host_devices(16)
    monkeypatch.setenv("XLA_FLAGS", "")
    rk.mesh.host_devices(4)
    assert calls == [("jax_num_cpu_devices", 16), ("jax_num_cpu_devices", 4)]
