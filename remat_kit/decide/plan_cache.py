"""A plan, the planner's answer for one budget, and the JSON file plans are cached in.

`Plan` is the answer; `read_cache`, `cached_plan` and `write_cache` keep plans keyed by the
traced program's fingerprint, the JAX version, the target, the memory figure, the budget, the
groups and the objective, each sealed (`measure.sealed`): one failing its check is planned again.
Docs: docs/plan.md ("Plans are cached", in "How it works").
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Sequence

from remat_kit.files import atomic_write, read_regular
from remat_kit.measure import sealed
from remat_kit.policy.names import register_emitted
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import parse

@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer for one budget. Bytes are per device, of the compiled
    figure `memory_kind` names.

    >>> import jax.numpy as jnp, remat_kit as rk
    >>> loss = lambda w, x: jnp.sum(jnp.sin(jnp.sin(x @ w) @ w))
    >>> plan = rk.plan(loss, jnp.ones((8, 8)), jnp.ones((64, 8)), budget="0.8", cache=False)
    >>> plan.spec, plan.measured_bytes <= plan.budget_bytes
    ('full', True)

    Attributes:
      budget: the budget as given (e.g. "6GiB", 0.25).
      budget_bytes: it in bytes (a fraction resolved against none_bytes).
      policy: the chosen `Policy` (a tuple of one per layer for a per-layer
        plan, see `layer_specs`); spec: its canonical spec string.
      predicted_bytes, predicted_flops: the cost model's memory (`full`'s
        figure plus the saved tags' bytes and 1 - the offload probe's figure
        of the offloaded tags') and FLOPs of the step (value and
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
        or "peak_memory_in_bytes" (`remat_kit.measure.measure.memory_kind`).
      cached: read from the plan cache rather than planned now.
      none_out_of_memory: no remat did not compile for lack of the target's
        memory (e.g. XLA:TPU's CompileTimeHbmOom), so the budget cannot hold it.
      layer_specs: for a per-layer plan, each layer's spec (apply them as
        `TransformerConfig(remat="none", layer_remat=...)`); `policy` is then
        the tuple of their Policies and `spec` a summary ("0-6 save:mlpwi /
        7-11 full"). Empty for a plan that is one policy for every layer.
      groups: layer groups the tags were decided in (1: one decision per tag).
      objective: what the plan minimized, "flops" or "time" (`OBJECTIVES`).
      predicted_seconds, none_seconds: predicted step time of the plan and of no
        remat (`time_model.compiled_seconds`: a roofline per op of the compiled
        value-and-grad program, a fusion one op, on the target's peaks, plus
        host transfers not hidden behind compute), seconds; None where not
        predicted.
      offloaded_bytes: residual bytes the plan moves to host memory (its record's
        `offloaded_bytes`); host_bytes: the compiler's host temp memory
        (`host_temp_size_in_bytes`), None where it gives none; offload_notes:
        what verification found offloading did to the device memory.
      model: what the plan was made for, where the planner was given a model's
        `Workload`: {"block": class name, "num_layers": int, "parameters": int};
        `rk.remat_model` refuses the plan on a model that differs. {} for a loss.
      step: what the budget and the memory figures cover: "grad", the
        value-and-grad step (`compare`'s figure), or "train", the whole train
        step as `fit` measures it (`memory_kind` is then "train_step_bytes";
        FLOPs are the train step's too).
      aliases: tag -> the other names the model gives the same values (its own
        `checkpoint_name`s, module paths), for each tag the plan keeps that has
        any (`CostModel.aliases`) or is the model's own name outside the
        vocabulary (then registered as the plan is read back): `remat_kit.decide.emit` writes a plan out in
        the names a framework knows.
      audit: the verifying compile's audit (`Record.audit`): whether the compiled
        program does what the plan chose, per tag; None where not audited (read back
        from an older cache).
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
    layer_specs: tuple[str, ...] = ()
    groups: int = 1
    objective: str = "flops"
    predicted_seconds: float | None = None
    none_seconds: float | None = None
    offloaded_bytes: int = 0
    host_bytes: int | None = None
    offload_notes: tuple[str, ...] = ()
    model: dict = dataclasses.field(default_factory=dict)
    step: str = "grad"
    aliases: dict = dataclasses.field(default_factory=dict)
    audit: dict | None = None

    @property
    def memory_fraction(self) -> float | None:
        """measured_bytes / none_bytes; None where no remat ran out of memory."""
        return None if self.none_bytes is None else self.measured_bytes / self.none_bytes

    @property
    def flops_overhead(self) -> float:
        """measured_flops / none_flops - 1 (0.05 is 5% more FLOPs than no remat)."""
        return self.measured_flops / self.none_flops - 1

    @property
    def time_overhead(self) -> float | None:
        """predicted_seconds / none_seconds - 1; None where not predicted."""
        if self.predicted_seconds is None or not self.none_seconds:
            return None
        return self.predicted_seconds / self.none_seconds - 1

    def to_dict(self) -> dict:
        """JSON-ready: every field (policy as its spec), plus memory_fraction,
        flops_overhead and time_overhead."""
        d = dataclasses.asdict(self) | {"policy": self.spec, "layer_specs": list(self.layer_specs),
                                        "offload_notes": list(self.offload_notes)}
        return d | {"memory_fraction": self.memory_fraction,
                    "flops_overhead": self.flops_overhead, "time_overhead": self.time_overhead}

    @classmethod
    def from_dict(cls, d: dict, policy: "Policy | tuple[Policy, ...]") -> "Plan":
        """The inverse of `to_dict`, given the `policy` its spec (or `layer_specs`) names,
        parsed where the dict was read (`cached_plan`)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        layers = tuple(d.get("layer_specs") or ())
        return cls(**{k: v for k, v in d.items() if k in fields}
                   | {"policy": policy, "layer_specs": layers,
                      "offload_notes": tuple(d.get("offload_notes") or ())})


def layers_summary(policies: Sequence[Policy]) -> str:
    """'0-6 save:mlpwi / 7-11 full': runs of consecutive layers with one policy."""
    runs: list[list] = []
    for i, p in enumerate(policies):
        if runs and runs[-1][2] == p:
            runs[-1][1] = i
        else:
            runs.append([i, i, p])
    return " / ".join(f"{a}{'' if a == b else f'-{b}'} {p}" for a, b, p in runs)


def default_cache_path() -> str:
    """$REMAT_KIT_CACHE, else $XDG_CACHE_HOME/remat_kit/plans.json (~/.cache by default)."""
    if os.environ.get("REMAT_KIT_CACHE"):
        return os.environ["REMAT_KIT_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remat_kit", "plans.json")


# The most of a plan cache file read: an entry is ~1 KB, so tens of thousands of plans.
CACHE_LIMIT = 64 << 20
_DAMAGED: set[tuple[str, bytes]] = set()  # (path, contents) of damaged caches warned about


def read_cache(path: str) -> dict | None:
    """The plan cache at `path`: {} if there is none yet, None if the file is not
    a plan cache (a JSON object of objects, the sealed entries: a `plan --json`
    report is not one); such a file is never overwritten.

    A damaged cache (empty, or a JSON object cut short or garbled, as a killed
    writer of an older version could leave it) reads as {} with a warning, and
    is rewritten by the next plan. A folder, FIFO or device, or a file over
    `CACHE_LIMIT` bytes, is not a plan cache: it is never read past the limit.
    """
    try:
        text = read_regular(path, CACHE_LIMIT)
    except FileNotFoundError:
        return {}
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        if text.strip() and not text.lstrip().startswith(b"{"):
            return None  # some other file, e.g. a config given as --cache by mistake
        if (path, text) not in _DAMAGED:  # once per damage, not at every read
            _DAMAGED.add((path, text))
            warnings.warn(f"plan cache {path!r} is damaged ({str(e)[:80] or 'empty'}); read "
                          "as empty, it is rewritten by the next plan", stacklevel=2)
        return {}
    # Each entry is a sealed object; a report (plan --json: schema_version, budgets) is not.
    is_cache = isinstance(data, dict) and all(isinstance(v, dict) for v in data.values())
    return data if is_cache else None


_count, _amount = sealed.count, sealed.amount
# The figures of a kept plan, checked when it is read back (`cached_plan`).
_PLAN: sealed.Schema = {
    "budget": sealed.text, "budget_bytes": _count, "spec": sealed.text,
    "predicted_bytes": _count, "predicted_flops": _amount, "measured_bytes": _count,
    "measured_flops": _amount, "none_bytes": sealed.optional(_count), "none_flops": _amount,
    "minimum_bytes": _count, "status": sealed.text, "iterations": _count,
    "platform": sealed.text, "memory_kind": sealed.text, "layer_specs": sealed.texts,
    "groups": _count, "objective": sealed.text,
    "predicted_seconds": sealed.optional(_amount), "none_seconds": sealed.optional(_amount),
    "offloaded_bytes": _count, "host_bytes": sealed.optional(_count),
    "offload_notes": sealed.texts,
    "model": sealed.mapping(lambda v: sealed.text(v) or sealed.count(v)),
    "step": sealed.text, "aliases": sealed.mapping(sealed.texts)}


def cached_plan(path: str, key: str) -> Plan | None:
    """The plan kept under `key` in the cache at `path` (`cached` set), or None:
    no cache, no such plan, or one that fails its checksum or figures (it is
    planned again and overwritten)."""
    entry = sealed.unseal((read_cache(path) or {}).get(key), _PLAN)
    if entry is None:
        return None
    try:  # the file's text is parsed here, where it is read: the plan holds values
        # A tag of the model's own outside the vocabulary (attention_out) parses once known.
        register_emitted([t for tag, names in (entry.get("aliases") or {}).items()
                          for t in (tag, *names)])
        layers = entry.get("layer_specs")
        policy = tuple(parse(s) for s in layers) if layers else parse(entry["spec"])
        return dataclasses.replace(Plan.from_dict(entry, policy), cached=True)
    except (TypeError, ValueError):  # a spec that no longer parses
        return None


def write_cache(path: str, key: str, plan: Plan) -> None:
    """Adds `plan` under `key` to the JSON plan cache at `path`, atomically; warns (never
    raises) where the file is not a plan cache or cannot be written."""
    data = read_cache(path)
    if data is None:
        warnings.warn(f"plan cache {path!r} is not a plan cache (a JSON object); left as it "
                      "is, the plan is not cached", stacklevel=3)
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path) as f:  # concurrent runs never read half a file
            json.dump(data | {key: sealed.seal(plan.to_dict())}, f, indent=1)
    except OSError as e:
        warnings.warn(f"cannot write plan cache {path!r} ({e}); the plan is not cached",
                      stacklevel=3)


__all__ = ["Plan", "cached_plan", "default_cache_path", "layers_summary", "read_cache",
           "write_cache"]
