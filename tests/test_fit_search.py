"""fit's search by prediction then verification: the answer a plain binary search gives, where
the step's memory is affine in the batch or quadratic in the sequence length (as a compiled
step's is, up to XLA's buffer choices), in at most 4 compiles a policy from a start above the
answer (a later row: rows start at the largest size found so far), 5 from nothing."""

import pytest

from remat_kit.decide.fit_search import _search


def binary_search(fits, max_units: int) -> int:
    """The largest k in [0, max_units] with fits(k): doubling from 1, then bisection."""
    lo, hi = 0, None
    k = 1
    while hi is None:
        if fits(k):
            lo = k
            if k == max_units:
                return k
            k = min(2 * k, max_units)
        else:
            hi = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def searched(memory, at_zero: int, budget: int, max_units: int, start: int, degree: int):
    """(answer, units compiled) of `_search` on a memory model, memory(k) bytes at unit k."""
    probes = []

    def fits(k):
        probes.append(k)
        return memory(k) <= budget
    units, _ = _search(fits, lambda k: at_zero if k == 0 else
                       (memory(k) if k in probes else None), budget, max_units, start, degree)
    return units, probes


# (state bytes, constant workspace, bytes per unit, bytes per unit², the search's degree):
# a 70B-like seq search (state 60% of the budget), a small model's, batch searches.
SHAPES = [(57 * 2**30, 2**30, 3 * 2**20, 40 * 2**10, 2),
          (2 * 10**6, 3 * 10**5, 30_000, 700, 2),
          (8 * 2**30, 2**28, 600 * 2**20, 0, 1),
          (10**6, 10**5, 12_345, 0, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("room", [1.01, 1.3, 2.0, 5.0, 40.0])
def test_answer_of_a_binary_search_in_4_compiles_from_above_5_from_nothing(shape, room):
    state, workspace, linear, square, degree = shape
    memory = lambda k: state + workspace + linear * k + square * k * k  # noqa: E731
    budget = int(state + workspace + room * linear * 10 + square * 100)
    expect = binary_search(lambda k: memory(k) <= budget, 4096)
    for start, most in ((expect + 2, 4), (1, 5)):
        units, probes = searched(memory, state, budget, 4096, start, degree)
        assert units == expect > 0
        assert len(probes) <= most, probes
        assert len(set(probes)) == len(probes)  # nothing compiled twice


@pytest.mark.parametrize("jump", [0, 1, 3])
def test_a_step_with_jumps_still_gets_the_binary_search_answer(jump):
    # XLA's buffer choices: memory jumps by a whole unit's worth at some sizes; the
    # prediction is off, and bisection takes over after two stalls.
    memory = lambda k: 10**6 + 5_000 * k + (20_000 if k % 5 == jump else 0)  # noqa: E731
    for budget in (1_100_000, 1_333_333, 2_000_000):
        expect = binary_search(lambda k: memory(k) <= budget, 1000)
        units, probes = searched(memory, 10**6, budget, 1000, 1, 1)
        assert units == expect and len(probes) <= 10, probes


def test_capped_and_nothing_fits():
    memory = lambda k: 10**6 + 1000 * k  # noqa: E731
    assert searched(memory, 10**6, 10**9, 50, 1, 1) == (50, [1, 50])
    assert searched(memory, 10**6, 10**6, 50, 1, 1) == (0, [1])

