"""Budget planner: the policy with the fewest FLOPs whose compiled memory fits a budget.

`plan(loss_fn, *args, budget=...)` answers "what should I save for this much
memory?" in three steps:

1. A cost model, measured from the program itself (`cost_model`). The loss is
   traced under `save:*` (every tag saved, untagged values recomputed). The
   tags the backward pass then reads are the *needed* tags. In the forward
   jaxpr each tag has a *segment*: the equations between it and its nearest
   tagged ancestors (its *parents*) or the function's inputs. A tag's
   recompute cost is its segment's FLOPs, each equation's FLOPs counted by
   XLA (`lower(...).cost_analysis()` of that equation alone); its bytes are
   its values' bytes over all layers. Tags that the remat region keeps anyway
   (its inputs, e.g. `decoder_layer_input`, found as the tag residuals of
   `full`) are always available.
2. A mixed-integer program over the tags, after Checkmate (Jain et al. 2020,
   "Checkmate: Breaking the Memory Wall with Optimal Tensor
   Rematerialization") with one recompute stage, as in PyTorch's
   `activation_memory_budget` min-cut partitioner (torch/_functorch/partitioners.py),
   which chooses saved values by their recompute cost, but with the
   dependencies between tags as constraints rather than a knapsack over
   independent items. Binary s_t (save t) and r_t (recompute t):

       minimize    sum_t flops_t r_t
       subject to  s_t + r_t >= 1              t needed by the backward pass
                   s_p + r_p >= r_t            p a parent of t (recomputing t reads p)
                   sum_t bytes_t s_t <= room   room = budget - memory of `full`

   solved with `scipy.optimize.milp` (HiGHS), then again for the fewest bytes
   among solutions within `FLOP_RESOLUTION` of the cheapest, so nothing
   useless is saved. Recomputing
   `mlpwo`'s input means recomputing `mlp_act`, which reads `mlpwi`: the
   parent constraints carry such chains.
3. Verification: the chosen policy (`save:` the tags with s_t = 1) is compiled
   and its real memory checked. Over budget, the room shrinks
   by the overshoot (and below the rejected plan's bytes) and the program is
   solved again; under budget, the unused bytes are offered back (XLA's
   buffer reuse often makes saved tags cost less than their size). Up to
   `max_iterations` policies are compiled; the one with the fewest measured
   FLOPs that fits is returned, and `full` always fits. Every other policy
   the `Planner` has compiled for this loss (e.g. the presets `remat-kit plan`
   compares) is a candidate too. A budget that holds no remat returns `none`.

Memory is the figure `remat_kit.measure.memory_kind` names for the target
(`Record.memory_bytes`), per device, as `remat-kit compare` ranks by: XLA's
`temp_size_in_bytes` on the XLA CPU backend (its peak figure leaves temp
buffers out), the compiler's `peak_memory_in_bytes` on TPU and GPU targets
(XLA:TPU's temp figure leaves out buffers its peak counts, and can rank full
remat above no remat). A fractional budget is a fraction of the `none`
policy's figure, the minimum is the least figure of any compiled policy, and
the room the MILP fills is the budget minus `full`'s figure; saved tags add
to either figure about their bytes, and verification by compiling corrects
what they do not. `Plan.memory_kind` says which figure a plan's bytes are.

Plans are cached in a JSON file keyed by a fingerprint of the traced program
(model, shapes, dtypes, shardings), the JAX version, the target, the memory
figure and the budget, so a restarted run does not plan again and a plan made
for one figure is never returned for another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun
from scipy.optimize import Bounds, LinearConstraint, milp

from remat_kit import targets
from remat_kit.errors import BudgetError
from remat_kit.measure import measure
from remat_kit.models.program import workload as config_workload
from remat_kit.record import MEMORY_LABELS, Record, memory_kind
from remat_kit.residuals import _stage
from remat_kit.workload import Workload, _as_factory
from remat_kit.policy import Policy
from remat_kit.spec import AutoSpec, parse
from remat_kit.validate import tag_of

# ---------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?P<num>[-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$",
                   re.I)
_HELP = "a size (6GiB, 512MiB, 6000000000 bytes) or a fraction 0 < f <= 1 of no-remat memory " \
        "(0.25, 25%; temp memory on CPU, peak on TPU and GPU)"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A parsed memory budget: `bytes` (int) or `fraction` (0 < f <= 1) of no-remat memory."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, none_bytes: int | None) -> int:
        """Bytes, given no remat's memory `none_bytes` (`Record.memory_bytes` of `none`)."""
        return self.bytes if self.bytes is not None else int(self.fraction * none_bytes)


def parse_budget(budget: "str | int | float") -> Budget:
    """Parses a memory budget.

    Args:
      budget: a size: an int or a string of a number and a unit ("6GiB",
        "512MiB", "1.5GB", "6000000000"; KiB/MiB/GiB/TiB are powers of 1024,
        KB/MB/GB/TB of 1000, no unit or B is bytes; a size with a unit is
        rounded down to whole bytes); or a fraction of no
        remat's memory (`Record.memory_bytes`: temp on CPU, peak on TPU and
        GPU): a number 0 < f <= 1 ("0.25", 0.25, 1) or a
        percentage ("25%"). Numbers above 1 without a unit are bytes.
    Returns:
      A `Budget`.
    Raises:
      BudgetError: not a size or fraction, zero or negative, an unknown
        unit, or a byte count that is not whole (1.5).
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
    if unit not in _UNITS:
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
    n = value * _UNITS[unit]
    if unit and unit != "b":
        return Budget(bytes=int(n))  # 3.2MiB is 3355443.2 bytes: whole bytes, rounded down
    if n != int(n):
        raise BudgetError(f"a fraction must be 0 < f <= 1 and a size in bytes a whole number "
                          f"({_HELP})", budget=budget)
    return Budget(bytes=int(n))


# ---------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------

SAVE_TAGS = Policy(save=frozenset({"*"}))

# Recompute FLOPs below this fraction of the step's are within the cost model's
# error (predicted vs compiled FLOPs differ by ~0.1% on gpt2_small and llama_1b),
# so the MILP's second solve trades them for fewer saved bytes.
FLOP_RESOLUTION = 1e-4


def _eqn_key(eqn) -> tuple:
    return (eqn.primitive.name, tuple(str(v.aval) for v in eqn.invars),
            tuple(sorted((k, str(v)) for k, v in eqn.params.items())))


def _eqn_flops(eqn, cache: dict) -> float:
    """XLA's FLOPs of one equation, lowered alone (HloCostAnalysis, no compile)."""
    key = _eqn_key(eqn)
    if key not in cache:
        invars = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, Literal)))
        structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
        try:
            with warnings.catch_warnings():  # a hand-built Jaxpr has no DebugInfo; harmless
                warnings.simplefilter("ignore", DeprecationWarning)
                closed = ClosedJaxpr(Jaxpr([], invars, list(eqn.outvars), [eqn]), [])
                costs = jax.jit(jaxpr_as_fun(closed)).lower(*structs).cost_analysis()
            costs = costs[0] if isinstance(costs, (list, tuple)) else costs
            cache[key] = float((costs or {}).get("flops", 0.0))
        except Exception:  # noqa: BLE001 - an equation XLA cannot lower alone costs nothing here
            cache[key] = 0.0
    return cache[key]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What saving or recomputing each tag costs, summed over its occurrences (layers).

    Attributes:
      tags: the tags the policy decides, in forward order.
      nbytes: bytes of each tag's values (all occurrences), per device.
      flops: FLOPs of recomputing each tag from its parents (its segment).
      parents: tags each tag's segment reads (always-available tags left out).
      needed: tags the backward pass reads.
    """

    tags: tuple[str, ...]
    nbytes: dict[str, int]
    flops: dict[str, float]
    parents: dict[str, frozenset[str]]
    needed: frozenset[str]

    def recomputed(self, saved) -> frozenset[str]:
        """The tags recomputed when `saved` are saved: needed ones not saved,
        and the unsaved parents of every recomputed tag, transitively."""
        out, stack = set(), [t for t in self.needed if t not in saved]
        while stack:
            t = stack.pop()
            if t not in out:
                out.add(t)
                stack += [p for p in self.parents[t] if p not in saved]
        return frozenset(out)

    def cost(self, saved) -> tuple[int, float]:
        """(saved bytes, recompute FLOPs) of saving `saved`."""
        return (sum(self.nbytes[t] for t in saved),
                sum(self.flops[t] for t in self.recomputed(saved)))

    def solve(self, room: float, flop_tolerance: float = 0.0) -> tuple[frozenset[str], str]:
        """The cheapest tags to save within `room` bytes (the MILP above).

        Args:
          room: bytes the saved tags may take.
          flop_tolerance: FLOPs the second solve may give up for fewer bytes.
        Returns:
          (saved tags, HiGHS status message). Among plans within
          `flop_tolerance` of the fewest recompute FLOPs, the one with the
          fewest saved bytes.
        """
        n = len(self.tags)
        if n == 0:
            return frozenset(), "no tags to decide"
        index = {t: i for i, t in enumerate(self.tags)}
        rows, lower = [], []

        def row(s=(), r=(), minus_r=()):
            a = np.zeros(2 * n)
            for t in s:
                a[index[t]] += 1
            for t in r:
                a[n + index[t]] += 1
            for t in minus_r:
                a[n + index[t]] -= 1
            return a

        for t in self.needed:
            rows.append(row(s=[t], r=[t]))
            lower.append(1)
        for t in self.tags:
            for p in self.parents[t]:
                rows.append(row(s=[p], r=[p], minus_r=[t]))
                lower.append(0)
        # Scaled to ~1 so HiGHS's tolerances mean the same at any model size.
        b = np.array([self.nbytes[t] for t in self.tags], float)
        f = np.array([self.flops[t] for t in self.tags], float)
        b_scale, f_scale = max(b.max(), 1.0), max(f.max(), 1.0)
        memory = np.concatenate([b / b_scale, np.zeros(n)])
        cons = [LinearConstraint(np.array(rows), lower, np.inf)] if rows else []
        cons.append(LinearConstraint(memory[None], -np.inf, max(room, 0) / b_scale + 1e-9))
        opts = dict(integrality=np.ones(2 * n), bounds=Bounds(0, 1),
                    options={"mip_rel_gap": 0.0})
        first = milp(np.concatenate([np.zeros(n), f / f_scale]), constraints=cons, **opts)
        if first.x is None:
            return frozenset(), f"HiGHS: {first.message}"
        flops_row = np.concatenate([np.zeros(n), f / f_scale])
        cons.append(LinearConstraint(flops_row[None], -np.inf,
                                     first.fun + 1e-7 + flop_tolerance / f_scale))
        second = milp(memory, constraints=cons, **opts)
        x = second.x if second.x is not None else first.x
        saved = frozenset(t for t in self.tags if x[index[t]] > 0.5)
        return saved, f"HiGHS: {second.message if second.x is not None else first.message}"


def _forward_eqns(jaxpr, outs) -> list:
    """The equations `outs` depend on (the forward pass), in program order."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    keep, stack = set(), list(outs)
    while stack:
        v = stack.pop()
        e = None if isinstance(v, Literal) else producers.get(v)
        if e is not None and id(e) not in keep:
            keep.add(id(e))
            stack += e.invars
    return [e for e in jaxpr.eqns if id(e) in keep]


def _add_tags(eqns, scale: int, free: set, acc: dict, flop_cache: dict) -> None:
    """Adds the tags applied by `eqns` (one program level) to `acc`, each
    tag's bytes and segment FLOPs times `scale`, descending into `scan`
    bodies (`nn.scan` over layers: a body runs `length` times).

    A segment ends at the level's inputs (a scan body's carry and slices)
    and at scan outputs: a tag after a layer stack reads the stack's result,
    which no layer policy recomputes.
    """
    producers = {v: e for e in eqns for v in e.outvars}
    for eqn in eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            _add_tags(body.eqns, scale * eqn.params["length"], free, acc, flop_cache)
            continue
        tag = tag_of(eqn)
        if tag is None or tag in free:
            continue
        aval = eqn.outvars[0].aval
        acc["nbytes"][tag] = acc["nbytes"].get(tag, 0) \
            + scale * math.prod(aval.shape) * aval.dtype.itemsize
        parents = acc["parents"].setdefault(tag, set())
        seen, stack = set(), list(eqn.invars)
        while stack:  # the segment: back to the nearest tags or the inputs
            v = stack.pop()
            e = None if isinstance(v, Literal) else producers.get(v)
            if e is None or id(e) in seen or e.primitive.name == "scan":
                continue
            if (t := tag_of(e)) is not None:
                if t not in free:
                    parents.add(t)
                continue
            seen.add(id(e))
            acc["flops"][tag] = acc["flops"].get(tag, 0.0) + scale * _eqn_flops(e, flop_cache)
            stack += e.invars


def cost_model(loss_fn: Callable, *args, free: Sequence[str] = (), staged=None) -> CostModel:
    """Measures a `CostModel` for `loss_fn(*args)` (see the module docstring).

    Tags inside a `scan` (a scanned layer stack, `TransformerConfig.scan_layers`,
    or nested scans) count once per iteration: a tag in a body of length L
    holds L times its bytes, and recomputing it costs L times its segment.

    Args:
      loss_fn: a loss or a policy -> loss factory, as `measure` takes.
      args: arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
      free: tags the remat region keeps whatever the policy (its inputs).
      staged: the loss already traced under `SAVE_TAGS` (`measure._stage`), if at hand.
    Raises:
      TypeError: the loss does not return a scalar.
    """
    staged = staged or _stage(_as_factory(loss_fn)(SAVE_TAGS), args)
    jaxpr = staged.program.jaxpr
    forward = _forward_eqns(jaxpr, [*staged.residual_vars, jaxpr.outvars[0]])
    free = set(free)
    needed = {r.name for r in staged.residuals if r.kind == "tag"} - free
    acc: dict = {"nbytes": {}, "flops": {}, "parents": {}}
    _add_tags(forward, 1, free, acc, {})
    nbytes, parents = acc["nbytes"], acc["parents"]
    tags = tuple(nbytes)
    return CostModel(tags, nbytes, {t: acc["flops"].get(t, 0.0) for t in tags},
                     {t: frozenset(parents[t] - {t}) for t in tags},
                     frozenset(needed & set(tags)))


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer for one budget. Bytes are per device, of the compiled
    figure `memory_kind` names.

    Attributes:
      budget: the budget as given (e.g. "6GiB", 0.25).
      budget_bytes: it in bytes (a fraction resolved against none_bytes).
      policy: the chosen `Policy`; spec: its canonical spec string.
      predicted_bytes, predicted_flops: the cost model's memory (`full`'s
        figure plus the saved tags' bytes) and FLOPs of the step (value and
        grad) under the policy.
      measured_bytes, measured_flops: the compiled step's memory
        (`Record.memory_bytes`: `temp_size_in_bytes` on CPU,
        `peak_memory_in_bytes` on TPU and GPU) and FLOPs (loops counted per
        trip), from `measure`.
      none_bytes, none_flops: the same for no remat (`none`). Where no
        remat's compile runs out of the target's memory (`none_out_of_memory`),
        none_bytes is None and none_flops is the cost model's: `full`'s
        measured FLOPs less its predicted recompute.
      minimum_bytes: the least memory of the policies compiled so far:
        `full`'s, except on small models where XLA gives another policy less.
      status: the solver's last message, each policy compiled with its
        measured bytes and whether it fit, and the choice.
      iterations: policies compiled to verify (0 for `none`).
      platform: whose compiler measured, e.g. "XLA CPU compile".
      memory_kind: which figure the bytes above are: "temp_size_in_bytes"
        or "peak_memory_in_bytes" (`remat_kit.measure.memory_kind`).
      cached: read from the plan cache rather than planned now.
      none_out_of_memory: no remat did not compile for lack of the target's
        memory (e.g. XLA:TPU's CompileTimeHbmOom), so the budget cannot hold it.
    """

    budget: str
    budget_bytes: int
    policy: Policy
    spec: str
    predicted_bytes: int
    predicted_flops: float
    measured_bytes: int
    measured_flops: float
    none_bytes: int | None
    none_flops: float
    minimum_bytes: int
    status: str
    iterations: int
    platform: str
    memory_kind: str
    cached: bool = False
    none_out_of_memory: bool = False

    @property
    def memory_fraction(self) -> float | None:
        """measured_bytes / none_bytes; None where no remat ran out of memory."""
        return None if self.none_bytes is None else self.measured_bytes / self.none_bytes

    @property
    def flops_overhead(self) -> float:
        """measured_flops / none_flops - 1 (0.05 is 5% more FLOPs than no remat)."""
        return self.measured_flops / self.none_flops - 1

    def to_dict(self) -> dict:
        """JSON-ready: every field (policy as its spec), plus memory_fraction and flops_overhead."""
        d = dataclasses.asdict(self) | {"policy": self.spec}
        return d | {"memory_fraction": self.memory_fraction,
                    "flops_overhead": self.flops_overhead}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The inverse of `to_dict`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields} | {"policy": parse(d["spec"])})


def default_cache_path() -> str:
    """$REMAT_KIT_CACHE, else $XDG_CACHE_HOME/remat_kit/plans.json (~/.cache by default)."""
    if os.environ.get("REMAT_KIT_CACHE"):
        return os.environ["REMAT_KIT_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remat_kit", "plans.json")


def read_cache(path: str) -> dict | None:
    """The plan cache at `path`: {} if there is none yet, None if the file is not
    a plan cache (a JSON object); such a file is never overwritten."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_cache(path: str, key: str, plan: Plan) -> None:
    data = read_cache(path)
    if data is None:
        warnings.warn(f"plan cache {path!r} is not a plan cache (a JSON object); left as it "
                      "is, the plan is not cached", stacklevel=3)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data | {key: plan.to_dict()}, f, indent=1)
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    except OSError as e:
        warnings.warn(f"cannot write plan cache {path!r} ({e}); the plan is not cached",
                      stacklevel=3)


class Planner:
    """Plans one loss for any number of budgets, sharing the measurements.

    `Planner(loss_fn, *args).plan("6GiB")`; `.frontier([0.1, 0.2])`.

    Args:
      loss_fn: a `Workload` (`remat_kit.workload`), a loss(*args) returning a
        scalar (wrapped whole in one remat region per policy) or a factory
        policy -> loss (the model applies the policy, e.g. per layer), as
        `measure` takes; differentiated with respect to args[0].
      args: with a loss, arrays or `jax.ShapeDtypeStruct`s (with shardings
        for a mesh).
      cache: path of the JSON plan cache; True for `default_cache_path()`;
        None or False for none.
      max_iterations: policies compiled per budget before falling back to
        `full`, which always fits.
      progress: called with a one-line message as each policy is compiled.
      target: whose compiler the plan is verified with and whose memory it
        fits (`remat_kit.targets`, e.g. "tpu:v5e:1x1"); default JAX's
        default backend. It sets the memory figure budgeted:
        `temp_size_in_bytes` on CPU, `peak_memory_in_bytes` on TPU and GPU
        (`remat_kit.measure.memory_kind`).
      per_device: for args sharded over a mesh, (factory, args) of the
        program one device runs (`Workload.per_device`), as `measure`
        takes it: the cost model's bytes and FLOPs are then per device, like
        the compiled figures. Needed where a shard is not a valid input
        (parameters split over fsdp or tensor).
    """

    def __init__(self, loss_fn: Callable, *args, cache: "str | bool | None" = True,
                 max_iterations: int = 3, progress: Callable[[str], None] | None = None,
                 target=None, per_device: tuple[Callable, tuple] | None = None):
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
                or max_iterations < 1:
            raise ValueError(f"max_iterations must be a positive int, got {max_iterations!r}")
        if isinstance(loss_fn, Workload):
            if args:
                raise TypeError("Planner takes a Workload or a loss and its args, not both")
            per_device = per_device or loss_fn.per_device
            loss_fn, args = loss_fn.loss_for_policy, loss_fn.args
        self.loss_fn, self.args = _as_factory(loss_fn), args
        self.cache = default_cache_path() if cache is True else (cache or None)
        self.max_iterations, self.progress = max_iterations, progress
        self.target = targets.parse_target(target)
        self.per_device = per_device
        self.records: dict[str, Record] = {}
        self._model: CostModel | None = None
        self._fingerprint: str | None = None
        self._staged = None

    # -- measurements, each made once -------------------------------------

    def measure_all(self, policies: Sequence) -> list[Record]:
        """Records of `policies` (specs or Policies; auto specs not allowed),
        compiling only those not measured yet, in one `measure` call (so
        policies that compile alike compile once). Records may carry errors."""
        keys = [str(parse(p)) for p in policies]
        todo = [p for p, k in zip(policies, keys) if k not in self.records]
        if todo:
            def progress(i, n, record):
                if self.progress:
                    self.progress(f"[{i}/{n}] compiled {', '.join(record.names)}")
            for record in measure(self.loss_fn, *self.args, policies=todo, progress=progress,
                                  target=self.target, per_device=self.per_device):
                for name in record.names:
                    self.records.setdefault(str(parse(name)), record)
        return [self.records[k] for k in keys]

    def measure(self, policy: "Policy | str") -> Record:
        """The compiled record of `policy` (memoized).

        Raises:
          BudgetError: `full` runs out of the target's memory when compiled:
            no policy fits the device at these shapes.
          RuntimeError: the policy fails to compile for another reason, or
            the backend gives no memory or FLOP figures.
        """
        record = self.measure_all([policy])[0]
        key = str(parse(policy))
        if record.error and key == "full" and targets.is_out_of_memory(record.error):
            raise BudgetError(f"even full remat runs out of {self.target}'s memory at these "
                              f"shapes, so no policy fits: {record.error.splitlines()[0]}")
        if record.error or record.memory_bytes is None or record.flops is None:
            raise RuntimeError(f"cannot plan: policy {key!r} did not compile to memory and "
                               f"FLOP figures: {record.error or 'the backend reports none'}")
        return record

    @property
    def model(self) -> CostModel:
        """The measured `CostModel` (tags `full` keeps are always available)."""
        if self._model is None:
            free = set(self.measure(Policy()).residual_bytes_by_tag)
            self._model = (cost_model(self.loss_fn, *self.args, free=free, staged=self.staged)
                           if self.per_device is None
                           else cost_model(self.per_device[0], *self.per_device[1], free=free))
        return self._model

    @property
    def staged(self):
        """The loss traced under `SAVE_TAGS` (for the cost model and the fingerprint)."""
        if self._staged is None:
            self._staged = _stage(self.loss_fn(SAVE_TAGS), self.args)
        return self._staged

    def fingerprint(self) -> str:
        """A hash of the traced program, argument shardings, JAX version and target."""
        if self._fingerprint is None:
            text = re.sub(r"0x[0-9a-f]+", "", str(self.staged.program))  # object addresses vary
            shardings = [str(getattr(x, "sharding", None)) for x in jax.tree.leaves(self.args)]
            blob = "\n".join([text, *shardings, jax.__version__, str(self.target),
                              str(jax.device_count())])
            self._fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:32]
        return self._fingerprint

    # -- planning ---------------------------------------------------------

    @property
    def memory_kind(self) -> str:
        """The figure this planner budgets, "temp_size_in_bytes" or
        "peak_memory_in_bytes": `full`'s `Record.memory_kind` (compiles `full`)."""
        return self.measure(Policy()).memory_kind

    def none(self) -> Record | None:
        """No remat's record; None where its compile runs out of the target's
        memory (it cannot fit any budget on that device)."""
        record = self.measure_all([Policy(remat=False)])[0]
        if record.error and targets.is_out_of_memory(record.error):
            return None
        return self.measure(Policy(remat=False))

    def none_flops(self) -> float:
        """No remat's FLOPs: compiled, or where it runs out of memory, the cost
        model's (`full`'s measured FLOPs less its predicted recompute)."""
        none = self.none()
        if none is not None:
            return none.flops
        return self.measure(Policy()).flops - self.model.cost(frozenset())[1]

    def minimum(self) -> tuple[int, int | None]:
        """(least memory of any compiled policy, memory of `none` or None where
        it runs out of memory), bytes of `memory_kind`, after compiling `full`
        and `none`. The least is `full`'s except on small models, where XLA
        can give another policy less."""
        self.measure(Policy())
        none = self.none()
        return min(r.memory_bytes for r in self._compiled()), none and none.memory_bytes

    def plan(self, budget: "str | int | float") -> Plan:
        """The policy with the fewest FLOPs whose compiled memory fits `budget`.

        Args:
          budget: see `parse_budget`.
        Returns:
          A verified `Plan`: measured_bytes <= budget_bytes.
        Raises:
          BudgetError: a malformed budget, or one below the least memory of
            any compiled policy, normally `full` (the message gives that
            minimum in bytes and as a fraction); a fraction budget where no
            remat runs out of the target's memory (there is nothing to take a
            fraction of); `full` runs out of the target's memory.
          RuntimeError: `full` or `none` does not compile for another reason.
        """
        parsed = parse_budget(budget)
        # The figure budgeted is in the key: a temp plan never answers a peak budget.
        key = f"{self.fingerprint()}|{memory_kind(self.target.platform)}|{parsed}"
        if self.cache and key in (hit := read_cache(self.cache) or {}):
            try:
                return dataclasses.replace(Plan.from_dict(hit[key]), cached=True)
            except (TypeError, ValueError, KeyError):
                pass  # an entry from an older layout: plan again
        full, none = self.measure(Policy()), self.none()
        if none is None and parsed.bytes is None:
            raise BudgetError(f"budget {budget} is a fraction of no remat's memory, but no remat "
                              f"runs out of {self.target}'s memory at these shapes; give the "
                              "budget in bytes (e.g. 12GiB)", budget=budget)
        limit = parsed.resolve(none and none.memory_bytes)
        least = min(self._compiled(), key=lambda r: r.memory_bytes)
        if limit < least.memory_bytes:
            lo = least.memory_bytes
            which = "full remat" if least is full else f"{least.policy} (below full remat's)"
            of_none = (f"{lo / none.memory_bytes:.3f} of no remat ({none.memory_bytes:,} bytes)"
                       if none else f"no remat runs out of {self.target}'s memory")
            raise BudgetError(
                f"budget {budget} ({limit:,} bytes) is below the least "
                f"{MEMORY_LABELS[full.memory_kind]} memory any policy "
                f"reaches: {lo:,} bytes under {which}, {of_none}", budget=budget,
                minimum_bytes=lo, minimum_fraction=none and lo / none.memory_bytes)
        if none is not None and limit >= none.memory_bytes:
            return self._finish(key, budget, limit, Policy(remat=False), none,
                                none.memory_bytes, none.flops, "the budget holds no remat", 0)
        model = self.model
        base_flops = full.flops - model.cost(frozenset())[1]
        room, hi, status, tried, notes = limit - full.memory_bytes, None, "", set(), []
        # full is the fallback; on small models XLA can give it more memory than others.
        best = ((full.flops, full.memory_bytes, Policy(), full, 0,
                 model.cost(frozenset())[1]) if full.memory_bytes <= limit else None)
        for _ in range(self.max_iterations):
            saved, status = model.solve(room, FLOP_RESOLUTION * self.none_flops())
            if saved in tried:
                break  # the room moved, the answer did not
            tried.add(saved)
            policy = Policy(save=saved)
            record = self.measure_all([policy])[0]
            tag_bytes, recompute = model.cost(saved)
            if record.error or record.memory_bytes is None or record.flops is None:
                notes.append(f"{policy}: no figures ({record.error}), skipped")
                hi, room = tag_bytes, max(0, tag_bytes - 1)
                continue
            notes.append(f"{policy}: {record.memory_bytes:,} bytes, "
                         + ("fits" if record.memory_bytes <= limit else "over"))
            if record.memory_bytes <= limit:
                found = (record.flops, record.memory_bytes, policy, record, tag_bytes,
                         recompute)
                best = found if best is None else min(best, found, key=lambda c: c[:2])
                # Fits with bytes to spare: the model over-predicted; offer the slack,
                # but stay below a room that was already too much.
                grown = room + limit - record.memory_bytes
                room = grown if hi is None else min(grown, (room + hi) / 2)
            else:
                # Over budget: shrink the room by the overshoot, and below this plan's bytes.
                hi = tag_bytes
                room = max(0, min(room - (record.memory_bytes - limit), tag_bytes - 1))
        if best is not None:
            _, _, policy, record, tag_bytes, recompute = best
            predicted = (full.memory_bytes + tag_bytes, base_flops + recompute)
        # Any other policy compiled for this loss (e.g. the presets remat-kit plan
        # compares) that fits with fewer FLOPs wins: it is verified just the same.
        other = min((r for r in self._compiled() if r.memory_bytes <= limit),
                    key=lambda r: (r.flops, r.memory_bytes))  # `least` fits
        if best is None or (other.flops, other.memory_bytes) < best[:2]:
            policy, record = parse(other.policy), other
            predicted = (other.memory_bytes, other.flops)
            notes.append(f"{other.policy} (compiled before) has fewer FLOPs")
        return self._finish(key, budget, limit, policy, record, *predicted,
                            "; ".join([status, *notes, f"chose {policy}"]), len(tried))

    def _compiled(self) -> list[Record]:
        """Every policy compiled for this loss that has memory and FLOP figures."""
        return [r for r in {id(r): r for r in self.records.values()}.values()  # no hash
                if r.error is None and r.flops is not None and r.memory_bytes is not None]

    def _finish(self, key, budget, limit, policy, record, predicted_bytes, predicted_flops,
                status, iterations) -> Plan:
        least, none = self.minimum()
        if none is None:
            status += "; no remat runs out of the target's memory: its FLOPs are the cost model's"
        result = Plan(
            budget=str(budget), budget_bytes=limit, policy=policy, spec=str(policy),
            predicted_bytes=predicted_bytes,
            predicted_flops=predicted_flops, measured_bytes=record.memory_bytes,
            measured_flops=record.flops, none_bytes=none, none_flops=self.none_flops(),
            minimum_bytes=least, status=status, iterations=iterations,
            platform=record.platform, memory_kind=self.memory_kind,
            none_out_of_memory=none is None)
        if self.cache:
            _write_cache(self.cache, key, result)
        return result

    def frontier(self, budgets: Sequence) -> list[Plan]:
        """`plan` for each budget, made monotone: where a smaller budget's plan
        has fewer measured FLOPs, it is kept for the larger budget too (it fits).

        Returns:
          Plans in the order of `budgets`.
        Raises:
          BudgetError: as `plan`, for the first budget that fails.
        """
        plans = [self.plan(b) for b in budgets]
        best: Plan | None = None
        for i in sorted(range(len(plans)), key=lambda i: plans[i].budget_bytes):
            p = plans[i]
            if best is not None and best.measured_flops < p.measured_flops:
                plans[i] = dataclasses.replace(
                    best, budget=p.budget, budget_bytes=p.budget_bytes, cached=p.cached,
                    status=p.status + f"; kept the plan of budget {best.budget} (fewer FLOPs)")
            best = plans[i]
        return plans


def plan(loss_fn: Callable, *args, budget, cache: "str | bool | None" = True,
         max_iterations: int = 3, target=None) -> Plan:
    """The cheapest policy (fewest FLOPs) whose compiled memory fits `budget`.

    `rk.plan(loss_fn, *args, budget="6GiB")`: a mixed-integer program over the
    tags `loss_fn` emits, costs measured from its jaxpr and XLA, verified by
    compiling (see the module docstring and `Planner`).

    Args:
      loss_fn: a `Workload`, a loss(*args) -> scalar, or a policy -> loss factory.
      args: with a loss, arrays or `jax.ShapeDtypeStruct`s.
      budget: bytes ("6GiB", "512MiB", 6_000_000_000) or a fraction 0 < f <= 1
        of no remat's memory (0.25); memory is `temp_size_in_bytes` on the XLA
        CPU backend, `peak_memory_in_bytes` on TPU and GPU (`Planner`).
      cache: plan cache path, True for `default_cache_path()`, None for none.
      max_iterations: compiles per budget before falling back to `full`.
      target: whose compiler to plan for (`remat_kit.targets`, e.g.
        "tpu:v5e:1x1"); default JAX's default backend.
    Returns:
      A `Plan` with measured_bytes <= budget_bytes.
    Raises:
      BudgetError: a malformed budget, or one below full remat's memory.
      TargetError: a bad target, or libtpu / the CUDA plugin missing.
    """
    return Planner(loss_fn, *args, cache=cache, max_iterations=max_iterations,
                   target=target).plan(budget)


def config_planner(cfg, batch: int, seq: int, *, dtype: str | None = None, mesh=None,
                   cache: "str | bool | None" = True, target=None, **kwargs) -> Planner:
    """A `Planner` for a reference transformer's loss (`remat_kit.models.workload`);
    for a target compiled ahead of time with no mesh, data parallel over its chips, as
    `measure_config` measures it."""
    target = targets.parse_target(target)
    if mesh is None and target.aot:
        mesh = targets.make_mesh(target, {"data": len(targets.devices(target))})
    return Planner(config_workload(cfg, batch, seq, dtype=dtype, mesh=mesh), cache=cache,
                   target=target, **kwargs)


def resolve(policies: Sequence, loss_fn: Callable, *args,
            cache: "str | bool | None" = True, target=None, per_device=None) -> list[Policy]:
    """`policies` with every `auto:budget=...` replaced by its planned Policy.

    per_device: as `Planner` takes it, for args sharded over a mesh.

    Raises:
      RematSpecError: a spec does not parse. BudgetError: as `plan`.
    """
    parsed = [parse(p) for p in policies]
    if not any(isinstance(p, AutoSpec) for p in parsed):
        return parsed
    planner = Planner(loss_fn, *args, cache=cache, target=target, per_device=per_device)
    return [planner.plan(p.budget).policy if isinstance(p, AutoSpec) else p for p in parsed]


def resolve_config(cfg, batch: int, seq: int, *, mesh=None, cache: "str | bool | None" = True):
    """`cfg` with an `auto:budget=...` remat replaced by the planned policy's spec;
    any other cfg unchanged. batch, seq: the global shapes the model will train at."""
    if not isinstance(parse(cfg.remat), AutoSpec):
        return cfg
    planner = config_planner(cfg.replace(remat="none"), batch, seq, mesh=mesh, cache=cache)
    return cfg.replace(remat=planner.plan(parse(cfg.remat).budget).spec)


__all__ = ["Budget", "CostModel", "Plan", "Planner", "config_planner", "cost_model",
           "default_cache_path", "parse_budget", "plan", "read_cache", "resolve",
           "resolve_config"]
