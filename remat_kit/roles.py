"""Role inference: which canonical tag each value of a third-party model's jaxpr plays.

A model from a library names its values its own way (or not at all), so MaxText's
presets (`minimal`, `save_qkv_proj`, ...) would save nothing on it. `infer_roles`
reads the roles from the dataflow instead, the way a reader of the model would:

- a softmax over one axis (`exp(x - max) / sum(exp(...))`, as `jax.nn.softmax`
  traces, inline or inside a custom_jvp) whose input comes from a dot_general of
  two activations is attention: that dot is `attn_logits`, the value that enters
  the next dot is `attn_probs` (after dropout, masking or a dtype cast), that dot
  is `context` and the parameter matmul consuming it is `out_proj`;
- the parameter matmuls feeding the scores are the query (the operand carrying
  the softmax's kept axis) and the key (the one carrying the reduced, key axis);
  the one feeding context's other operand is the value; one matmul feeding all
  three is `qkv_proj`, one feeding key and value is `kv_proj`;
- a parameter matmul whose input is a nonlinearity (tanh, erf, logistic, max) or
  a product of matmuls, all of them from one input, is an MLP: `mlpwi` (or
  `mlpwi_0` through the nonlinearity and `mlpwi_1` beside it when gated),
  `mlp_act`, `mlpwo`. A fused gate/up matmul, split in two, is `mlpwi`, as
  MaxText's `fused_mlp` tags it;
- a normalized value (a reduce_sum over the last axis and an rsqrt) feeding the
  query/key/value matmuls is `attn_norm`, feeding the MLP's input matmuls `mlp_norm`;
- a fused attention op (cuDNN's `dot_product_attention_fwd`, a custom call or
  Pallas kernel named like attention) has only `context`: its scores never exist.

The walk sees through calls (jit/pjit, closed_call, checkpoint/remat in
either remat mode, custom_jvp_call, custom_vjp_call, shard_map) and into scan, while and cond
bodies; a parameter stays a parameter through layout ops and casts. Names
already in the jaxpr (`checkpoint_name`'s `name` primitive) are transparent: a
role goes to the named value itself, never to the `name` equation's output.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Iterable, Sequence

from jax.extend import core as jcore

# The tags inferred here: the vocabulary but for the block boundary
# (decoder_layer_input/output), which is where a block is wrapped, not a role.
ROLES = ("attn_norm", "query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj",
         "attn_logits", "attn_probs", "context", "out_proj", "mlp_norm", "mlpwi", "mlpwi_0",
         "mlpwi_1", "mlp_act", "mlpwo")

# Calls whose single sub-jaxpr maps eqn inputs and outputs one to one: inlined.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "shard_map": "jaxpr", "call_hi_primitive": "jaxpr"}
# Ops that move or relabel a value without computing: a role goes before or after
# them alike. `name` is checkpoint_name.
_LAYOUT = {"reshape", "transpose", "squeeze", "expand_dims", "name", "sharding_constraint",
           "copy", "copy_p", "pvary", "mesh_cast", "reduce_precision"}
_NONLIN = {"tanh", "logistic", "erf", "erfc", "max", "exp", "log1p"}
_ELEMENTWISE = _NONLIN | {
    "add", "sub", "mul", "div", "neg", "min", "pow", "integer_pow", "square", "sqrt", "rsqrt",
    "abs", "sign", "select_n", "clamp", "sin", "cos", "convert_element_type", "log", "exp2",
    "expm1", "cbrt", "floor", "ceil", "round", "atan2", "erf_inv", "and", "or", "not",
    "ge", "gt", "le", "lt", "eq", "ne", "is_finite", "nextafter"}
# Ops a value is looked through on its way between two matmuls (rope, head
# repeats for grouped-query attention, splits of a fused projection).
_THROUGH = _ELEMENTWISE | _LAYOUT | {"broadcast_in_dim", "slice", "dynamic_slice", "concatenate",
                                     "split", "unstack", "gather"}
# Ops between an MLP's input matmuls and its activation (a fused gate/up split in two).
_MLP_THROUGH = _LAYOUT | {"broadcast_in_dim", "slice", "split", "unstack", "concatenate"}
_FUSED_ATTENTION = re.compile(r"attention|attn|flash|fmha|\bmha|splash", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Roles:
    """Canonical tags of a jaxpr's values, as inferred by `infer_roles`.

    Attributes:
      of: jax.extend.core.Var -> canonical tag (a name in `ROLES`). A Var is the
        one of the (sub-)jaxpr where the value is computed: an equation's output
        var, or the outermost var of a value a call returns. Keyed by identity; a
        sub-jaxpr traced once and called per layer maps its Vars once.
      missing: canonical tag (of `ROLES`) -> one-line reason no value has it, e.g.
        {"attn_logits": "fused attention (one op ...): its scores never exist"}.
    """

    of: dict
    missing: dict


class _Val:
    """One value of the flattened dataflow graph."""

    __slots__ = ("var", "depth", "aval", "producer", "consumers", "param", "data", "literal")

    def __init__(self, var, depth, aval, producer=None, param=False, data=False,
                 literal=False):
        self.var, self.depth, self.aval, self.producer = var, depth, aval, producer
        self.consumers: list[_Node] = []
        self.param, self.data, self.literal = param, data, literal

    @property
    def shape(self):
        return tuple(getattr(self.aval, "shape", ()))


class _Node:
    """One primitive application, calls inlined."""

    __slots__ = ("prim", "params", "ins", "outs")

    def __init__(self, prim, params, ins):
        self.prim, self.params, self.ins = prim, params, ins
        self.outs: list[_Val] = []


class _Graph:
    """The jaxpr flattened: calls inlined; scan/while/cond bodies walked as regions."""

    def __init__(self, jaxpr, is_param: Sequence[bool]):
        closed = jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else None
        jaxpr = closed.jaxpr if closed is not None else jaxpr
        if len(is_param) != len(jaxpr.invars):
            raise ValueError(f"is_param has {len(is_param)} entries; the jaxpr has "
                             f"{len(jaxpr.invars)} inputs (one bool per jaxpr.invars)")
        self.nodes: list[_Node] = []
        ins = [_Val(v, 0, v.aval, param=bool(p), data=not p)
               for v, p in zip(jaxpr.invars, is_param)]
        self._walk(jaxpr, ins, 0)

    def _const(self, var, depth):
        return _Val(var, depth, var.aval)

    def _walk(self, jaxpr, in_vals, depth) -> list[_Val]:
        env = dict(zip(jaxpr.invars, in_vals))
        for v in jaxpr.constvars:
            env[v] = self._const(v, depth)

        def read(v):
            if isinstance(v, jcore.Literal):
                return _Val(None, depth, v.aval, literal=True)
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            # jax_remat3 stages remat as a hi-primitive holding its params.
            params = getattr(eqn.params.get("_prim"), "params", None) or eqn.params
            sub = params.get(_CALLS.get(name, ""))
            inner = getattr(sub, "jaxpr", sub)
            if (isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(ins)
                    and len(inner.outvars) == len(eqn.outvars)):
                for var, val in zip(eqn.outvars, self._walk(inner, ins, depth + 1)):
                    if val.depth >= depth:  # the outermost var of a returned value
                        val.var, val.depth = var, depth
                    env[var] = val
                continue
            node = _Node(name, eqn.params, ins)
            self.nodes.append(node)
            for val in ins:
                val.consumers.append(node)
            param = any(v.param for v in ins) and not any(v.data for v in ins)
            data = any(v.data for v in ins)
            for var in eqn.outvars:
                out = _Val(var, depth, var.aval, node, param=param, data=data)
                node.outs.append(out)
                env[var] = out
            self._regions(eqn, ins, depth + 1)
        return [read(v) for v in jaxpr.outvars]

    def _regions(self, eqn, ins, depth):
        """Walks scan/while/cond bodies: consts and branch operands are the outer
        values; a scanned slice of a parameter is a parameter; carries are new values."""
        p, name = eqn.params, eqn.primitive.name

        def fresh(jaxpr, shared: int, like: Sequence[_Val], carry: int = 0):
            # A carry is never a parameter; a loop counter from a constant is not data.
            return [src if i < shared else
                    _Val(v, depth, v.aval, param=src.param and i >= shared + carry,
                         data=src.data)
                    for i, (v, src) in enumerate(zip(jaxpr.invars, like))]

        if name == "scan":
            body = p["jaxpr"]
            if "ft_in" in p:  # jax 0.12: a tree of (consts, carry, xs)
                consts, carry, _ = p["ft_in"].update(list(ins)).unpack()
                nc, ncarry = len(list(consts)), len(list(carry))
            else:
                nc, ncarry = p["num_consts"], p["num_carry"]
            if len(body.jaxpr.invars) != len(ins):
                return
            self._walk(body.jaxpr, fresh(body.jaxpr, nc, ins, ncarry), depth)
        elif name == "while":
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            body = p["body_jaxpr"].jaxpr
            self._walk(body, fresh(body, bn, ins[cn:], len(ins) - cn - bn), depth)
        elif name == "cond":
            for branch in p["branches"]:
                self._walk(branch.jaxpr, list(ins[1:]), depth)


# --- walks over the graph -------------------------------------------------------------

def _is_dot(node) -> bool:
    return node is not None and node.prim == "dot_general"


def _param_dot(node):
    """(weight operand index, activation operand index) of a matmul against a
    parameter, or None."""
    if not _is_dot(node):
        return None
    a, b = node.ins
    if b.param and a.data:
        return 1, 0
    if a.param and b.data:
        return 0, 1
    return None


def _data_ins(node) -> list[_Val]:
    """The operands a value flows from, for backward walks (not indices, predicates,
    or parameter and constant operands)."""
    if node.prim in ("gather", "dynamic_slice"):
        ins = node.ins[:1]
    elif node.prim == "select_n":
        ins = node.ins[1:]
    else:
        ins = node.ins
    return [v for v in ins if v.data and not v.literal]


def _back(val: _Val, ops: set, stop=lambda n: False):
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
            queue.extend(_data_ins(n))


def _back_path(val: _Val, target, ops: set) -> list[tuple[_Node, _Val, _Val]] | None:
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
            for u in _data_ins(n):
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


def _axes_back(node, out_val, in_val, axes: set) -> set:
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


def _dot_operand_axes(node, axes: set) -> dict[int, set]:
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


def _fwd_end(val: _Val, extra=lambda n, v: False, ops=_LAYOUT) -> _Val:
    """The last value of `val`'s single-consumer chain of `ops` (and of ops where
    `extra(node, val)` holds), skipping `name` outputs: a role sits on the named value."""
    best, depth = val, val.depth
    while len(val.consumers) == 1:
        n = val.consumers[0]
        # Never into a call's body: a helper jit (jnp.where's) is shared by its callers.
        if (len(n.outs) != 1 or n.outs[0].depth > depth
                or not (n.prim in ops or extra(n, val))):
            break
        val = n.outs[0]
        if n.prim != "name":
            best = val
    return best


def _back_end(val: _Val, ops=_LAYOUT | {"broadcast_in_dim"}) -> _Val:
    """`val` walked back through layout ops to the value they rearrange."""
    depth = val.depth
    while (val.producer is not None and val.producer.prim in ops
           and len(val.producer.ins) == 1 and val.producer.ins[0].depth <= depth):
        val = val.producer.ins[0]
    return val


def _bias_add(n, v) -> bool:
    """A projection's bias: an add of a parameter to the matmul output."""
    return n.prim == "add" and all(u is v or u.param for u in n.ins)


def _scale(n, v) -> bool:
    """Scaling scores by a scalar constant (1/sqrt(head_dim), a softcap's 1/cap)."""
    if n.prim not in ("mul", "div") or (n.prim == "div" and n.ins[0] is not v):
        return False
    return all(u is v or (not u.data and not u.param and not u.shape) for u in n.ins)


def _proj(node) -> _Val:
    """The value a projection matmul gives: after its bias, before any reshape (where
    MaxText and our reference model tag it)."""
    return _fwd_end(node.outs[0], _bias_add, ops={"name", "sharding_constraint"})


def _param_dots_upstream(val: _Val) -> list[_Node]:
    """The parameter matmuls `val` comes from, looked through rope, head repeats,
    splits and casts (not past another matmul)."""
    return [n for n, _ in _back(val, _THROUGH) if _param_dot(n) is not None]


def _softmax(node):
    """(exp output, key axes) if `node` normalizes an exp by its own sum: the div
    of softmax; else None."""
    if node.prim not in ("div", "mul") or len(node.ins) != 2:
        return None
    num, den = node.ins
    if num.producer is None or num.producer.prim != "exp":
        return None
    if node.prim == "mul":  # num * (1 / sum)
        r = _back_end(den)
        if r.producer is None or r.producer.prim not in ("div", "integer_pow"):
            return None
        den = r.producer.ins[-1]
    s = _back_end(den)
    if s.producer is None or s.producer.prim != "reduce_sum":
        return None
    src = _back_end(s.producer.ins[0], _LAYOUT | {"convert_element_type"})
    if src is not num:
        return None
    return num, set(s.producer.params["axes"])


class _Assign:
    """Collects roles per value; a value claimed twice keeps its first role."""

    def __init__(self):
        self.of: dict[int, tuple[_Val, str]] = {}
        self.why: dict[str, str] = {}

    def put(self, val: _Val, tag: str):
        if val.var is not None and not isinstance(val.var, jcore.DropVar):
            self.of.setdefault(id(val), (val, tag))

    def vars(self) -> dict:
        by_var: dict = {}
        for val, tag in self.of.values():
            by_var.setdefault(val.var, set()).add(tag)
        # One Var of a shared sub-jaxpr seen in two roles has neither.
        return {v: next(iter(t)) for v, t in by_var.items() if len(t) == 1}


def _projections(a: _Assign, q_dots, k_dots, v_dots, why: dict):
    """Tags the query/key/value matmuls, fused ones as qkv_proj or kv_proj."""
    q, k, v = (set(map(id, d)) for d in (q_dots, k_dots, v_dots))
    for dots in (q_dots, k_dots, v_dots):
        for d in dots:
            i = id(d)
            tag = ("qkv_proj" if i in q and i in k and i in v else
                   "kv_proj" if i in k and i in v else
                   "query_proj" if i in q else "key_proj" if i in k else "value_proj")
            a.put(_proj(d), tag)
    if not (q_dots and k_dots and v_dots):
        why.setdefault("query_proj", "no parameter matmul found upstream of the attention "
                       "scores")


def _attention(g: _Graph, a: _Assign, why: dict) -> tuple[set, set]:
    """Finds softmax attention and fused attention ops; tags their values.

    Returns the ids of the q/k/v matmuls and of the out matmuls found."""
    qkv_ids, out_ids = set(), set()
    fused = []
    for node in g.nodes:
        target = str(node.params.get("target_name", node.params.get("call_target_name",
                                                                    node.params.get("name", ""))))
        if (_FUSED_ATTENTION.search(node.prim) or (
                node.prim in ("ffi_call", "custom_call", "pallas_call")
                and _FUSED_ATTENTION.search(target))) and len(node.ins) >= 3:
            fused.append(node)
    for node in fused:
        context = _fwd_end(node.outs[0])
        a.put(context, "context")
        dots = [_param_dots_upstream(v) for v in node.ins[:3]]
        _projections(a, *dots, why)
        qkv_ids |= {id(d) for ds in dots for d in ds}
        out_ids |= _out_proj(a, context)
        reason = f"fused attention (one op, {node.prim}): its scores never exist"
        why.setdefault("attn_logits", reason)
        why.setdefault("attn_probs", reason)

    for node in g.nodes:
        sm = _softmax(node)
        if sm is None:
            continue
        num, key_axes = sm
        probs_out = node.outs[0]
        # The scores: the matmul of two activations the exp's input comes from.
        scores = [n for n, _ in _back(num.producer.ins[0], _THROUGH - {"stop_gradient"})
                  if _is_dot(n) and _param_dot(n) is None and all(v.data for v in n.ins)]
        if len(scores) != 1:
            continue
        qk = scores[0]
        # The key axis, followed back from the exp to the scores' matmul.
        axes = _axes_back(num.producer, num, num.producer.ins[0], key_axes)
        for step_node, out_v, in_v in _back_path(num.producer.ins[0], qk, _THROUGH) or []:
            axes = _axes_back(step_node, out_v, in_v, axes)
        side = _dot_operand_axes(qk, axes)
        if set(side) not in ({0}, {1}):
            why.setdefault("query_proj", "could not tell query from key: the softmax axis "
                           "is not one operand's")
            continue
        key_i = next(iter(side))
        # The context matmul: the next matmul the probabilities flow into.
        ctx, p_i = next(((n, n.ins.index(via)) for n, via in
                         _fwd(probs_out, _ELEMENTWISE | _LAYOUT | {"broadcast_in_dim"})
                         if _is_dot(n)), (None, 0))
        if ctx is None or _param_dot(ctx) is not None:
            continue
        a.put(_fwd_end(qk.outs[0], _scale), "attn_logits")
        a.put(_back_end(ctx.ins[p_i]), "attn_probs")
        context = _fwd_end(ctx.outs[0])
        a.put(context, "context")
        q_dots = _param_dots_upstream(qk.ins[1 - key_i])
        k_dots = _param_dots_upstream(qk.ins[key_i])
        v_dots = _param_dots_upstream(ctx.ins[1 - p_i])
        _projections(a, q_dots, k_dots, v_dots, why)
        qkv_ids |= {id(d) for d in q_dots + k_dots + v_dots}
        out_ids |= _out_proj(a, context)
    return qkv_ids, out_ids


def _fwd(val: _Val, ops: set) -> Iterable[tuple[_Node, _Val]]:
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


def _out_proj(a: _Assign, context: _Val) -> set:
    for n, _ in _fwd(context, _LAYOUT | {"convert_element_type"}):
        if _param_dot(n) is not None:
            a.put(_proj(n), "out_proj")
            return {id(n)}
        if n.prim not in _LAYOUT | {"convert_element_type"}:
            break
    return set()


def _mlp(g: _Graph, a: _Assign, skip: set) -> list[_Node]:
    """Tags MLPs: a parameter matmul (wo) whose input is a nonlinearity or a gated
    product of parameter matmuls (wi) of one input. Returns the wi matmuls."""
    wis = []
    for wo in g.nodes:
        ix = _param_dot(wo)
        if ix is None or id(wo) in skip:
            continue
        act = _back_end(wo.ins[ix[1]])
        region, leaves, ok = [], [], True
        for n, _ in _back(act, _ELEMENTWISE | _MLP_THROUGH,
                          stop=lambda n: _param_dot(n) is not None):
            if _param_dot(n) is not None:
                leaves.append(n)
            elif n.prim in _ELEMENTWISE | _MLP_THROUGH:
                region.append(n)
            elif any(o.data for o in n.outs):
                ok = False  # the input is not made from matmuls alone
        if not ok or not leaves or any(id(n) in skip for n in leaves):
            continue
        sources = {id(_back_end(n.ins[_param_dot(n)[1]], _LAYOUT | {"convert_element_type"}))
                   for n in leaves}
        nonlin = [n for n in region if n.prim in _NONLIN and _not_relu_guard(n)]
        gated = [n for n in region if n.prim == "mul" and sum(v.data for v in n.ins) == 2]
        if len(sources) != 1 or not (nonlin or gated):
            continue
        a.put(act, "mlp_act")
        a.put(_proj(wo), "mlpwo")
        if len(leaves) == 1:
            a.put(_proj(leaves[0]), "mlpwi")
        elif len(leaves) == 2:
            region_ids = {id(n) for n in region}
            through = [any(id(n) in region_ids and n.prim in _NONLIN
                           for n, _ in _fwd(w.outs[0], _THROUGH)) for w in leaves]
            if sorted(through) == [False, True]:
                for w, t in zip(leaves, through):
                    a.put(_proj(w), "mlpwi_0" if t else "mlpwi_1")
        wis += leaves
    return wis


def _not_relu_guard(n) -> bool:
    """`max` counts as a nonlinearity (relu) only against a constant."""
    return n.prim != "max" or any(not v.data for v in n.ins)


def _norm_of(val: _Val) -> _Val | None:
    """`val` (walked back through layout ops) if it is a normalized value: made
    elementwise from an rsqrt (or sqrt, or a power) of a reduce_sum over the last axis."""
    out = _back_end(val)
    saw_rsqrt = False
    for n, _ in _back(out, _ELEMENTWISE | {"broadcast_in_dim"} | _LAYOUT):
        if n.prim in ("rsqrt", "sqrt") or (n.prim == "pow" and n.ins[1].literal):
            saw_rsqrt = True
        if (n.prim == "reduce_sum" and saw_rsqrt
                and tuple(n.params["axes"]) == (len(n.ins[0].shape) - 1,)):
            return out
    return None


def infer_roles(jaxpr, is_param: Sequence[bool]) -> Roles:
    """Infers canonical tags (query_proj, attn_probs, mlpwo, ...) by dataflow.

    Args:
      jaxpr: a ClosedJaxpr or Jaxpr: a loss, one decoder block, or a whole
        model's forward (as `jax.make_jaxpr` gives it), any dtypes and shapes.
      is_param: one bool per `jaxpr.invars`: True where the input is a
        parameter (a weight). A value made from parameters and constants only
        (a cast, reshape or `1 + scale`) counts as a parameter.
    Returns:
      `Roles`: `of` maps each Var with a role to its tag (Vars of the
      sub-jaxpr the value is computed in); `missing` gives, for each tag of
      `ROLES` no value has, a one-line reason. Values whose role cannot be
      inferred are left out (they keep the path tags auto_tag gives them).
    Raises:
      ValueError: `is_param` does not have one entry per input.
      TypeError: `jaxpr` is neither a ClosedJaxpr nor a Jaxpr.
    """
    if not isinstance(jaxpr, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        raise TypeError(f"infer_roles needs a ClosedJaxpr or Jaxpr (jax.make_jaxpr(f)(...)), "
                        f"got {type(jaxpr).__name__}")
    g = _Graph(jaxpr, list(is_param))
    a, why = _Assign(), {}
    qkv, outs = _attention(g, a, why)
    wis = _mlp(g, a, qkv | outs)
    for dots, tag in ((qkv, "attn_norm"), ({id(w) for w in wis}, "mlp_norm")):
        for n in g.nodes:
            if id(n) in dots:
                norm = _norm_of(n.ins[_param_dot(n)[1]])
                if norm is not None:
                    a.put(norm, tag)
    of = a.vars()
    found = set(of.values())
    return Roles(of=of, missing={t: _reason(t, found, why) for t in ROLES if t not in found})


def _reason(tag: str, found: set, why: dict) -> str:
    """Why no value has `tag`, given the tags found."""
    if tag in why:
        return why[tag]
    attention = found & {"attn_logits", "attn_probs", "context"}
    if tag in ("query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj") and attention:
        fused = sorted(found & {"qkv_proj", "kv_proj", "query_proj", "key_proj", "value_proj"})
        return f"this model's projections are {', '.join(fused) or 'not parameter matmuls'}"
    if tag in ("attn_norm", "attn_logits", "attn_probs", "context", "out_proj") or (
            tag.endswith("_proj")):
        if not attention:
            return "no attention found (no softmax over a matmul of two activations)"
        return {"attn_norm": "no norm (reduce over the features, rsqrt) feeds the projections",
                "out_proj": "no parameter matmul consumes the attention context"}.get(
                    tag, "not found in the attention")
    mlp = found & {"mlpwi", "mlpwi_0", "mlpwi_1", "mlp_act", "mlpwo"}
    if not mlp:
        return "no MLP found (a parameter matmul of a nonlinearity of parameter matmuls)"
    if tag in ("mlpwi_0", "mlpwi_1") and "mlpwi" in found:
        return "the MLP has one input matmul (mlpwi)"
    if tag == "mlpwi" and found & {"mlpwi_0", "mlpwi_1"}:
        return "the MLP is gated (mlpwi_0, mlpwi_1)"
    if tag == "mlp_norm":
        return "no norm (reduce over the features, rsqrt) feeds the MLP"
    return "not found in the MLP"


__all__ = ["ROLES", "Roles", "infer_roles"]
