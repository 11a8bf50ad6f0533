"""The user's own model in `experiments.train`: `--model FILE.py:FUNCTION` or
`config.model = "FILE.py:FUNCTION"`, loaded as `remat-kit compare --model` loads it.

FUNCTION takes no arguments and returns a linen or NNX language model (int32
tokens [batch, seq] -> logits [batch, seq, vocab], or a dict / object with
`logits`; `remat_kit.flax.user_model`). A linen model's parameters are
initialized from config.seed. An NNX model trains the arrays FUNCTION built:
its `nnx.Param` state (`nnx.split`) is the train state's params, and the model
under the policy is merged with it in each step (`nnx.merge`), so checkpoints
hold the model's own `nnx.State` paths.

The policy is applied with `rk.remat_model`, so the run trains the program
`compare --model` measured: an `auto:budget=` spec is planned first on
`rk.from_model.workload(model, batch, seq)` (`rk.Planner`) and its Plan
applied; config.remat may also name a `remat-kit plan --json` file (PATH.json:
its only plan; PATH.json@BUDGET: the plan of that budget, as written on plan's
--budgets), per layer or not. The loss is `compare`'s: next-token cross-entropy
within each window (`from_model.next_token_loss`), so the compiled step's temp
memory equals `remat_kit.decide.step`'s prediction for the same policy and shape.

FUNCTION may also return `(model, batch, loss)`, a model that is not a token LM
(`remat_kit.flax.batch_model`): it trains on synthetic batches of the declared
shapes (`experiments.synthetic`) under its own loss. An NNX model's RNG streams
(dropout) are keyed per batch (`rng_state`), so each step draws new masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import remat_kit as rk
from experiments.common import SIZE_FIELDS
from remat_kit.errors import BadInput
from remat_kit.decide import step as stepping
from remat_kit.errors import RematSpecError
from remat_kit.flax import batch_model, from_model, user_model
from remat_kit.flax.measured import read_plan
from remat_kit.measure import targets
from remat_kit.policy.spec import AutoSpec, parse
from remat_kit.trace import regions
from remat_kit.trace.workload import Workload

# Fields that size our reference transformer; a user's model brings its own sizes.
REFERENCE_FIELDS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "mlp_dim")


def is_own(name: str) -> bool:
    """Whether config.model names a user's model (FILE.py:FUNCTION, module:FUNCTION)
    rather than one of `remat_kit.models.CONFIGS` (names hold no ':')."""
    return ":" in name


@dataclasses.dataclass(frozen=True)
class OwnModel:
    """A user's model made ready to train at one (batch, seq).

    Attributes:
      label: "FILE.py:FUNCTION".
      model: the linen or NNX module as FUNCTION returned it.
      workload: `rk.from_model.workload(model, batch, seq)` (on the run's mesh).
      policy: what `rk.remat_model` is given: config.remat, or a plan as a
        dict (spec, layer_specs; `Plan.to_dict` of an `auto:budget=` spec, or
        a plan file's entry with its context).
      spec: the policy as printed and recorded (the plan's spec, or its
        per-layer specs joined by ' | ').
      vocab: the logits' last dimension; None for a model of other inputs.
      batch: the batch FUNCTION declared, for a model that is not a token LM
        (`(model, batch, loss)`); else None.
      user_loss: that model's loss(output, batch) -> scalar; else None.
    """

    label: str
    model: nn.Module | nnx.Module
    workload: Workload
    policy: object
    spec: str
    vocab: int | None
    batch: object = None
    user_loss: Callable | None = None

    def shardings(self, state, tx) -> tuple | None:
        """(state, batch, key) shardings of the run, as the prediction places its
        arguments (`remat_kit.flax.placement`: the model's own partitioning on its
        own mesh or the run's): the parameters as the workload's, each optimizer
        moment like its parameter, the tokens over the batch axes, the rest whole;
        so the step compiled is the one predicted. None off a mesh.

        state: the run's TrainState, unboxed (`jax.eval_shape`); tx: its optimizer.
        """
        mesh = self.workload.mesh
        if mesh is None:
            return None
        whole = NamedSharding(mesh, PartitionSpec())
        params = jax.tree.unflatten(jax.tree.structure(state.params),
                                    [x.sharding for x in jax.tree.leaves(self.workload.params)])
        opt = optax.tree_map_params(tx, lambda _, s: s, state.opt_state, params,
                                    transform_non_params=lambda _: whole)
        return (state.replace(step=whole, params=params, opt_state=opt),
                self.workload.args[1].sharding, whole)

    def tracing(self):
        """Context to trace the run's step in: the workload's mesh as JAX's context
        mesh (`jax.set_mesh`), so the model's own constraints apply as predicted."""
        mesh = self.workload.mesh
        return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

    @property
    def layers(self):
        """The policy as `Workload.loss_for_policy` takes it."""
        if isinstance(self.policy, Mapping):
            return tuple(self.policy.get("layer_specs") or ()) or self.policy["spec"]
        return self.policy

    def init(self, rng, tokens):
        """The parameters to train: linen's `init` from `rng` (boxed where the
        model names logical axes) on `tokens`, or on the workload's batch for a
        model of other inputs; NNX's `nnx.Param` state, the arrays the model
        holds (`rng` and `tokens` unused)."""
        if isinstance(self.model, nnx.Module):
            return nnx.state(self.model, nnx.Param)
        if self.batch is None:
            return self.model.init(rng, tokens)["params"]
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.workload.args[1])
        args, kwargs = batch_model.call_args(self.model, zeros)
        return self.model.init(rng, *args, **kwargs)["params"]

    def loss_fn(self, policy=None) -> Callable:
        """loss(params, inputs, targets, rng) -> float32 scalar, under `policy`
        (default the run's): `compare`'s next-token loss of `inputs` alone
        (targets and rng unused: the loss `compare` measured, no dropout).
        A model of other inputs: its own loss of the batch `inputs`, `targets`
        its NNX state (`rng_state`; `_batch_loss`)."""
        run = rk.remat_model(self.model, self.policy if policy is None else policy)
        if self.user_loss is not None:
            return _batch_loss(self.model, run, self.user_loss)
        apply = _applier(run)

        def loss(params, inputs, targets, rng):
            del targets, rng
            return from_model.next_token_loss(
                from_model.logits_of(apply(params, inputs), *inputs.shape), inputs)
        return loss

    def predicted(self, optimizer) -> stepping.StepMemory:
        """`remat_kit.decide.step`'s figures for this policy and shape, with the
        run's optimizer: the prediction the compiled step is checked against."""
        return stepping.compile_step(self.workload, self.layers, optimizer,
                                     targets.parse_target(None))


def load(config: ml_collections.ConfigDict, mesh, cache: str | None) -> OwnModel:
    """The user's model of config.model, checked and planned, before any compile.

    Raises:
      BadInput: everything `--model` refuses (`user_model.load`, the same one
        line), a model with variables besides its parameters (linen
        collections besides params, NNX state besides `nnx.Param` that its
        call updates: not trained here yet), an abstract NNX model (`nnx.eval_shape`: no arrays
        to train), a vocab below `vocab_size` bytes, config fields that size
        our reference model, an `auto:budget=` that cannot be planned, a plan
        file that cannot be read or was made for another model (its layer
        count or block class: `rk.remat_model`'s line, traced here).
      RematSpecError: config.remat does not parse (the caller's one line).
    """
    from experiments import data

    set_fields = [f"config.{n}" for n in REFERENCE_FIELDS if config.get(n) is not None]
    if set_fields:
        raise BadInput(f"{', '.join(set_fields)} size the reference model; --model "
                       f"{config.model} brings its own sizes: drop them")
    try:
        label, make = user_model.load(config.model, config.get("block") or None,
                                      sizes=SIZE_FIELDS)
        workload = make(config.batch_size, config.seq_len, mesh)
    except from_model.ModelError as e:
        raise BadInput(str(e)) from None
    except rk.UnknownModuleError as e:
        raise BadInput(f"--model {config.model!r}: {e}") from None
    model = getattr(make, "model", None)
    if getattr(make, "loss", None) is not None:  # (model, batch, loss): not a token LM
        return _batch_model(config, label, make, workload, cache)
    if model is None:
        raise BadInput(f"--model {config.model!r}: experiments.train trains a model; "
                       f"{label}(batch, seq) builds a Workload: give a function that "
                       "returns the linen or NNX module")
    vocab = from_model.logits_of(_output(model, config.seq_len, config.model), 1,
                                 config.seq_len).shape[-1]
    if vocab < data.VOCAB_SIZE:
        raise BadInput(f"--model {config.model!r}: its logits have vocab {vocab}; the data is "
                       f"bytes, one token per byte value: the model needs a vocab of at least "
                       f"{data.VOCAB_SIZE}")
    own = OwnModel(label, model, workload, *_policy(config.remat, workload, cache), vocab)
    if isinstance(own.policy, Mapping) and own.policy.get("context"):
        # A plan file names the model it was made for: checked on one trace, before compiling.
        # At the run's shape; its notes are the run's to give, when the step is traced.
        tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jax.eval_shape(own.loss_fn(), workload.params, tokens, tokens, None)
        except RematSpecError as e:
            raise BadInput(f"config.remat={config.remat!r}: {e}") from None
    return own


def _batch_model(config, label: str, make, workload: Workload, cache: str | None) -> OwnModel:
    """The OwnModel of a FUNCTION that returned (model, batch, loss). BadInput for a
    mesh (not trained here yet) or a plan file made for another model."""
    if config.get("mesh"):
        raise BadInput(f"--model {config.model!r}: a model of a batch and a loss trains on one "
                       "device here; drop config.mesh")
    own = OwnModel(label, make.model, workload, *_policy(config.remat, workload, cache), None,
                   make.values, make.loss)
    if isinstance(own.policy, Mapping) and own.policy.get("context"):
        try:  # a plan file names the model it was made for: checked on one trace
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jax.eval_shape(own.loss_fn(), workload.params, workload.args[1],
                               rng_state(own, 0, 0), jax.random.key(0))
        except RematSpecError as e:
            raise BadInput(f"config.remat={config.remat!r}: {e}") from None
    return own


def rng_state(own: OwnModel, seed: int, i: int):
    """What stands where a token LM's targets do for batch `i` of a model of other
    inputs (the loss reads its labels from the batch): an NNX model's state besides
    its parameters with every `nnx.RngKey` drawn from (seed, i), so dropout draws
    new masks each step and the step is the program `compare` measured (that state
    an argument, as in `batch_model`'s loss); None for a linen model."""
    if not isinstance(own.model, nnx.Module):
        return None
    rest = nnx.state(own.model, nnx.Not(nnx.Param))
    # i < 0 for the eval batches (`synthetic.batches`): folded in as an unsigned 32-bit int.
    key, seeds = jax.random.fold_in(jax.random.key(seed), i & 0xFFFFFFFF), iter(range(len(
        jax.tree.leaves(rest))))
    return jax.tree.map(lambda v: v.replace(value=jax.random.fold_in(key, next(seeds)))
                        if isinstance(v, nnx.RngKey) else v, rest,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


def _batch_loss(model, run, loss: Callable) -> Callable:
    """loss(params, batch, state, rng) of `run` (`rk.remat_model(model, ...)`) on a
    batch, called as `model` takes it (`batch_model.call_args`). NNX: merged with a
    copy of `state` (`rng_state`), whose RNG counts the call advances are dropped
    with the copy; linen: `state` and `rng` unused."""
    graphdef = nnx.split(run, nnx.Param, ...)[0] if isinstance(run, nnx.Module) else None

    def batch_loss(params, batch, state, rng):
        del rng
        args, kwargs = batch_model.call_args(model, batch)
        if graphdef is None:
            return loss(run.apply({"params": params}, *args, **kwargs), batch)
        return loss(nnx.merge(graphdef, params, state, copy=True)(*args, **kwargs), batch)
    return batch_loss


def _policy(remat: str, workload: Workload, cache: str | None) -> tuple[object, str]:
    """(what `rk.remat_model` is given, the spec as printed) for config.remat:
    a spec as it is; an `auto:budget=` spec's Plan from `rk.Planner` on the
    workload; a plan file's plan (PATH.json or PATH.json@BUDGET)."""
    path, at, budget = remat.rpartition("@")
    if not (at and path.endswith(".json")):
        path, budget = remat, None
    if path.endswith(".json"):
        try:
            plan = read_plan(path, budget)
        except RematSpecError as e:
            if budget is None and e.choices:
                raise BadInput(f"config.remat={remat!r} holds plans for budgets "
                               f"{', '.join(e.choices)}: pick one as {path}@BUDGET") from None
            raise BadInput(f"config.remat: {e}") from None
    else:
        policy = parse(remat)
        if not isinstance(policy, AutoSpec):
            return remat, str(policy)
        plan = rk.Planner(workload, cache=cache or None).plan(policy.budget).to_dict()
    layers = plan.get("layer_specs") or ()
    return plan, " | ".join(layers) if layers else plan["spec"]


def _applier(run) -> Callable:
    """(params, tokens) -> the output of `run` (`rk.remat_model`'s model) on
    those parameters: linen's `apply`; NNX's `nnx.merge` of its graph with them
    and its other state, which the call leaves alone (`_output`), held fixed."""
    if isinstance(run, nnx.Module):
        graphdef, _, rest = nnx.split(run, nnx.Param, ...)
        return lambda params, tokens: nnx.merge(graphdef, params, rest)(tokens)
    return lambda params, tokens: run.apply({"params": params}, tokens)


def _output(model, seq: int, spec: str):
    """The model's output on int32 tokens [1, seq] as ShapeDtypeStructs
    (`jax.eval_shape`). BadInput where it holds variables besides its
    parameters (linen) or NNX state besides `nnx.Param` that the call changes
    (batch statistics, the count of an RNG stream in use: not trained here
    yet), or, NNX, its parameters are abstract. NNX state the call leaves alone
    (the RNG stream of a dropout at rate 0, a table held as an array) trains
    held fixed."""
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    if isinstance(model, nn.Module):
        variables, out = jax.eval_shape(
            lambda t: model.init_with_output(jax.random.key(0), t)[::-1], tokens)
        if len(variables) > 1:
            raise BadInput(f"--model {spec!r}: its variables "
                           f"{sorted(set(variables) - {'params'})} besides its parameters are "
                           "not trained here yet; give a model with parameters only")
    else:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
            raise BadInput(f"--model {spec!r}: its parameters are abstract (nnx.eval_shape); "
                           "experiments.train trains the model's arrays: return the built "
                           "model")
        def call(p, r, t):
            module = nnx.merge(graphdef, p, r)
            return module(t), nnx.state(module, nnx.Param, ...)[1]

        closed, (out, _) = jax.make_jaxpr(call, return_shape=True)(params, rest, tokens)
        passed = regions.passed_through(closed.jaxpr)
        changed = [f"{type(v).__name__} {'/'.join(map(str, path))}"
                   for (path, v), alone in zip(nnx.to_flat_state(rest),
                                               passed[len(passed) - len(jax.tree.leaves(rest)):])
                   if not alone]
        if changed:
            raise BadInput(f"--model {spec!r}: its call updates its NNX state {sorted(changed)}: "
                           "state besides the parameters that changes as the model runs is not "
                           "trained here yet; give a model whose other state stays as built")
    return out


def describe(own: OwnModel, remat: str) -> str:
    """The run's "model:" line, and its model map's (`remat_kit.trace.model_map`)."""
    inputs = (f"vocab {own.vocab}" if own.batch is None
              else f"batch {batch_model.describe(own.workload.args[1])}")
    the_map = own.workload.model_map
    return (f"model: {own.label} ({type(own.model).__name__}, {own.workload.num_layers} "
            f"blocks, {inputs}); remat={remat} (policy {own.spec})"
            + ("" if the_map is None else f"\nmodel map: {the_map.line()}"))


def check_line(compiled: dict, predicted: stepping.StepMemory, step: int = 0
               ) -> tuple[str, dict]:
    """The step-0 line comparing the compiled train step with the prediction,
    and the summary's entry. `compiled`: train's `_compiled_stats`; `step`: the
    step the run starts at (a resumed run's checkpoint step). The run's
    step also holds its step counter and PRNG key, which the predicted step
    has not: in-use bytes differ by those, temp bytes do not."""
    entry = {"temp_size_in_bytes": predicted.temp_size_in_bytes,
             "step_bytes": predicted.total_bytes, "flops": predicted.flops,
             "temp_equal": compiled["temp_size_in_bytes"] == predicted.temp_size_in_bytes}
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.3f} MiB"  # noqa: E731
    # The train step holds the optimizer update too: the figure to match is fit's, not
    # compare's (value and grad alone).
    line = (f"step {step}: compiled train step (value, grad and optimizer update) temp "
            f"{mib(compiled['temp_size_in_bytes'])}, in use {mib(compiled['step_bytes'])}; "
            "predicted (remat_kit.decide.step, as fit prices it: same policy, shape and "
            f"optimizer) temp {mib(predicted.temp_size_in_bytes)}, in use "
            f"{mib(predicted.total_bytes)}: "
            + ("temp equal" if entry["temp_equal"] else "temp DIFFERS"))
    return line, entry


__all__ = ["OwnModel", "check_line", "describe", "is_own", "load", "rng_state"]
