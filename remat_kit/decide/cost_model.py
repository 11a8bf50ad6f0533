"""The planner's cost model: what saving or recomputing each tag costs, measured from the program.

`Program` flattens the traced loss into regions, scan levels and layers; each tag's segment (the
equations back to its tagged parents, the region's inputs or what the base rule saves) gives its
recompute FLOPs and seconds, its values their bytes. Main names: `cost_model` (the items, for
`milp.CostModel`), `Program`, `forward_jaxpr`, `with_region_policies`.
How costs are measured and where they fall short: docs/plan.md ("How it works").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from remat_kit.decide.milp import CostModel, tie_rank
from remat_kit.measure import time_model
from remat_kit.measure.residuals import COPY_PRIMITIVES, stage, call_body
from remat_kit.trace.workload import as_factory
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
        # Tags in a scanned region share one policy. Tags outside every remat region
        # (a model's embedding or final norm, named by path) are kept by plain autodiff
        # whatever the policy: they are not decided (`model`) and do not stop per-layer plans.
        self._loose = [n for n in tagged if n.region is not None and self.regions[n.region]]
        self._outside = bool(self.regions) and any(n.region is None for n in tagged)

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
            return "the layers are one scan body, which takes one policy for every layer"
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
        while node is not None and node.eqn.primitive in COPY_PRIMITIVES and node.ins:
            node = self.producers.get(node.ins[0])
        return node

    def planned_names(self) -> dict[str, str]:
        """Tag name -> the tag it is planned as: names that always sit on one value
        with another (a role on a module's output path, the model's own
        `checkpoint_name` beside a role) are one decision, named by the first of
        the names on every such value in `milp.tie_rank` (a role, then the model's own
        name, then a module path). Saving that name saves every value the merged
        name is on, so the merge keeps the policy's meaning. Names on no shared
        value map to themselves."""
        chains: dict[int, set] = {}  # bottom tag node -> the names on its value
        for node in self.nodes:
            if (tag := tag_of(node.eqn)) is None:
                continue
            bottom = node
            while bottom.ins and (below := self._source(bottom.ins[0])) is not None \
                    and tag_of(below.eqn) is not None:
                bottom = below
            chains.setdefault(id(bottom), set()).add(tag)
        common: dict[str, set] = {}
        for names in chains.values():
            for name in names:
                common[name] = common[name] & names if name in common else set(names)
        return {name: min(shared, key=tie_rank) for name, shared in common.items()}

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
        rep = self.planned_names()
        items = _Items(self, rep, {rep.get(t, t) for t in free}, base, group, groups)
        for node in self.nodes:
            items.add(node, roofline, cache)
        tags = tuple(items.order)
        offload = {}
        if host_bandwidth is not None:
            offload = dict(
                transfer={t: items.nbytes[t] / host_bandwidth for t in tags if items.nbytes[t]},
                hide={t: 0 if groups == 1 else t[1] for t in tags},
                compute=self._compute(group, roofline, cache), flop_rate=roofline.bf16_flops)
        return items.cost_model({rep.get(t, t) for t in needed}, roofline is not None, **offload)

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


class _Items:
    """What `Program.model` measures per decision item, one tag node at a time: bytes,
    recompute FLOPs and seconds, the items each segment reads, forward order."""

    def __init__(self, program: Program, rep: dict, free: set, base: str, group: dict,
                 groups: int):
        self.program, self.rep, self.free, self.base = program, rep, free, base
        self.group, self.groups = group, groups
        self.nbytes, self.flops, self.seconds, self.parents, self.order = {}, {}, {}, {}, {}

    def planned(self, node):
        tag = tag_of(node.eqn)
        return None if tag is None else self.rep.get(tag, tag)

    def item(self, node):
        tag = self.planned(node)
        return tag if self.groups == 1 else (tag, self.group.get(node.region, 0))

    def add(self, node, roofline, cache: dict) -> None:
        """Counts `node` where it is a decided tag: its bytes (none where the base rule
        keeps its source) and its segment's FLOPs, seconds and parents."""
        tag, program = self.planned(node), self.program
        below = program._source(node.ins[0]) if node.ins else None
        if tag is None or tag in self.free or (below is not None and self.planned(below) == tag) \
                or (node.region is None and program._outside):
            return  # untagged, kept anyway, a value's second name, or outside every remat
        it = self.item(node)
        self.order.setdefault(it, None)
        aval = node.eqn.outvars[0].aval
        kept = below is not None and program._saved_by_base(below, self.base)
        self.nbytes[it] = self.nbytes.get(it, 0) + (0 if kept else node.scale * math.prod(
            aval.shape) * aval.dtype.itemsize)
        segment = self._segment(node, self.parents.setdefault(it, set()))
        for e in segment:  # summed in the walk's order, as the FLOPs always were
            self.flops[it] = self.flops.get(it, 0.0) + e.scale * time_model.eqn_costs(
                e.eqn, cache)[0]
        if roofline is not None:  # XLA fuses a recompute: priced as one op
            self.seconds[it] = self.seconds.get(it, 0.0) + time_model.segment_seconds(
                segment, aval, roofline, cache)

    def _segment(self, node, reads: set) -> list:
        """The equations recomputing `node`: back to the nearest tags (added to
        `reads` unless free), inputs, scans or base-saved values."""
        seen, stack, segment = set(), list(node.ins), []
        while stack:
            e = self.program.producers.get(stack.pop())
            if e is None or id(e) in seen or e.eqn.primitive.name == "scan":
                continue
            seen.add(id(e))
            if (t := self.planned(e)) is not None:
                if t not in self.free:
                    reads.add(self.item(e))
                continue
            if self.program._saved_by_base(e, self.base):
                continue
            segment.append(e)
            stack += e.ins
        return segment

    def cost_model(self, wanted: set, timed: bool, **offload) -> CostModel:
        """The `CostModel` of the items counted; `wanted`: planned names the backward
        reads; timed: whether seconds were predicted; offload: `CostModel`'s fields."""
        tags, one = tuple(self.order), self.groups == 1
        names = {t if one else t[0] for t in tags}
        aliases = {r: tuple(sorted(n for n, to in self.rep.items() if to == r and n != r))
                   for r in sorted(names)}
        return CostModel(tags, self.nbytes, {t: self.flops.get(t, 0.0) for t in tags},
                         {t: frozenset(self.parents[t] - {t}) for t in tags},
                         frozenset(t for t in tags if (t if one else t[0]) in wanted),
                         {t: self.seconds.get(t, 0.0) for t in tags} if timed else {},
                         self.base, aliases={r: a for r, a in aliases.items() if a}, **offload)


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
      staged: the loss already traced under `SAVE_TAGS` (`residuals.stage`), if at hand.
      base, groups, roofline: as `Program.model`.
    Raises:
      TypeError: the loss does not return a scalar.
    """
    loss = as_factory(loss_fn)(SAVE_TAGS)
    staged = staged or stage(loss, args)
    needed = {r.name for r in staged.residuals if r.kind == "tag"} - set(free)
    return Program(forward_jaxpr(loss, args).jaxpr).model(
        free=free, needed=needed, base=base, groups=groups, roofline=roofline)


__all__ = ["CostModel", "PLANNED_BASES", "Program", "SAVE_TAGS", "cost_model", "forward_jaxpr",
           "with_region_policies"]
