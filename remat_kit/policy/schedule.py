"""Layer schedules: which decoder layers of a stack run under the remat policy.

A `Schedule` is a `Policy`'s `schedule` field, the spec suffix after "@": `uniform` (default),
`every:k`, `first:n` (Megatron-LM --recompute-num-layers), `nested[:g]` (Chen et al. 2016,
sqrt(N) checkpointing; `nested` alone is Levanter's `full@nested`).
The schedules, their defaults and errors: docs/scan.md.
"""

from __future__ import annotations

import dataclasses
import re

from remat_kit.errors import RematSpecError

KINDS = ("uniform", "every", "first", "nested")
_SYNTAX = ("uniform", "every:K", "first:N", "nested", "nested:G")
_TEXT = re.compile(r"^(?P<kind>[A-Za-z_]\w*)\s*(?::(?P<n>.*))?$")
# What the number of each kind means, for messages.
_COUNTS = {"every": "every:K puts layers 0, K, 2K, ... under the policy; K",
           "first": "first:N puts layers 0 .. N-1 under the policy; N",
           "nested": "nested:G rematerializes groups of G layers; G"}


def _count_message(kind: str) -> str:
    return f"{_COUNTS[kind]} must be a positive int"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which layers run under a policy; see the module docstring.

    Attributes:
      kind: one of `KINDS`.
      n: k of every:k, n of first:n, the group size g of nested:g (None:
        chosen from the number of layers); None for uniform.

    Raises:
      RematSpecError: an unknown kind, n given to uniform or missing for
        every/first, or n not a positive int.
    """

    kind: str = "uniform"
    n: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RematSpecError("unknown layer schedule", token=str(self.kind), choices=KINDS)
        if self.kind == "uniform" and self.n is not None:
            raise RematSpecError("the uniform schedule takes no number", token=repr(self.n),
                                 choices=_SYNTAX)
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int)
                                   or self.n <= 0):
            raise RematSpecError(_count_message(self.kind), token=repr(self.n), choices=_SYNTAX)
        if self.kind in ("every", "first") and self.n is None:
            raise RematSpecError(f"schedule {self.kind} needs a layer count, e.g. "
                                 f"{self.kind}:2", token=self.kind, choices=_SYNTAX)

    def __str__(self) -> str:
        return self.kind if self.n is None else f"{self.kind}:{self.n}"

    def check(self, num_layers: int) -> None:
        """Checks the schedule against a stack of `num_layers` layers.

        Raises:
          ValueError: k or n outside 1..num_layers, or a nested group size
            that does not divide num_layers (the message lists the divisors).
        """
        if self.kind in ("every", "first") and self.n > num_layers:
            raise ValueError(f"layer schedule {self}: {self.n} is out of range for "
                             f"{num_layers} layers; use 1..{num_layers}")
        if self.kind == "nested" and self.n is not None and num_layers % self.n:
            raise ValueError(f"layer schedule {self}: group size {self.n} does not divide "
                             f"{num_layers} layers; use one of {_divisors(num_layers)}")

    def group_size(self, num_layers: int) -> int:
        """Layers per rematerialized group of `nested` (1 for other kinds)."""
        if self.kind != "nested":
            return 1
        self.check(num_layers)
        return self.n or min(_divisors(num_layers), key=lambda g: (g + num_layers // g, g))

    def remat_mask(self, num_layers: int) -> tuple[bool, ...]:
        """Per layer: does it run under the policy (True) or without remat (False)?

        Raises:
          ValueError: as `check`.
        """
        self.check(num_layers)
        if self.kind == "every":
            return tuple(i % self.n == 0 for i in range(num_layers))
        if self.kind == "first":
            return tuple(i < self.n for i in range(num_layers))
        return (True,) * num_layers

    def boundaries(self, num_layers: int) -> int:
        """Layer (or group) inputs [batch, seq, d_model] the forward pass stores
        for rematerialized layers: one per remat'd layer; for nested, one per
        group (L/g). A nested backward pass stores g more while it recomputes
        one group: L/g + g in all, 2*sqrt(L) at g = sqrt(L) (Chen et al. 2016).

        Raises:
          ValueError: as `check`.
        """
        g = self.group_size(num_layers)
        return num_layers // g if g > 1 else sum(self.remat_mask(num_layers))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_schedule(text: str, spec: str | None = None, at: int | None = None) -> Schedule:
    """Parses the schedule after "@" in a spec: uniform, every:k, first:n, nested[:g].

    Raises:
      RematSpecError: unknown kind or a count that is not a positive int; the
        message gives `spec` and the position `at`.
    """
    stripped = text.strip()
    at = None if at is None else at + len(text) - len(text.lstrip())
    if not stripped:
        raise RematSpecError("missing layer schedule after '@'", spec=spec, token=text,
                             position=at, choices=_SYNTAX)
    m = _TEXT.match(stripped)
    if not m or m.group("kind") not in KINDS:
        raise RematSpecError("unknown layer schedule", spec=spec, token=stripped,
                             position=at, choices=_SYNTAX)
    kind, n = m.group("kind"), m.group("n")
    n_at = None if at is None or n is None else at + m.start("n")
    if n is not None and kind == "uniform":
        raise RematSpecError("the uniform schedule takes no number; write 'uniform' or leave "
                             "the schedule out", spec=spec, token=n, position=n_at,
                             choices=_SYNTAX)
    if n is not None and not re.fullmatch(r"\s*0*[1-9][0-9]*\s*", n):
        raise RematSpecError(_count_message(kind), spec=spec, token=n, position=n_at,
                             choices=_SYNTAX)
    try:
        return Schedule(kind, None if n is None else int(n))
    except RematSpecError as e:
        raise RematSpecError(e.message, spec=spec, token=stripped, position=at,
                             choices=_SYNTAX) from None


__all__ = ["KINDS", "Schedule", "parse_schedule"]
