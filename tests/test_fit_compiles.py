"""fit on real compiles: the answer of a plain binary search (`binary_search`, the test helper
of tests/test_fit_search.py) in at most 4 compiles of the policy, from nothing (the row's first
probe is one unit), on a reference config and two zoo models, varying seq and the batch, on
the XLA CPU compiler, XLA:TPU (v5e) and XLA:GPU (an H100's description with 5.33 MiB of
memory, so that XLA would rematerialize on its own, which fit holds off), ahead of time.

Both searches share one memo of compiled steps, so the binary search compiles only the sizes
fit did not; a module fixture runs each case once. Shapes are tiny: a compile is seconds."""

import functools
import importlib
import importlib.util
import tempfile
from pathlib import Path

import jax
import pytest

from remat_kit.api.configs import fit
from remat_kit.decide import fit_estimate
from remat_kit.decide.step import compile_step, default_optimizer, one_policy, resizer
from remat_kit.flax.from_model import workload
from remat_kit.models import TransformerConfig, get_config
from remat_kit.models.program import workload as config_workload
from remat_kit.policy.spec import parse
from tests.test_fit_search import binary_search
from tests.zoo import gpt_linen, llama_nnx

fit_mod = importlib.import_module("remat_kit.decide.fit")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed")
needs_cuda = pytest.mark.skipif(not fit_mod.targets._cuda_plugin_installed(),
                                reason="the CUDA plugin is not installed")


@functools.cache
def _small_h100() -> str:
    """gpu:FILE, an H100's description with 5,592,408 bytes of memory: JAX would take 75%,
    4 MiB + 2 B, and XLA hold a step to 95% of that less its arguments and outputs."""
    text = (Path(fit_mod.targets.__file__).parent / "gpu_targets" / "h100_sxm.txtpb").read_text()
    path = Path(tempfile.mkdtemp()) / "h100_small.txtpb"
    path.write_text(text.replace("device_memory_size: 84942979072",
                                 "device_memory_size: 5592408"))
    return f"gpu:{path}"


def _zoo(module, abstract_make=False):
    model = module.make(1, 16, abstract=True)[0] if abstract_make else module.model()
    return workload(model, 2, 16)


# (model, vary, fit's sizes, budget bytes, target): answers of 5 to 7 units. One config and
# two zoo models, seq and batch, CPU and v5e: three cases, as each costs 8-10 compiles
# (fit's, the binary search's and no remat's at the answer).
CASES = {
    "tiny-seq-cpu": (lambda: get_config("tiny"), "seq", dict(batch=2, multiple=16), 4 * 2**20,
                     None),
    "llama_nnx-batch-cpu": (lambda: _zoo(llama_nnx, True), "batch", dict(seq=16), 700_000,
                            None),
    "gpt_linen-batch-v5e": (lambda: _zoo(gpt_linen), "batch", dict(seq=16), 1_550_000,
                            "tpu:v5e:1x1"),
    "tiny-seq-gpu": (lambda: get_config("tiny"), "seq", dict(batch=2, multiple=16), 4 * 2**20,
                     _small_h100),
}


@pytest.fixture(scope="module")
def memo():
    """Compiled steps by (policy, argument shapes, target), shared by fit and the binary search."""
    return {}


def _run(case: str, memo: dict, monkeypatch) -> tuple[int, int, object]:
    """(fit's size, the binary search's size, fit's row) of one case."""
    make, vary, sizes, budget, target = CASES[case]
    model, target = make(), target() if callable(target) else target
    compile_step = fit_mod.compile_step

    def memoized(work, policy, optimizer, target_, xla_remat=True):
        key = (str(policy), str([a.shape for a in jax.tree.leaves(work.args)]), target_.label,
               xla_remat)
        if key not in memo:
            memo[key] = compile_step(work, policy, optimizer, target_, xla_remat)
        return memo[key]
    monkeypatch.setattr(fit_mod, "compile_step", memoized)
    (row,) = fit(model, budget, vary=vary, policies=["full"], target=target, **sizes).rows
    assert row.error is None and not row.capped
    unit = sizes.get("multiple", 1)
    shape = ((lambda k: (sizes["batch"], k * unit)) if vary == "seq"
             else (lambda k: (k * unit, sizes["seq"])))
    # A config is resized as a workload of its program (as fit's shortcut does).
    at = resizer(config_workload(model, 2, 16) if isinstance(model, TransformerConfig)
                 else model, None)[0]
    parsed = fit_mod.targets.parse_target(target)

    def fits(k):
        step = memoized(at(*shape(k)), one_policy(parse("full")), default_optimizer(), parsed,
                        False)
        return step.total_bytes <= budget
    return row.size, binary_search(fits, 4096) * unit, row


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=needs_libtpu) if c.endswith("v5e") else
    pytest.param(c, marks=needs_cuda) if c.endswith("gpu") else c for c in CASES])
def test_fit_gives_the_binary_search_answer_in_4_compiles(case, memo, monkeypatch):
    size, expect, row = _run(case, memo, monkeypatch)
    probes = row.probes
    assert size == expect > 0, probes
    assert len(probes) <= 4, probes
    # As the CLI counts them: the policy's, and no remat's at the answer for the overhead
    # (compiled here: these tiny steps are within 2x of the budget without remat).
    assert row.compiles == len(probes) + (row.none_flops == "compiled")
    # The answer is proved by compiles: it fits, one unit more does not.
    sizes = dict(probes)
    unit = CASES[case][2].get("multiple", 1)
    assert sizes[size] <= CASES[case][3] < sizes[size + unit]
    # On the small H100 XLA would rematerialize on its own at the answer (fit holds it off:
    # tests/test_verdict_fits.py shows XLA doing it there unless held off).
    if case.endswith("gpu"):
        assert row.xla_remat.startswith(f"XLA would rematerialize on its own at {size}: ")
    else:
        assert row.xla_remat is None


def test_no_remat_far_over_the_budget_is_traced_not_compiled(memo, monkeypatch):
    # FAR lowered so that a tiny scanned step's no remat counts as far over: its overhead
    # is then the traced programs' ratio, within 1.5% of the compiled one, and it costs
    # no compile. (Off XLA:TPU and GPU fit compiles no remat without the estimate.)
    monkeypatch.setattr(fit_estimate, "FAR", 0.5)
    monkeypatch.setattr(fit_estimate, "PLATFORMS", ("cpu",))  # the estimate on XLA CPU
    cfg = get_config("tiny", scan_layers=True)
    (row,) = fit(cfg, 4 * 2**20, vary="seq", policies=["full"], batch=2, multiple=16).rows
    assert row.size > 0 and row.none_flops == "traced" and row.none_fits is False
    assert row.compiles == len(row.probes) <= 4
    work = config_workload(cfg, 2, row.size)
    cpu = fit_mod.targets.parse_target(None)
    compiled = [compile_step(work, one_policy(parse(p)), default_optimizer(), cpu).flops
                for p in ("full", "none")]
    assert row.flop_overhead == pytest.approx(compiled[0] / compiled[1], rel=0.015)


def test_no_remat_has_a_traced_estimate_on_a_reference_config():
    # No remat's residuals include literals (constants it keeps); the estimate skips them
    # instead of failing, so fit can trace no remat's overhead rather than compile it.
    work = config_workload(get_config("tiny"), 2, 128)
    none, full = (fit_estimate.activation_bytes(work, parse(p), default_optimizer())
                  for p in ("none", "full"))
    assert (none, full) == (8691484, 1187588)
