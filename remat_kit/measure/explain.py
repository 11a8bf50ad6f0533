"""What one block saves, offloads and recomputes under a policy, value by value.

`explain_policy` (for `rk.explain`) lists one row per residual of one block of a
workload (or of any function), then each emitted tag the policy does not store, with
the policy's decision. `stack_stored_bytes` sums the blocks of a stack measured
one at a time: the figure Korthikanti et al. (2022, Table 2) tabulate.
Docs: docs/compare.md ("`remat-kit explain`: what one layer keeps").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from remat_kit.measure import targets
from remat_kit.measure import lowering
from remat_kit.policy.names import TAGS
from remat_kit.policy.policy import Policy
from remat_kit.measure.residuals import Residual, aval_bytes, residuals
from remat_kit.policy.spec import layer_policies
from remat_kit.trace import marked
from remat_kit.trace.validate import emitted_tags, policy_notes, tag_aliases
from remat_kit.trace.workload import Workload, checkpointed

@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One value of a decoder layer and what the policy does with it.

    decision: "saved" (kept in device memory), "offloaded" (kept in host
    memory), "recomputed" (the policy recomputes this tag in the backward
    pass), "not needed" (the policy would keep it, but the backward pass
    never reads it, e.g. the layer's own output) or "constant" (a
    `LayerBreakdown.constants` row). nbytes: bytes per layer.
    aliases: the value's other tags: on a model not ours, a role tag's path
    tag (e.g. qkv_proj's "h_0/attn/c_attn"), listed once, under its role.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    decision: str
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LayerBreakdown:
    """Residuals of one decoder layer under one policy.

    Attributes:
      policy: canonical spec string.
      rows: saved and offloaded residuals (tags, primitives, the layer input),
        then emitted tags that are not stored, in vocabulary order.
      parameter_bytes: inputs the backward pass reads that are not rows (kept
        by reference, not extra memory): the layer's parameters for
        `layer_residuals`, every argument for `explain`.
      num_layers: layers in the model.
      blocks_differ: where the model's blocks are not alike (one class, other
        widths), a line giving each block's input bytes (`blocks_differ`): the
        rows are the first block's and L x them is no figure; else "".
      compiled: with a `target`, the layer's value-and-grad compiled for it
        (`lowering.Compiled`: temp bytes, FLOPs, compile seconds), else None.
      constants: values the backward pass reads that depend on none of the
        layer's parameters or activations (`Residual.constant`: a rotary
        sin/cos table, a causal mask and its fill, a literal, position ids or
        a mask passed to every layer), decision "constant": not residuals a
        policy chooses, and the same in every layer, which the compiled
        program computes once or folds into its consumers (XLA CPU, tiny_llama
        under none: no temp buffer of their shapes at 2 or 4 layers). They are
        not in `rows` nor in any per-layer sum.
      notes: where the policy's names select nothing the layer emits (a path
        glob matching no path, a role the model lacks), the lines `compare`
        notes for it (`validate.policy_notes`); else ().
    """

    policy: str
    rows: tuple[LayerRow, ...]
    parameter_bytes: int
    num_layers: int
    compiled: "lowering.Compiled | None" = None
    blocks_differ: str = ""
    constants: tuple[LayerRow, ...] = ()
    notes: tuple[str, ...] = ()

    def _sum(self, decision: str) -> int:
        return sum(r.nbytes for r in self.rows if r.decision == decision)

    @property
    def saved_bytes(self) -> int:
        """Bytes one layer keeps in device memory for its backward pass."""
        return self._sum("saved")

    @property
    def offloaded_bytes(self) -> int:
        """Bytes one layer keeps in host memory."""
        return self._sum("offloaded")

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of tagged values one layer recomputes instead of storing."""
        return self._sum("recomputed")

    @property
    def constant_bytes(self) -> int:
        """Bytes of `constants`, once for the whole model, not per layer."""
        return sum(r.nbytes for r in self.constants)

    @property
    def stored_bytes(self) -> int:
        """saved + offloaded bytes of one layer."""
        return self.saved_bytes + self.offloaded_bytes


def is_param_residual(r: Residual) -> bool:
    """Whether a residual is a parameter (an argument under `params`), not an activation."""
    return r.kind == "argument" and r.name.startswith("params")


def _block_stored_bytes(workload: Workload, policy: Policy) -> int:
    """One block's stored bytes: its residuals, less parameters and constants (the
    same in every block: `LayerBreakdown.constants`)."""
    fn, args = workload.block(policy)
    return sum(r.nbytes for r in residuals(fn, *args) if not is_param_residual(r) and not r.constant)


def _block_regions(jaxpr):
    """The outermost remat regions of `jaxpr`, looking into jit-ed calls (not scans:
    a scanned stack is one body, alike by construction)."""
    for eqn in jaxpr.eqns:
        if marked.region(eqn) is not None:
            yield eqn
        elif eqn.primitive.name in ("pjit", "jit", "closed_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            yield from _block_regions(getattr(inner, "jaxpr", inner))


def blocks_differ(workload: Workload) -> str:
    """"" where the blocks of `workload` are alike (or cannot be told apart), else a
    line saying how they differ: each block's input bytes (its parameters and
    activations), from the loss traced under `full`, where each block is one
    remat region. Traced only, no compile."""
    if workload.block is None or not workload.num_layers or workload.num_layers < 2:
        return ""
    jaxpr = jax.make_jaxpr(workload.loss_for_policy(Policy()))(*workload.args).jaxpr
    found = list(_block_regions(jaxpr))
    if len(found) != workload.num_layers:
        return ""
    shapes = [tuple((v.aval.shape, str(v.aval.dtype)) for v in e.invars) for e in found]
    if len(set(shapes)) == 1:
        return ""
    sizes = [sum(aval_bytes(v.aval) for v in e.invars) for e in found]
    return (f"the {len(found)} blocks differ in shape: their inputs (parameters and "
            f"activations) are {', '.join(f'{b:,}' for b in sizes)} bytes; one block's "
            "figures are the first block's, and L x them is no figure for the model")


def stack_stored_bytes(workload: Workload, policy: Policy,
                       alike: bool | None = None) -> dict[str, int | None]:
    """{"layer_residual_bytes", "layers_residual_bytes"} of `Record` for the
    blocks of `workload` under `policy`, one block measured at a time.

    For a uniform policy, layer_residual_bytes is one block's stored bytes
    and layers_residual_bytes L x that; for every:k / first:n the blocks under
    the policy plus those without remat; for nested:g (g > 1) the L/g group
    inputs (a full-remat block's bytes each). Both None where the workload
    has no `block`; layers_residual_bytes None where the blocks differ in shape
    (`blocks_differ`; `alike` gives its answer where known), or where a remat of the
    model's own runs around several layers (a pipeline's per iteration), which
    stores what its policy saves, not the layers' residuals.
    """
    if workload.block is None or not workload.num_layers:
        return {"layer_residual_bytes": None, "layers_residual_bytes": None}
    schedule, L = policy.schedule, workload.num_layers
    if schedule.kind == "nested" and schedule.group_size(L) > 1:
        # A group is rematerialized whole: the forward pass keeps its input only.
        per_layer = (Policy(),) * (L // schedule.group_size(L))
    else:
        per_layer = layer_policies(policy, L)
    measured = {p: _block_stored_bytes(workload, p) for p in set(per_layer)}
    if alike is None:  # else the first block's bytes x L mean nothing
        alike = not blocks_differ(workload)
    own = workload.model_map.own_remat if workload.model_map is not None else ()
    alike = alike and not any(r.where == "around several layers" for r in own)
    return {"layer_residual_bytes": (measured[per_layer[0]] if schedule.kind == "uniform"
                                     else None),
            "layers_residual_bytes": sum(measured[p] for p in per_layer) if alike else None}


def breakdown(policy: Policy, f: Callable, args, keep_argument: Callable[[Residual], bool],
               num_layers: int, target, missing: tuple[str, ...] = ()) -> LayerBreakdown:
    """Rows for `f`'s residuals, then for the tags it emits but does not store; with a
    `target`, `f`'s value-and-grad compiled for it. missing: the workload's notes on
    roles it lacks, for the notes."""
    found = residuals(f, *args)
    aliases = tag_aliases(f, *args)
    listed = [r for r in found if r.kind != "argument" or keep_argument(r)]

    def row(r: Residual, decision: str) -> LayerRow:
        return LayerRow(r.name, r.kind, r.shape, r.dtype, r.nbytes, decision,
                        aliases.get(r.name, ()) if r.kind == "tag" else ())

    rows = [row(r, "offloaded" if r.memory == "host" else "saved")
            for r in listed if not r.constant]
    constants = tuple(row(r, "constant") for r in listed if r.constant)
    # A value with two tags (role and path) is one row, under the tag listed first.
    shown = {t for r in (*rows, *constants) if r.kind == "tag" for t in (r.name, *r.aliases)}
    order = {t: i for i, t in enumerate(TAGS)}
    emitted = emitted_tags(f, *args)
    for t, aval in sorted(emitted.items(), key=lambda kv: order.get(kv[0], len(order))):
        if t not in shown:
            names = (t, *aliases.get(t, ()))
            shown.update(names)
            decision = ("recomputed" if all(policy.decide(n) == "recompute" for n in names)
                        else "not needed")
            rows.append(LayerRow(t, "tag", tuple(aval.shape), str(aval.dtype),
                                 aval_bytes(aval), decision, names[1:]))
    unlisted = sum(r.nbytes for r in found if r not in listed)
    compiled = (None if target is None
                else lowering.compile_for(jax.value_and_grad(f), *args, target=target))
    return LayerBreakdown(str(policy), tuple(rows), unlisted, num_layers, compiled,
                          constants=constants,
                          notes=policy_notes(policy, tuple(emitted), missing))


def explain_policy(policy: Policy, fn: "Callable | Workload", *args,
                   target: "targets.Target | None" = None) -> LayerBreakdown:
    """`rk.explain` (`remat_kit.api.answers.explain`, which parses the spec and the target
    and documents every argument) on values: a `Policy`, a `Target` or None.

    Raises:
      ValueError: a workload without blocks. TypeError: `fn` does not return a scalar.
    """
    if isinstance(fn, Workload):
        if fn.block is None:
            raise ValueError(f"workload {fn.name!r} has no blocks to explain one of; explain "
                             "its loss as a function instead")
        block, block_args = fn.block(layer_policies(policy, fn.num_layers)[0])
        return dataclasses.replace(
            breakdown(policy, block, block_args, lambda r: not is_param_residual(r), fn.num_layers,
                      target, fn.notes), blocks_differ=blocks_differ(fn))
    return breakdown(policy, checkpointed(fn)(policy), args, lambda r: False, 1, target)


__all__ = ["LayerBreakdown", "LayerRow", "blocks_differ", "breakdown", "explain_policy",
           "is_param_residual", "stack_stored_bytes"]
