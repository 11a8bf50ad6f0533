"""Two processes x 4 CPU devices train on one 2x4 mesh through jax.distributed
(gloo collectives), and lose exactly what one process with 8 devices loses."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

STEPS = 5
TIMEOUT_S = 300  # the whole test, both processes and the reference


def _env(devices: int) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(workdir, data, *extra) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--config=experiments/configs/tiny.py",
            f"--workdir={workdir}", f"--config.data={data}", "--config.mesh=data:2,tensor:4",
            f"--config.num_steps={STEPS}", "--config.warmup_steps=1", "--config.seq_len=16",
            "--config.batch_size=8", "--config.eval_batches=1", "--config.num_layers=1",
            # No remat: the train step compiles once (a policy adds a "none" compile
            # for the summary); policies on meshes are tests/test_mesh.py's.
            "--config.remat=none", *extra]


def _losses(workdir) -> list[float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_loss"] for line in lines]


def test_two_processes_train_like_one(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    port = _free_port()
    dist = [f"--config.coordinator=127.0.0.1:{port}", "--config.num_processes=2",
            "--config.distributed_timeout=120"]
    procs = []
    try:
        # One workdir for both, as on a shared file system: orbax writes each
        # checkpoint together from every process.
        for i in range(2):
            procs.append(subprocess.Popen(
                _train(tmp_path / "two", data, *dist, f"--config.process_id={i}"),
                env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        procs.append(subprocess.Popen(_train(tmp_path / "one", data), env=_env(8),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # bounded even when a process hangs or the test fails
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    # Only process 0 writes metrics: one line per step, not two.
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == STEPS
    assert two == pytest.approx(one, abs=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["mesh"] == "data:2,tensor:4"
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["processes"] == 1
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == [str(STEPS)]


@pytest.mark.parametrize("field, value, message", [
    ("mesh", "data:2,model:4", "unknown axis 'model'"),
    ("mesh", "tensor:3", "num_heads=4 is not divisible by the tensor axis of size 3"),
    ("mesh", "data:3", "batch 8 does not split over the 3 data-parallel devices"),
    ("num_processes", 2, "the coordinator must be HOST:PORT (or JAX_COORDINATOR_ADDRESS)"),
    ("num_processes", 0, "config.num_processes must be a positive int"),
])
def test_train_rejects_bad_sharding_fields_before_starting(field, value, message, tmp_path):
    from experiments import train
    from experiments.configs import tiny
    from remat_kit.cli.commands import BadInput

    config = tiny.get_config()
    config[field] = value
    with pytest.raises(BadInput) as e:
        train.train_and_evaluate(config, str(tmp_path))
    assert message in str(e.value)
