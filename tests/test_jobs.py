"""The compile pool (`remat_kit.measure.pool`, --jobs): compare, plan and fit give the same
answers with one compile at a time and with two side by side, on the CPU and on a TPU target
compiled ahead of time; a bad --jobs is one line."""

import dataclasses
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

import remat_kit as rk
from remat_kit.api.configs import config_planner, measure_config
from remat_kit.cli import commands as cli
from remat_kit.measure import figure_cache, pool
from remat_kit.models import get_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = get_config("tiny", num_layers=2)


@pytest.fixture(autouse=True)
def no_kept_figures(monkeypatch):
    """Every run compiles: no figures read back from an earlier one."""
    monkeypatch.setattr(figure_cache, "folder", lambda: None)


def _figures(records):
    return [dataclasses.replace(r, compile_seconds=None) for r in records]


@pytest.mark.parametrize("target", [None, "tpu:v5e:1x1"])
def test_compare_gives_the_same_records_with_one_or_two_jobs(target):
    runs = {}
    for jobs in (1, 2):
        with pool.using(jobs) as used:
            runs[jobs] = measure_config(TINY, 2, 16, ["none", "full", "minimal", "dots"],
                                        per_layer=False, target=target)
        assert used.jobs == jobs and used.done >= 1  # its compiles ran on this pool
    assert _figures(runs[1]) == _figures(runs[2])
    assert all(r.error is None and r.flops for r in runs[2])


@functools.cache  # the serial plans, also the Ray cluster's reference
def _plans(target, budgets, jobs):
    planner = config_planner(TINY, 2, 16, cache=None, groups=1, target=target, jobs=jobs)
    return [(p.spec, p.measured_bytes, p.measured_flops, p.iterations)
            for p in planner.frontier(list(budgets))]


@pytest.mark.parametrize("target,budgets", [(None, [0.6, 0.8, 1.0]),
                                            ("tpu:v5e:1x1", [0.92, 0.96, 1.0])])
def test_plan_gives_the_same_plans_with_one_or_two_jobs(target, budgets):
    plans = {1: _plans(target, tuple(budgets), 1), 2: _plans(target, tuple(budgets), 2)}
    assert plans[1] == plans[2]
    assert plans[2][-1][0] == "none"  # the whole of no remat's memory holds no remat


def test_fit_gives_the_same_sizes_with_one_or_two_jobs():
    rows = {}
    for jobs in (1, 2):
        result = rk.fit(TINY, "3MiB", vary="batch", seq=16, policies=["none", "full"],
                        max_size=64, jobs=jobs)
        rows[jobs] = [(r.policy, r.size, r.memory and r.memory.total_bytes, r.capped)
                      for r in result.rows]
    assert rows[1] == rows[2]
    assert all(0 < size < 64 for _, size, _, _ in rows[2])  # both searched to a boundary


@pytest.mark.parametrize("jobs", [0, -1, pool.cores() + 1, 1.5, True])
def test_a_bad_jobs_is_one_line(jobs, capsys):
    with pytest.raises(ValueError, match=f"jobs must be a whole number from 1 to "
                                         f"{pool.cores()}.*got {jobs!r}"):
        pool.check_jobs(jobs)
    if isinstance(jobs, int) and not isinstance(jobs, bool):
        assert cli.main(["plan", "--config", "tiny", "--budgets", "0.5",
                         f"--jobs={jobs}"]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line == (f"remat-kit plan: error: argument --jobs: must be a whole number "
                        f"from 1 to {pool.cores()} (this machine's cores), got '{jobs}'")


def test_the_default_is_one_a_core_within_the_free_memory(monkeypatch):
    monkeypatch.delenv("REMAT_KIT_JOBS")
    assert 1 <= pool.default_jobs() <= min(pool.cores(), max(
        1, pool.available_bytes() // pool.COMPILE_BYTES))
    monkeypatch.setenv("REMAT_KIT_JOBS", "1")
    assert pool.default_jobs() == 1
    with pool.using(None) as same:
        assert same is pool.current()
    monkeypatch.setenv("REMAT_KIT_JOBS", "0")
    with pytest.raises(ValueError, match=r"^REMAT_KIT_JOBS='0': give a whole number from 1 "):
        pool.default_jobs()


def test_sigterm_stops_a_pooled_plan_at_once(tmp_path):
    # Stopped while compiles run on the pool: the main thread waits on them, so the
    # signal ends the command without waiting for XLA to finish them.
    proc = subprocess.Popen(
        [sys.executable, "-m", "remat_kit.cli", "plan", "--config", "tiny", "--seq", "64",
         "--budgets", "0.3,0.5,0.7", "--jobs", str(min(2, pool.cores())), "--cache", ""],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "REMAT_KIT_COMPILE_CACHE": "",
             "PYTHONPATH": REPO})
    for line in proc.stderr:  # the first compile done: the pool is busy with the next
        if "compiled" in line:
            break
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        proc.wait(timeout=60)  # a hang guard, not a timing
    finally:
        proc.kill()
    rest = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "stopped by SIGTERM" in rest
    assert time.monotonic() - sent < 60


def test_the_progress_lines_count_the_pools_compiles(capsys):
    code = cli.main(["compare", "--config", "tiny", "--batch", "1", "--seq", "16",
                     "--policies", "none,full,minimal", "--jobs", str(min(2, pool.cores()))])
    assert code == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[")]
    assert len(lines) == 3
    counts = [re.search(r"\(compiles: (\d+) running, (\d+) done, (\d+) queued\)$", l)
              for l in lines]
    assert all(counts), lines
    done = [int(m[2]) for m in counts]
    assert done == sorted(done) and done[-1] >= 3  # the pool may have compiled before
    assert counts[-1][1] == counts[-1][3] == "0"  # the last record: nothing left to run


def test_a_local_ray_cluster_gives_the_serial_plan():
    ray = pytest.importorskip("ray")  # optional: pip install 'remat-kit[ray]'
    from remat_kit.measure import cluster
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        before = cluster.sent()
        with cluster.using("auto"):
            assert cluster.active() and pool.current().jobs == 2  # the cluster's CPUs
            on_ray = config_planner(TINY, 2, 16, cache=None, groups=1).frontier([0.6, 0.8, 1.0])
        assert cluster.sent() > before and not cluster.active()
    finally:
        ray.shutdown()
    assert [(p.spec, p.measured_bytes, p.measured_flops, p.iterations) for p in on_ray] == \
        _plans(None, (0.6, 0.8, 1.0), 1)


def test_a_ray_address_that_does_not_answer_is_one_line(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["compare", "--config", "tiny", "--policies", "none",
                     "--ray", f"127.0.0.1:{port}"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"remat-kit compare: error: --ray '127.0.0.1:{port}': ")
    assert ("no Ray cluster answers there within 3 s" in line
            or "Ray is not installed" in line), line


def test_a_compile_starts_beside_another_only_while_the_memory_holds_one(monkeypatch):
    monkeypatch.setattr(pool, "available_bytes", lambda: 1 << 30)
    jobs = pool.CompilePool(1, most=2)
    jobs.jobs = 2  # two workers here, whatever this machine's cores
    jobs.compile_rss = 2 << 30  # measured before: a compile grows the process by 2 GiB
    first_runs, release = threading.Event(), threading.Event()
    order = []

    def first():
        first_runs.set()
        release.wait(10)
        order.append("first")

    a = jobs.submit(first)
    first_runs.wait(10)
    b = jobs.submit(lambda: order.append("second"))
    time.sleep(0.3)  # room for the second to start, were it admitted (it must not be)
    assert order == [] and jobs.running == 1 and jobs.queued == 1
    release.set()
    a.result(10), b.result(10)
    assert order == ["first", "second"]
    assert jobs.compile_rss >= 2 << 30  # kept: the most a lone compile grew it


def test_a_worker_killed_for_memory_is_retried_here_then_named(monkeypatch):
    from remat_kit.measure import cluster

    class OutOfMemoryError(Exception):
        pass

    class FakeRay:  # what `cluster` calls of Ray: a task whose worker the kernel killed
        exceptions = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError,
                                           WorkerCrashedError=RuntimeError,
                                           RayTaskError=LookupError)

        @staticmethod
        def get(ref):
            raise OutOfMemoryError("Task was killed due to the node running low on memory")

    class Task:
        remote = staticmethod(lambda *args: None)

    monkeypatch.setitem(cluster._STATE, "ray", FakeRay)
    monkeypatch.setitem(cluster._STATE, "task", Task)
    here = []

    def out_of_memory(*request):
        here.append(request)
        raise MemoryError()

    monkeypatch.setattr(cluster, "compile_figures", out_of_memory)
    request = (b"m" * (3 << 20), b"options", [0])
    with pytest.raises(cluster.HostMemoryError, match=r"^out of host memory compiling a 3\.0 "
                       r"MiB program for cpu: its Ray worker died \(OutOfMemoryError\) and the "
                       r"compile retried here alone failed too \(.* GiB available here\)"):
        cluster._remote_or_here(request, "cpu")
    assert here == [(*request, "cpu")]  # retried once, here


_WRITER = """
import sys, threading
from remat_kit.measure import figure_cache
figure_cache.folder = lambda: sys.argv[1]
def write(n):
    for i in range(200):
        figure_cache.store(f"key{i % 20}", {"writer": sys.argv[2], "n": n, "i": i,
                                            "pad": "x" * 4096})
threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def test_two_processes_writing_the_figure_cache_at_once_leave_it_whole(tmp_path):
    where = str(tmp_path / "figures")
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, where, name], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
               for name in ("a", "b")]  # two threads each: four writers on the same keys
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert sorted(os.listdir(where)) == sorted(f"key{i}.json" for i in range(20))  # no .tmp
    with pytest.MonkeyPatch.context() as m:
        m.setattr(figure_cache, "folder", lambda: where)
        kept = [figure_cache.load(f"key{i}") for i in range(20)]
    assert all(k is not None and k["writer"] in "ab" and len(k["pad"]) == 4096 for k in kept)
