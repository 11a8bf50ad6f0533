"""Old import paths that still work for one round: a module-level `__getattr__` that
hands a moved name on from its new home, with a DeprecationWarning naming it
(the moves are listed in README.md ("Changes"))."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping


def moved(old: str, names: "Mapping[str, str] | str") -> Callable[[str], object]:
    """A module `__getattr__` for the module `old` whose names moved.

    Args:
      old: the old module's dotted name (`__name__`).
      names: {name: new dotted module} for names that moved one by one, or one
        dotted module that every name not found in `old` moved to (a whole module).
    Returns:
      `__getattr__(name)`: the object from its new module, after a DeprecationWarning
      "old.name moved to new.name"; AttributeError for a name that never was there.
    """

    def __getattr__(name: str):
        new = names if isinstance(names, str) else names.get(name)
        if new is None or name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)  # by name: no import upward
        warnings.warn(f"{old}.{name} moved to {new}.{name}; the old path goes in the next "
                      "round", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__


__all__ = ["moved"]
