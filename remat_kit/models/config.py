"""`TransformerConfig` and the named reference configs.
Docs: docs/training.md ("Training config fields"), docs/scan.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from remat_kit.errors import RematSpecError, closest_choice
from remat_kit.flax.chunked_loss import check_chunks
from remat_kit.policy.policy import Policy
from remat_kit.policy.spec import layer_policies, per_layer
from remat_kit.policy.spec import AutoSpec, parse

FAMILIES = ("gpt2", "llama")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of a decoder-only transformer.

    Attributes:
      family: "gpt2" (LayerNorm, GELU MLP, learned positions, multi-head
        attention, tied embeddings; Radford et al. 2019) or "llama" (RMSNorm,
        RoPE, SwiGLU MLP, grouped-query attention; Touvron et al. 2023).
      vocab_size: number of token ids.
      num_layers: decoder layers.
      d_model: residual stream width (embed).
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention); None = num_heads.
      head_dim: per-head width; None = d_model // num_heads.
      mlp_dim: MLP hidden width.
      max_len: longest sequence; the size of GPT-2's position table.
      dtype: activation dtype name ("float32", "bfloat16", "float16").
      param_dtype: parameter dtype name.
      dropout_rate: dropout on attention probabilities and on both residual
        branches; 0 turns dropout off.
      remat: a policy spec string (see `remat_kit.parse`) or a `Policy`; a
        per-layer spec as `plan` prints it ('0 save:mlpwi / 1 full') sets
        `layer_remat` instead (remat becomes "none").
        Each layer runs under `nn.remat(..., policy=policy.to_jax())` unless
        it is "none". A layer schedule suffix (`full@every:2`,
        `selective@first:4`, `nested`, `full@nested:4`; see
        `remat_kit.policy.schedule`) picks the layers, or nests them in groups.
      layer_remat: one spec or Policy per layer (no schedules), for any
        per-layer pattern; empty = use `remat`. Needs remat="none" and
        scan_layers=False.
      scan_layers: run the layer stack as one `nn.scan` (parameters stacked
        on a leading layer axis) instead of a Python loop. Takes the
        uniform and nested schedules (nested: a scan over groups of a scan
        over layers; parameters stacked [num_layers, ...] either way).
      vocab_chunks: compute the training loss (`make_loss_fn`) over this many
        vocabulary slices, one at a time, recomputed in the backward pass, so
        the float32 logits [batch, seq, vocab] and their gradient never exist
        whole (`remat_kit.flax.chunked_loss`; MaxText's `num_vocab_tiling` is
        the same idea over tokens); 1 = the plain loss. Must divide vocab_size.
      rope_theta: RoPE base frequency (llama).
      norm_eps: epsilon of LayerNorm / RMSNorm.

    Raises:
      TypeError: a field has the wrong type; the message names the field.
      ValueError: a field has a bad value (unknown family or dtype,
        non-positive size, heads or vocab_chunks that do not divide, a layer schedule that
        does not fit num_layers or scan_layers, a layer_remat list of the
        wrong length).
      RematSpecError: `remat` is not a valid spec.
    """

    family: str = "gpt2"
    vocab_size: int = 256
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int = 256
    max_len: int = 128
    dtype: str = "float32"
    param_dtype: str = "float32"
    dropout_rate: float = 0.0
    remat: str | Policy = "none"
    layer_remat: tuple[str | Policy, ...] = ()
    scan_layers: bool = False
    vocab_chunks: int = 1
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if isinstance(self.layer_remat, list):  # from a config file or flag
            object.__setattr__(self, "layer_remat", tuple(self.layer_remat))
        try:  # a per-layer plan as `plan` prints it, pasted as --config.remat=
            layers = per_layer(self.remat) if isinstance(self.remat, str) else None
        except RematSpecError as e:
            raise RematSpecError(f"TransformerConfig.remat: {e.message}", spec=e.spec,
                                 token=e.token) from None
        if layers is not None and not self.layer_remat:
            object.__setattr__(self, "layer_remat", layers)
            object.__setattr__(self, "remat", "none")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {"str": str, "int": int, "float": (int, float), "bool": bool,
                        "int | None": (int, type(None)), "str | Policy": (str, Policy),
                        "tuple[str | Policy, ...]": tuple}[f.type]
            bad_bool = isinstance(value, bool) and f.type in ("int", "int | None", "float")
            if bad_bool or not isinstance(value, expected):
                raise TypeError(f"TransformerConfig.{f.name} must be {f.type}, "
                                f"got {type(value).__name__} {value!r}")
        _choice("family", self.family, FAMILIES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "mlp_dim", "max_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive, "
                                 f"got {getattr(self, name)}")
        try:
            check_chunks(self.vocab_chunks, self.vocab_size)
        except ValueError as e:
            raise ValueError(f"TransformerConfig.vocab_chunks: {e}") from None
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig.{name} must be positive or None, "
                                 f"got {getattr(self, name)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"TransformerConfig.num_heads={self.num_heads} must be a multiple "
                             f"of num_kv_heads={self.kv_heads}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"TransformerConfig.d_model={self.d_model} is not divisible by "
                             f"num_heads={self.num_heads}; set head_dim")
        if self.family == "llama" and self.heads_dim % 2:
            raise ValueError(f"TransformerConfig: RoPE (llama) needs an even head_dim, got "
                             f"{self.heads_dim} (d_model={self.d_model}, "
                             f"num_heads={self.num_heads}); set head_dim")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"TransformerConfig.dropout_rate must be in [0, 1), "
                             f"got {self.dropout_rate}")
        try:
            policy = parse(self.remat)  # once, here: `policy` hands the value on
            object.__setattr__(self, "_policy", policy)
            if isinstance(policy, AutoSpec):
                # Planned for known shapes before the model is built (remat_kit.decide.plan).
                if self.layer_remat:
                    raise ValueError("TransformerConfig.layer_remat needs remat='none', got "
                                     f"{str(policy)!r}")
                return
            layer_policies(self.layer_remat or policy, self.num_layers)
        except RematSpecError as e:
            field = "layer_remat" if self.layer_remat else "remat"
            raise RematSpecError(f"TransformerConfig.{field}: {e.message}", spec=e.spec,
                                 token=e.token, position=e.position, choices=e.choices) from None
        except ValueError as e:
            raise ValueError(f"TransformerConfig: {e}") from None
        if self.layer_remat and (policy.remat or self.scan_layers):
            raise ValueError("TransformerConfig.layer_remat gives each layer its own policy; "
                             f"it needs remat='none' (got {str(policy)!r}) and "
                             f"scan_layers=False (got {self.scan_layers})")
        if self.scan_layers and policy.schedule.kind in ("every", "first"):
            raise ValueError(f"TransformerConfig: layer schedule {policy.schedule} needs "
                             "scan_layers=False: one nn.scan body runs every layer under one "
                             "policy; scanned stacks take the uniform and nested schedules")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def heads_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def policy(self) -> Policy:
        """The parsed remat policy. Raises RematSpecError for an auto:budget= spec
        not yet planned for this model's shapes (`remat_kit.api.configs.resolve_config`)."""
        policy = self._policy  # parsed by __post_init__
        if isinstance(policy, AutoSpec):
            policy.to_jax()  # raises, naming how to resolve it
        return policy

    @property
    def layer_policies(self) -> tuple[Policy, ...]:
        """The policy of each layer, schedules applied (`schedule.layer_policies`)."""
        return layer_policies(self.layer_remat or self.policy, self.num_layers)

    @property
    def activation_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with `changes`; unknown field names raise TypeError naming them."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown TransformerConfig field(s) {sorted(unknown)}; valid: "
                            f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest_choice(value, choices)
        raise ValueError(f"TransformerConfig.{field}={value!r} is not one of {list(choices)}"
                         + (f"; did you mean {hint!r}?" if hint else ""))


CONFIGS: dict[str, TransformerConfig] = {
    # For tests: a forward and backward pass in well under a second on a CPU.
    "tiny": TransformerConfig(family="gpt2", vocab_size=256, num_layers=2, d_model=64,
                              num_heads=4, mlp_dim=256, max_len=128),
    "tiny_llama": TransformerConfig(family="llama", vocab_size=256, num_layers=2, d_model=64,
                                    num_heads=4, num_kv_heads=2, mlp_dim=192, max_len=128),
    # GPT-2 small, 124M parameters (Radford et al. 2019).
    "gpt2_small": TransformerConfig(family="gpt2", vocab_size=50257, num_layers=12,
                                    d_model=768, num_heads=12, mlp_dim=3072, max_len=1024),
    # Llama 3.2 1B shapes (Meta, 2024): 16 layers, d2048, 32 query / 8 kv heads.
    "llama_1b": TransformerConfig(family="llama", vocab_size=128256, num_layers=16,
                                  d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                                  mlp_dim=8192, max_len=131072, rope_theta=500_000.0),
}


def get_config(name: str, **overrides) -> TransformerConfig:
    """A named config from CONFIGS, with field `overrides`.

    >>> import remat_kit as rk
    >>> cfg = rk.models.get_config("tiny", num_layers=2)
    >>> cfg.family, cfg.num_layers, cfg.d_model
    ('gpt2', 2, 64)

    Raises:
      KeyError: unknown name; the message lists the names and the closest one.
    """
    if not isinstance(name, str) or name not in CONFIGS:
        hint = closest_choice(name, tuple(CONFIGS)) if isinstance(name, str) else None
        raise KeyError(f"unknown model config {name!r}; valid: {', '.join(CONFIGS)}"
                       + (f"; did you mean {hint!r}?" if hint else ""))
    return CONFIGS[name].replace(**overrides) if overrides else CONFIGS[name]


def from_config_dict(config, **overrides) -> TransformerConfig:
    """The model an experiment config describes, as in experiments/configs/*.py.

    Both `experiments.train` (the model it trains) and `remat-kit compare
    --config FILE.py` (the model it measures) build their model here, so the
    two agree.

    Args:
      config: a Mapping or an ml_collections ConfigDict (anything with `in`
        and `[]`). `model` (required) names the base config in `CONFIGS`.
        Every field named like a `TransformerConfig` field (vocab_size,
        num_layers, d_model, dtype, dropout_rate, remat, ...) and not None
        overrides the base. `seq_len`, if set and not None, becomes max_len
        unless `max_len` is set. Other fields (data, batch_size,
        learning_rate, ...) are not the model's and are ignored.
      overrides: TransformerConfig fields applied last, e.g. remat="none".
    Raises:
      KeyError: `model` names no config in CONFIGS (the message lists them).
      ValueError: no `model` field, seq_len not positive, or a field with a
        bad value (the message names the field).
      TypeError: a field of the wrong type, or an override that is not a
        TransformerConfig field (the message names it).
      RematSpecError: `remat` is not a valid spec.
    """
    if "model" not in config or config["model"] is None:
        raise ValueError(f"the config has no 'model' field; set it to one of {list(CONFIGS)}")
    if not isinstance(config["model"], str):
        raise TypeError(f"config field 'model' must be a str naming one of {list(CONFIGS)}, "
                        f"got {config['model']!r}")
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    changes = {f: config[f] for f in sorted(fields) if f in config and config[f] is not None}
    seq_len = config["seq_len"] if "seq_len" in config else None
    if seq_len is not None and "max_len" not in changes:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"config field 'seq_len' (the model's max_len) must be a positive "
                             f"int, got {seq_len!r}")
        changes["max_len"] = seq_len
    return get_config(config["model"], **{**changes, **overrides})
