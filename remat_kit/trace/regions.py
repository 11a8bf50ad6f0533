"""A traced loss, run again under any policy: its block regions re-policied, its values tagged.

A model that is not ours is traced once with each block in a remat region marked by a `Marker`;
`Regions.loss(policies)` evaluates that jaxpr again with each region under its layer's policy
(`jax.checkpoint`, or inline for `none`) and each value `trace.roles` inferred tagged with
`checkpoint_name`, so MaxText's and Megatron's presets select the same values as on ours.
Main names: `build`, `Regions`. How: docs/models.md ("A Flax model, no glue", step 5).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from remat_kit._jax_private import scan_parts
from remat_kit.trace import rebind, retarget, roles, wrapping
from remat_kit.errors import RematSpecError
from remat_kit.policy.policy import Policy
from remat_kit.trace.validate import emitted_tags, tag_of
from remat_kit.trace.marked import CALLS, call_body, count_marked, is_marked, region, sub_jaxprs

# One-input ops that keep a value's bytes: a role may be named after them.
_RELABEL = ("reshape", "transpose", "squeeze", "expand_dims", "copy")


def _needs(jaxpr, key: str, roles: Mapping, memo: dict) -> bool:
    """Whether evaluating `jaxpr` must go through the interpreter: it holds a
    marked region or a value with a role, at any depth."""
    if id(jaxpr) in memo:
        return memo[id(jaxpr)]
    found = False
    for eqn in jaxpr.eqns:
        if is_marked(eqn, key) or any(v in roles for v in eqn.outvars):
            found = True
        elif any(_needs(sub, key, roles, memo) for sub in sub_jaxprs(eqn)):
            found = True
        if found:
            break
    memo[id(jaxpr)] = found
    return found


@dataclasses.dataclass
class _Run:
    """One evaluation: which policy each marked region gets, in order."""

    key: str
    roles: Mapping
    policies: Sequence[Policy]
    emitted: tuple[str, ...]
    memo: dict
    taken: frozenset = frozenset()  # the model's own remat of whole layers (`own_remat`)
    next_layer: int = 0

    def layer_policy(self) -> Policy:
        i = min(self.next_layer, len(self.policies) - 1)  # a scan body is entered once
        self.next_layer += 1
        return self.policies[i]

    def eval(self, jaxpr, consts, args) -> list:
        env = {}

        def read(v):
            return rebind.literal(v.val) if isinstance(v, Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        roles = self.placed(jaxpr)
        for eqn in jaxpr.eqns:
            outs = self.run(eqn, [read(v) for v in eqn.invars])
            for v, x in zip(eqn.outvars, outs):
                if v in roles:
                    x = checkpoint_name(x, roles[v])
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def placed(self, jaxpr) -> dict:
        """{var: role} of `jaxpr` with each role moved past the path tags
        (`auto_tag`'s checkpoint_name) and layout ops (same bytes) that carry
        the same value, out of jit-ed calls too, so the role is the outermost
        name: residuals and explain rows are named by it."""
        key = ("placed", id(jaxpr))
        if key not in self.memo:
            named = {eqn.invars[0]: eqn.outvars[0] for eqn in jaxpr.eqns
                     if (tag_of(eqn) is not None or eqn.primitive.name in _RELABEL)
                     and len(eqn.invars) == 1 and not isinstance(eqn.invars[0], Literal)}
            found = {v: self.roles[v] for e in jaxpr.eqns for v in e.outvars
                     if v in self.roles and tag_of(e) is None}
            for eqn in jaxpr.eqns:  # a call whose output is a role's value (a module's
                inner = call_body(eqn)  # matmul under nn.jit) passes the role out
                if inner is not None:
                    ends = self.placed(inner)
                    found.update((o, ends[i]) for i, o in zip(inner.outvars, eqn.outvars)
                                 if not isinstance(i, Literal) and i in ends
                                 and o not in found)  # a constant output has no role
            out = {}
            for v, role in found.items():
                while v in named:
                    v = named[v]
                out[v] = role
            self.memo[key] = out
        return self.memo[key]

    def block_body(self, inner, consts) -> Callable:
        """A marked block's body, naming its residual-stream input
        `decoder_layer_input` (as our DecoderLayer does) before the rest runs."""
        stream = _stream_input(inner)

        def body(*xs):
            if stream is not None:
                xs = list(xs)
                xs[stream] = checkpoint_name(xs[stream], "decoder_layer_input")
            return self.eval(inner, consts, xs)
        return body

    def run(self, eqn, invals) -> list:
        r = region(eqn)
        if r is not None and (isinstance(r[2], wrapping.Marker) and r[2].key == self.key):
            inner, consts, _, prevent_cse = r
            policy = self.layer_policy()
            body = self.block_body(inner, consts)
            if not policy.remat:
                return body(*invals)
            jax_policy = wrapping.to_jax(policy, self.emitted)
            return jax.checkpoint(body, policy=jax_policy, prevent_cse=prevent_cse)(*invals)
        if r is not None and id(r[0]) in self.taken:  # a layer's own remat: the policy's
            return self.eval(r[0], r[1], invals)     # region (or none) stands for it
        if not any(_needs(sub, self.key, self.roles, self.memo) for sub in sub_jaxprs(eqn)):
            return rebind.bind(eqn, invals)
        if r is not None:  # the model's own remat region, with tags inside
            inner, consts, policy, prevent_cse = r
            body = lambda *xs: self.eval(inner, consts, xs)  # noqa: E731
            return jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)(*invals)
        if eqn.primitive.name in CALLS:
            closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            consts = closed.consts if isinstance(closed, ClosedJaxpr) else ()
            return self.eval(getattr(closed, "jaxpr", closed), consts, invals)
        if eqn.primitive.name == "scan":
            return self.scan(eqn, invals)
        if eqn.primitive.name == "shard_map":
            return self.shard_map(eqn, invals)
        return rebind.bind(eqn, invals)  # cond, while, custom derivatives: tags inside are lost

    def shard_map(self, eqn, invals) -> list:
        """A `shard_map` (a pipeline's stages, say) traced again around its body run
        here, so the blocks inside take their policies.

        Raises:
          MeshError: compiling for a target whose devices the mesh is not over.
        """
        p = eqn.params
        body = p["jaxpr"]
        run = jax.shard_map(lambda *xs: tuple(self.eval(body, (), xs)),
                            mesh=retarget.shard_map_mesh(p["mesh"]),
                            in_specs=p["in_specs"], out_specs=p["out_specs"],
                            axis_names=p["newly_manual_axes"], check_vma=p["check_vma"])
        return list(run(*invals))

    def scan(self, eqn, invals) -> list:
        p = eqn.params
        body, body_consts, nc, ncarry = scan_parts(eqn)
        consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]

        def step(carry, x):
            out = self.eval(body, body_consts, [*consts, *carry, *x])
            return out[:ncarry], out[ncarry:]

        carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]


# Equations whose outputs are parameters again when their float inputs are.
_PARAM_PRESERVING = ("convert_element_type", "reshape", "transpose", "broadcast_in_dim",
                     "copy", "squeeze", "expand_dims", "slice", "dynamic_slice", "concatenate",
                     "sharding_constraint", "device_put", "reduce_precision")


def derives_from_params(eqn, flags: Mapping) -> bool:
    """Whether `eqn`'s outputs are (copies, casts, slices of) parameters: every float
    input is one, and at least one input is."""
    if eqn.primitive.name not in _PARAM_PRESERVING:
        return False
    floats = [v for v in eqn.invars if not isinstance(v, Literal)
              and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    return bool(floats) and all(_flag(flags, v) for v in floats)


def _flag(flags: Mapping, v) -> bool:
    """Whether `v` is a parameter; a literal (`jnp.where(m, x, -1e9)`'s -1e9,
    `jnp.clip`'s bounds) never is, and is unhashable."""
    return not isinstance(v, Literal) and flags.get(v, False)


def _value(known: Mapping, v):
    """The concrete value of `v` where it is a literal or one of the loss's constants
    (a jaxpr const: an array the model built in numpy, e.g. a rotary table, or one
    `_fold` computed), else None."""
    return v.val if isinstance(v, Literal) else known.get(v)


# Tables up to this many values are folded (16 MiB of float32): a rotary sin/cos table,
# a causal mask at a training length. Bigger ones stay inputs of each layer.
_FOLD_VALUES = 1 << 22


def _fold(eqn, known: dict) -> None:
    """Puts `eqn`'s outputs in `known`, evaluated, where every input is known: a table
    the model builds with jnp from an iota (`jnp.arange`, sin, cos, jit-ed helpers
    included) before its blocks is a constant of the loss, as a numpy one is."""
    if (eqn.effects or region(eqn) is not None or eqn.primitive.name == "scan"
            or sum(math.prod(v.aval.shape) for v in eqn.outvars) > _FOLD_VALUES):
        return
    values = [_value(known, v) for v in eqn.invars]
    if any(x is None for x in values):
        return
    if eqn.primitive.name in _PLACEMENT:  # the value as it is, wherever it would be placed
        known.update(zip(eqn.outvars, values))
        return
    if not _runs_here(eqn):
        return
    with jax.ensure_compile_time_eval():
        outs = eqn.primitive.bind(*values, **eqn.params)
    known.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))


# Equations that place their inputs and leave their values unchanged.
_PLACEMENT = ("sharding_constraint", "device_put")


def _runs_here(eqn) -> bool:
    """False for an equation that names, at any depth (a jit-ed call's body, a
    shard_map's mesh, a sharding's), devices this process cannot run: an ahead-of-time
    target's chips are compiled for, never run here, so `_fold` leaves it."""
    here = set(jax.devices())
    return all(set(m.devices.flat) <= here for m in retarget.meshes(eqn.params))


def _first_block(jaxpr, key: str, flags: dict, known: dict | None = None):
    """(inner jaxpr, consts, is-parameter per inner input, constant value or None per
    inner input) of the first marked region, looking into jit-ed calls and scan bodies;
    None if there is none. `known`: the concrete values of `jaxpr`'s constants (its
    constvars) and of what `_fold` computes from them, passed on into calls and into
    scans' broadcast inputs."""
    known = {} if known is None else known
    for eqn in jaxpr.eqns:
        r = region(eqn)
        if r is not None and isinstance(r[2], wrapping.Marker) and r[2].key == key:
            return (r[0], r[1], [_flag(flags, v) for v in eqn.invars],
                    [_value(known, v) for v in eqn.invars])
        for v in eqn.outvars:
            flags[v] = derives_from_params(eqn, flags)
        _fold(eqn, known)
        if eqn.primitive.name in CALLS or r is not None:
            closed = r[0] if r is not None else eqn.params.get("jaxpr",
                                                               eqn.params.get("call_jaxpr"))
            inner = getattr(closed, "jaxpr", closed)
            sub = {iv: _flag(flags, ov) for iv, ov in zip(inner.invars, eqn.invars)}
            sub_known = {iv: x for iv, ov in zip(inner.invars, eqn.invars)
                         if (x := _value(known, ov)) is not None}
            sub_known.update(zip(inner.constvars, getattr(closed, "consts", ())))
            found = _first_block(inner, key, sub, sub_known)
        elif eqn.primitive.name == "scan":  # a carry is never a parameter
            body, consts, nc, ncarry = scan_parts(eqn)
            sub = {iv: _flag(flags, ov) and not nc <= i < nc + ncarry
                   for i, (iv, ov) in enumerate(zip(body.invars, eqn.invars))}
            # What the scan broadcasts to every trip (its consts) keeps a known value.
            sub_known = {iv: x for iv, ov in zip(body.invars[:nc], eqn.invars[:nc])
                         if (x := _value(known, ov)) is not None}
            sub_known.update(zip(body.constvars, consts))
            found = _first_block(body, key, sub, sub_known)
        elif eqn.primitive.name == "shard_map":  # per device: known values are global
            inner = eqn.params["jaxpr"]
            sub = {iv: _flag(flags, ov) for iv, ov in zip(inner.invars, eqn.invars)}
            found = _first_block(inner, key, sub, {})
        else:
            continue
        if found is not None:
            return found
    return None


def passed_through(jaxpr) -> tuple[bool, ...]:
    """Per output of `jaxpr`: whether it is one of its inputs, passed through calls
    and remat regions unchanged (an NNX module's state that the call left alone)."""
    return tuple(i is not None for i in _sources(jaxpr, {}))


def _sources(jaxpr, memo: dict) -> tuple[int | None, ...]:
    """Per output of `jaxpr`: the index of the input it passes through, or None."""
    if id(jaxpr) not in memo:
        index = {v: i for i, v in enumerate(jaxpr.invars)}
        made = {o: (e, i) for e in jaxpr.eqns for i, o in enumerate(e.outvars)}

        def source(v) -> int | None:
            while not isinstance(v, Literal) and v not in index and v in made:
                eqn, i = made[v]
                inner = call_body(eqn)
                if inner is None or len(inner.invars) != len(eqn.invars):
                    return None
                j = _sources(inner, memo)[i]
                if j is None:
                    return None
                v = eqn.invars[j]
            return None if isinstance(v, Literal) else index.get(v)
        memo[id(jaxpr)] = tuple(map(source, jaxpr.outvars))
    return memo[id(jaxpr)]


def _stream_input(block) -> int | None:
    """The index of the block's residual-stream input: the first float input shaped
    like one of its computed outputs ([batch, seq, embed] in, the same out), or None.
    Outputs that are inputs passed through (an NNX block returns its parameters) are
    not computed."""
    ins = set(block.invars)
    outs = {(v.aval.shape, v.aval.dtype) for v in block.outvars
            if not isinstance(v, Literal) and v not in ins}
    return next((i for i, v in enumerate(block.invars)
                 if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.ndim >= 2
                 and (v.aval.shape, v.aval.dtype) in outs), None)


def block_tags(jaxpr, key: str) -> tuple[str, ...]:
    """The tags the interpreter adds at the blocks' boundary: ("decoder_layer_input",)
    where the first marked block has a residual-stream input, else ()."""
    found = _first_block(jaxpr, key, {})
    return ("decoder_layer_input",) if found and _stream_input(found[0]) is not None else ()


@dataclasses.dataclass(frozen=True, eq=False)
class Regions:
    """A loss traced once with its blocks marked, to run under any policy.

    Attributes:
      closed: the loss's jaxpr; its inputs are the flattened loss arguments,
        its one output the scalar loss.
      in_tree: the pytree structure of the loss arguments.
      key: the `Marker` key of the block regions.
      num_layers: how many block regions the forward pass enters.
      roles: {jaxpr Var: canonical tag} (`remat_kit.trace.roles.infer_roles`).
      emitted: every tag the loss emits once tagged (path tags and roles),
        to resolve globs against.
      num_params: how many of the jaxpr's inputs are parameter leaves (the
        first ones).
      parameter_count: the scalars in those leaves, e.g. 1,234,688: a plan
        records it, so it is refused on another model of the same blocks.
      taken: ids of the model's own remat regions that are a whole layer's
        (`own_remat.find`): run inline, the policy's region standing for them.
    """

    closed: ClosedJaxpr
    in_tree: jax.tree_util.PyTreeDef
    key: str
    num_layers: int
    roles: Mapping
    emitted: tuple[str, ...]
    num_params: int = 0
    taken: frozenset = frozenset()

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(a.shape) for a in self.closed.in_avals[:self.num_params])

    @functools.cached_property
    def _first_block(self):
        """`_first_block` of the loss, its constants evaluated once."""
        flags = {v: i < self.num_params for i, v in enumerate(self.closed.jaxpr.invars)}
        return _first_block(self.closed.jaxpr, self.key, flags,
                            dict(zip(self.closed.jaxpr.constvars, self.closed.consts)))

    def block(self, policy: Policy) -> tuple[Callable, tuple]:
        """The first block alone under `policy`, for `explain`: (fn(params, inputs)
        -> the sum of its float outputs, (params, inputs) as tuples of
        ShapeDtypeStructs). params are the block's inputs that derive from the
        loss's parameters (`args[0]`), inputs the rest (activations, keys, masks),
        apart from float or int8 inputs that are constants of the loss (a rotary
        sin/cos table built in numpy, a jaxpr const; splash's int8 block mask, which
        prices its kernel as `measure` does): those the block closes over, constants
        as in the loss, so `explain` counts them as no layer's residuals.

        Raises:
          ValueError: no marked block is found outside scans and conds.
        """
        found = self._first_block
        if found is None:
            raise ValueError("no block region found to explain")
        inner, consts, is_param, values = found
        fixed = [None if p or x is None or not (jnp.issubdtype(v.aval.dtype, jnp.floating)
                                                 or v.aval.dtype == jnp.int8) else x
                 for v, p, x in zip(inner.invars, is_param, values)]
        struct = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)  # noqa: E731
        params = tuple(struct(v) for v, p in zip(inner.invars, is_param) if p)
        inputs = tuple(struct(v) for v, p, c in zip(inner.invars, is_param, fixed)
                       if not p and c is None)
        memo: dict = {}

        def run_block(params, inputs):
            ps, xs = iter(params), iter(inputs)
            flat = [next(ps) if p else next(xs) if c is None else c
                    for p, c in zip(is_param, fixed)]
            run = _Run(self.key, self.roles, (policy,), self.emitted, memo, self.taken)
            body = run.block_body(inner, consts)
            if policy.remat:
                body = jax.checkpoint(body, policy=wrapping.to_jax(policy, self.emitted))
            outs = map(jnp.asarray, body(*flat))  # a constant output is a Python scalar
            return sum(o.astype(jnp.float32).sum() for o in outs
                       if jnp.issubdtype(o.dtype, jnp.floating))

        return run_block, (params, inputs)

    def loss(self, policies: Sequence[Policy]) -> Callable:
        """The loss(*args) with block i under policies[i] (one entry per block)."""
        run = self.function(policies)

        def loss(*args):
            leaves, tree = jax.tree.flatten(args)
            if tree != self.in_tree:
                raise TypeError(f"loss arguments {tree} differ from the traced ones "
                                f"{self.in_tree}")
            out, = run(*leaves)
            return out
        return loss

    def function(self, policies: Sequence[Policy]) -> Callable:
        """The traced function on its flat inputs, block i under policies[i]: a
        callable (*leaves) -> the list of its flat outputs.

        Raises:
          ValueError: not one policy per block.
          RematSpecError: different policies for blocks that one scan body runs.
        """
        if len(policies) != self.num_layers:
            raise ValueError(f"{len(policies)} policies for {self.num_layers} blocks")
        bodies = count_marked(self.closed.jaxpr, self.key, trips=False)
        if bodies < self.num_layers and len(set(policies)) > 1:
            raise RematSpecError(
                f"the model runs its {self.num_layers} blocks as {bodies} scan "
                f"bod{'y' if bodies == 1 else 'ies'}, which take{'s' if bodies == 1 else ''} one "
                f"policy for every layer; got {len(set(policies))} different policies "
                f"({', '.join(dict.fromkeys(map(str, policies)))}); give one policy")
        memo: dict = {}

        def run(*leaves):
            return _Run(self.key, self.roles, tuple(policies), self.emitted, memo,
                        self.taken).eval(
                self.closed.jaxpr, self.closed.consts, list(leaves))
        return run


def build(closed: ClosedJaxpr, in_tree, key: str, num_params: int,
          taken: frozenset = frozenset()):
    """The `Regions` of a function traced with its blocks marked `Marker(key)`, and
    the roles inferred on it (`roles.infer_roles`, its first `num_params` inputs the
    parameters), the one way every program of a model not ours is made: `compare
    --model`'s and the wrappers' (`rk.remat_model`) alike.

    taken: the ids of the model's own remat regions the policy replaces
    (`remat_kit.trace.own_remat.find`).

    Returns:
      (Regions, Roles). Regions.emitted holds the path tags, the tags inside the
      marked blocks and the roles, for globs to resolve against.
    """
    found = roles.infer_roles(closed, [i < num_params for i in range(len(closed.jaxpr.invars))])
    emitted = tuple(dict.fromkeys((*emitted_tags(jaxpr_as_fun(closed), *(
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals)),
                                   *block_tags(closed.jaxpr, key), *found.of.values())))
    return Regions(closed, in_tree, key, count_marked(closed.jaxpr, key), found.of, emitted,
                   num_params=num_params, taken=taken), found


__all__ = ["Regions", "block_tags", "build", "passed_through"]
