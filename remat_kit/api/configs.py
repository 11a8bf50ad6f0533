"""The answers for a reference config (`rk.measure_config`, `rk.layer_residuals`,
`rk.fit`, `rk.step_memory`, ...): the parts below take a `Workload`; here a
`TransformerConfig` is made one (`remat_kit.models.program.workload`) and its
target parsed once. Reference: docs/fit.md, docs/compare.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from remat_kit import mesh as rk_mesh
from remat_kit.decide import fit as fitting
from remat_kit.decide import step as stepping
from remat_kit.decide.plan import Planner
from remat_kit.api.answers import measure
from remat_kit.measure import targets
from remat_kit.measure.explain import LayerBreakdown, is_param_residual, breakdown
from remat_kit.measure.record import Record
from remat_kit.models.config import TransformerConfig
from remat_kit.models.program import layer_program, sized
from remat_kit.models.program import workload as config_workload
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, parse


def _config(cfg, where: str) -> TransformerConfig:
    """`cfg`, or a TypeError naming how to make one (a name such as "tiny" is
    `get_config`'s, as fit and step_memory say): not an AttributeError inside."""
    if not isinstance(cfg, TransformerConfig):
        made = f"get_config({cfg!r})" if isinstance(cfg, str) else "get_config('tiny')"
        raise TypeError(f"{where} takes a TransformerConfig (rk.models.{made}), got "
                        f"{type(cfg).__name__} {cfg!r:.80}")
    return cfg


def _aot_mesh(target, mesh):
    """The mesh a config is measured on: for a target compiled ahead of time with no
    mesh given, data parallel over its chips (of every slice: `targets.make_mesh`)."""
    if mesh is None and target.aot:
        return targets.make_mesh(target, {"data": len(target.devices) // target.slices})
    return mesh


def _as_workload(model, mesh, seq: int | None = None):
    """A config as a resizable `Workload` at fit's default sizes (the mesh's data x
    fsdp batch, seq min(max_len, 1024)); anything else as given."""
    if not isinstance(model, TransformerConfig):
        return model, mesh
    seq = min(model.max_len, 1024) if seq is None else seq
    return config_workload(sized(model, seq), rk_mesh.axis_size(mesh, "batch"), seq,
                           mesh=mesh), None


def measure_config(cfg: TransformerConfig, batch: int, seq: int, policies: Sequence | None = None,
                   *, names=None, dtype: str | None = None, time_steps: int = 0,
                   mesh: jax.sharding.Mesh | None = None, per_layer: bool = True,
                   progress: Callable[[int, int, Record], None] | None = None,
                   target: "str | targets.Target | None" = None) -> list[Record]:
    """Measures a reference transformer (`remat_kit.models`) under each policy:
    `measure(rk.models.workload(cfg, batch, seq, dtype=, mesh=), ...)`.

    >>> import remat_kit as rk
    >>> cfg = rk.models.get_config("tiny", num_layers=1)
    >>> [r.policy for r in rk.measure_config(cfg, 1, 16, ["none", "full"], per_layer=False)]
    ['none', 'full']

    Args:
      cfg: the model config; `cfg.remat` is the default policy list.
      batch, seq: global batch size and sequence length (positive ints).
      policies: spec strings or `Policy`s; default `[cfg.remat]`.
      names, time_steps, progress, target: see `measure`.
      dtype: activation dtype override ("float32", "bfloat16", "float16").
      mesh: a `jax.sharding.Mesh` from `remat_kit.mesh.make` (axes data,
        fsdp, tensor); every figure is then per device. For a target compiled
        ahead of time the mesh must be over its devices
        (`targets.make_mesh`); default a data mesh over all of them.
      per_layer: also measure each decoder layer alone (see `measure`).
    Raises:
      TypeError: cfg is not a TransformerConfig (a name: `get_config` it).
      ValueError: batch or seq not a positive int, seq above a GPT-2
        config's max_len, a bad dtype.
      MeshError: the mesh does not split the batch or the heads.
      RematSpecError, TargetError: see `measure`.
    """
    cfg = _config(cfg, "measure_config")
    target = targets.parse_target(target)
    mesh = _aot_mesh(target, mesh)
    work = config_workload(cfg, batch, seq, dtype=dtype, mesh=mesh)
    return measure(work, policies=policies if policies is not None else [cfg.remat],
                   names=names, time_steps=time_steps, progress=progress, target=target,
                   per_layer=per_layer)


def layer_residuals(cfg: TransformerConfig, batch: int, seq: int,
                    policy: "str | Policy | None" = None,
                    target: "str | targets.Target | None" = None) -> LayerBreakdown:
    """What one decoder layer of `cfg` saves, offloads and recomputes under `policy`.

    >>> import remat_kit as rk
    >>> cfg = rk.models.get_config("tiny", num_layers=1)
    >>> rk.layer_residuals(cfg, 1, 16, "full").saved_bytes  # the layer input alone
    4096

    Applies `remat_layer(DecoderLayer, cfg)` (the layer exactly as the model
    wraps it) alone to an input [batch, seq, d_model] of `cfg.dtype`, under
    `jax.vjp`, and lists its residuals (`residuals`). Tags the layer emits
    (found by tracing it with `jax.make_jaxpr`) that are not stored get a row
    too, with the policy's decision (`Policy.decide`). The layer input is a
    row; the parameters are `parameter_bytes`. Nothing is allocated.

    Args:
      cfg: model config; policy: spec or Policy, default `cfg.remat`.
      batch, seq: per-device batch size and sequence length.
      target: if given, also compile the layer's value-and-grad for it
        (`LayerBreakdown.compiled`), see `explain`.
    Raises:
      TypeError: cfg is not a TransformerConfig (a name: `get_config` it).
      ValueError: batch or seq not a positive int.
      RematSpecError: the policy does not parse.
      TargetError: see `explain`.
    """
    cfg = _config(cfg, "layer_residuals")
    policy = parse(cfg.remat if policy is None else policy)
    apply, args = layer_program(cfg, batch, seq, policy)
    return breakdown(policy, apply, args, lambda r: not is_param_residual(r), cfg.num_layers, target)


def config_planner(cfg, batch: int, seq: int, *, dtype: str | None = None, mesh=None,
                   cache: "str | bool | None" = True, target=None, **kwargs) -> Planner:
    """A `Planner` for a reference transformer's loss (`remat_kit.models.workload`);
    for a target compiled ahead of time with no mesh, data parallel over its chips, as
    `measure_config` measures it.

    >>> import remat_kit as rk
    >>> from remat_kit.api.configs import config_planner
    >>> cfg = rk.models.get_config("tiny", num_layers=1)
    >>> config_planner(cfg, 1, 16, cache=None).target.platform
    'cpu'
    """
    cfg = _config(cfg, "config_planner")
    target = targets.parse_target(target)
    mesh = _aot_mesh(target, mesh)
    return Planner(config_workload(cfg, batch, seq, dtype=dtype, mesh=mesh), cache=cache,
                   target=target, **kwargs)


def resolve_config(cfg, batch: int, seq: int, *, mesh=None, cache: "str | bool | None" = True,
                   **kwargs):
    """`cfg` with an `auto:budget=...` remat replaced by the planned policy's spec,
    or for a per-layer plan by remat="none" and its `layer_remat`; any other cfg
    unchanged. batch, seq: the global shapes the model will train at. kwargs:
    `Planner`'s (groups, objective).

    >>> import remat_kit as rk
    >>> from remat_kit.api.configs import resolve_config
    >>> resolve_config(rk.models.get_config("tiny", remat="full"), 1, 16).remat  # not auto
    'full'
    """
    cfg = _config(cfg, "resolve_config")
    if not isinstance(parse(cfg.remat), AutoSpec):
        return cfg
    planner = config_planner(cfg.replace(remat="none"), batch, seq, mesh=mesh, cache=cache,
                             **kwargs)
    planned = planner.plan(parse(cfg.remat).budget)
    if planned.layer_specs:
        return cfg.replace(remat="none", layer_remat=planned.layer_specs)
    return cfg.replace(remat=planned.spec)

def fit(model, budget: "int | str", *, mesh=None, seq: int | None = None,
        policies: Sequence = fitting.FIT_POLICIES, **kwargs) -> "fitting.FitResult":
    """`remat_kit.decide.fit.fit` (see it for every argument and error), where
    `model` may also be a `TransformerConfig`, built on `mesh`; its search is
    bounded by the config's attention scores (`remat_kit.models.bounds`); a
    config's `rechunk` is itself with that many `vocab_chunks`. `policies` are
    specs or Policies (or one), parsed here once (`fit_rows`).

    >>> import remat_kit as rk
    >>> cfg = rk.models.get_config("tiny", num_layers=1)
    >>> r = rk.fit(cfg, "64MiB", vary="batch", seq=16, policies=["full"], max_size=2)
    >>> r.rows[0].policy, r.rows[0].size
    ('full', 2)

    Raises:
      RematSpecError: a spec does not parse (before anything is traced).
      TypeError: mesh not a `jax.sharding.Mesh` (`rk.mesh.make`).
    """
    rows = fit_rows(policies, budget)
    stepping.check_mesh(mesh)  # before the mesh sizes the batch
    if isinstance(model, TransformerConfig) and kwargs.get("rechunk") is None:
        kwargs["rechunk"] = lambda n, cfg=model, mesh=mesh: _as_workload(
            cfg.replace(vocab_chunks=n), mesh, seq)[0]
    model, mesh = _as_workload(model, mesh, seq)
    return fitting.fit(model, budget, mesh=mesh, seq=seq, policies=rows, **kwargs)


def fit_rows(policies: Sequence, budget: "int | str") -> dict:
    """fit's rows as {the label a row shows (the spec as given): its parsed policy},
    in order, each spec parsed once; "auto" is the planner's row at the fit budget.

    >>> from remat_kit.api.configs import fit_rows
    >>> {k: str(v) for k, v in fit_rows(["minimal", "auto"], "1MiB").items()}["auto"]
    'auto:budget=1048576B'

    Raises:
      RematSpecError: a spec does not parse. BudgetError: "auto" with a budget that is
        not a size in bytes (`decide.fit.fit_budget_bytes`). TypeError: `policies` is
        neither a spec nor a non-empty list of them (None).
    """
    if isinstance(policies, (str, Policy)):  # one spec, not its letters
        policies = [policies]
    if not isinstance(policies, Sequence) or not policies:
        raise TypeError(f"policies must be one spec or a non-empty list of specs (e.g. "
                        f"['minimal', 'full', 'auto']), got {policies!r:.80}")
    given: dict = {}
    for p in policies:
        given.setdefault(p if isinstance(p, str) else str(p), p)
    return {label: (AutoSpec(f"{fitting.fit_budget_bytes(budget)}B") if label == "auto"
                    else parse(p)) for label, p in given.items()}


def _config_steps(model, mesh):
    """A config as a function (batch, seq) -> Workload on `mesh`, a GPT-2 config's
    position table made seq long; anything else as given, with `mesh`."""
    if not isinstance(model, TransformerConfig):
        return model, mesh
    return (lambda b, s: config_workload(sized(model, s), b, s, mesh=mesh)), None


def step_memory(model, batch: int, seq: int, policy: "str | Policy", *, mesh=None,
                **kwargs) -> "stepping.StepMemory":
    """`remat_kit.decide.step.step_memory` (see it for every argument and error),
    where `model` may also be a `TransformerConfig` (its remat replaced by
    `policy`), built on `mesh`.

    >>> import remat_kit as rk
    >>> cfg = rk.models.get_config("tiny", num_layers=1)
    >>> rk.step_memory(cfg, 1, 16, "full").total_bytes > 0
    True
    """
    stepping.check_args(kwargs.get("optimizer"), batch=batch, seq=seq)
    model, mesh = _config_steps(model, mesh)
    return stepping.step_memory(model, batch, seq, parse(policy), mesh=mesh, **kwargs)


def train_step(model, batch: int, seq: int, policy: "str | Policy", *, mesh=None,
               **kwargs) -> "stepping.TrainStep":
    """`remat_kit.decide.step.train_step` (see it), where `model` may also be a
    `TransformerConfig`, built on `mesh`.

    >>> import remat_kit as rk
    >>> from remat_kit.api.configs import train_step
    >>> step = train_step(rk.models.get_config("tiny", num_layers=1), 1, 16, "full")
    >>> type(step).__name__
    'TrainStep'
    """
    stepping.check_args(kwargs.get("optimizer"), batch=batch, seq=seq)
    model, mesh = _config_steps(model, mesh)
    return stepping.train_step(model, batch, seq, parse(policy), mesh=mesh, **kwargs)


__all__ = ["config_planner", "fit", "fit_rows", "layer_residuals", "measure_config",
           "resolve_config", "step_memory", "train_step"]
