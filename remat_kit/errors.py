"""The library's exceptions. Each names the bad input, the valid choices and the closest match.

Where they are raised: docs/policies.md (`UnknownTagError`), docs/plan.md (`BudgetError`),
docs/meshes.md (`MeshError`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence


def closest_choice(word: str, choices: Sequence[str]) -> str | None:
    """The closest choice, case-insensitively (MINIMAL -> minimal), or None."""
    lowered = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[found[0]] if found else None


def _choices_text(choices: Sequence[str], limit: int = 24) -> str:
    # Long lists (80-odd preset names) are cut: docs/policies.md has them all.
    shown = ", ".join(choices[:limit])
    more = f", ... and {len(choices) - limit} more (docs/policies.md lists them)"
    return shown + (more if len(choices) > limit else "")


# Characters of a long spec shown either side of the error in messages.
_SHOWN = 80


def shorten(text: str, keep: int = _SHOWN) -> str:
    """`text`, or for a long one (a 100k-character spec) its first and last `keep`
    characters (fewer, to end on a word) around how many are left out, so that messages
    stay readable."""
    if len(text) <= 2 * keep + 20:
        return text
    # Cut between words where a space lies in the outer half of each kept part (a message),
    # never inside one ("temp...[26 characters]...lues"); a spec without spaces as it is.
    head, tail = text[:keep], text[-keep:]
    if (at := head.rfind(" ")) >= keep // 2:
        head = head[:at]
    if -1 < (at := tail.find(" ")) <= keep // 2:
        tail = tail[at + 1:]
    return f"{head}...[{len(text) - len(head) - len(tail)} characters]...{tail}"


def _around(spec: str, position: int) -> str:
    """repr of `spec`, or of its `_SHOWN` characters either side of `position` if long."""
    if len(spec) <= 2 * _SHOWN + 20:
        return repr(spec)
    lo, hi = max(0, position - _SHOWN), min(len(spec), position + _SHOWN)
    return (f"{'...' if lo else ''}{spec[lo:hi]!r}{'...' if hi < len(spec) else ''} "
            f"({len(spec)} characters)")


class BadInput(ValueError):
    """Input a command or script cannot use (a size, a path, a flag); the message is one
    line for the user, naming the bad value."""


class RematSpecError(ValueError):
    """A policy spec string (or Policy field) is malformed.

    Attributes:
      message: what is wrong, without the location.
      spec: the whole spec string, or None.
      token: the offending token.
      position: 0-based character offset of `token` in `spec`, or None.
      choices: the valid choices at that point.
      closest: the closest valid choice to `token`, or None.
    """

    def __init__(self, message: str, *, spec: str | None = None, token: str | None = None,
                 position: int | None = None, choices: Sequence[str] = ()):
        self.message, self.spec, self.token, self.position = message, spec, token, position
        self.choices = tuple(choices)
        self.closest = closest_choice(token, self.choices) if token and self.choices else None
        if self.closest == token:  # the token is valid here, the syntax around it is not
            self.closest = None
        parts = [shorten(message, 2 * _SHOWN)]
        if token is not None and spec is not None and position is not None:
            where = f"in spec {_around(spec, position)} at position {position}"
            # A token that is the whole spec is not shown twice.
            parts.append(where if token.strip() == spec.strip() else
                         f"{where}: {shorten(token)!r}")
        elif token is not None:
            parts.append(f"got {shorten(token)!r}")
        if self.closest:
            parts.append(f"did you mean {self.closest!r}?")
        if self.choices:
            parts.append(f"valid choices: {_choices_text(self.choices)}")
        super().__init__("; ".join(parts))


class UnknownTagError(RematSpecError):
    """A tag name is not in the vocabulary, or is not emitted by the function checked."""

    def __init__(self, name: str, choices: Sequence[str], *, spec: str | None = None,
                 position: int | None = None, message: str = "unknown tag"):
        super().__init__(message, spec=spec, token=name, position=position, choices=choices)


class UnknownModuleError(RematSpecError):
    """A module class named in an `apply_remat` mapping matches no submodule of the model.

    Attributes (besides RematSpecError's): `choices` are the class names of
    the model's submodules (linen: those it calls; NNX: the nodes of its graph).
    """

    def __init__(self, name: str, choices: Sequence[str], *, message: str):
        super().__init__(message, token=name, choices=choices)


class MeshError(ValueError):
    """A mesh spec, a mesh that does not fit the devices or the model, or a failed
    multi-process start. The message names the bad value and the valid choices."""


class BudgetError(RematSpecError):
    """A memory budget that is malformed, or below what any policy reaches.

    Attributes:
      budget: the budget as given.
      minimum_bytes: the least memory any policy reaches (full remat), bytes
        per device (the planner's figure: temp on CPU, peak on TPU and GPU;
        `fit`'s whole step); None for a malformed budget.
      minimum_fraction: minimum_bytes / no remat's memory; None for a
        malformed budget or where there is no such ratio.
    """

    def __init__(self, message: str, *, budget=None, minimum_bytes: int | None = None,
                 minimum_fraction: float | None = None, choices: Sequence[str] = ()):
        self.budget, self.minimum_bytes = budget, minimum_bytes
        self.minimum_fraction = minimum_fraction
        super().__init__(message, token=None if budget is None else str(budget),
                         choices=choices)


def check_positive(name: str, value) -> None:
    """ValueError naming `name` unless `value` is a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# How a checkout is installed (the Makefile's `pip install -e`): setuptools' compat mode puts
# the checkout on sys.path (a .pth file), where its default puts an import hook after
# Python's own path search, which a folder named remat_kit (the checkout itself, seen from
# the folder that holds it) then shadows as an empty namespace package.
EDITABLE_MODE = "--config-settings editable_mode=compat"


def install_command(extra: str) -> str:
    """The pip command that adds `extra` where this package runs from: `pip install -e
    '.[tpu]' --config-settings editable_mode=compat` in a checkout (a pyproject.toml beside
    the package; the Makefile's install, `EDITABLE_MODE`), else `pip install
    'remat-kit[tpu]'`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, "pyproject.toml")):
        return f"cd {root} && pip install -e '.[{extra}]' {EDITABLE_MODE}"
    return f"pip install 'remat-kit[{extra}]'"
