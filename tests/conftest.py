"""Test-wide settings, applied before JAX is imported by any test module.

XLA's CPU backend spends most of a tiny model's compile time in LLVM
optimization, and threefry dropout masks make it several times slower
(measured: 20 s vs 3.4 s for the tiny model's grad). Tests compare values,
not speed, so they compile at LLVM -O0 with the rbg PRNG. Neither changes
HLO buffer assignment, so memory figures are those of a default compile.

The host platform has 8 devices, for the sharded tests (tests/test_mesh.py).
Unsharded programs run on the first, as with one device.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
     "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_DEFAULT_PRNG_IMPL", "rbg")
