"""The planner's MILP ends: each HiGHS run stops at its time limit with its incumbent and
says its gap, and a signal reaches the caller within a fraction of a second of a solve."""

import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from remat_kit.decide.milp import CostModel


def hard_model(layers: int = 16, tags: int = 12) -> CostModel:
    """A per-layer model as hard as llama_1b's: `layers` copies of a chain of `tags`
    near-equal items (bytes 1.000-1.099 MB, FLOPs 1.0-1.2 GFLOP), every item needed."""
    rng = np.random.default_rng(0)
    b, f = rng.integers(1000, 1100, tags) * 1000, rng.integers(1000, 1200, tags) * 1e6
    items = tuple((f"t{j}", g) for g in range(layers) for j in range(tags))
    j = {i: int(i[0][1:]) for i in items}
    return CostModel(tags=items, nbytes={i: int(b[j[i]]) for i in items},
                     flops={i: float(f[j[i]]) for i in items},
                     parents={i: frozenset({(f"t{j[i] - 1}", i[1])} if j[i] else ())
                              for i in items},
                     needed=frozenset(items))


def test_a_time_limited_solve_returns_its_incumbent_and_gap():
    model = hard_model()
    room = 0.37 * sum(model.nbytes.values())
    start = time.perf_counter()
    saved, offloaded, status = model.solve(room, 1e8, seconds=0.3)
    assert time.perf_counter() - start < 5  # three runs of 0.3 s, and HiGHS's start
    gap = re.search(r"the FLOPs run stopped at its time limit, gap (\d+\.\d+)%", status)
    assert gap and 0 < float(gap.group(1)) < 5, status
    assert offloaded == frozenset() and len(saved) > 50
    assert model.cost(saved)[0] <= room  # the incumbent is a plan within the room


def test_sigterm_during_a_solve_is_seen_at_once():
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, '.')
        from remat_kit.cli import stops
        from tests.test_milp_bounds import hard_model
        model = hard_model()
        print('solving', flush=True)
        with stops.catching():
            try:
                model.solve(0.37 * sum(model.nbytes.values()), 1e8, seconds=60)
            except stops.Stopped as e:
                print('stopped', e.name, flush=True)
                sys.exit(e.exit_code)
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "solving\n"
    time.sleep(1.0)  # in HiGHS by now
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "stopped SIGTERM\n"
    assert time.perf_counter() - sent < 1.0  # seen at once, HiGHS still running
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.perf_counter() - sent < 5.0  # the process ends with its time limit at 60 s
