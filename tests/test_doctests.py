"""The `>>>` examples of the public functions and classes run, and give what they say
. Tiny models on the CPU."""

import doctest
import importlib
import inspect
from pathlib import Path

import pytest

import remat_kit as rk

PACKAGE = Path(rk.__file__).parent
# Every module of the package whose docstrings hold an example, wherever it sits.
MODULES = sorted(".".join(("remat_kit",) + path.relative_to(PACKAGE).with_suffix("").parts)
                 for path in PACKAGE.rglob("*.py") if ">>>" in path.read_text())
# The main functions of the namespaces `rk.linen`, `rk.nnx` and `rk.models`.
NAMESPACED = {"linen": ("remat",), "nnx": ("remat",), "models": ("get_config", "workload")}


def public_answers() -> dict[str, object]:
    """rk.__all__'s functions and classes (exceptions need no example), and NAMESPACED's."""
    found = {name: obj for name, obj in ((n, getattr(rk, n)) for n in rk.__all__)
             if inspect.isfunction(obj)
             or (inspect.isclass(obj) and not issubclass(obj, Exception))}
    found.update({f"{space}.{name}": getattr(getattr(rk, space), name)
                  for space, names in NAMESPACED.items() for name in names})
    return found


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_run(name):
    result = doctest.testmod(importlib.import_module(name),
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def test_every_public_answer_has_an_example():
    answers = public_answers()
    assert {"parse", "Policy", "Planner", "linen.remat", "models.workload"} <= set(answers)
    assert "BudgetError" not in answers
    bare = [name for name, obj in answers.items() if ">>>" not in (obj.__doc__ or "")]
    assert bare == [], "give these a short >>> example"
    # ... and the tests run it: its module is one test_the_examples_run runs.
    unrun = [name for name, obj in answers.items() if obj.__module__ not in MODULES]
    assert unrun == []
