"""A jaxpr as one dataflow graph: calls inlined, loop bodies walked, parameters followed.

`Graph` gives each value (`Val`) its producer and consumers (`Node`), whether it is made from
parameters alone or from the data, and the Var to name it by; calls that map inputs to outputs
one to one (jit, closed_call, checkpoint, custom_jvp/vjp, shard_map) are inlined, scan, while
and cond bodies walked as regions. `remat_kit.trace.roles` reads roles from it (`back`, `fwd_chain`).
What the walk sees through: docs/models.md ("A Flax model, no glue", step 4).
"""

from __future__ import annotations

import math

from collections import deque
from collections.abc import Iterable, Sequence

from jax.extend import core as jcore

from remat_kit._jax_private import scan_parts
from remat_kit.trace.validate import tag_of

# Calls whose single sub-jaxpr maps eqn inputs and outputs one to one: inlined.
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "shard_map": "jaxpr", "call_hi_primitive": "jaxpr"}
# Ops that move or relabel a value without computing: a role goes before or after
# them alike. `name` is checkpoint_name.
LAYOUT = {"reshape", "transpose", "squeeze", "expand_dims", "name", "sharding_constraint",
           "copy", "copy_p", "pvary", "mesh_cast", "reduce_precision"}


class Val:
    """One value of the flattened dataflow graph."""

    __slots__ = ("var", "depth", "aval", "producer", "consumers", "param", "data", "literal")

    def __init__(self, var, depth, aval, producer=None, param=False, data=False,
                 literal=False):
        self.var, self.depth, self.aval, self.producer = var, depth, aval, producer
        self.consumers: list[Node] = []
        self.param, self.data, self.literal = param, data, literal

    @property
    def shape(self):
        return tuple(getattr(self.aval, "shape", ()))


class Node:
    """One primitive application, calls inlined."""

    __slots__ = ("prim", "params", "ins", "outs")

    def __init__(self, prim, params, ins):
        self.prim, self.params, self.ins = prim, params, ins
        self.outs: list[Val] = []


class Graph:
    """The jaxpr flattened: calls inlined; scan/while/cond bodies walked as regions."""

    def __init__(self, jaxpr, is_param: Sequence[bool]):
        closed = jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else None
        jaxpr = closed.jaxpr if closed is not None else jaxpr
        if len(is_param) != len(jaxpr.invars):
            raise ValueError(f"is_param has {len(is_param)} entries; the jaxpr has "
                             f"{len(jaxpr.invars)} inputs (one bool per jaxpr.invars)")
        self.nodes: list[Node] = []
        ins = [Val(v, 0, v.aval, param=bool(p), data=not p)
               for v, p in zip(jaxpr.invars, is_param)]
        self._walk(jaxpr, ins, 0)

    def _const(self, var, depth):
        return Val(var, depth, var.aval)

    def _walk(self, jaxpr, in_vals, depth) -> list[Val]:
        env = dict(zip(jaxpr.invars, in_vals))
        for v in jaxpr.constvars:
            env[v] = self._const(v, depth)

        def read(v):
            if isinstance(v, jcore.Literal):
                return Val(None, depth, v.aval, literal=True)
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            # jax_remat3 stages remat as a hi-primitive holding its params.
            params = getattr(eqn.params.get("_prim"), "params", None) or eqn.params
            tag = tag_of(eqn)
            if tag is not None:  # checkpoint_name, a hi-primitive under jax_remat3 too
                name, params = "name", {"name": tag}
            if name == "broadcast_in_dim" and _adds_unit_axes(eqn):
                name = "reshape"  # jnp.matmul's re-broadcast of a size-1 batch: the same values
            sub = params.get(CALLS.get(name, ""))
            inner = getattr(sub, "jaxpr", sub)
            if (isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(ins)
                    and len(inner.outvars) == len(eqn.outvars)):
                for var, val in zip(eqn.outvars, self._walk(inner, ins, depth + 1)):
                    if val.depth >= depth:  # the outermost var of a returned value
                        val.var, val.depth = var, depth
                    env[var] = val
                continue
            node = Node(name, params if tag is not None else eqn.params, ins)
            self.nodes.append(node)
            for val in ins:
                val.consumers.append(node)
            param = any(v.param for v in ins) and not any(v.data for v in ins)
            data = any(v.data for v in ins)
            for var in eqn.outvars:
                out = Val(var, depth, var.aval, node, param=param, data=data)
                node.outs.append(out)
                env[var] = out
            self._regions(eqn, ins, depth + 1)
        return [read(v) for v in jaxpr.outvars]

    def _regions(self, eqn, ins, depth):
        """Walks scan/while/cond bodies: consts and branch operands are the outer
        values; a scanned slice of a parameter is a parameter; carries are new values."""
        p, name = eqn.params, eqn.primitive.name

        def fresh(jaxpr, shared: int, like: Sequence[Val], carry: int = 0):
            # A carry is never a parameter; a loop counter from a constant is not data.
            return [src if i < shared else
                    Val(v, depth, v.aval, param=src.param and i >= shared + carry,
                         data=src.data)
                    for i, (v, src) in enumerate(zip(jaxpr.invars, like))]

        if name == "scan":
            body, _, nc, ncarry = scan_parts(eqn)
            if len(body.invars) != len(ins):
                return
            self._walk(body, fresh(body, nc, ins, ncarry), depth)
        elif name == "while":
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            body = p["body_jaxpr"].jaxpr
            self._walk(body, fresh(body, bn, ins[cn:], len(ins) - cn - bn), depth)
        elif name == "cond":
            for branch in p["branches"]:
                self._walk(branch.jaxpr, list(ins[1:]), depth)


def data_ins(node) -> list[Val]:
    """The operands a value flows from, for backward walks (not indices, predicates,
    or parameter and constant operands)."""
    if node.prim in ("gather", "dynamic_slice"):
        ins = node.ins[:1]
    elif node.prim == "select_n":
        ins = node.ins[1:]
    else:
        ins = node.ins
    return [v for v in ins if v.data and not v.literal]


def back(val: Val, ops: set, stop=lambda n: False):
    """Breadth-first producers of `val` through `ops`: yields (node, parents) for
    every node reached, including the first node outside `ops` on each path
    (not walked past), and nodes where `stop` holds."""
    seen, queue = set(), deque([val])
    while queue:
        v = queue.popleft()
        n = v.producer
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        yield n, v
        if n.prim in ops and not stop(n):
            queue.extend(data_ins(n))


def back_path(val: Val, target, ops: set) -> list[tuple[Node, Val, Val]] | None:
    """The steps (node, its output on the path, its input on the path) from `val`
    back to `target`'s output, through `ops`; None if there is none."""
    queue, came = deque([val]), {id(val): None}
    while queue:
        v = queue.popleft()
        n = v.producer
        if n is None:
            continue
        if n is target:
            steps, cur = [], v
            while came[id(cur)] is not None:
                node, nxt = came[id(cur)]
                steps.append((node, nxt, cur))
                cur = nxt
            return steps[::-1]
        if n.prim in ops:
            for u in data_ins(n):
                if id(u) not in came:
                    came[id(u)] = (n, v)
                    queue.append(u)
    return None


def _reshape_axes(in_shape, out_shape, axes: set) -> set:
    """Input axes of a reshape holding the output `axes` (sizes-1 axes dropped)."""
    def bounds(shape):
        out, acc = [], 1
        for s in shape:
            out.append((acc, acc * s))
            acc *= s
        return out
    ob, ib = bounds(out_shape), bounds(in_shape)
    found = set()
    for a in axes:
        lo, hi = ob[a]
        found |= {j for j, (l2, h2) in enumerate(ib)
                  if in_shape[j] > 1 and l2 >= lo and h2 <= hi}
    return found


def _adds_unit_axes(eqn) -> bool:
    """Whether a broadcast_in_dim only inserts size-1 axes (a reshape: the same values
    in the same order), as jnp.matmul does after squeezing a batch of 1."""
    (x,), (out,) = eqn.invars, eqn.outvars
    dims = eqn.params["broadcast_dimensions"]
    return (math.prod(x.aval.shape) == math.prod(out.aval.shape)
            and list(dims) == sorted(dims)
            and all(out.aval.shape[d] == n for d, n in zip(dims, x.aval.shape)))


def axes_back(node, out_val, in_val, axes: set) -> set:
    """Axes of `in_val` that hold `axes` of `node`'s output `out_val`."""
    p = node.params
    if node.prim == "transpose":
        return {p["permutation"][a] for a in axes}
    if node.prim == "broadcast_in_dim":
        bd = p["broadcast_dimensions"]
        return {bd.index(a) for a in axes if a in bd and in_val.shape[bd.index(a)] > 1}
    if node.prim == "squeeze":
        kept = [i for i in range(len(in_val.shape)) if i not in p["dimensions"]]
        return {kept[a] for a in axes}
    if node.prim == "reshape":
        return _reshape_axes(in_val.shape, out_val.shape, axes)
    if len(in_val.shape) == len(out_val.shape):
        return set(axes)
    return set()


def dot_operand_axes(node, axes: set) -> dict[int, set]:
    """{operand index: its free axes} holding the dot_general output `axes`."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    nb = len(lb)
    free = [[i for i in range(len(v.shape)) if i not in c and i not in b]
            for v, c, b in zip(node.ins, (lc, rc), (lb, rb))]
    out: dict[int, set] = {}
    for a in axes:
        if a < nb:
            out.setdefault(-1, set()).add(a)
        elif a < nb + len(free[0]):
            out.setdefault(0, set()).add(free[0][a - nb])
        else:
            out.setdefault(1, set()).add(free[1][a - nb - len(free[0])])
    return out


def fwd_chain(val: Val, extra=lambda n, v: False, ops=LAYOUT) -> list[Val]:
    """`val` and the values of its single-consumer chain of `ops` (and of ops where
    `extra(node, val)` holds), `name` outputs left out: a role sits on the named value."""
    chain, depth = [val], val.depth
    while len(val.consumers) == 1:
        n = val.consumers[0]
        # Never into a call's body: a helper jit (jnp.where's) is shared by its callers.
        if (len(n.outs) != 1 or n.outs[0].depth > depth
                or not (n.prim in ops or extra(n, val))):
            break
        val = n.outs[0]
        depth = min(depth, val.depth)
        if n.prim != "name":
            chain.append(val)
    return chain


def fwd_end(val: Val, extra=lambda n, v: False, ops=LAYOUT) -> Val:
    """The last value of `fwd_chain(val, extra, ops)`."""
    return fwd_chain(val, extra, ops)[-1]


def back_end(val: Val, ops=LAYOUT | {"broadcast_in_dim"}) -> Val:
    """`val` walked back through layout ops to the value they rearrange."""
    depth = val.depth
    while (val.producer is not None and val.producer.prim in ops
           and len(val.producer.ins) == 1 and val.producer.ins[0].depth <= depth):
        val = val.producer.ins[0]
    return val


def fwd(val: Val, ops: set) -> Iterable[tuple[Node, Val]]:
    """(consumer, the operand it was reached by) breadth-first from `val` through
    `ops`; each node once."""
    seen, queue = set(), deque([val])
    while queue:
        v = queue.popleft()
        for n in v.consumers:
            if id(n) in seen:
                continue
            seen.add(id(n))
            yield n, v
            if n.prim in ops:
                queue.extend(n.outs)



def exchanges(g: "Graph", marks: Sequence) -> list[tuple]:
    """The all-to-alls of `g` whose output is floating point (expert parallelism's dispatch
    and combine), in program order, each with whether a node of `marks` runs after it and
    before the next one: [(node, bool)]."""
    at = {id(n): i for i, n in enumerate(g.nodes)}
    swaps = [n for n in g.nodes if n.prim in ("all_to_all", "ragged_all_to_all")
             and n.outs and "float" in str(getattr(n.outs[0].aval, "dtype", ""))]
    ends = [at[id(n)] for n in swaps[1:]] + [math.inf]
    return [(n, any(at[id(n)] < at[id(m)] < end for m in marks)) for n, end in zip(swaps, ends)]

__all__ = ["CALLS", "LAYOUT", "Graph", "Node", "Val", "axes_back", "back", "back_end",
           "back_path", "data_ins", "dot_operand_axes", "exchanges", "fwd", "fwd_chain", "fwd_end"]
