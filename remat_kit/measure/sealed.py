"""Cache entries sealed with a checksum, and checked against a schema when read back.

Every cache kept on disk (the figure cache, the CPU roofline, the plan cache) stores an entry as
{"sha256": digest of its canonical JSON, "entry": ...} (`seal`). `unseal` returns it only where
the digest matches and every field has its kind and range (`Schema`; `count`, `amount`, ...);
anything else is a miss, measured again and overwritten. Docs: docs/speed.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping

Check = Callable[[object], bool]
Schema = Mapping[str, Check]  # field -> whether its value is valid; every field required


def _digest(entry) -> str:
    text = json.dumps(entry, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(entry: dict) -> dict:
    """The JSON-ready form of `entry` to store: {"sha256": ..., "entry": entry}."""
    return {"sha256": _digest(entry), "entry": entry}


def unseal(stored, schema: Schema) -> dict | None:
    """The entry `seal` made, or None where `stored` is not one (another layout,
    a changed byte) or a field of `schema` is missing or fails its check."""
    if not (isinstance(stored, dict) and set(stored) == {"sha256", "entry"}
            and isinstance(stored["entry"], dict)):
        return None
    entry = stored["entry"]
    try:
        if stored["sha256"] != _digest(entry):
            return None
    except ValueError:  # a value JSON cannot hold
        return None
    if not all(name in entry and check(entry[name]) for name, check in schema.items()):
        return None
    return entry


# Checks, for schemas.

def count(x) -> bool:
    """A whole number >= 0 (bytes, iterations); not a bool."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def amount(x) -> bool:
    """A finite number >= 0 (FLOPs, seconds); not a bool."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and x >= 0)


def positive(x) -> bool:
    """A finite number > 0 (a peak FLOP/s or bandwidth)."""
    return amount(x) and x > 0


def text(x) -> bool:
    """A string."""
    return isinstance(x, str)


def texts(x) -> bool:
    """A list of strings (notes)."""
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def optional(check: Check) -> Check:
    """`check`, or None."""
    return lambda x: x is None or check(x)


def mapping(check: Check) -> Check:
    """A dict of string keys whose values all pass `check`."""
    return lambda x: isinstance(x, dict) and all(isinstance(k, str) and check(v)
                                                 for k, v in x.items())


__all__ = ["Schema", "amount", "count", "mapping", "optional", "positive", "seal",
           "text", "texts", "unseal"]
