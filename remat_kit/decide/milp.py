"""The planner's decision program: save, offload or recompute each item, as a MILP.

`CostModel` holds what each item (a tag, or a tag in a group of layers) costs, and
`CostModel.solve` picks the cheapest within a room of bytes (`scipy.optimize.milp`, each run
bounded by `SOLVE_SECONDS`). Ties go by a stated rule (`tie_rank`), so the same costs give the
same plan in any process. Source: Checkmate (Jain et al. 2020), one recompute stage.
The program and the tie rule: docs/plan.md ("How it works", "The tie rule").
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from remat_kit.policy.names import TAGS, is_path

# Each of solve's three HiGHS runs stops here, seconds, with its best plan so far (the
# incumbent) and the gap it had left to prove: a per-layer model is a knapsack of near-equal
# copies of each tag, one per layer, whose optimality proof can take HiGHS an hour, though
# the incumbent is found in well under a second (docs/plan.md, "A MILP that ends").
SOLVE_SECONDS = 8.0
# The relative gap at which HiGHS may stop: none, since any looser gap would swamp the tie
# rules' small weights; the time limit above is what bounds a run.
MIP_GAP = 0.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What saving, offloading or recomputing each decision item costs, summed over
    its occurrences.

    An item is a tag (uniform decisions) or a (tag, group) pair (per layer group).

    Attributes:
      tags: the items the policy decides, in forward order.
      nbytes: bytes of each item's values (all occurrences), per device.
      flops: FLOPs of recomputing each item from its parents (its segment).
      parents: items each item's segment reads (always-available tags left out).
      needed: items the backward pass reads.
      seconds: predicted seconds of recomputing each item (`time_model`); empty
        when no time model was given.
      base: the base rule the segments assume (`PLANNED_BASES`).
      transfer: seconds of moving each offloadable item to host memory, one way
        (its bytes over the host bandwidth); empty where offload is not planned.
      hide: item -> group whose forward compute hides its transfers.
      compute: group -> seconds of its layers' forward compute (`time_model`):
        each way, transfers hide up to this much; only the excess is charged.
      flop_rate: FLOP/s that converts a transfer's excess seconds to FLOPs for
        objective "flops" (the target's peak: what the device could have run).
      fixed: items always recomputed (never saved or offloaded), `narrowed`.
      offload_share: device bytes an offloaded byte still takes, 1 - the offload
        probe's figure (`remat_kit.decide.offload_probe`); 0 is offload's ideal.
      aliases: tag -> the other names the program gives the same values (a
        module path, the model's own `checkpoint_name`), which the tag stands for
        (`Program.model`); tags with none are left out.
      byte_share: what a saved byte adds to the compiled figure, measured on the
        program (`remat_kit.decide.planner_costs.PlannerCosts.byte_share`): XLA
        reuses buffers, and a layer's saved tags stand in for values its
        recompute would hold anyway, so a kept byte costs less than a byte.
    """

    tags: tuple
    nbytes: dict
    flops: dict
    parents: dict
    needed: frozenset
    seconds: dict = dataclasses.field(default_factory=dict)
    base: str = "nothing"
    transfer: dict = dataclasses.field(default_factory=dict)
    hide: dict = dataclasses.field(default_factory=dict)
    compute: dict = dataclasses.field(default_factory=dict)
    flop_rate: float = 0.0
    fixed: frozenset = frozenset()
    offload_share: float = 0.0
    aliases: dict = dataclasses.field(default_factory=dict)
    byte_share: float = 1.0

    def narrowed(self, keep: Callable) -> "CostModel":
        """This model with the items `keep(item)` rejects always recomputed."""
        return dataclasses.replace(self, fixed=frozenset(t for t in self.tags if not keep(t)))

    def recomputed(self, saved, offloaded=frozenset()) -> frozenset:
        """The items recomputed when `saved` are saved (and `offloaded` offloaded):
        needed ones not kept, and the unkept parents of every recomputed item,
        transitively."""
        kept = set(saved) | set(offloaded)
        out, stack = set(), [t for t in self.needed if t not in kept]
        while stack:
            t = stack.pop()
            if t not in out:
                out.add(t)
                stack += [p for p in self.parents[t] if p not in kept]
        return frozenset(out)

    def cost(self, saved, offloaded=frozenset()) -> tuple[int, float]:
        """(device bytes, recompute FLOPs) of saving `saved` and offloading
        `offloaded`; a saved item takes `byte_share` of its bytes, an offloaded
        one `offload_share`."""
        return (round(self.byte_share * sum(self.nbytes[t] for t in saved))
                + round(self.offload_share * sum(self.nbytes[t] for t in offloaded)),
                sum(self.flops[t] for t in self.recomputed(saved, offloaded)))

    def excess(self, offloaded) -> float:
        """Transfer seconds not hidden behind compute: per group, both ways,
        max(0, sum of its offloaded items' transfer - its forward compute)."""
        load: dict = {}
        for t in offloaded:
            load[self.hide[t]] = load.get(self.hide[t], 0.0) + self.transfer[t]
        return sum(2 * max(0.0, x - self.compute.get(g, 0.0)) for g, x in load.items())

    def time(self, saved, offloaded=frozenset()) -> float:
        """Predicted seconds of recompute and unhidden transfers (0 recompute
        without a time model)."""
        return (sum(self.seconds.get(t, 0.0) for t in self.recomputed(saved, offloaded))
                + self.excess(offloaded))

    def objective(self, saved, offloaded=frozenset(), objective: str = "flops") -> float:
        """What `solve` minimizes: recompute FLOPs plus unhidden transfer seconds at
        `flop_rate` ("flops"), or `time` ("time")."""
        if objective == "time":
            return self.time(saved, offloaded)
        return self.cost(saved, offloaded)[1] + self.excess(offloaded) * self.flop_rate

    def _rows(self, groups: list) -> tuple[list, list, list, float]:
        """`solve`'s constraint rows, columns s_t, r_t, o_t for each item in `tags`
        order, then e_g for each of `groups`: (rows, lower bounds, upper bounds, the
        scale of the transfer seconds)."""
        n = len(self.tags)
        gi = {g: 3 * n + i for i, g in enumerate(groups)}
        width = 3 * n + len(groups)
        index = {t: i for i, t in enumerate(self.tags)}
        rows, lower, upper = [], [], []

        def row(*terms, low=0.0, high=np.inf):
            a = np.zeros(width)
            for col, coef in terms:
                a[col] += coef
            rows.append(a)
            lower.append(low)
            upper.append(high)

        def s(t): return index[t]
        def r(t): return n + index[t]
        def o(t): return 2 * n + index[t]

        # Sorted, not set order: the rows' order must not depend on the process's hash seed.
        for t in (t for t in self.tags if t in self.needed):
            row((s(t), 1), (o(t), 1), (r(t), 1), low=1)
        for t in self.tags:
            for p in sorted(self.parents[t], key=index.get):
                row((s(p), 1), (o(p), 1), (r(p), 1), (r(t), -1))
            if t in self.transfer:
                row((s(t), 1), (o(t), 1), low=-np.inf, high=1)
        t_scale = max([*self.transfer.values(), *self.compute.values(), 1e-30])
        for g in groups:
            row((gi[g], 1), *((o(t), -self.transfer[t] / t_scale) for t in self.transfer
                              if self.hide[t] == g), low=-self.compute.get(g, 0.0) / t_scale)
        return rows, lower, upper, t_scale

    def _tie_rank_row(self, width: int) -> np.ndarray:
        """The third solve's objective: keeping an item earlier by `_item_rank` costs
        less (columns as `_rows`)."""
        n, rank = len(self.tags), np.zeros(width)
        order = sorted(range(n), key=lambda i: _item_rank(self.tags[i]))
        for place, i in enumerate(order):
            rank[i] = rank[2 * n + i] = 1 + place / n
        return rank

    def _upper(self, width: int) -> np.ndarray:
        """Upper bounds of `_rows`' columns: s_t 1 unless fixed, o_t 1 where offloadable,
        r_t 1, e_g none."""
        n, high = len(self.tags), np.ones(width)
        high[:n] = [float(t not in self.fixed) for t in self.tags]
        high[2 * n:3 * n] = [float(t in self.transfer and t not in self.fixed)
                             for t in self.tags]
        high[3 * n:] = np.inf
        return high

    def _tie_bounds(self, x: np.ndarray, high: np.ndarray):
        """The third solve's bounds: an item with no twin (another of the same bytes,
        FLOPs and layer group) keeps its save and offload decisions `x` (the second
        solve's). Only twins can tie; left free, every item made HiGHS search for a
        point of the second's optimal face, minutes to hours on a per-layer model."""
        from scipy.optimize import Bounds
        n = len(self.tags)
        sigs = [(self.nbytes[t], self.flops[t], t[1] if isinstance(t, tuple) else 0)
                for t in self.tags]
        low, high = np.zeros_like(high), high.copy()
        for i, sig in enumerate(sigs):
            if sigs.count(sig) == 1:
                for col in (i, 2 * n + i):
                    low[col] = high[col] = round(x[col])
        return Bounds(low, high)

    def solve(self, room: float, flop_tolerance: float = 0.0, objective: str = "flops",
              seconds: float = SOLVE_SECONDS) -> tuple[frozenset, frozenset, str]:
        """The cheapest items to save within `room` bytes, and to offload.

        Binary s_t (save t), o_t (offload t; only items in `transfer`) and r_t
        (recompute t), continuous e_g >= 0 (group g's unhidden transfer), after
        Checkmate (Jain et al. 2020) with one recompute stage and offload as in
        Beaumont et al. 2021 ("Efficient combination of rematerialization and
        offloading"), the transfers overlapping compute:

            minimize    sum_t cost_t r_t + 2 w sum_g e_g
            subject to  s_t + o_t + r_t >= 1         t needed by the backward pass
                        s_p + o_p + r_p >= r_t       p a parent of t
                        s_t + o_t <= 1
                        e_g >= sum_{t in g} transfer_t o_t - compute_g
                        sum_t bytes_t (k s_t + share o_t) <= room

        (k: `byte_share`; share: `offload_share`; w: 1 for "time", `flop_rate` for
        "flops"), then for the fewest stored bytes (offloaded a little more: saving is
        preferred; a little more in earlier layer groups) within the tolerance, then
        a third time for the items first by `tie_rank` (roles, the model's own names,
        module paths, each by name; earlier groups first): the tie rule.

        Args:
          room: device bytes the saved items may take.
          flop_tolerance: cost the second solve may give up for fewer bytes (FLOPs or s).
          objective: "flops" (cost_t = flops) or "time" (cost_t = seconds).
          seconds: each run's time limit: it keeps its incumbent, the status says so
            (`_status`); the third moves only twins (`_tie_bounds`); `bounded_milp`.
        Returns:
          (saved items, offloaded items, HiGHS status message; "...; the bytes run
          stopped at its time limit, gap 0.31%" where a run kept its incumbent).
        """
        # Imported here: scipy.optimize is half a second of every command's start-up.
        from scipy.optimize import Bounds, LinearConstraint, milp
        n = len(self.tags)
        if n == 0:
            return frozenset(), frozenset(), "no tags to decide"
        groups = sorted(set(self.hide[t] for t in self.transfer), key=str)
        width = 3 * n + len(groups)
        rows, lower, upper, t_scale = self._rows(groups)
        weights = self.seconds if objective == "time" else self.flops
        # Scaled to ~1 so HiGHS's tolerances mean the same at any model size.
        b = np.array([self.nbytes[t] for t in self.tags], float)
        f = np.array([weights.get(t, 0.0) for t in self.tags], float)
        b_scale, f_scale = max(b.max(), 1.0), max(f.max(), 1e-30)
        per_second = 1.0 if objective == "time" else self.flop_rate
        cost_row = np.concatenate([np.zeros(n), f / f_scale, np.zeros(n),
                                   np.full(len(groups), 2 * per_second * t_scale / f_scale)])
        memory = np.concatenate([self.byte_share * b / b_scale, np.zeros(n),
                                 self.offload_share * b / b_scale,
                                 np.zeros(len(groups))])
        # Ties go to later layers: their residuals are read back first, so XLA often
        # reuses their buffers before the peak (the last layer's can cost nothing).
        layer = [t[1] if isinstance(t, tuple) else 0 for t in self.tags]
        last = max(max(layer), 1)
        late = np.array([1 + 1e-4 * (last - g) / last for g in layer])
        stored = np.concatenate([late * b / b_scale, np.zeros(n), 1.001 * late * b / b_scale,
                                 np.zeros(len(groups))])
        cons = [LinearConstraint(np.array(rows), lower, upper)] if rows else []
        cons.append(LinearConstraint(memory[None], -np.inf, max(room, 0) / b_scale + 1e-9))
        high = self._upper(width)
        opts = dict(integrality=np.r_[np.ones(3 * n), np.zeros(len(groups))],
                    bounds=Bounds(0, high), options={"mip_rel_gap": MIP_GAP,
                                                     "time_limit": seconds})
        first = bounded_milp(milp, cost_row, constraints=cons, **opts)
        if first.x is None:
            return frozenset(), frozenset(), f"HiGHS: {first.message}"
        cons.append(LinearConstraint(cost_row[None], -np.inf,
                                     first.fun + 1e-7 + flop_tolerance / f_scale))
        second = bounded_milp(milp, stored, constraints=cons, **opts)
        x = second.x if second.x is not None else first.x
        if second.x is not None:  # the tie rule: among equal FLOPs and bytes, by name
            cons.append(LinearConstraint(stored[None], -np.inf, second.fun + 1e-9))
            third = bounded_milp(milp, self._tie_rank_row(width), constraints=cons,
                                 **opts | {"bounds": self._tie_bounds(second.x, high)})
            x = third.x if third.x is not None else x
        saved = frozenset(t for i, t in enumerate(self.tags) if x[i] > 0.5)
        offloaded = frozenset(t for i, t in enumerate(self.tags) if x[2 * n + i] > 0.5)
        return saved, offloaded, "HiGHS: " + _status(first, second)


def bounded_milp(milp: Callable, *args, **kwargs):
    """`milp(*args, **kwargs)` run in a daemon thread, the calling thread waiting in
    short joins: HiGHS releases the GIL, so a signal handler (`remat_kit.cli.stops`)
    runs and its exception leaves at once; the abandoned solve ends at its time limit."""
    out = []
    worker = threading.Thread(target=lambda: out.append(milp(*args, **kwargs)), daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if not out:
        raise RuntimeError("HiGHS ended without a result (its thread raised)")
    return out[0]


def _status(first, second) -> str:
    """The message of the run whose plan is kept, and for each run stopped at its time
    limit (status 1) before proving its plan the best, that run and its gap left."""
    last = second if second.x is not None else first
    stopped = [f"{which} run stopped at its time limit, gap "
               + ("unknown" if getattr(r, "mip_gap", None) is None else f"{r.mip_gap:.2%}")
               for which, r in (("the FLOPs", first), ("the bytes", second)) if r.status == 1]
    return "; ".join([last.message, *stopped])


def tie_rank(name: str) -> tuple:
    """Where a tag comes in the tie rule: a role of the vocabulary (MaxText's tag names,
    `remat_kit.policy.names.TAGS`) first, then another name the model gives its values
    (its own `checkpoint_name`, e.g. `attention_out`), then a module path
    (`layers_0/mlp/wi_0`), each by name."""
    kind = 0 if name in TAGS else 2 if is_path(name) else 1
    return kind, name


def _item_rank(item) -> tuple:
    """`tie_rank` of a tag, or of a (tag, layer group) item, its group after."""
    return (*tie_rank(item[0]), item[1]) if isinstance(item, tuple) else tie_rank(item)


__all__ = ["MIP_GAP", "SOLVE_SECONDS", "CostModel", "bounded_milp", "tie_rank"]
