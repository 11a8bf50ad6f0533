"""Speed-ups that must not change a figure: JAX's persistent compilation cache
(tests/conftest.py, `cli.use_compile_cache`), the figures kept for programs
that will not run (`figure_cache`) and concurrent compiles (`measure`)."""

import dataclasses
import importlib
import os

import jax
import pytest
from jax._src import compilation_cache, monitoring

from remat_kit.cli import commands as cli
from remat_kit.measure import figure_cache, pool
from remat_kit.measure import targets
from remat_kit.models import get_config

measure = importlib.import_module("remat_kit.measure.measure")  # rk.measure is the function
from remat_kit.api import configs  # noqa: E402
POLICIES = ["none", "full", "minimal"]


def _figures(records):
    return [dataclasses.replace(r, compile_seconds=None) for r in records]


def _measure(target=None):
    return configs.measure_config(get_config("tiny", num_layers=1), 1, 16, POLICIES,
                                  per_layer=False, target=target)


@pytest.fixture
def empty_cache(tmp_path):
    """An empty persistent cache for the test; the suite's own afterwards."""
    before = jax.config.jax_compilation_cache_dir
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", before)


def test_cache_hits_and_concurrent_compiles_give_the_same_figures(empty_cache, monkeypatch):
    monkeypatch.setattr(figure_cache, "folder", lambda: None)  # JAX's cache alone
    events = []
    listener = lambda event, **_: events.append(event)  # noqa: E731
    monitoring.register_event_listener(listener)
    try:
        with pool.using(1):
            fresh = _measure()  # compiled one at a time, written to the empty cache
        assert "/jax/compilation_cache/cache_hits" not in events
        with pool.using(2):
            cached = _measure()  # read back, two at a time
    finally:
        monitoring.unregister_event_listener(listener)
    assert events.count("/jax/compilation_cache/cache_hits") == len(POLICIES)
    assert _figures(cached) == _figures(fresh)
    assert all(r.error is None and r.temp_size_in_bytes and r.flops for r in cached)


@pytest.mark.parametrize("target,memory", [("tpu:v5e:1x1", "peak_memory_in_bytes"),
                                           ("cpu", "temp_size_in_bytes")])
def test_figures_are_kept_and_read_back_without_compiling(empty_cache, monkeypatch, tmp_path,
                                                          target, memory):
    # JAX cannot load back an executable compiled for devices this machine lacks;
    # a CPU program that only is measured needs no executable either.
    compiles = []
    compile_one = measure._Compiles._compile
    monkeypatch.setattr(measure._Compiles, "_compile",
                        lambda self, *a: compiles.append(1) or compile_one(self, *a))
    fresh = _measure(target)
    assert len(compiles) == len(POLICIES)
    if target != "cpu":  # nor is it written to JAX's cache, where reading it back warns
        assert list(tmp_path.iterdir()) == []
    assert len(list((tmp_path.parent / f"{tmp_path.name}-figures").glob("*.json"))) == len(
        POLICIES)
    kept = _measure(target)
    assert len(compiles) == len(POLICIES)  # nothing compiled the second time
    assert _figures(kept) == _figures(fresh)
    assert all(r.error is None and getattr(r, memory) and r.flops and r.predicted_seconds
               for r in kept)


def test_a_program_that_runs_keeps_no_figures(empty_cache):
    cpu, tpu = targets.parse_target("cpu"), targets.parse_target("tpu:v5e:1x1")
    assert figure_cache.key("text", cpu, None, "measure", runs=True) is None
    assert figure_cache.key("text", cpu, None, "measure") is not None
    assert figure_cache.key("text", tpu, None, "measure", runs=True) is not None


def test_commands_use_a_cache_folder(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("REMAT_KIT_COMPILE_CACHE", str(tmp_path))
    try:
        cli.use_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    monkeypatch.setenv("REMAT_KIT_COMPILE_CACHE", "")  # empty: off
    cli.use_compile_cache()
    assert jax.config.jax_compilation_cache_dir == before


def test_each_program_starts_compiling_before_the_next_is_traced():
    from remat_kit.measure import targets
    from remat_kit.models import workload
    from remat_kit.policy.spec import parse
    work = workload(get_config("tiny", num_layers=1), 1, 16)
    events = []

    def loss_for_policy(policy):
        events.append(("trace", str(policy)))
        return work.loss_for_policy(policy)

    def start(lowered, text, program):
        events.append(("compile", events[-1][1]))
        return lambda: None

    groups = [(parse(p), [p]) for p in POLICIES]
    programs = measure._lower_programs(groups, loss_for_policy, work.args,
                                       targets.parse_target("cpu"), start)
    assert [names for _, names, *_ in programs] == [[p] for p in POLICIES]
    assert events == [(kind, str(parse(p))) for p in POLICIES for kind in ("trace", "compile")]


def test_the_figures_folder_keeps_the_most_recently_used(empty_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(figure_cache, "MAX_ENTRIES", 4)
    for i in range(4):
        figure_cache.store(f"k{i}", {"i": i})
    os.utime(figure_cache.folder() + "/k0.json", (0, 0))  # the oldest three, k0 first
    os.utime(figure_cache.folder() + "/k1.json", (1, 1))
    os.utime(figure_cache.folder() + "/k2.json", (2, 2))
    assert figure_cache.load("k0") == {"i": 0}  # read: now the most recent
    figure_cache.store("k4", {"i": 4})  # five entries: down to two
    assert sorted(os.listdir(figure_cache.folder())) == ["k0.json", "k4.json"]
    assert figure_cache.load("k1") is None


def test_every_kernel_parameter_that_prices_differently_has_its_own_key(empty_cache):
    """cuDNN attention's mask type and window never reach the lowered text of its stand-in
    (whose work ignores them): the figures kept for one must not answer another. Each
    variant's pricing differs, and so does its key; the same pricing keys the same (a scale
    changes no figure)."""
    import jax.numpy as jnp
    from remat_kit.measure import kernels
    from remat_kit.trace import stand_in
    kernel_args = ({}, {"is_causal": True}, {"is_causal": True, "local_window_size": (63, 0)},
                   {"local_window_size": (31, 0)}, {"scale": 0.5})
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    target = targets.parse_target("cpu")

    def keyed(kwargs):
        loss = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, implementation="cudnn", **kwargs).astype(jnp.float32).sum()
        with stand_in.cudnn_stand_in(True):
            program = jax.make_jaxpr(jax.grad(loss))(q, q, q)
            text = jax.jit(loss).lower(q, q, q).as_text()
        return (figure_cache.key(text, target, None, "measure", program=program),
                kernels.price(program, "cpu").kernel_flops, text)

    found = [keyed(kwargs) for kwargs in kernel_args]
    assert len({flops for _, flops, _ in found}) == len(kernel_args) - 1  # scale: same
    assert len({text for *_, text in found}) == 1  # what the key alone read before
    assert len({k for k, *_ in found}) == len(kernel_args) - 1
    assert keyed(kernel_args[2])[0] == found[2][0] and found[-1][0] == found[0][0]
