"""The `>>>` examples of the front floor's public functions run, and give what they say
(issue 47: docstrings that teach). Tiny models on the CPU."""

import doctest

import pytest

from remat_kit.api import answers, configs

MODULES = [answers, configs]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_the_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def test_every_public_answer_has_an_example():
    names = [n for m in MODULES for n in m.__all__ if callable(getattr(m, n))
             and getattr(m, n).__module__ == m.__name__]
    bare = [n for m in MODULES for n in names if n in m.__all__
            and ">>>" not in (getattr(m, n).__doc__ or "")]
    assert bare == [], "give these a short >>> example"
