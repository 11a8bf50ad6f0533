"""The wrappers' cache of traced block programs (`remat_kit.trace.call_region.once`)."""

from remat_kit.trace import call_region


def test_a_kept_program_is_made_once_and_the_least_recently_used_goes_first():
    built, made = {}, []

    def make(k):
        made.append(k)
        return f"program {k}"

    assert call_region.once(built, 0, lambda: make(0)) == "program 0"
    for k in range(1, call_region.KEPT):
        call_region.once(built, k, lambda k=k: make(k))
    assert call_region.once(built, 0, lambda: make("again")) == "program 0"  # kept, now recent
    call_region.once(built, "new", lambda: make("new"))  # one past KEPT: key 1 goes
    assert len(built) == call_region.KEPT and 1 not in built and 0 in built
    assert made == [*range(call_region.KEPT), "new"]


def test_an_unhashable_call_is_made_each_time_and_never_kept():
    built = {}
    assert [call_region.once(built, None, lambda: 7) for _ in range(2)] == [7, 7]
    assert built == {}
