"""The mesh a step is measured on: host devices the CLI makes for --mesh (no XLA_FLAGS)."""

import json
import os
import subprocess
import sys


def test_the_cli_makes_the_host_devices_mesh_needs_without_xla_flags(tmp_path):
    # A fresh process whose backend has not started: --mesh data:2 needs 2 CPU devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "remat_kit.cli", "compare", "--config", "tiny",
                           "--batch", "2", "--seq", "16", "--mesh", "data:2", "--policies",
                           "full", "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    context = json.loads(out.read_text())["context"]
    assert (context["devices"], context["mesh"]) == (2, "data:2")
