"""What asking for the peak breakdown costs: compile seconds of `measure` with
and without `peak=True`, alternated over rounds on one machine, as a ratio.

    python benchmarks/peak_cost.py [config] [batch] [seq] [rounds] [target]
"""

import statistics
import sys
import time

from remat_kit.measure import targets
from remat_kit.api.answers import measure
from remat_kit.models import get_config
from remat_kit.models.program import workload


def main(name="gpt2_small", batch=1, seq=256, rounds=3, target="cpu"):
    work, target = workload(get_config(name), int(batch), int(seq)), targets.parse_target(target)
    seconds = {False: [], True: []}
    for _ in range(int(rounds)):
        for peak in (False, True):
            start = time.perf_counter()
            [r] = measure(work, policies=["full"], target=target, peak=peak)
            assert r.error is None, r.error
            seconds[peak].append(time.perf_counter() - start)
    ratios = [p / q for p, q in zip(seconds[True], seconds[False])]
    print(f"{name} b{batch} s{seq} on {target}, full: without peak "
          f"{statistics.median(seconds[False]):.2f} s, with {statistics.median(seconds[True]):.2f} s,"
          f" ratio {statistics.median(ratios):.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main(*sys.argv[1:])
