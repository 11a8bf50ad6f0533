"""`Policy`: one declarative, hashable description of what a remat region saves.

A policy decides, for every residual, whether to save it on device, offload it to another memory
kind, or recompute it: tagged values (`checkpoint_name`) by tag pattern (`TagPolicy`), untagged
ones by a base rule. `to_jax()` gives the `policy=` of `jax.checkpoint` / `nn.remat` /
`nnx.remat`, JAX's own policy objects where one expresses it. Docs: docs/policies.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Iterable, Sequence

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from remat_kit.policy import names
from remat_kit._jax_private import name_p
from remat_kit.errors import RematSpecError
from remat_kit.policy.schedule import Schedule

cp = jax.checkpoint_policies

# Base rules for untagged values, from saving least to most.
BASES = ("nothing", "dots_no_batch", "dots", "everything")
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
DECISIONS = ("save", "offload", "recompute")


def _patterns(value, field: str) -> frozenset[str]:
    """Canonical patterns: aliases expanded; unknown tags rejected (`names.expand`)."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, dict) or not isinstance(value, (set, frozenset, list, tuple)):
        raise RematSpecError(f"Policy.{field} must be a set, list or tuple of tag patterns",
                             token=repr(value))
    pats = set()
    for p in value:
        if not isinstance(p, str) or not p.strip():
            raise RematSpecError(f"Policy.{field} holds an empty or non-string pattern",
                                 token=repr(p))
        pats.update(names.expand(p))
    return frozenset(pats)


def _specificity(pattern: str) -> tuple[int, int]:
    """Literal names beat globs; a glob with more literal characters beats a shorter one."""
    if not names.is_glob(pattern):
        return (1, len(pattern))
    return (0, sum(c not in "*?[]" for c in pattern))


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a remat region saves, offloads and recomputes.

    Attributes:
      save: tag patterns (canonical tags or fnmatch globs) whose values are
        kept in device memory for the backward pass.
      offload: tag patterns whose values are moved from `offload_src` to
        `offload_dst` memory in the forward pass and back in the backward pass.
      recompute: tag patterns whose values are recomputed. A tag matched by
        several patterns takes the decision of the most specific one: a literal
        name beats a glob; a longer glob beats a shorter one.
      base: rule for untagged values and tags no pattern matches, one of
        `BASES`: "nothing" (recompute them), "dots_no_batch" (save
        dot_general outputs without batch dims), "dots" (save dot_general and
        conv outputs), "everything" (save all). Under "dots" a tag's producer
        dot is saved whatever the tag's decision, since JAX policies judge one
        primitive at a time.
      offload_src, offload_dst: memory kinds, from `MEMORY_KINDS`; the
        source must be "device" and the destination a host kind.
      remat: False means no remat wrapper at all (the `none` spec). All other
        fields must then keep their defaults.
      schedule: which layers of a stack run under the policy
        (`remat_kit.policy.schedule.Schedule`: uniform, every:k, first:n, nested:g);
        written as the spec suffix "@every:2". `to_jax()` describes one
        layer and ignores it; the models apply it.

    `str(policy)` is the canonical spec string; `remat_kit.parse(str(p)) == p`.

    >>> import remat_kit as rk
    >>> p = rk.Policy(save=frozenset({"query_proj"}), base="dots_no_batch")
    >>> str(p), rk.parse(str(p)) == p
    ('dots_no_batch;save:query_proj', True)

    Raises:
      RematSpecError: an unknown base or memory kind, offload to the same
        memory kind, a pattern under two decisions, two equally specific
        patterns deciding a known tag differently, fields (or a schedule)
        set with `remat=False`, or a schedule that is not a `Schedule`.
      UnknownTagError: a pattern names no known tag (aliases are expanded).
    """

    save: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    recompute: frozenset[str] = frozenset()
    base: str = "nothing"
    offload_src: str = "device"
    offload_dst: str = "pinned_host"
    remat: bool = True
    schedule: Schedule = Schedule()

    def __post_init__(self):
        if not isinstance(self.remat, bool):
            raise RematSpecError("Policy.remat must be a bool (False: no remat wrapper)",
                                 token=repr(self.remat))
        for field in DECISIONS:
            object.__setattr__(self, field, _patterns(getattr(self, field), field))
        if self.base not in BASES:
            raise RematSpecError("unknown base rule", token=str(self.base), choices=BASES)
        for field in ("offload_src", "offload_dst"):
            if getattr(self, field) not in MEMORY_KINDS:
                raise RematSpecError(f"unknown memory kind for {field}",
                                     token=str(getattr(self, field)), choices=MEMORY_KINDS)
        if self.offload_src == self.offload_dst:
            raise RematSpecError(f"offload from {self.offload_src!r} to itself; "
                                 "offload_dst must differ from offload_src",
                                 token=self.offload_dst)
        # Residuals are produced on the device; JAX asserts the source is device memory.
        if self.offload_src != "device":
            raise RematSpecError("offload moves residuals off the device: offload_src must be "
                                 "'device'", token=self.offload_src, choices=("device",))
        for i, a in enumerate(DECISIONS):
            for b in DECISIONS[i + 1:]:
                both = getattr(self, a) & getattr(self, b)
                if both:
                    raise RematSpecError(f"conflicting decisions: {sorted(both)} is both "
                                         f"{a} and {b}; give each tag one decision",
                                         token=sorted(both)[0])
        if not isinstance(self.schedule, Schedule):
            raise RematSpecError("Policy.schedule must be a remat_kit.policy.schedule.Schedule",
                                 token=repr(self.schedule))
        if not self.remat and (self.save or self.offload or self.recompute
                               or self.base != "nothing" or self.schedule != Schedule()):
            raise RematSpecError("the 'none' policy (no remat wrapper) takes no other "
                                 "decisions", token=str(self))
        self.resolve()  # two equally specific patterns deciding one tag differently

    # -- decisions ----------------------------------------------------------

    def decide(self, name: str) -> str:
        """The decision for a value tagged `name`: "save", "offload" or "recompute".

        Raises:
          RematSpecError: two equally specific patterns with different
            decisions match `name`.
        """
        if not self.remat:
            return "save"
        best, best_key, best_pat = None, (-1, -1), None
        for decision in DECISIONS:
            for pat in getattr(self, decision):
                if fnmatch.fnmatchcase(name, pat):
                    key = _specificity(pat)
                    if key > best_key:
                        best, best_key, best_pat = decision, key, pat
                    elif key == best_key and decision != best:
                        raise RematSpecError(
                            f"tag {name!r} is matched by {best_pat!r} ({best}) and {pat!r} "
                            f"({decision}), equally specific; name it explicitly", token=name)
        if best is None:
            return "save" if self.base == "everything" else "recompute"
        return best

    def resolve(self, tags: Iterable[str] | None = None) -> dict[str, str]:
        """Decision per tag, for `tags` (default: the vocabulary, registered tags and
        the path tags this policy names literally, e.g. `Block_0/attn/query`).

        Raises:
          TypeError: `tags` is a single string rather than a collection of names.
        """
        if isinstance(tags, str):
            raise TypeError(f"tags must be a collection of tag names, got the string {tags!r}")
        if tags is None:
            tags = names.known_tags() + tuple(p for p in self.patterns()
                                              if names.is_path(p) and not names.is_glob(p))
        return {t: self.decide(t) for t in tags}

    def patterns(self) -> tuple[str, ...]:
        """Every tag pattern this policy names, in canonical order."""
        return _ordered(self.save | self.offload | self.recompute)

    # -- to JAX -------------------------------------------------------------

    def to_jax(self, tags: Sequence[str] | None = None, emitted: Sequence[str] = ()):
        """The `policy=` value for `jax.checkpoint`, `nn.remat` or `nnx.remat`.

        Args:
          tags: tag names to resolve glob patterns against; default the
            vocabulary plus registered tags and the path tags the policy
            names literally. Pass a function's emitted tags (see
            `remat_kit.emitted_tags`) to cover custom names.
          emitted: the names the wrapped function emits: its routing tags
            (`names.KEPT`, `moe_routing_maps`) that no pattern names are saved
            whatever the policy, as a recomputed router may route ties differently.
        Returns:
          A `jax.checkpoint_policies` built-in where one expresses the policy
          (`nothing_saveable`, `everything_saveable`, `dots_saveable`,
          `dots_with_no_batch_dims_saveable`, `save_only_these_names`,
          `save_and_offload_only_these_names`), else a hashable callable
          `TagPolicy`. A path glob (`save:*/attn/q_einsum`) without `tags`
          matches names no vocabulary lists, so it is never resolved here:
          the policy becomes a `TagPolicy`, which decides each name as the
          traced function emits it (for base "nothing" the same residuals
          as the built-in over the emitted names, in either remat mode).
          Under `jax_remat3` JAX consults a policy only for `dot_general` and
          `checkpoint_name`, so a callable then recomputes every other
          primitive; a warning names the policy in that case (not for base
          "nothing", which recomputes them anyway).
          `none` returns `everything_saveable` (the same residuals as no
          wrapper).
        """
        if not self.remat:
            return cp.everything_saveable
        if tags is None and self.base == "nothing" and any(
                names.is_path(p) and names.is_glob(p) for p in self.patterns()):
            return TagPolicy(self)  # resolved per emitted name, never dropped
        decided = self.resolve(tags)
        # The routing a function emits is kept unless a pattern names it.
        kept = {t for t in names.KEPT if t in emitted and decided.get(t) != "save"
                and not any(fnmatch.fnmatchcase(t, p) for p in self.patterns())}
        if kept and self.base != "nothing":
            return dataclasses.replace(self, save=self.save | kept).to_jax(tags)
        decided.update(dict.fromkeys(kept, "save"))
        saved = tuple(t for t, d in decided.items() if d == "save")
        offloaded = tuple(t for t, d in decided.items() if d == "offload")
        if self.base == "nothing":
            if offloaded:
                return cp.save_and_offload_only_these_names(
                    names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
                    offload_src=self.offload_src, offload_dst=self.offload_dst)
            return cp.save_only_these_names(*saved) if saved else cp.nothing_saveable
        if not (self.save | self.offload | self.recompute):
            return {"dots": cp.dots_saveable,
                    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
                    "everything": cp.everything_saveable}[self.base]
        if jax.config.jax_remat3:
            warnings.warn(f"policy {str(self)!r} has no JAX built-in equivalent; under "
                          "jax_remat3 JAX consults its callable only for dot_general and "
                          "checkpoint_name values and recomputes all other primitives",
                          stacklevel=2)
        return TagPolicy(self)

    # -- composition and printing -------------------------------------------

    def union(self, other: "Policy", prefer: str | None = None) -> "Policy":
        """A policy that saves what either saves (`a | b`).

        Per tag of the vocabulary the stronger decision wins (save or offload
        beat recompute); the base rule is the larger of the two. Globs are
        expanded against the vocabulary.

        Args:
          prefer: "save" or "offload", to settle a tag one side saves and the
            other offloads.
        Raises:
          RematSpecError: a tag saved by one side and offloaded by the other,
            with no `prefer`; the two sides offload to different memory kinds;
            or a side holds a path glob (`*/attn/query`), which cannot be
            expanded without the model's names (write it in one term instead);
            or they have different non-uniform layer schedules.
          TypeError: `other` is not a Policy.
        """
        if not isinstance(other, Policy):
            raise TypeError(f"a Policy unites only with a Policy (parse a spec string with "
                            f"remat_kit.parse), got {type(other).__name__} {other!r}")
        if prefer not in (None, "save", "offload"):
            raise RematSpecError("unknown preference", token=str(prefer),
                                 choices=("save", "offload"))
        if not (self.remat and other.remat):
            return Policy(remat=False)  # no wrapper saves everything
        path_globs = [p for q in (self, other) for p in q.patterns()
                      if names.is_path(p) and names.is_glob(p)]
        if path_globs:
            raise RematSpecError("a union ('|') cannot expand path globs; write them in one "
                                 "term, e.g. 'save:*/attn/query;recompute:*'",
                                 token=path_globs[0])
        schedules = {p.schedule for p in (self, other)} - {Schedule()}
        if len(schedules) > 1:
            raise RematSpecError(f"cannot union policies with different layer schedules "
                                 f"{sorted(map(str, schedules))}", token=str(other))
        kinds = {(p.offload_src, p.offload_dst) for p in (self, other) if p.offload}
        if len(kinds) > 1:
            raise RematSpecError(f"cannot union policies offloading to different memory kinds "
                                 f"{sorted(kinds)}", token=str(other))
        base = max(self.base, other.base, key=BASES.index)
        out = {d: set() for d in DECISIONS}
        for t in dict.fromkeys(tuple(self.resolve()) + tuple(other.resolve())):
            da, db = self.decide(t), other.decide(t)
            if {da, db} == {"save", "offload"}:
                if prefer is None:
                    raise RematSpecError(
                        f"tag {t!r} is saved by one policy and offloaded by the other; "
                        "use Policy.union(..., prefer='save' or 'offload')", token=t)
                d = prefer
            else:
                d = min(da, db, key=("save", "offload", "recompute").index)
            default = "save" if base == "everything" else "recompute"
            if d != default:
                out[d].add(t)
        src, dst = next(iter(kinds), (self.offload_src, self.offload_dst))
        return Policy(save=out["save"], offload=out["offload"], recompute=out["recompute"],
                      base=base, offload_src=src, offload_dst=dst,
                      schedule=next(iter(schedules), Schedule()))

    def __or__(self, other: "Policy") -> "Policy":
        if isinstance(other, str):
            raise TypeError(f"Policy | {other!r}: parse the text first, "
                            f"Policy | rk.parse({other!r})")
        if not isinstance(other, Policy):
            return NotImplemented
        return self.union(other)

    def __str__(self) -> str:
        if not self.remat:
            return "none"
        clauses = []
        if self.base != "nothing":
            clauses.append(self.base)
        for decision in DECISIONS:
            pats = getattr(self, decision)
            if pats:
                head = decision
                if decision == "offload" and (self.offload_src, self.offload_dst) != (
                        "device", "pinned_host"):
                    head += f"[{self.offload_src}->{self.offload_dst}]"
                clauses.append(f"{head}:{','.join(_ordered(pats))}")
        text = ";".join(clauses) or "full"
        return text if self.schedule == Schedule() else f"{text}@{self.schedule}"


def _ordered(pats: Iterable[str]) -> tuple[str, ...]:
    """Vocabulary order for known tags, then the rest sorted."""
    order = {t: i for i, t in enumerate(names.TAGS)}
    return tuple(sorted(pats, key=lambda p: (order.get(p, len(order)), p)))


@dataclasses.dataclass(frozen=True)
class TagPolicy:
    """A JAX policy callable for a `Policy` no built-in expresses.

    JAX calls it once per primitive as `policy(prim, *avals, **params)`. Tagged
    values (`name_p`) get their resolved decision; anything else follows the
    base rule. It is hashable and compares by value, so JAX's caches keyed on
    the policy hit across identical policies.
    """

    policy: Policy

    def __call__(self, prim, *avals, **params):
        if prim is name_p:
            decision = self.policy.decide(params["name"])
            if decision == "save":
                return Saveable
            if decision == "offload":
                return Offloadable(src=self.policy.offload_src, dst=self.policy.offload_dst)
            return Recompute
        base = self.policy.base
        if base == "everything":
            return Saveable
        if base == "dots":
            return Saveable if cp.dots_saveable(prim, *avals, **params) else Recompute
        if base == "dots_no_batch":
            return (Saveable if cp.dots_with_no_batch_dims_saveable(prim, *avals, **params)
                    else Recompute)
        return Recompute

    def __repr__(self) -> str:
        return f"TagPolicy({str(self.policy)!r})"
