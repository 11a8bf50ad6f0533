"""The user's own model in `experiments.train`: `--model FILE.py:FUNCTION` or
`config.model = "FILE.py:FUNCTION"`, loaded as `remat-kit compare --model` loads it.

FUNCTION takes no arguments and returns a linen language model (int32 tokens
[batch, seq] -> logits [batch, seq, vocab], or a dict / object with `logits`;
`remat_kit.flax.user_model`). The policy is applied with `rk.remat_model`, so
the run trains the program `compare --model` measured: an `auto:budget=` spec
is planned first on `rk.from_model.workload(model, batch, seq)` (`rk.Planner`)
and its Plan applied. The loss is `compare`'s: next-token cross-entropy within
each window (`from_model.next_token_loss`), so the compiled step's temp memory
equals `remat_kit.decide.step`'s prediction for the same policy and shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

import remat_kit as rk
from remat_kit.cli.inputs import BadInput
from remat_kit.decide import step as stepping
from remat_kit.flax import from_model, user_model
from remat_kit.measure import targets
from remat_kit.policy.spec import AutoSpec, parse
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
      model: the linen module as FUNCTION returned it.
      workload: `rk.from_model.workload(model, batch, seq)` (on the run's mesh).
      policy: what `rk.remat_model` is given: config.remat, or the Plan of an
        `auto:budget=` spec.
      spec: the policy as printed and recorded (the plan's spec, or its
        per-layer specs joined by ' | ').
      vocab: the logits' last dimension.
    """

    label: str
    model: nn.Module
    workload: Workload
    policy: object
    spec: str
    vocab: int

    @property
    def layers(self):
        """The policy as `Workload.loss_for_policy` takes it."""
        if hasattr(self.policy, "layer_specs"):
            return tuple(self.policy.layer_specs) or self.policy.spec
        return self.policy

    def init(self, rng, tokens) -> dict:
        """The model's parameters (boxed where it names logical axes)."""
        return self.model.init(rng, tokens)["params"]

    def loss_fn(self, policy=None) -> Callable:
        """loss(params, inputs, targets, rng) -> float32 scalar, under `policy`
        (default the run's): `compare`'s next-token loss of `inputs` alone
        (targets and rng unused: the loss `compare` measured, no dropout)."""
        run = rk.remat_model(self.model, self.policy if policy is None else policy)

        def loss(params, inputs, targets, rng):
            del targets, rng
            out = run.apply({"params": params}, inputs)
            return from_model.next_token_loss(
                from_model.logits_of(out, *inputs.shape), inputs)
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
        line), an NNX model or one with variables besides params (not trained
        here yet), a vocab below `vocab_size` bytes, config fields that size
        our reference model, or an `auto:budget=` that cannot be planned.
    """
    from experiments import data

    set_fields = [f"config.{n}" for n in REFERENCE_FIELDS if config.get(n) is not None]
    if set_fields:
        raise BadInput(f"{', '.join(set_fields)} size the reference model; --model "
                       f"{config.model} brings its own sizes: drop them")
    try:
        label, make = user_model.load(config.model, config.get("block") or None)
        workload = make(config.batch_size, config.seq_len, mesh)
    except from_model.ModelError as e:
        raise BadInput(str(e)) from None
    except rk.UnknownModuleError as e:
        raise BadInput(f"--model {config.model!r}: {e}") from None
    model = getattr(make, "model", None)
    if model is None:
        raise BadInput(f"--model {config.model!r}: experiments.train trains a model; "
                       f"{label}(batch, seq) builds a Workload: give a function that "
                       "returns the linen module")
    if not isinstance(model, nn.Module):
        raise BadInput(f"--model {config.model!r}: experiments.train takes a linen model; "
                       f"{label} returned a {type(model).__name__} (NNX training is not "
                       "supported yet)")
    tokens = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    variables, out = jax.eval_shape(lambda t: model.init_with_output(jax.random.key(0), t)[::-1],
                                    tokens)
    other = sorted(set(variables) - {"params"})
    if other:
        raise BadInput(f"--model {config.model!r}: its variables {other} besides params are "
                       "not trained here yet; give a model with params only")
    vocab = from_model.logits_of(out, 1, config.seq_len).shape[-1]
    if vocab < data.VOCAB_SIZE:
        raise BadInput(f"--model {config.model!r}: its logits have vocab {vocab}; the data is "
                       f"bytes, one token per byte value: the model needs a vocab of at least "
                       f"{data.VOCAB_SIZE}")
    policy = parse(config.remat)  # RematSpecError: the caller's one line
    if isinstance(policy, AutoSpec):
        planned = rk.Planner(workload, cache=cache or None).plan(policy.budget)
        spec = " | ".join(planned.layer_specs) if planned.layer_specs else planned.spec
        return OwnModel(label, model, workload, planned, spec, vocab)
    return OwnModel(label, model, workload, config.remat, str(policy), vocab)


def describe(own: OwnModel, remat: str) -> str:
    """The run's "model:" line."""
    return (f"model: {own.label} ({type(own.model).__name__}, {own.workload.num_layers} "
            f"blocks, vocab {own.vocab}); remat={remat} (policy {own.spec})")


def check_line(compiled: dict, predicted: stepping.StepMemory) -> tuple[str, dict]:
    """The step-0 line comparing the compiled train step with the prediction,
    and the summary's entry. `compiled`: train's `_compiled_stats`. The run's
    step also holds its step counter and PRNG key, which the predicted step
    has not: in-use bytes differ by those, temp bytes do not."""
    entry = {"temp_size_in_bytes": predicted.temp_size_in_bytes,
             "step_bytes": predicted.total_bytes, "flops": predicted.flops,
             "temp_equal": compiled["temp_size_in_bytes"] == predicted.temp_size_in_bytes}
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.3f} MiB"  # noqa: E731
    line = (f"step 0: compiled train step temp {mib(compiled['temp_size_in_bytes'])}, in use "
            f"{mib(compiled['step_bytes'])}; predicted (remat_kit.decide.step, same policy "
            f"and shape) temp {mib(predicted.temp_size_in_bytes)}, in use "
            f"{mib(predicted.total_bytes)}: "
            + ("temp equal" if entry["temp_equal"] else "temp DIFFERS"))
    return line, entry


__all__ = ["OwnModel", "check_line", "describe", "is_own", "load"]
