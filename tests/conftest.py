"""Test-wide settings, applied before JAX is imported by any test module.

XLA's CPU backend spends most of a tiny model's compile time in LLVM
optimization, and threefry dropout masks make it several times slower
(measured: 20 s vs 3.4 s for the tiny model's grad). Tests compare values,
not speed, so they compile at LLVM -O0 with the rbg PRNG. Neither changes
HLO buffer assignment, so memory figures are those of a default compile.

The host platform has 8 devices, for the sharded tests (tests/test_mesh.py).
Unsharded programs run on the first, as with one device.

Compiled programs are kept in JAX's persistent compilation cache, every
compile however short, in the user's cache folder
($XDG_CACHE_HOME or ~/.cache, then remat_kit/jax-tests; JAX_COMPILATION_CACHE_DIR
overrides it), outside the checkout: a second run, in a fresh clone as in the
same one (CI clones afresh each time), loads what did not change instead of
compiling it. JAX evicts the least recently used entries past 2 GiB. A cached executable gives the same
memory_analysis and cost_analysis figures as a fresh compile (checked on
every preset, CPU and TPU targets); delete the folder to run cold.
"""

import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
     "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_DEFAULT_PRNG_IMPL", "rbg")
_CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_CACHE_HOME, "remat_kit", "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 2**30))
# One compile at a time unless a test asks for more (`--jobs`, `jobs=`): the suite runs two
# modules at once, and tests count the serial searches' compiles.
os.environ.setdefault("REMAT_KIT_JOBS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The slowest modules (measured, `make test --durations`) run first: `make test`
# runs one module per process at a time (pytest-xdist, --no-loadscope-reorder),
# and the quick ones left for the end let both processes finish together.
SLOW_FIRST = ("test_targets", "test_plan", "test_train", "test_remat", "test_scan",
              "test_resume", "test_train_faults", "test_mesh", "test_schedule", "test_fit",
              "test_from_model", "test_train_own_model", "test_remat_model",
              "test_wrappers_robust", "test_plan_layers", "test_gpu_truth", "test_multiprocess",
              "test_docs", "test_batch_models", "test_model_map", "test_own_partitioning",
              "test_time_floor", "test_plan_emit", "test_sharded_step")


# Tests over 15 s cold, marked `long`: `make test` leaves them out, `make test-long` runs them.
_LONG_FILE = os.path.join(os.path.dirname(__file__), "long_tests.txt")
LONG = frozenset(line.split()[1] for line in open(_LONG_FILE)
                 if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FIRST)))  # stable
    found = set()
    for item in items:
        if item.nodeid in LONG:
            item.add_marker(pytest.mark.long)
            found.add(item.nodeid)
    collected = {item.nodeid.split("::")[0] for item in items}
    stale = sorted(n for n in LONG - found if n.split("::")[0] in collected
                   and not config.getoption("keyword") and not config.getoption("deselect"))
    if stale:
        raise pytest.UsageError("tests/long_tests.txt names tests that are not there any "
                                "more: " + ", ".join(stale))
