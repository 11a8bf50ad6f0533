"""The measured program, applied: a user's Flax model run exactly as `compare --model` measured it.

`remat_model(model, policy)` returns the model (linen: the same `init`/`apply` and parameters;
NNX: a copy with the same arrays) whose forward pass is made by the code that makes the measured
program (`trace.regions.build`), so its gradients compile to equal temp memory and FLOPs.
`policy`: a spec, one per block, a `Plan`, or a plan file (`read_plan`, with `budget=`).
The forms and an example: docs/models.md ("Train with the measured program").
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import warnings
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx

from remat_kit.errors import RematSpecError, UnknownModuleError, UnknownTagError
from remat_kit.files import read_regular
from remat_kit.flax import blocks, from_model
from remat_kit.flax import linen as flax_linen
from remat_kit.flax import nnx as flax_nnx
from remat_kit.policy.names import register_emitted
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import AutoSpec, layer_policies, parse, per_layer
from remat_kit.trace import call_region, model_map, own_remat, regions, validate, wrapping


# The schema_version `remat-kit plan --json` writes, the one `read_plan` reads.
PLAN_SCHEMA_VERSION = 1
# The most of a plan file read: a plan is a few KB, per layer a few hundred more.
PLAN_FILE_LIMIT = 64 << 20


def read_plan(path: "str | os.PathLike", budget=None) -> dict:
    """One plan of a `remat-kit plan --json` file: its `plan` entry (spec,
    layer_specs, ...) with the file's context under "context".

    Args:
      budget: which budget's plan, as written on the command line ("0.5",
        "6GiB"); default the file's only plan.
    Raises:
      RematSpecError: the file does not exist, cannot be read (a folder,
        a FIFO, over `PLAN_FILE_LIMIT` bytes) or is not plan JSON (a
        schema_version other than `PLAN_SCHEMA_VERSION`, absent read as
        it; its plans, their `spec` and `layer_specs`, its context's `block`,
        `num_layers` and `parameters` of the wrong type: named), `budget` is
        not one of its budgets or one no policy met, or it holds several
        plans (or none) and no budget.
    """
    name = os.fspath(path)

    def refuse(why: str):
        return RematSpecError(f"plan file {name!r} is not remat-kit plan --json output: {why}",
                              token=name)
    try:
        data = json.loads(read_regular(name, PLAN_FILE_LIMIT))
    except FileNotFoundError:
        raise RematSpecError(f"plan file {name!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise refuse(f"{type(e).__name__}: {e}") from None
    # A hand-written plan (no schema_version) is read as this version; "1" or 99 is not.
    version = data.get("schema_version", PLAN_SCHEMA_VERSION) if isinstance(data, dict) \
        else PLAN_SCHEMA_VERSION
    if type(version) is not int or version != PLAN_SCHEMA_VERSION:  # noqa: E721 - not True
        raise refuse(f"its schema_version is {version!r}; this remat_kit reads "
                     f"schema_version {PLAN_SCHEMA_VERSION}")
    try:
        entries = [e for e in data["budgets"] if e.get("plan")]
        unmet = [str(e["budget"]) for e in data["budgets"] if not e.get("plan")]
        context = data.get("context", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise refuse(f"{type(e).__name__}: {e}") from None
    budgets = [str(e["budget"]) for e in entries]
    # plan --json writes a budget no policy fit with no plan: say so, not "not in the file".
    if budget is None and unmet and not entries:
        raise RematSpecError(f"plan file {name!r} holds no plan: no policy fit its budgets "
                             f"({', '.join(unmet)}) when they were planned; plan a larger "
                             "budget", token=name)
    if str(budget) in unmet:
        raise RematSpecError(f"plan file {name!r} has no plan for budget {budget}: no policy "
                             "fit it when it was planned; give a budget that was met",
                             token=str(budget), choices=budgets)
    if budget is None and len(entries) != 1:
        raise RematSpecError(f"plan file {name!r} holds {len(entries)} plans "
                             f"(budgets {', '.join(budgets) or 'none'}); pick one with budget=",
                             token=name, choices=budgets)
    found = [e for e in entries if budget is None or str(e["budget"]) == str(budget)]
    if not found:
        raise RematSpecError(f"budget {budget!r} is not in plan file {name!r}",
                             token=str(budget), choices=budgets)
    if not isinstance(found[0]["plan"], Mapping):
        raise refuse(f"its plan is {type(found[0]['plan']).__name__}, not an object")
    plan = found[0]["plan"] | {"context": context}
    _checked(plan, f"plan file {name!r}")
    return plan


def _checked(plan: Mapping, where: str = "the plan") -> tuple:
    """(spec or per-layer tuple, context) of a plan dict, every field of the type
    `Plan.to_dict` and `remat-kit plan --json` write it: a hand-edited file
    gets a line naming the field, not a TypeError from deep inside."""
    def refuse(why: str):
        return RematSpecError(f"{where}: {why}")
    spec, layers = plan.get("spec"), plan.get("layer_specs") or ()
    context = plan.get("context", {})
    if not isinstance(spec, str):
        raise refuse(f"'spec' must be a spec string, got {type(spec).__name__} {spec!r:.80}")
    if not isinstance(layers, (list, tuple)) or not all(isinstance(s, str) for s in layers):
        raise refuse(f"'layer_specs' must be a list of spec strings, one per layer, got "
                     f"{layers!r:.80}")
    if not isinstance(context, Mapping):
        raise refuse(f"'context' must be an object, got {type(context).__name__}")
    block = context.get("block")
    if block is not None and not isinstance(block, str):
        raise refuse(f"context 'block' must be a class name, got {block!r:.80}")
    for field in ("num_layers", "parameters"):
        n = context.get(field)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise refuse(f"context {field!r} must be a positive int, got {n!r:.80}")
    return tuple(layers) or spec, context


# How alike (difflib's ratio) an unknown tag and a vocabulary tag must be for the tag to
# be refused at the call as a misspelling: 'attn_logit' and 'attn_logits' are 0.95.
TYPO_RATIO = 0.9


def _planned_first(spec, parsed) -> None:
    """RematSpecError for an `auto:budget=` spec (`parsed`: the value of `spec`, or None
    where it is no spec): it is planned for a model, not run."""
    if isinstance(parsed, AutoSpec):
        raise RematSpecError(f"{spec} is planned for a model at its shapes: plan it "
                             "first (rk.plan, remat-kit plan --json) and give the plan",
                             token=str(spec))


def _near_miss(e: UnknownTagError) -> None:
    """A tag outside the vocabulary may be one of the model's own `checkpoint_name`s,
    known once the model is traced (`_layers` registers them): checked there, unless
    it is a near miss of a vocabulary tag (`TYPO_RATIO`), refused here with the
    "did you mean" of `parse`."""
    close = e.closest and difflib.SequenceMatcher(None, e.token, e.closest).ratio()
    if close and close >= TYPO_RATIO:
        raise UnknownTagError(e.token, e.choices, spec=e.spec, position=e.position,
                              message=f"rk.remat_model: unknown tag, too close to "
                              f"{e.closest!r} to be one of the model's own (if it is, "
                              f"rk.register_tag({e.token!r}) first)") from None


def _spec_of(policy, budget):
    """The policy as a spec, Policy or per-layer tuple, and the plan's context
    ({} where it is not a plan)."""
    is_file = isinstance(policy, (str, os.PathLike)) and os.fspath(policy).endswith(".json")
    if budget is not None and not is_file:
        raise RematSpecError(f"budget= picks one plan of a remat-kit plan --json file; "
                             f"{policy!r:.80} is not one: drop budget=", token=str(budget))
    if is_file:
        policy = read_plan(policy, budget)
    if isinstance(policy, Mapping):
        if "spec" not in policy:
            raise RematSpecError(f"a plan given as a dict needs 'spec' (and 'layer_specs' for a "
                                 f"per-layer plan), got keys {sorted(policy)}")
        spec, context = _checked(policy)
    elif hasattr(policy, "layer_specs") and hasattr(policy, "spec"):  # a remat_kit Plan
        spec = tuple(policy.layer_specs) or policy.spec
        context = dict(getattr(policy, "model", {}))  # the model it was planned for
    elif isinstance(policy, str) and (layers := per_layer(policy)) is not None:
        spec, context = layers, {}  # a per-layer plan as `plan` prints it
    elif isinstance(policy, (str, Policy)):
        spec, context = policy, {}
    elif isinstance(policy, Sequence):
        spec, context = tuple(policy), {}
    else:
        raise TypeError(f"rk.remat_model takes a spec, a Policy, one per block, a Plan or a "
                        f"plan JSON file, got {type(policy).__name__} {policy!r:.80}")
    return spec, context


def _layers(spec, context: dict, program: regions.Regions, cls: type) -> tuple[Policy, ...]:
    """One Policy per block; RematSpecError, naming what differs, where a plan or list
    was made for another model (layer count, block class, parameters, tags)."""
    n = program.num_layers
    made_for, layers = context.get("block"), context.get("num_layers")
    if made_for and made_for != cls.__name__:
        raise RematSpecError(f"the plan was made for blocks of class {made_for}; this model's "
                             f"blocks are {cls.__name__}", token=made_for)
    if layers and layers != n:
        raise RematSpecError(f"the plan was made for a model of {layers} blocks"
                             f"{f' ({made_for})' if made_for else ''}; this model runs {n} "
                             f"{cls.__name__} blocks")
    count = context.get("parameters")
    if count and count != program.parameter_count:
        raise RematSpecError(f"the plan was made for a model of {count:,} parameters; this "
                             f"model has {program.parameter_count:,} (its {n} {cls.__name__} "
                             "blocks are another size): plan this model")
    if isinstance(spec, tuple) and len(spec) != n:
        raise RematSpecError(f"{len(spec)} per-layer policies for a model of {n} blocks "
                             f"({cls.__name__}): give one per block")
    # The model's own checkpoint_names (attention_out) are tags a spec or plan may name,
    # in a process where no planner has registered them.
    register_emitted(program.emitted)
    policies = layer_policies(spec, n)
    # A plan keeps only tags its model emitted: one this model lacks means another model.
    lacking = sorted({p for policy in policies for p in validate.lacking(policy, program.emitted)})
    if context and lacking:
        raise RematSpecError(f"the plan keeps tags this model does not emit "
                             f"({', '.join(lacking)}): it was made for another model; "
                             "plan this one")
    return policies


def _warn(layers, program, found, notes) -> None:
    """The notes `compare` prints for these policies on this model, as warnings."""
    for policy in dict.fromkeys(layers):
        line = call_region.policy_line("rk.remat_model", policy, program, found)
        if line:
            warnings.warn(line, stacklevel=4)
    for note in notes:
        warnings.warn(f"rk.remat_model: {note}", stacklevel=4)


def _program(fn, arrays, num_params: int, pick: blocks.Pick, spec, context):
    """(run(*arrays) -> flat outputs, output tree, which outputs pass an input through
    (`regions.passed_through`)) of `fn(*arrays)` with its layers (`pick`) under the
    policy, the model's own remat of whole layers taken over (`own_remat`), as
    `from_model.workload` builds it; `fn` marks the layers."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    closed, shape = from_model.trace(fn, structs, None, pick.cls)
    own = own_remat.find(closed.jaxpr, from_model.KEY)
    program, found = regions.build(closed, None, from_model.KEY, num_params, own.taken)
    if program.num_layers == 0 and pick.cls:
        raise UnknownModuleError(pick.cls.__name__, [pick.cls.__name__],
                                 message="the block class is instantiated but never called "
                                         "by the model's __call__; name another with block=")
    layers = _layers(spec, context, program, pick.cls) if program.num_layers else ()
    the_map = model_map.ModelMap(model_map.stacks_of(list(pick.layers)), own.regions)
    _warn(layers, program, found,
          model_map.notes(the_map) + blocks.unremat_note(pick.others, pick.cls))
    return (program.function(layers), jax.tree.structure(shape),
            regions.passed_through(closed.jaxpr))


def _shape_note(context: Mapping, args) -> None:
    """Warns where a plan made at one batch and seq (a `remat-kit plan --json` file's
    context) runs at others (the call's first array, [batch, seq, ...]): what a plan saves
    and costs depends on the shapes, so its budget need not hold there."""
    planned = (context.get("batch"), context.get("seq"))
    first = next((a for a in args if hasattr(a, "shape")), None)
    if not all(isinstance(n, int) for n in planned) or first is None or len(first.shape) < 2:
        return
    if tuple(first.shape[:2]) != planned:
        b, s = first.shape[:2]
        warnings.warn(f"rk.remat_model: the plan was made at batch {planned[0]}, seq "
                      f"{planned[1]}; this call runs batch {b}, seq {s}: what it saves depends "
                      f"on the shapes, so its budget may not hold here (plan again at these: "
                      f"remat-kit plan --batch {b} --seq {s})", stacklevel=4)


def _signature(arrays, rebuild, *extra):
    """The program's cache key: shapes, static arguments, `extra`; None if unhashable."""
    shapes = flax_linen.call_cache_key(arrays, rebuild)
    return None if shapes is None else call_region.key_of(shapes, *extra)


def _linen(model: nn.Module, spec, context, block) -> nn.Module:
    base = type(model)
    built: dict = {}

    def apply(self, variables, *args, method=None, **kwargs):
        params = variables.get("params", {})
        rest = {k: v for k, v in variables.items() if k != "params"}
        arrays, rebuild = wrapping.split_static((params, rest, *args), kwargs)

        def call(*xs):
            (p, r, *a), kw = rebuild(xs)
            return base.apply(self, {"params": p, **r}, *a, method=method, **kw)

        def make():
            _shape_note(context, args)
            instances, _ = from_model.linen_instances(self, call, *arrays, params=params)
            pick = blocks.pick_block(instances, block)

            def marked(*xs):
                with from_model.marking_linen(pick.cls):
                    return call(*xs)

            num_params = sum(map(wrapping.is_array, jax.tree.leaves(params)))
            return _program(marked, arrays, num_params, pick, spec, context)

        run, tree, _ = call_region.once(built, _signature(arrays, rebuild, method), make)
        return jax.tree.unflatten(tree, run(*arrays))

    sub = flax_nnx.same_named_subclass(base, {"apply": apply})
    return sub(**flax_linen.init_fields(model, "parent"))


@contextlib.contextmanager
def _as_class(module: nnx.Module, cls: type):
    """`module` seen as an instance of `cls` inside (its forward not ours)."""
    own, module.__class__ = module.__class__, cls
    try:
        yield module
    finally:
        module.__class__ = own


def _nnx(model: nnx.Module, spec, context, block) -> nnx.Module:
    base = type(model)
    built: dict = {}

    def __call__(self, *args, **kwargs):
        arrays, rebuild = wrapping.split_static(args, kwargs)
        with _as_class(self, base):
            state = nnx.state(self, nnx.Param, ...)  # (params, the rest)
            leaves, tree = jax.tree.flatten(state)

            def make():
                _shape_note(context, args)
                pick = from_model.nnx_block(self, block, *args, **kwargs)
                graphdef = nnx.split(from_model.nnx_marked(self, pick.cls))[0]

                def forward(*xs):  # state leaves, then the call's arrays
                    a, kw = rebuild(xs[len(leaves):])
                    module = nnx.merge(graphdef, *jax.tree.unflatten(tree, xs[:len(leaves)]))
                    return module(*a, **kw), nnx.state(module, nnx.Param, ...)

                num_params = len(jax.tree.leaves(state[0]))
                return _program(forward, (*leaves, *arrays), num_params, pick, spec, context)

            run, out_tree, passed = call_region.once(built, _signature(arrays, rebuild), make)
            out, new_state = jax.tree.unflatten(out_tree, run(*leaves, *arrays))
            flax_nnx.update_changed(self, new_state, passed[len(passed) - len(leaves):])
        return out

    out = flax_nnx.copy_model(model)
    out.__class__ = flax_nnx.same_named_subclass(base, {"__call__": __call__})
    return out


def remat_model(model, policy, *, block=None, budget=None):
    """`model` running exactly the program `compare --model` / `plan --model` measured.

    >>> import remat_kit as rk
    >>> model = rk.models.Transformer(rk.models.get_config("tiny"))
    >>> fast = rk.remat_model(model, "minimal")  # or a Plan from rk.plan
    >>> isinstance(fast, rk.models.Transformer), fast.config == model.config
    (True, True)

    Args:
      model: a `flax.linen.Module` instance (unbound) or a `flax.nnx.Module`.
      policy: a spec string or `Policy` (a layer schedule picks the blocks), a
        sequence of one spec or Policy per block, a `Plan` (`rk.plan`; per
        layer or not), its `to_dict()`, or the path of a `remat-kit plan --json`
        file (with `budget=` where it holds several plans).
      block: the block class or its name, or several (a tuple, or "A,B");
        default the repeated classes `from_model` finds (those `compare`
        measured).
      budget: with a plan file, which budget's plan ("0.5", "6GiB").
    Returns:
      linen: a module of a subclass of `type(model)` with the same fields,
      whose `init` is the model's and whose `apply` takes the same arguments
      (rngs, mutable, method) and gives the same outputs and gradients. NNX:
      a copy (same arrays, same `nnx.state` paths) whose call runs the
      program; its state updates (RNG counts, statistics) land on the copy.
      Each new argument signature traces the model once (no FLOPs) before
      its first run; a plan file's plan run at another batch or seq than it
      was planned at warns (what it saves depends on the shapes). A policy
      naming a role or tag the model does not emit warns, as `compare` notes
      it; the model's own remat of whole layers is replaced by the policy;
      its other remat regions stay, and warn.
    Raises:
      TypeError: not a linen or NNX module; a policy of another type.
      RematSpecError: a spec that does not parse (a tag neither in the vocabulary
        nor registered: at the first call, where the model's own checkpoint_names
        count as tags; here where it is a near miss of a vocabulary tag), an `auto:budget=` spec (plan
        it first), a plan file that cannot be read, or (at the first call,
        before anything compiles) a plan or list for another layer count or
        block class.
      UnknownModuleError: (at the first call) `block` matches none.
    """
    spec, context = _spec_of(policy, budget)
    for one in spec if isinstance(spec, tuple) else (spec,):
        try:  # the text given, checked before the model's own tags are known (`_near_miss`)
            _planned_first(one, parse(one) if isinstance(one, (str, Policy)) else None)
        except UnknownTagError as e:
            _near_miss(e)
    if isinstance(model, nnx.Module):
        return _nnx(model, spec, context, block)
    if isinstance(model, nn.Module) and not isinstance(model, type):
        return _linen(model, spec, context, block)
    raise TypeError(f"rk.remat_model takes a flax.linen.Module instance or a flax.nnx.Module, "
                    f"got {type(model).__name__} {model!r:.80}")


__all__ = ["PLAN_SCHEMA_VERSION", "read_plan", "remat_model"]
