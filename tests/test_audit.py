"""The audit: each compiled row's policy as asked (the traced program) against the program as
compiled (its optimized HLO), per tag, with a one-line finding where they differ."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit as rk
from remat_kit.ui.inputs import preset_policies
from remat_kit import _jax_private
from remat_kit.measure import audit, figure_cache

# What each kind of preset does (recompute all, by name, by primitive, offload), for the zoo.
ZOO_PRESETS = ["none", "full", "minimal", "selective", "save_dot_except_mlp", "dots",
               "minimal_offloaded"]
W = [(jnp.ones((32, 128)), jnp.ones((128, 32)))] * 3
X = jnp.ones((8, 32))


def _layer(w, x):
    h = checkpoint_name(jnp.tanh(x @ w[0]), "mlpwi")
    return x + checkpoint_name(h @ w[1], "mlpwo")


def _unscanned(prevent_cse: bool):
    """A loss factory: three unscanned layers, each under jax.checkpoint(prevent_cse)."""
    def for_policy(p):
        def loss(ws, x):
            for w in ws:
                x = (jax.checkpoint(_layer, prevent_cse=prevent_cse, policy=p.to_jax())(w, x)
                     if p.remat else _layer(w, x))
            return jnp.sum(x ** 2)
        return loss
    return for_policy


def _scanned(p):
    """A loss factory: `_layer` scanned over its stacked weights, under jax.checkpoint(p)."""
    def loss(ws, x):
        step = jax.checkpoint(_layer, policy=p.to_jax()) if p.remat else _layer
        x, _ = jax.lax.scan(lambda x, w: (step(w, x), None), x, ws)
        return jnp.sum(x ** 2)
    return loss


def test_prevent_cse_false_around_unscanned_layers_is_found():
    rows = {r.names[0]: r for r in rk.measure(_unscanned(False), W, X,
                                               policies=["none", "full"])}
    found = rows["full"].audit
    assert not found["as_asked"]
    assert found["findings"] == [
        "XLA merged the recompute of `mlpwi` with the forward (CSE): saved as if `none` (its "
        "jax.checkpoint has prevent_cse=False outside a loop: set prevent_cse=True, or scan "
        "the layers)"]
    assert [(t["tag"], t["asked"], t["compiled"], t["asked_bytes"]) for t in found["tags"]] == [
        ("mlpwi", "recompute", "merged", 3 * 8 * 128 * 4)]
    # what the finding says: the compiled temp is no remat's
    assert rows["full"].temp_size_in_bytes == rows["none"].temp_size_in_bytes


def test_prevent_cse_true_is_as_asked():
    [full] = rk.measure(_unscanned(True), W, X, policies=["full"])
    assert full.audit["as_asked"], full.audit
    assert [(t["tag"], t["compiled"]) for t in full.audit["tags"]] == [("mlpwi", "recomputed")]


def test_a_saved_name_emitted_outside_the_remat_is_found():
    """query_proj is tagged before the remat region: saving it by name saves nothing."""
    def for_policy(p):
        def loss(w, x):
            q = checkpoint_name(x @ w[0], "query_proj")
            body = lambda w, q: checkpoint_name(jnp.tanh(q) @ w[1], "mlpwo")  # noqa: E731
            out = jax.checkpoint(body, policy=p.to_jax())(w, q) if p.remat else body(w, q)
            return jnp.sum(out ** 2)
        return loss
    [row] = rk.measure(for_policy, W[0], X, policies=["save:query_proj", "full"])
    assert row.names == ("save:query_proj", "full")  # one program: the save changed nothing
    assert row.audit["findings"] == [
        "`query_proj` is never emitted inside the remat: saving it saves nothing (it is kept "
        "as with no remat)"]


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32)(jax.nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))
        return x + h


class _Decoder(nn.Module):
    prevent_cse: bool = False
    remat: bool = True

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        block = nn.remat(_Block, prevent_cse=self.prevent_cse) if self.remat else _Block
        for i in range(4):
            x = block(name=f"layers_{i}")(x)
        return nn.Dense(64)(x)


def test_a_models_own_prevent_cse_false_is_said_with_its_fix():
    """As written (nn.remat(prevent_cse=False), unscanned), XLA CPU merges the recompute:
    the model's own grad step keeps what no remat keeps; the map says so and how to fix."""
    work = rk.from_model.workload(_Decoder(), 8, 64)
    assert ("4 x jax.checkpoint(nothing_saveable) around each layer, taken over; as written, "
            "prevent_cse=False outside a scan lets XLA merge its recompute with the forward "
            "(CSE), saving as much as no remat: write prevent_cse=True, or scan the layers"
            in work.model_map.line())
    assert "as written" not in rk.from_model.workload(_Decoder(True), 8, 64).model_map.line()
    tokens = jnp.zeros((8, 64), jnp.int32)

    def temp(model):
        params = model.init(jax.random.key(0), tokens)
        loss = lambda p: jnp.sum(model.apply(p, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp(_Decoder()) == temp(_Decoder(remat=False)) > temp(_Decoder(True))


def test_an_offload_compiled_on_a_tpu_target_agrees_with_offloaded_bytes():
    """A scanned layer's output offloaded: XLA:TPU places it in host memory, as traced."""
    ws = (jax.ShapeDtypeStruct((3, 32, 128), jnp.float32),
          jax.ShapeDtypeStruct((3, 128, 32), jnp.float32))
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    [row] = rk.measure(_scanned, ws, x, policies=["offload:mlpwi"], target="tpu:v5e:1x1")
    assert row.offloaded_bytes == 3 * 8 * 128 * 4
    assert row.audit["as_asked"], row.audit
    assert [(t["tag"], t["compiled"], t["compiled_bytes"]) for t in row.audit["tags"]
            if t["asked"] == "offload"] == [("mlpwi", "host", row.offloaded_bytes)]
    # an ahead-of-time TPU compile serializes no buffer assignment: the audit says so
    assert any(u.startswith("the allocated size of the bytes kept across the forward/backward "
                            "boundary: the backend serializes no buffer assignment")
               for u in row.audit["unchecked"]), row.audit["unchecked"]
    [cpu] = rk.measure(_scanned, ws, x, policies=["offload:mlpwi"])
    assert any(u.startswith("offload: XLA CPU has no host memory space")
               for u in cpu.audit["unchecked"])


@pytest.mark.parametrize("source", ["tiny", "gpt_linen", "llama_nnx"])
def test_every_preset_audits_clean(source, monkeypatch):
    """No false alarm: every preset on the reference tiny config and two zoo models."""
    # Compiled here, not read back: an executable of the same program compiled unnamed by
    # another test carries no tag names (JAX leaves op metadata out of its cache key).
    monkeypatch.setattr(figure_cache, "folder", lambda: None)
    monkeypatch.setattr(_jax_private._compilation_cache, "is_cache_used", lambda backend: False)
    if source == "tiny":
        work = rk.models.workload(rk.models.get_config("tiny"), batch=2, seq=16)
    else:
        work = rk.from_model.workload(importlib.import_module(f"tests.zoo.{source}").make(2, 8)[0],
                                      2, 8)
    rows = rk.measure(work, policies=preset_policies() if source == "tiny" else ZOO_PRESETS)
    assert all(r.error is None for r in rows)
    assert [(r.names[0], r.audit["findings"]) for r in rows if not r.audit["as_asked"]] == []
    recomputed = {t["tag"] for r in rows for t in r.audit["tags"] if t["compiled"] == "recomputed"}
    assert {"mlpwi", "attn_probs"} & recomputed, recomputed  # the check did look


def _row(policy, seconds, **terms):
    base = {"bytes_bound_seconds": 0.0, "flops_bound_seconds": 0.0,
            "f32_flops_bound_seconds": 0.0, "hbm_bytes": 0.0, "flops": 0.0, "dcn_seconds": 0.0,
            "kernel_seconds": 0.0, "seconds": seconds}
    return rk.Record(policy, (policy,), "XLA TPU compile", "tpu:v5e:1x1",
                     predicted_seconds=seconds,
                     audit={"as_asked": True, "findings": [], "step": None,
                            "step_terms": base | terms})


def test_a_row_faster_than_none_names_the_term_or_says_none_does():
    none = _row("none", 3e-3, bytes_bound_seconds=2e-3, flops_bound_seconds=1e-3,
                hbm_bytes=2 << 30, flops=1e12)
    by_traffic = _row("full", 2.3e-3, bytes_bound_seconds=1e-3, flops_bound_seconds=1.3e-3,
                      hbm_bytes=1 << 30, flops=1.3e12)
    unexplained = _row("minimal", 2.6e-3, bytes_bound_seconds=2.1e-3,
                       flops_bound_seconds=0.5e-3, hbm_bytes=(2 << 30) + (100 << 20),
                       flops=1.3e12)
    slower = _row("dots", 3.5e-3, bytes_bound_seconds=2e-3, flops_bound_seconds=1.5e-3)
    out = {r.policy: r for r in audit.faster_than_none([none, by_traffic, unexplained, slower])}
    assert out["full"].audit["step"] == (
        "predicted 23.3% faster than none: its ops move 1.00 GiB less HBM traffic (the "
        "residuals it no longer writes and reads), 1 ms less bandwidth-bound time, against "
        "FLOPs +30.0% (+300 us compute-bound time)")
    assert out["full"].notes == (out["full"].audit["step"],)
    on_chip = _row("full", 2.3e-3, bytes_bound_seconds=1e-3, flops_bound_seconds=1.3e-3,
                   hbm_bytes=1 << 30, flops=1.3e12, vmem_bytes=3 << 30)
    assert audit.faster_than_none([none, on_chip])[1].audit["step"].startswith(
        "predicted 23.3% faster than none: its ops move 1.00 GiB less HBM traffic (the "
        "residuals it no longer writes and reads) and 3.00 GiB more VMEM traffic, 1 ms less "
        "bandwidth-bound time")
    assert out["minimal"].audit["step"] == (
        "predicted 13.3% faster than none, which no term of the time model accounts for: "
        "bandwidth-bound time +100 us (+100.00 MiB HBM traffic), compute-bound -500 us (FLOPs "
        "+30.0%; at the f32 peak +0 us): the prediction is suspect here")
    assert out["dots"].audit["step"] is None and out["none"] is none


def test_compare_wide_and_explain_audit_show_it(capsys, tmp_path, monkeypatch):
    from remat_kit.cli import commands as cli
    import json
    monkeypatch.setenv("COLUMNS", "250")  # every --wide column, headers unwrapped
    sizes = ["--config", "tiny", "--batch", "2", "--seq", "16"]
    assert cli.main(["compare", *sizes, "--policies", "none,full", "--wide", "--json",
                     str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "as asked" in out and "✓" in out
    records = json.loads((tmp_path / "c.json").read_text())["records"]
    assert [r["audit"]["as_asked"] for r in records] == [True, True]
    assert cli.main(["explain", *sizes, "--policy", "full", "--audit"]) == 0
    out = capsys.readouterr().out
    assert "the whole model under full, as asked and as compiled" in out
    assert "│ mlpwi                │ recompute │   64.00 KiB │ recomputed │      64.00 KiB │" in out


def test_a_module_outside_the_layers_is_named_as_such_not_an_unknown_tag(capsys, tmp_path):
    """Refused before a compile where the name is not yet known; where an earlier trace of
    the model registered it, compiled, and its row says the save does nothing."""
    import json
    from remat_kit.cli import commands as cli
    code = cli.main(["compare", "--model", "tests/zoo/gpt_linen.py:model", "--batch", "2",
                     "--seq", "8", "--policies", "none,save:wte", "--json",
                     str(tmp_path / "c.json")])
    err = capsys.readouterr().err
    assert "unknown tag" not in err
    if code == 2:
        assert "`wte` is emitted only outside the layers (the model map: outside: wte, ln_f" in err
    else:
        rows = {r["names"][0]: r for r in json.loads((tmp_path / "c.json").read_text())["records"]}
        assert rows["save:wte"]["audit"]["findings"] == [
            "`wte` is never emitted inside the remat: saving it saves nothing (it is kept as "
            "with no remat)"]


def test_a_compile_without_tag_names_is_unchecked_not_merged():
    # An executable read back from JAX's cache, compiled from the same program unnamed,
    # carries no tag names: its recompute cannot be seen, which is no CSE merge.
    recompute = {"mlpwi": {"bytes": 4096, "elements": 1024, "checkable": True,
                         "prevent_cse": True}}
    facts = {"text": True, "marked": False, "recomputed_roles": [], "host_bytes": None,
             "host_ops": 0, "xla_remat": 0, "platform": "cpu", "step_terms": None}
    out = audit.audit(rk.parse("full"), [], recompute, facts)
    assert out["findings"] == [] and out["as_asked"]
    assert [(t["tag"], t["compiled"]) for t in out["tags"]] == [("mlpwi", "unchecked")]
    assert out["unchecked"][0].startswith("recompute: the compiled program carries no tag names")
    named = audit.audit(rk.parse("full"), [], recompute, {**facts, "marked": True})
    assert named["findings"] == ["XLA merged the recompute of `mlpwi` with the forward (CSE): "
                                 "saved as if `none`"]


def test_the_bytes_kept_across_the_boundary_are_read_from_the_buffer_assignment():
    """A scanned layer saving `mlpwi`: XLA CPU serializes its buffer assignment, which
    sizes the stacked residual the backward reads (3 layers x 8 x 128 f32)."""
    ws = (jnp.ones((3, 32, 128)), jnp.ones((3, 128, 32)))
    [row] = rk.measure(_scanned, ws, X, policies=["save:mlpwi"])
    assert [(t["tag"], t["compiled"], t["compiled_bytes"]) for t in row.audit["tags"]] == [
        ("mlpwi", "kept", 3 * 8 * 128 * 4)]
    assert not any("boundary" in u for u in row.audit["unchecked"]), row.audit["unchecked"]


def test_a_merge_in_some_layers_only_is_found():
    """Three unscanned layers, the middle one's jax.checkpoint with prevent_cse=False:
    XLA merges that layer's recompute with the forward, and keeps its `mlpwi`."""
    def for_policy(p):
        def loss(ws, x):
            for i, w in enumerate(ws):
                x = jax.checkpoint(_layer, prevent_cse=i != 1, policy=p.to_jax())(w, x)
            return jnp.sum(x ** 2)
        return loss
    [full] = rk.measure(for_policy, W, X, policies=["full"])
    assert full.audit["findings"] == [
        "XLA merged part of the recompute of `mlpwi` with the forward (CSE): 4.00 KiB of its "
        "12.00 KiB kept across the forward/backward boundary (its jax.checkpoint has "
        "prevent_cse=False outside a loop: set prevent_cse=True, or scan the layers)"]
    assert [(t["compiled"], t["compiled_bytes"]) for t in full.audit["tags"]] == [
        ("merged in part", 2 * 8 * 128 * 4)]


def test_the_partitioners_all_gather_recomputed_in_the_backward_is_named():
    """FSDP on 4 CPU devices: under `full` the backward gathers the first weight of each
    layer again for its recompute; with no remat it reads the forward's gather."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("fsdp",))
    split = NamedSharding(mesh, P("fsdp", None))

    def for_policy(p):
        def loss(ws, x):
            for w in ws:
                x = jax.checkpoint(_layer, policy=p.to_jax())(w, x) if p.remat else _layer(w, x)
            return jnp.sum(x ** 2)
        return loss
    shapes = [((32, 128), (128, 32))] * 2
    ws = [tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=split) for s in w) for w in shapes]
    one = ([tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in w) for w in shapes],
           jax.ShapeDtypeStruct((2, 32), jnp.float32))
    rows = {r.names[0]: r for r in rk.measure(
        for_policy, ws, jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=split),
        policies=["none", "full"], per_device=(for_policy, one))}
    assert rows["none"].audit["as_asked"], rows["none"].audit["findings"]
    assert rows["full"].audit["findings"] == [
        "the partitioner's all-gather of `[0][1][0]`, `[0][0][0]` is recomputed in the "
        "backward (2 all-gather(s) the forward ran: what the recompute reads is gathered again)"]


def test_an_offload_kept_in_hbm_is_found_per_tag():
    """Where a compiled value carries the offloaded tag's name in device memory (HBM), its
    row says so; where it is placed in host memory (S(5)), it agrees with the bytes asked."""
    rows = audit._offloads({"mlpwi": 12288, "context": 4096}, {"text": True,
                           "platform": "tpu", "host_bytes": 12288, "host_ops": 1}, [],
                           {"mlpwi": [0, 12288, 3072], "context": [4096, 0, 1024]})
    assert [(r["tag"], r["compiled"], r["compiled_bytes"], r["line"]) for r in rows] == [
        ("mlpwi", "host", 12288, None),
        ("context", "kept in HBM", 0, "offload of `context` not compiled: kept in HBM")]
