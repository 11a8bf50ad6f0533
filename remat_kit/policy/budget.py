"""Memory budgets: what `--budget`, `--budgets`, `auto:budget=` and a config's
`memory_budget` mean.

`parse_budget` gives a `Budget`: a size ("6GiB", "512MiB", "24B") or a fraction of no remat's
memory ("0.25", "25%"); a bare number above 1 is refused (24 means 24 GiB more often than 24 bytes).
It parses only; the floor a budget cannot go below is `remat_kit.decide.floor`.
Docs: docs/plan.md (`--budgets`), docs/fit.md (`--budget`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from remat_kit.errors import BudgetError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?P<num>[-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$",
                   re.I)
_HELP = "a size (6GiB, 512MiB, 6000000000B) or a fraction 0 < f <= 1 of no-remat memory " \
        "(0.25, 25%; temp memory on CPU, peak on TPU and GPU)"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A parsed memory budget: `bytes` (int) or `fraction` (0 < f <= 1) of no-remat memory."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, none_bytes: int | None) -> int:
        """Bytes, given no remat's memory `none_bytes` (`Record.memory_bytes` of `none`)."""
        return self.bytes if self.bytes is not None else int(self.fraction * none_bytes)


def parse_budget(budget: "str | int | float | Budget") -> Budget:
    """Parses a memory budget.

    Args:
      budget: a string: a number and a unit ("6GiB", "512MiB", "1.5GB",
        "6000000000B"; KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of
        1000, B is bytes; rounded down to whole bytes), a fraction of no
        remat's memory (`Record.memory_bytes`: temp on CPU, peak on TPU and
        GPU) 0 < f <= 1 ("0.25", "1"), or a percentage ("25%"). From Python,
        a number 0 < f <= 1 is a fraction and a whole number above 1 a byte
        count (an int such as 6_000_000_000, as the planner is called with
        its own figures).
    Returns:
      A `Budget`.
    Raises:
      BudgetError: not a size or fraction, zero or negative, an unknown
        unit, a unit of bits (16Gb, a lowercase b), a string number above 1 without a unit ("24": add a unit), or
        a byte count that is not whole (1.5).
    """
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
        raise BudgetError(f"a budget is a size or a fraction ({_HELP}), not a "
                          f"{type(budget).__name__}", budget=repr(budget))
    text = str(budget).strip()
    percent = text.endswith("%")
    m = _SIZE.match(text[:-1] if percent else text)
    if m is None or (percent and m.group("unit")):
        raise BudgetError(f"a budget must be {_HELP}", budget=budget)
    value, unit = float(m.group("num")), m.group("unit").lower()
    if len(unit) == 2 and m.group("unit").endswith("b") and unit in _UNITS:  # 16Gb: bits
        given = m.group("unit")
        raise BudgetError(f"unit {given!r} reads as bits; a budget is in bytes: "
                          f"{m.group('num')}{given[0].upper()}B (powers of 1000) or "
                          f"{m.group('num')}{given[0].upper()}iB (of 1024)", budget=budget)
    if unit and unit not in _UNITS:
        raise BudgetError(f"unknown unit {m.group('unit')!r} in a budget; units: "
                          "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (of 1024)",
                          budget=budget)
    if not math.isfinite(value):
        raise BudgetError(f"a budget must be finite ({_HELP})", budget=budget)
    if value <= 0:
        raise BudgetError(f"a budget must be positive ({_HELP})", budget=budget)
    if percent:
        if value > 100:
            raise BudgetError("a percentage budget must be at most 100%", budget=budget)
        return Budget(fraction=value / 100)
    if not unit and value <= 1:
        return Budget(fraction=value)
    if not unit and isinstance(budget, str):
        num = m.group("num")
        units = f"{num}GiB, {num}MiB, or {num}B for bytes" if value == int(value) \
            else f"{num}GiB or {num}MiB"
        raise BudgetError(f"a bare number above 1 is not a budget (a fraction of no-remat "
                          f"memory is 0 < f <= 1): add a unit: {units}", budget=budget)
    n = value * _UNITS[unit or "b"]
    if unit and unit != "b":
        if int(n) < 1:  # 1e-30GiB: less than a byte, a budget of nothing
            raise BudgetError(f"a budget must be at least 1 byte ({_HELP})", budget=budget)
        return Budget(bytes=int(n))  # 3.2MiB is 3355443.2 bytes: whole bytes, rounded down
    if n != int(n):
        raise BudgetError(f"a size in bytes must be a whole number ({_HELP})", budget=budget)
    return Budget(bytes=int(n))


__all__ = ["Budget", "parse_budget"]
