"""Role inference: which canonical tag each value of a third-party model's jaxpr plays.

A model from a library names its values its own way, so MaxText's presets (`minimal`,
`save_qkv_proj`, ...) would save nothing on it; `infer_roles` reads the roles (`ROLES`) from the
dataflow instead: the softmax and the dots around it are attention, the parameter matmuls around
a nonlinearity the MLP, a normalized value feeding them a norm, grouped matmuls over routed
tokens a mixture of experts (routing, dispatch, expert matmuls). Also `Roles`, `kernel_name`.
The rules: docs/models.md ("A Flax model, no glue", step 4).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax.numpy as jnp
from jax.extend import core as jcore

from remat_kit.trace import dataflow as df

# The tags inferred here: the vocabulary but for the block boundary
# (decoder_layer_input/output), which is where a block is wrapped, not a role.
ROLES = ("attn_norm", "query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj",
         "attn_logits", "attn_probs", "context", "out_proj", "mlp_norm", "mlpwi", "mlpwi_0",
         "mlpwi_1", "mlp_act", "mlpwo")
# A mixture of experts' roles, MaxText's names (layers/moe.py), inferred too; reported
# missing only where a grouped matmul is found.
MOE_ROLES = ("moe_routing_maps", "moe_x_sorted", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")

_NONLIN = {"tanh", "logistic", "erf", "erfc", "max", "exp", "log1p"}
_ELEMENTWISE = _NONLIN | {
    "add", "sub", "mul", "div", "neg", "min", "pow", "integer_pow", "square", "sqrt", "rsqrt",
    "abs", "sign", "select_n", "clamp", "sin", "cos", "convert_element_type", "log", "exp2",
    "expm1", "cbrt", "floor", "ceil", "round", "atan2", "erf_inv", "and", "or", "not",
    "ge", "gt", "le", "lt", "eq", "ne", "is_finite", "nextafter"}
# Ops a value is looked through on its way between two matmuls (rope, head
# repeats for grouped-query attention, splits of a fused projection; scatter:
# a rope that writes its halves with `out.at[..., 0::2].set(...)`).
_THROUGH = _ELEMENTWISE | df.LAYOUT | {"broadcast_in_dim", "slice", "dynamic_slice",
                                        "concatenate", "split", "unstack", "gather",
                                        "scatter"}
# Ops between an MLP's input matmuls and its activation (a fused gate/up split in two).
_MLP_THROUGH = df.LAYOUT | {"broadcast_in_dim", "slice", "split", "unstack", "concatenate"}
_FUSED_ATTENTION = re.compile(r"attention|attn|flash|fmha|\bmha|splash", re.IGNORECASE)
# Grouped-matmul kernels (megablox gmm, by its name or its source file).
_GROUPED_KERNEL = re.compile(r"gmm|megablox|grouped|ragged", re.IGNORECASE)


def kernel_name(prim: str, params: dict) -> str:
    """A kernel's name: a Pallas call's `name=`, else its kernel function's (the TPU
    flash kernel passes no name), a custom call's target, or the primitive's."""
    body = getattr(params.get("jaxpr"), "debug_info", None)
    function = (getattr(body, "func_src_info", None) or "").split(" ")[0].strip("_")
    return str(params.get("name") or function or params.get("call_target_name")
               or params.get("target_name") or prim)


@dataclasses.dataclass(frozen=True)
class Roles:
    """Canonical tags of a jaxpr's values, as inferred by `infer_roles`.

    Attributes:
      of: jax.extend.core.Var -> canonical tag (a name in `ROLES` or `MOE_ROLES`). A Var is the
        one of the (sub-)jaxpr where the value is computed: an equation's output
        var, or the outermost var of a value a call returns. Keyed by identity; a
        sub-jaxpr traced once and called per layer maps its Vars once.
      missing: canonical tag (of `ROLES`; of `MOE_ROLES` where a grouped matmul is found) -> reason no value has it, e.g.
        {"attn_logits": "fused attention (one op ...): its scores never exist"}.
    """

    of: dict
    missing: dict

    def notes(self) -> tuple[str, ...]:
        """One line per missing tag, sorted: "attn_logits: fused attention ..."."""
        return tuple(f"{tag}: {why}" for tag, why in sorted(self.missing.items()))


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


def _bias_add(n, v) -> bool:
    """A projection's bias: an add of a parameter to the matmul output."""
    return n.prim == "add" and all(u is v or u.param for u in n.ins)


def _scale(n, v) -> bool:
    """Scaling scores by a scalar constant (1/sqrt(head_dim), a softcap's 1/cap)."""
    if n.prim not in ("mul", "div") or (n.prim == "div" and n.ins[0] is not v):
        return False
    return all(u is v or (not u.data and not u.param and not u.shape) for u in n.ins)


def _proj(node) -> df.Val:
    """The value a projection matmul gives: after its bias, before any reshape (where
    MaxText and our reference model tag it); but where a `name` follows a layout op
    (an auto_tag path tag on a layer's output, e.g. the transpose jnp.einsum ends
    with), the named value: one value, one set of names."""
    val = df.fwd_end(node.outs[0], _bias_add, ops={"name", "sharding_constraint"})
    return next((v for v in df.fwd_chain(val, _bias_add)
                 if any(c.prim == "name" for c in v.consumers)), val)


def _param_dots_upstream(val: df.Val) -> list[df.Node]:
    """The parameter matmuls `val` comes from, looked through rope, head repeats,
    splits and casts (not past another matmul)."""
    return [n for n, _ in df.back(val, _THROUGH) if _param_dot(n) is not None]


def _divided(node):
    """(numerator, the reduce_sum node of the denominator) of `x / sum(...)` or
    `x * (1 / sum(...))`; else None."""
    if node.prim not in ("div", "mul") or len(node.ins) != 2:
        return None
    num, den = node.ins
    if node.prim == "mul":  # num * (1 / sum)
        r = df.back_end(den)
        if r.producer is None or r.producer.prim not in ("div", "integer_pow"):
            return None
        den = r.producer.ins[-1]
    # A low-precision softmax sums its exps in float32 and casts the sum back.
    s = df.back_end(den, df.LAYOUT | {"broadcast_in_dim", "convert_element_type"})
    if s.producer is None or s.producer.prim != "reduce_sum":
        return None
    return num, s.producer


def _exp_summed(val: df.Val, total) -> bool:
    """Whether `val` is an exp whose sum (over layout ops and casts) is `total`."""
    return (val.producer is not None and val.producer.prim == "exp"
            and df.back_end(total.ins[0], df.LAYOUT | {"convert_element_type"}) is val)


def _softmax(node):
    """(exp output, key axes, probabilities, context matmul or None) if `node`
    normalizes an exp by its own sum: the div of softmax (probabilities: its
    output), or the div of a matmul of the unnormalized exps by their sum
    (`(exp(s - max) @ v) / sum(exp(s - max))`: probabilities are the exps and
    the matmul is the context's); else None."""
    got = _divided(node)
    if got is None:
        return None
    num, total = got
    axes = set(total.params["axes"])
    if _exp_summed(num, total):
        return num, axes, node.outs[0], None
    ctx = df.back_end(num, df.LAYOUT | {"convert_element_type"}).producer
    if not _is_dot(ctx) or _param_dot(ctx) is not None:
        return None
    exps = [v for v in ctx.ins
            if _exp_summed(df.back_end(v, df.LAYOUT | {"convert_element_type"}), total)]
    if len(exps) != 1:
        return None
    return df.back_end(exps[0], df.LAYOUT | {"convert_element_type"}), axes, exps[0], ctx


class _Assign:
    """Collects roles per value; a value claimed twice keeps its first role."""

    def __init__(self):
        self.of: dict[int, tuple[df.Val, str]] = {}

    def put(self, val: df.Val, tag: str):
        if val.var is not None and not isinstance(val.var, jcore.DropVar):
            self.of.setdefault(id(val), (val, tag))

    def vars(self) -> dict:
        by_var: dict = {}
        for val, tag in self.of.values():
            by_var.setdefault(val.var, set()).add(tag)
        # One Var of a shared sub-jaxpr seen in two roles has neither.
        return {v: next(iter(t)) for v, t in by_var.items() if len(t) == 1}


def _rotated(dot, operand: df.Val) -> df.Val:
    """The value a query or key projection `dot` gives on its way to the scores
    matmul's `operand`: past what computes on it element for element (a rotary
    embedding, its halves sliced and joined, a cast), up to a head repeat (grouped-query attention) or a
    scaling by a constant; where nothing computes, the projection (`_proj`).
    MaxText names query_proj/key_proj after the rotary embedding
    (layers/attentions.py: `checkpoint_name(query, "query_proj")` after
    `apply_rotary_embedding`)."""
    size = lambda v: math.prod(v.shape)  # noqa: E731
    out = dot.outs[0]
    found = None
    for node, val, _ in reversed(df.back_path(operand, dot, _THROUGH) or []):
        if size(val) > size(out) or _scale(node, _):  # a head repeat, the scaling
            break
        if size(val) == size(out) and node.prim not in df.LAYOUT | {"broadcast_in_dim"}:
            found = val  # (a rotation's halves, sliced, are smaller)
    if found is None:
        return _proj(dot)
    return df.fwd_end(found, ops={"name", "sharding_constraint"})


def _projections(a: _Assign, q_dots, k_dots, v_dots, why: dict, ends=()):
    """Tags the query/key/value matmuls, fused ones as qkv_proj or kv_proj;
    `ends` = (query operand, key operand) of the scores matmul, to name a query or
    key after its rotary embedding (`_rotated`)."""
    q, k, v = (set(map(id, d)) for d in (q_dots, k_dots, v_dots))
    for dots in (q_dots, k_dots, v_dots):
        for d in dots:
            i = id(d)
            tag = ("qkv_proj" if i in q and i in k and i in v else
                   "kv_proj" if i in k and i in v else
                   "query_proj" if i in q else "key_proj" if i in k else "value_proj")
            if ends and tag in ("query_proj", "key_proj"):
                a.put(_rotated(d, ends[tag == "key_proj"]), tag)
            else:
                a.put(_proj(d), tag)
    if not (q_dots and k_dots and v_dots):
        why.setdefault("query_proj", "no parameter matmul found upstream of the attention "
                       "scores")


def _attention(g: df.Graph, a: _Assign, why: dict) -> tuple[set, set]:
    """Finds softmax attention and fused attention ops; tags their values.

    Returns the ids of the q/k/v matmuls and of the out matmuls found."""
    qkv_ids, out_ids = set(), set()
    fused = []
    for node in g.nodes:
        if (_FUSED_ATTENTION.search(node.prim) or (
                node.prim in ("ffi_call", "custom_call", "pallas_call")
                and _FUSED_ATTENTION.search(kernel_name(node.prim, node.params)))):
            # q, k, v: its first three floating data arrays (a kernel's mask info,
            # sequence iotas and segment ids are integers; MQA's k and v are [seq, d])
            qkv = [v for v in node.ins if v.data and len(v.shape) >= 2
                   and jnp.issubdtype(v.aval.dtype, jnp.floating)][:3]
            if len(qkv) == 3:
                fused.append((node, qkv))
    for node, qkv in fused:
        context = df.fwd_end(node.outs[0])
        for out in node.outs:  # the result and its softmax statistics, where it gives them
            a.put(df.fwd_end(out), "context")
        dots = [_param_dots_upstream(v) for v in qkv]
        _projections(a, *dots, why)
        qkv_ids |= {id(d) for ds in dots for d in ds}
        out_ids |= _out_proj(a, context)
        reason = (f"fused attention (one op, {kernel_name(node.prim, node.params)}): its "
                  "scores never exist")
        why.setdefault("attn_logits", reason)
        why.setdefault("attn_probs", reason)
    for node in g.nodes:
        sm = _softmax(node)
        if sm is None:
            continue
        num, key_axes, probs_out, ctx = sm
        # The scores: the matmul of two activations the exp's input comes from.
        scores = [n for n, _ in df.back(num.producer.ins[0], _THROUGH - {"stop_gradient"})
                  if _is_dot(n) and _param_dot(n) is None and all(v.data for v in n.ins)]
        if len(scores) != 1:
            continue
        qk = scores[0]
        # The key axis, followed back from the exp to the scores' matmul.
        axes = df.axes_back(num.producer, num, num.producer.ins[0], key_axes)
        for step_node, out_v, in_v in df.back_path(num.producer.ins[0], qk, _THROUGH) or []:
            axes = df.axes_back(step_node, out_v, in_v, axes)
        side = df.dot_operand_axes(qk, axes)
        if set(side) not in ({0}, {1}):
            why.setdefault("query_proj", "could not tell query from key: the softmax axis "
                           "is not one operand's")
            continue
        key_i = next(iter(side))
        # The context matmul: the next matmul the probabilities flow into.
        context = None
        if ctx is None:
            ctx, p_i = next(((n, n.ins.index(via)) for n, via in
                             df.fwd(probs_out, _ELEMENTWISE | df.LAYOUT | {"broadcast_in_dim"})
                             if _is_dot(n)), (None, 0))
        else:  # normalized after the matmul: the context is the divide's output
            p_i, context = ctx.ins.index(probs_out), df.fwd_end(node.outs[0])
        if ctx is None or _param_dot(ctx) is not None:
            continue
        a.put(df.fwd_end(qk.outs[0], _scale), "attn_logits")
        a.put(df.back_end(ctx.ins[p_i]), "attn_probs")
        context = context or df.fwd_end(ctx.outs[0])
        a.put(context, "context")
        q_dots = _param_dots_upstream(qk.ins[1 - key_i])
        k_dots = _param_dots_upstream(qk.ins[key_i])
        v_dots = _param_dots_upstream(ctx.ins[1 - p_i])
        _projections(a, q_dots, k_dots, v_dots, why, (qk.ins[1 - key_i], qk.ins[key_i]))
        qkv_ids |= {id(d) for d in q_dots + k_dots + v_dots}
        out_ids |= _out_proj(a, context)
    return qkv_ids, out_ids


def _out_proj(a: _Assign, context: df.Val) -> set:
    for n, _ in df.fwd(context, df.LAYOUT | {"convert_element_type"}):
        if _param_dot(n) is not None:
            a.put(_proj(n), "out_proj")
            return {id(n)}
        if n.prim not in df.LAYOUT | {"convert_element_type"}:
            break
    return set()


def _mlp(g: df.Graph, a: _Assign, skip: set) -> list[df.Node]:
    """Tags MLPs: a parameter matmul (wo) whose input is a nonlinearity or a gated
    product of parameter matmuls (wi) of one input. Returns the wi matmuls."""
    wis = []
    for wo in g.nodes:
        ix = _param_dot(wo)
        if ix is None or id(wo) in skip:
            continue
        act = df.back_end(wo.ins[ix[1]])
        region, leaves, ok = [], [], True
        for n, _ in df.back(act, _ELEMENTWISE | _MLP_THROUGH,
                          stop=lambda n: _param_dot(n) is not None):
            if _param_dot(n) is not None:
                leaves.append(n)
            elif n.prim in _ELEMENTWISE | _MLP_THROUGH:
                region.append(n)
            elif any(o.data for o in n.outs):
                ok = False  # the input is not made from matmuls alone
        if not ok or not leaves or any(id(n) in skip for n in leaves):
            continue
        if any(n.outs[0].depth != wo.outs[0].depth for n in leaves):
            # An MLP lies within one call: a DiT's conditioning vector, made by an MLP
            # outside the blocks and turned into adaLN's shift and scale by a matmul
            # of silu(c) inside each block, is no MLP of the block.
            continue
        sources = {id(df.back_end(n.ins[_param_dot(n)[1]], df.LAYOUT | {"convert_element_type"}))
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
                           for n, _ in df.fwd(w.outs[0], _THROUGH)) for w in leaves]
            if sorted(through) == [False, True]:
                for w, t in zip(leaves, through):
                    a.put(_proj(w), "mlpwi_0" if t else "mlpwi_1")
        wis += leaves
    return wis


def _grouped(node) -> int | None:
    """The index of the routed tokens' operand of a grouped matmul against experts'
    weights (`ragged_dot`, or a grouped-matmul kernel: its 2-D floating operand before
    a 3-D parameter one); else None."""
    body = getattr(node.params.get("jaxpr"), "debug_info", None) if node else None
    if node is None or node.prim != "ragged_dot_general" and not (
            node.prim in ("pallas_call", "custom_call", "ffi_call") and _GROUPED_KERNEL.search(
                kernel_name(node.prim, node.params) + (getattr(body, "func_src_info", "") or ""))):
        return None
    floats = [i for i, v in enumerate(node.ins)
              if len(v.shape) >= 2 and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    if len(floats) < 2 or len(node.ins[floats[0]].shape) != 2 or not (
            len(node.ins[floats[1]].shape) == 3 and node.ins[floats[1]].param):
        return None
    return floats[0]


def _moe(g: df.Graph, a: _Assign) -> bool:
    """Tags a mixture of experts (MaxText's names): the expert MLPs' grouped matmuls (the
    output one, moe_mlpwo, fed by a nonlinearity or gated product of the input ones:
    moe_mlpwi_0 through it, moe_mlpwi_1 not), the routed tokens they read (moe_x_sorted), the
    routing (top-k expert ids and their sort permutation: moe_routing_maps) and, experts over
    chips, the rows an all-to-all brings (moe_dispatch, moe_combine). Returns if one found."""
    grouped = [n for n in g.nodes if _grouped(n) is not None]
    for wo in grouped:
        act = df.back_end(wo.ins[_grouped(wo)])
        leaves, region = [], []
        for n, _ in df.back(act, _ELEMENTWISE | _MLP_THROUGH,
                            stop=lambda n: _grouped(n) is not None):
            (leaves if _grouped(n) is not None else region).append(n)
        if not leaves or not any(n.prim in _NONLIN or n.prim == "mul" for n in region):
            continue
        a.put(_proj(wo), "moe_mlpwo")
        region_ids = {id(n) for n in region}
        for w in leaves:
            through = any(id(n) in region_ids and n.prim in _NONLIN
                          for n, _ in df.fwd(w.outs[0], _THROUGH))
            a.put(_proj(w), "moe_mlpwi_0" if through or len(leaves) == 1 else "moe_mlpwi_1")
            a.put(df.back_end(w.ins[_grouped(w)], df.LAYOUT | {"convert_element_type"}),
                  "moe_x_sorted")
    if not grouped:
        return False
    for n in g.nodes:
        if n.prim == "top_k" and len(n.outs) == 2:  # (values, expert ids)
            ids = df.fwd_end(n.outs[1])
            a.put(ids, "moe_routing_maps")
            for sort in ids.consumers:  # argsort: sort(ids, iota) -> (sorted, permutation)
                if sort.prim == "sort" and len(sort.outs) == 2 and sort.ins[0] is ids:
                    a.put(sort.outs[1], "moe_routing_maps")
    for n, before in df.exchanges(g, grouped):  # dispatch: before a grouped matmul
        a.put(n.outs[0], "moe_dispatch" if before else "moe_combine")
    return True


def _not_relu_guard(n) -> bool:
    """`max` counts as a nonlinearity (relu) only against a constant."""
    return n.prim != "max" or any(not v.data for v in n.ins)


def _norm_of(val: df.Val) -> df.Val | None:
    """`val` (walked back through layout ops) if it is a normalized value: made
    elementwise from an rsqrt (or sqrt, or a power) of a reduce_sum over the last axis."""
    out = df.back_end(val)
    saw_rsqrt = False
    for n, _ in df.back(out, _ELEMENTWISE | {"broadcast_in_dim"} | df.LAYOUT):
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
    g = df.Graph(jaxpr, list(is_param))
    a, why = _Assign(), {}
    qkv, outs = _attention(g, a, why)
    moe = _moe(g, a)
    wis = _mlp(g, a, qkv | outs)
    for dots, tag in ((qkv, "attn_norm"), ({id(w) for w in wis}, "mlp_norm")):
        for n in g.nodes:
            if id(n) in dots:
                norm = _norm_of(n.ins[_param_dot(n)[1]])
                if norm is not None:
                    a.put(norm, tag)
    of = a.vars()
    found = set(of.values())
    return Roles(of=of, missing={t: _reason(t, found, why)
                                 for t in ROLES + (MOE_ROLES if moe else ()) if t not in found})


def _reason(tag: str, found: set, why: dict) -> str:
    """Why no value has `tag`, given the tags found."""
    if tag in why:
        return why[tag]
    if tag in MOE_ROLES:  # (reported only where a mixture of experts was found)
        return "not found in the mixture of experts"
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


__all__ = ["MOE_ROLES", "ROLES", "Roles", "infer_roles", "kernel_name"]
