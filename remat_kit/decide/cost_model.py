"""The planner's cost model: what saving or recomputing each tag costs, measured from the program.

The loss is traced forward (`jax.make_jaxpr`) and flattened (`Program`): calls
that only group equations (`jax.jit` / `nn.jit` / `nnx.jit`, `closed_call`,
custom_jvp / custom_vjp functions) are inlined, so tags inside them are seen;
every remat region (`checkpoint`) is a *region*, whose inputs the remat keeps
(a recompute never reaches past them); a `scan` body is a level of its own whose
tags count once per trip. The regions outside any scan that hold tags are the
*layers*, in forward order: per-layer decisions (`Program.model(groups=G)`)
decide each tag per group of consecutive layers. A scanned stack's layers are
one body, so its tags are decided for all layers at once (`Program.per_layer`
says why not otherwise).

In the forward pass each tag has a *segment*: the equations between it and its
nearest tagged ancestors (its *parents*), the region's or level's inputs, and
the values the base rule saves (`dots` saves every `dot_general` output, so a
segment stops there and the dot is never recomputed). A tag's recompute cost is
its segment's FLOPs (each equation's from XLA's cost analysis of that equation
alone) and predicted seconds (the segment priced as one fusion,
`time_model.segment_seconds`); its bytes are its values' bytes, none where the
base rule saves them anyway.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from remat_kit.measure import time_model
from remat_kit.measure.residuals import _COPIES, _stage, call_body
from remat_kit.trace.workload import _as_factory
from remat_kit.policy.policy import BASES, Policy
from remat_kit.trace.validate import tag_of

SAVE_TAGS = Policy(save=frozenset({"*"}))
# Base rules the planner chooses among; "everything" saves what no remat saves.
PLANNED_BASES = tuple(b for b in BASES if b != "everything")
_REMAT = ("checkpoint", "remat2", "remat")
_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")

_cp = jax.checkpoint_policies
_BASE_SAVES = {"nothing": None, "dots": _cp.dots_saveable,
               "dots_no_batch": _cp.dots_with_no_batch_dims_saveable}


# ---------------------------------------------------------------------------
# The MILP over decision items
# ---------------------------------------------------------------------------

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
        `offloaded`; an offloaded item takes `offload_share` of its bytes."""
        return (sum(self.nbytes[t] for t in saved)
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

    def solve(self, room: float, flop_tolerance: float = 0.0,
              objective: str = "flops") -> tuple[frozenset, frozenset, str]:
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
                        sum_t bytes_t (s_t + share o_t) <= room

        (share: `offload_share`; w: 1 for "time", `flop_rate` for "flops"), then again for the fewest
        stored bytes (saved, and a little more for offloaded: saving is preferred
        where both fit; a little more in earlier layer groups) among solutions
        within the tolerance.

        Args:
          room: device bytes the saved items may take.
          flop_tolerance: cost the second solve may give up for fewer bytes, in
            the objective's unit (FLOPs, or seconds for "time").
          objective: "flops" (cost_t = flops) or "time" (cost_t = seconds).
        Returns:
          (saved items, offloaded items, HiGHS status message).
        """
        # Imported here: scipy.optimize is half a second of every command's start-up.
        from scipy.optimize import Bounds, LinearConstraint, milp
        n = len(self.tags)
        if n == 0:
            return frozenset(), frozenset(), "no tags to decide"
        groups = sorted(set(self.hide[t] for t in self.transfer), key=str)
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

        for t in self.needed:
            row((s(t), 1), (o(t), 1), (r(t), 1), low=1)
        for t in self.tags:
            for p in self.parents[t]:
                row((s(p), 1), (o(p), 1), (r(p), 1), (r(t), -1))
            if t in self.transfer:
                row((s(t), 1), (o(t), 1), low=-np.inf, high=1)
        t_scale = max([*self.transfer.values(), *self.compute.values(), 1e-30])
        for g in groups:
            row((gi[g], 1), *((o(t), -self.transfer[t] / t_scale) for t in self.transfer
                              if self.hide[t] == g), low=-self.compute.get(g, 0.0) / t_scale)
        weights = self.seconds if objective == "time" else self.flops
        # Scaled to ~1 so HiGHS's tolerances mean the same at any model size.
        b = np.array([self.nbytes[t] for t in self.tags], float)
        f = np.array([weights.get(t, 0.0) for t in self.tags], float)
        b_scale, f_scale = max(b.max(), 1.0), max(f.max(), 1e-30)
        per_second = 1.0 if objective == "time" else self.flop_rate
        cost_row = np.concatenate([np.zeros(n), f / f_scale, np.zeros(n),
                                   np.full(len(groups), 2 * per_second * t_scale / f_scale)])
        memory = np.concatenate([b / b_scale, np.zeros(n), self.offload_share * b / b_scale,
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
        high = np.ones(width)
        high[:n] = [float(t not in self.fixed) for t in self.tags]
        high[2 * n:3 * n] = [float(t in self.transfer and t not in self.fixed)
                             for t in self.tags]
        high[3 * n:] = np.inf
        opts = dict(integrality=np.r_[np.ones(3 * n), np.zeros(len(groups))],
                    bounds=Bounds(0, high), options={"mip_rel_gap": 0.0})
        first = milp(cost_row, constraints=cons, **opts)
        if first.x is None:
            return frozenset(), frozenset(), f"HiGHS: {first.message}"
        cons.append(LinearConstraint(cost_row[None], -np.inf,
                                     first.fun + 1e-7 + flop_tolerance / f_scale))
        second = milp(stored, constraints=cons, **opts)
        x = second.x if second.x is not None else first.x
        saved = frozenset(t for t in self.tags if x[s(t)] > 0.5)
        offloaded = frozenset(t for t in self.tags if x[o(t)] > 0.5)
        return saved, offloaded, \
            f"HiGHS: {second.message if second.x is not None else first.message}"


# ---------------------------------------------------------------------------
# The flattened forward program
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Node:
    eqn: object
    ins: list          # keys of the inputs (None for a literal)
    outs: list         # keys of the outputs
    region: int | None  # innermost remat region, or None
    scale: int         # trips of the scans around it


class Program:
    """A loss's forward program, flattened for the cost model (see the module docstring).

    Args:
      jaxpr: the forward jaxpr (`jax.make_jaxpr` of the loss on flat leaves).

    Attributes:
      nodes: the equations, call bodies inlined, in program order.
      regions: per remat region, in walk order: True where it is inside a scan.
      layers: the regions that hold tags outside any scan, in forward order.
    """

    def __init__(self, jaxpr):
        self.nodes: list[_Node] = []
        self.regions: list[bool] = []
        self._alias: dict = {}
        self._contexts = 0
        self._walk(jaxpr, self._context(), None, 1, False)
        self.producers = {k: n for n in self.nodes for k in n.outs if k is not None}
        tagged = [n for n in self.nodes if tag_of(n.eqn) is not None]
        self.layers = tuple(dict.fromkeys(n.region for n in tagged if n.region is not None
                                          and not self.regions[n.region]))
        self._loose = [n for n in tagged if n.region is None or self.regions[n.region]]

    def _context(self) -> int:
        self._contexts += 1
        return self._contexts

    def _key(self, ctx, v):
        if isinstance(v, Literal):
            return None
        return self._alias.get((ctx, v), (ctx, v))

    def _walk(self, jaxpr, ctx, region, scale, in_scan):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self._key(ctx, v) for v in eqn.invars]
            body = call_body(eqn, _CALL_KEYS)
            if name == "scan":
                inner = eqn.params["jaxpr"].jaxpr
                self._walk(inner, self._context(), region, scale * eqn.params["length"], True)
            elif name in _REMAT and body is not None:
                self.regions.append(in_scan)
                inner = self._context()
                self._walk(body, inner, len(self.regions) - 1, scale, in_scan)
                for o, io in zip(eqn.outvars, body.outvars):
                    self._alias[(ctx, o)] = self._key(inner, io)
                continue
            elif body is not None:
                inner = self._context()
                for iv, k in zip(body.invars, ins):
                    self._alias[(inner, iv)] = k
                self._walk(body, inner, region, scale, in_scan)
                for o, io in zip(eqn.outvars, body.outvars):
                    self._alias[(ctx, o)] = self._key(inner, io)
                continue
            # A scan is a boundary: a segment never recomputes a loop.
            self.nodes.append(_Node(eqn, ins, [self._key(ctx, v) for v in eqn.outvars],
                                    region, scale))

    @property
    def per_layer(self) -> str | None:
        """None where tags can be decided per layer; else why not."""
        if self._loose:
            inside = any(n.region is not None for n in self._loose)
            return ("the layers are one scan body, which takes one policy for every layer"
                    if inside else "some tags are outside any per-layer remat region")
        if len(self.layers) < 2:
            return "the program has one remat region"
        return None

    def groups(self, groups: int) -> dict[int, int]:
        """Region -> group, `groups` runs of consecutive layers as even as possible."""
        n = len(self.layers)
        return {r: i * groups // n for i, r in enumerate(self.layers)}

    def _saved_by_base(self, node: _Node, base: str) -> bool:
        rule = _BASE_SAVES[base]
        return rule is not None and bool(rule(node.eqn.primitive,
                                              *[v.aval for v in node.eqn.invars],
                                              **node.eqn.params))

    def _source(self, key):
        """The node producing `key`, through copies and layout changes."""
        node = self.producers.get(key)
        while node is not None and node.eqn.primitive in _COPIES and node.ins:
            node = self.producers.get(node.ins[0])
        return node

    def model(self, *, free: Sequence[str] = (), needed: Sequence[str] = (),
              base: str = "nothing", groups: int = 1,
              roofline: "time_model.Roofline | None" = None, cache: dict | None = None,
              host_bandwidth: float | None = None) -> CostModel:
        """The `CostModel` of this program under base rule `base`.

        Args:
          free: tags the remat regions keep whatever the policy (their inputs).
          needed: tag names the backward pass reads.
          base: "nothing", "dots_no_batch" or "dots".
          groups: 1 for one decision per tag (items are tag names); G > 1 for
            one per tag and group of layers (items are (tag, group) pairs);
            needs `per_layer` to be None.
          roofline: for predicted seconds (`CostModel.seconds`).
          cache: equation figures already measured (`time_model.eqn_costs`).
          host_bandwidth: bytes/s each way between device and host memory, to
            plan offload (`CostModel.transfer`); needs `roofline`. None: no offload.
        Raises:
          ValueError: groups > 1 where `per_layer` says no, or outside 1..layers;
            host_bandwidth without roofline.
        """
        if host_bandwidth is not None and roofline is None:
            raise ValueError("planning offload needs a roofline: transfers hide behind "
                             "the layers' predicted compute time")
        if groups > 1 and (self.per_layer or groups > len(self.layers)):
            raise ValueError(f"cannot decide tags in {groups} layer groups: "
                             f"{self.per_layer or f'the program has {len(self.layers)} layers'}")
        cache = {} if cache is None else cache
        group = self.groups(groups) if groups > 1 else {}
        free = set(free)
        nbytes, flops, seconds, parents, order = {}, {}, {}, {}, {}

        def item(node):
            tag = tag_of(node.eqn)
            return tag if groups == 1 else (tag, group.get(node.region, 0))

        for node in self.nodes:
            tag = tag_of(node.eqn)
            if tag is None or tag in free:
                continue
            it = item(node)
            order.setdefault(it, None)
            aval = node.eqn.outvars[0].aval
            source = self._source(node.ins[0]) if node.ins else None
            kept = source is not None and self._saved_by_base(source, base)
            nbytes[it] = nbytes.get(it, 0) + (0 if kept else node.scale * math.prod(
                aval.shape) * aval.dtype.itemsize)
            reads = parents.setdefault(it, set())
            seen, stack, segment = set(), list(node.ins), []
            while stack:  # the segment: back to the nearest tags, inputs or base-saved values
                e = self.producers.get(stack.pop())
                if e is None or id(e) in seen or e.eqn.primitive.name == "scan":
                    continue
                seen.add(id(e))
                if (t := tag_of(e.eqn)) is not None:
                    if t not in free:
                        reads.add(item(e))
                    continue
                if self._saved_by_base(e, base):
                    continue
                flops[it] = flops.get(it, 0.0) + e.scale * time_model.eqn_costs(e.eqn, cache)[0]
                segment.append(e)
                stack += e.ins
            if roofline is not None:  # XLA fuses a recompute: priced as one op
                seconds[it] = seconds.get(it, 0.0) + time_model.segment_seconds(
                    segment, aval, roofline, cache)
        tags = tuple(order)
        wanted = set(needed)
        offload = {}
        if host_bandwidth is not None:
            offload = dict(transfer={t: nbytes[t] / host_bandwidth for t in tags if nbytes[t]},
                           hide={t: 0 if groups == 1 else t[1] for t in tags},
                           compute=self._compute(group, roofline, cache),
                           flop_rate=roofline.bf16_flops)
        return CostModel(tags, nbytes, {t: flops.get(t, 0.0) for t in tags},
                         {t: frozenset(parents[t] - {t}) for t in tags},
                         frozenset(t for t in tags if (t if groups == 1 else t[0]) in wanted),
                         {t: seconds.get(t, 0.0) for t in tags} if roofline else {}, base,
                         **offload)

    def _compute(self, group: dict, roofline, cache: dict) -> dict:
        """Group -> predicted forward seconds of the remat regions holding tags in it
        (all of them in group 0 where `group` is empty: uniform decisions)."""
        tagged = {n.region for n in self.nodes if n.region is not None
                  and tag_of(n.eqn) is not None}
        out: dict = {}
        for node in self.nodes:
            if node.region in tagged and node.eqn.outvars:
                f, b = time_model.eqn_costs(node.eqn, cache)
                g = group.get(node.region, 0)
                out[g] = out.get(g, 0.0) + node.scale * roofline.seconds(
                    f, b, getattr(node.eqn.outvars[0].aval, "dtype", None))
        return out


def forward_jaxpr(loss: Callable, args) -> ClosedJaxpr:
    """`loss(*args)` traced forward on its flat leaves (nothing is computed)."""
    leaves, tree = jax.tree.flatten(args)
    return jax.make_jaxpr(lambda *xs: loss(*jax.tree.unflatten(tree, xs)))(*leaves)


def with_region_policies(closed: ClosedJaxpr, policies: dict[int, Policy]) -> Callable:
    """A loss(*args) that runs `closed` (`forward_jaxpr` of a loss at args) with
    remat region i under `policies[i]`.

    Regions are counted as `Program` counts them (walk order); regions not in
    `policies` keep theirs. The result is the model's own program with only the
    regions' policies changed, so it compiles as the model would with those
    per-layer policies (e.g. `TransformerConfig.layer_remat`).
    """
    counter = [0]
    jax_policies = {i: p.to_jax() for i, p in policies.items()}

    def rewrite(jaxpr):
        eqns = []
        for eqn in jaxpr.eqns:
            params = dict(eqn.params)
            name = eqn.primitive.name
            if name == "scan":
                sub = params["jaxpr"]
                params["jaxpr"] = ClosedJaxpr(rewrite(sub.jaxpr), sub.consts)
            else:
                for key in _CALL_KEYS:
                    sub = params.get(key)
                    if call_body(eqn, _CALL_KEYS) is None or sub is None:
                        continue
                    if name in _REMAT:
                        i, counter[0] = counter[0], counter[0] + 1
                        if i in jax_policies:
                            params["policy"] = jax_policies[i]
                    params[key] = (ClosedJaxpr(rewrite(sub.jaxpr), sub.consts)
                                   if isinstance(sub, ClosedJaxpr) else rewrite(sub))
                    break
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    fun = jaxpr_as_fun(ClosedJaxpr(rewrite(closed.jaxpr), closed.consts))

    def loss(*xs):
        return fun(*jax.tree.leaves(xs))[0]
    return loss


def cost_model(loss_fn: Callable, *args, free: Sequence[str] = (), staged=None,
               base: str = "nothing", groups: int = 1, roofline=None) -> CostModel:
    """Measures a `CostModel` for `loss_fn(*args)` (see the module docstring).

    Tags inside a `scan` (a scanned layer stack, `TransformerConfig.scan_layers`,
    or nested scans) count once per iteration; tags inside `jax.jit`-ed calls
    are seen.

    Args:
      loss_fn: a loss or a policy -> loss factory, as `measure` takes.
      args: arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
      free: tags the remat region keeps whatever the policy (its inputs).
      staged: the loss already traced under `SAVE_TAGS` (`residuals._stage`), if at hand.
      base, groups, roofline: as `Program.model`.
    Raises:
      TypeError: the loss does not return a scalar.
    """
    loss = _as_factory(loss_fn)(SAVE_TAGS)
    staged = staged or _stage(loss, args)
    needed = {r.name for r in staged.residuals if r.kind == "tag"} - set(free)
    return Program(forward_jaxpr(loss, args).jaxpr).model(
        free=free, needed=needed, base=base, groups=groups, roofline=roofline)


__all__ = ["CostModel", "PLANNED_BASES", "Program", "SAVE_TAGS", "cost_model", "forward_jaxpr",
           "with_region_policies"]
