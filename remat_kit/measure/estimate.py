"""Closed-form activation-memory estimates for one transformer layer, in bytes per device.

Source: Korthikanti et al. 2022, arXiv 2205.05198, Sections 4.1-5 and Table 2.
Main names: `layer_terms` (`ActivationTerms`, term by term), `per_layer`, `model_total`, and
one function per Table 2 row (`no_parallelism`, `tensor_parallel`, `selective_recompute`, ...).
The rows, notation and where JAX differs: docs/compare.md ("The Korthikanti estimate").
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Real
from typing import Union

Bytes = Union[int, float]

METHODS = ("none", "selective", "full")
_LAYER_KWARGS = ("bytes_per_elem", "mask_bytes", "dropout")

__all__ = [
    "METHODS",
    "ActivationTerms",
    "layer_terms",
    "no_parallelism",
    "tensor_parallel",
    "tensor_sequence_parallel",
    "selective_recompute",
    "full_recompute",
    "per_layer",
    "model_total",
]


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _check_pos_int(name: str, value) -> None:
    # bool is an int subclass; True as a batch size is almost surely a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _common_divisors(*ns: int) -> list[int]:
    g = math.gcd(*ns)
    return [d for d in range(1, g + 1) if g % d == 0]


def _check_t(t, h: int, a: int | None = None) -> None:
    _check_pos_int("t", t)
    dims = {"h": h} if a is None else {"a": a, "h": h}
    for dim_name, dim in dims.items():
        if dim % t:
            valid = _common_divisors(*dims.values())
            raise ValueError(
                f"t={t} must divide {dim_name}={dim} (tensor parallelism splits "
                f"{'heads' if dim_name == 'a' else 'the hidden size'} evenly); "
                f"valid t: {valid}"
            )


def _check_bytes(name: str, value, *, allow_zero: bool) -> None:
    bad = isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)
    if bad or value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {need} number of bytes, got {value!r}")


def _check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(
            f"unknown method {method!r}; valid choices: {', '.join(map(repr, METHODS))}"
        )


def _check_layer_kwargs(kw: dict) -> None:
    unknown = sorted(set(kw) - set(_LAYER_KWARGS))
    if unknown:
        # An unexpected keyword is a TypeError in Python; keep that convention.
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}; valid: {list(_LAYER_KWARGS)}"
        )


# --------------------------------------------------------------------------
# Term-by-term breakdown
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ActivationTerms:
    """Bytes stored for backward by one transformer layer on one device.

    Each field is one tensor from Section 4.1 of Korthikanti et al. 2022. The
    comment gives the paper's coefficient with 16-bit activations, 1-byte
    masks, no parallelism; under tensor parallelism the terms marked [t] are
    split across the t devices, the others are replicated (the paper's "10")
    unless sequence parallelism also splits them.
    """

    # Attention block: 11sbh + 5as²b.
    qkv_input: Bytes              # 2sbh   input to the fused QKV linear
    qk_inputs: Bytes              # 4sbh   [t] Q and K, inputs to QK^T
    softmax_output: Bytes         # 2as²b  [t] needed by softmax backward
    attn_dropout_mask: Bytes      # as²b   [t] mask on attention probabilities
    attn_dropout_output: Bytes    # 2as²b  [t] input to attention-over-V
    values: Bytes                 # 2sbh   [t] V, the other input to attention-over-V
    out_proj_input: Bytes         # 2sbh   [t] input to the output projection
    attn_out_dropout_mask: Bytes  # sbh    mask after the output projection
    # MLP block: 19sbh.
    fc1_input: Bytes              # 2sbh   input to the h -> 4h linear
    gelu_input: Bytes             # 8sbh   [t] 4h-wide GeLU input
    fc2_input: Bytes              # 8sbh   [t] 4h-wide input to the 4h -> h linear
    mlp_dropout_mask: Bytes       # sbh    mask after the MLP
    # Layer norms: 4sbh.
    ln1_input: Bytes              # 2sbh   input to the pre-attention norm
    ln2_input: Bytes              # 2sbh   input to the pre-MLP norm

    @property
    def attention_core(self) -> Bytes:
        """The 5as²b part (softmax output, its dropout mask and output).

        This is what selective recompute (Section 5) discards and recomputes.
        """
        return self.softmax_output + self.attn_dropout_mask + self.attn_dropout_output

    @property
    def attention(self) -> Bytes:
        """Attention block, bytes: 11sbh + 5as²b with paper defaults."""
        return (self.qkv_input + self.qk_inputs + self.values + self.out_proj_input
                + self.attn_out_dropout_mask + self.attention_core)

    @property
    def mlp(self) -> Bytes:
        """MLP block, bytes: 19sbh with paper defaults."""
        return self.fc1_input + self.gelu_input + self.fc2_input + self.mlp_dropout_mask

    @property
    def layernorm(self) -> Bytes:
        """Both layer norms, bytes: 4sbh with paper defaults."""
        return self.ln1_input + self.ln2_input

    @property
    def total(self) -> Bytes:
        """Whole layer, bytes: sbh(34 + 5as/h) with paper defaults, no parallelism."""
        return self.attention + self.mlp + self.layernorm

    def without_attention_core(self) -> "ActivationTerms":
        """The same layer under selective recompute: attention-core terms set to 0."""
        zero = 0 * self.softmax_output  # keeps int/float type consistent
        return dataclasses.replace(
            self, softmax_output=zero, attn_dropout_mask=zero, attn_dropout_output=zero
        )

    def as_dict(self) -> dict[str, Bytes]:
        """Field name -> bytes, in layer order."""
        return dataclasses.asdict(self)


def layer_terms(s: int, b: int, h: int, a: int, t: int = 1, *,
                sequence_parallel: bool = False, bytes_per_elem: Real = 2,
                mask_bytes: Real = 1, dropout: bool = True) -> ActivationTerms:
    """Per-tensor activation bytes of one GPT layer, per device, no recompute.

    Korthikanti et al. 2022, Section 4.1 (terms) and Section 4.2 (tensor and
    sequence parallelism). The sum `.total` equals
    Table 2 rows "no parallelism", "tensor parallel" and "tensor + sequence
    parallel" with the defaults.

    Args:
      s, b, h, a: sequence length, micro-batch, hidden size, heads (positive ints).
      t: tensor-parallel size; must divide both a and h.
      sequence_parallel: also split the replicated terms (norms, dropout
        masks, the linear inputs gathered from them) along s across the t
        devices, so every term is divided by t.
      bytes_per_elem: bytes per activation element (paper: 2; f32: 4).
      mask_bytes: bytes per dropout-mask element (paper: 1; bool in JAX is 1;
        0 models masks regenerated from the RNG key).
      dropout: if False, drop the three mask terms and `attn_dropout_output`:
        without dropout, attention-over-V reads the softmax output, which is
        already stored for the softmax backward, so no separate copy exists.
        With defaults that leaves sbh(32 + 2as/h).

    Returns:
      ActivationTerms in bytes; ints if both byte sizes are ints, else floats.

    Raises:
      ValueError: non-positive or non-int s, b, h, a, t; t not dividing a or h;
        negative or non-numeric byte sizes.
    """
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a)):
        _check_pos_int(name, value)
    _check_t(t, h, a)
    _check_bytes("bytes_per_elem", bytes_per_elem, allow_zero=False)
    _check_bytes("mask_bytes", mask_bytes, allow_zero=True)

    # Element counts, all exact because t | h and t | a.
    split_sbh = s * b * (h // t)                        # tensor-parallel split
    rep_sbh = split_sbh if sequence_parallel else s * b * h  # replicated unless SP
    split_as2b = (a // t) * s * s * b                   # heads are split under TP

    act, mask = bytes_per_elem, mask_bytes
    # Multiplying by 0 (not writing 0) keeps the int/float type of the result.
    keep = 1 if dropout else 0
    return ActivationTerms(
        qkv_input=rep_sbh * act,
        qk_inputs=2 * split_sbh * act,
        softmax_output=split_as2b * act,
        attn_dropout_mask=keep * split_as2b * mask,
        attn_dropout_output=keep * split_as2b * act,
        values=split_sbh * act,
        out_proj_input=split_sbh * act,
        attn_out_dropout_mask=keep * rep_sbh * mask,
        fc1_input=rep_sbh * act,
        gelu_input=4 * split_sbh * act,
        fc2_input=4 * split_sbh * act,
        mlp_dropout_mask=keep * rep_sbh * mask,
        ln1_input=rep_sbh * act,
        ln2_input=rep_sbh * act,
    )


# --------------------------------------------------------------------------
# Table 2 rows
# --------------------------------------------------------------------------

def no_parallelism(s: int, b: int, h: int, a: int, *, bytes_per_elem: Real = 2,
                   mask_bytes: Real = 1, dropout: bool = True) -> Bytes:
    """Activation bytes per layer without parallelism or recompute.

    Korthikanti et al. 2022, Section 4.1 / Table 2 row "no parallelism":
    sbh(34 + 5as/h). Keyword arguments and errors as in `layer_terms`.
    """
    return layer_terms(s, b, h, a, 1, bytes_per_elem=bytes_per_elem,
                       mask_bytes=mask_bytes, dropout=dropout).total


def tensor_parallel(s: int, b: int, h: int, a: int, t: int, *,
                    bytes_per_elem: Real = 2, mask_bytes: Real = 1,
                    dropout: bool = True) -> Bytes:
    """Activation bytes per layer per device with tensor parallelism of size t.

    Korthikanti et al. 2022, Section 4.2 / Table 2 row "tensor parallel":
    sbh(10 + 24/t + 5as/(ht)). The 10sbh (norm inputs, QKV and fc1 inputs,
    two dropout masks) is replicated on every device. Raises ValueError if t
    does not divide a and h; other arguments as in `layer_terms`.
    """
    return layer_terms(s, b, h, a, t, bytes_per_elem=bytes_per_elem,
                       mask_bytes=mask_bytes, dropout=dropout).total


def tensor_sequence_parallel(s: int, b: int, h: int, a: int, t: int, *,
                             bytes_per_elem: Real = 2, mask_bytes: Real = 1,
                             dropout: bool = True) -> Bytes:
    """Activation bytes per layer per device, tensor + sequence parallel.

    Korthikanti et al. 2022, Section 4.2 / Table 2 row "tensor + sequence
    parallel": sbh(34/t + 5as/(ht)), i.e. the no-parallelism figure divided
    by t. Arguments and errors as in `tensor_parallel`.
    """
    return layer_terms(s, b, h, a, t, sequence_parallel=True,
                       bytes_per_elem=bytes_per_elem, mask_bytes=mask_bytes,
                       dropout=dropout).total


def selective_recompute(s: int, b: int, h: int, a: int, t: int = 1,
                        sequence_parallel: bool = False, *,
                        bytes_per_elem: Real = 2, mask_bytes: Real = 1,
                        dropout: bool = True) -> Bytes:
    """Activation bytes per layer per device with selective recompute.

    Korthikanti et al. 2022, Section 5 / Table 2 rows "tensor parallel +
    selective" sbh(10 + 24/t) and "tensor + sequence parallel + selective"
    sbh(34/t): the 5as²b attention core (softmax output, its dropout mask
    and output) is recomputed in backward, the rest is stored. With t=1 this
    is 34sbh. The output and MLP dropout masks remain, so `mask_bytes` and
    `dropout` still matter. Errors as in `layer_terms`.
    """
    return layer_terms(s, b, h, a, t, sequence_parallel=sequence_parallel,
                       bytes_per_elem=bytes_per_elem, mask_bytes=mask_bytes,
                       dropout=dropout).without_attention_core().total


def full_recompute(s: int, b: int, h: int, t: int = 1,
                   sequence_parallel: bool = False, *,
                   bytes_per_elem: Real = 2) -> Bytes:
    """Activation bytes per layer per device with full recompute.

    Korthikanti et al. 2022, Table 2 row "full recompute": 2sbh, only the
    layer input is kept. Under tensor parallelism the input is replicated
    (still 2sbh); with sequence parallelism it is split along s, giving
    2sbh/t (Section 5). Raises ValueError on non-positive ints, t not
    dividing h, or a bad `bytes_per_elem`.
    """
    for name, value in (("s", s), ("b", b), ("h", h)):
        _check_pos_int(name, value)
    _check_t(t, h)
    _check_bytes("bytes_per_elem", bytes_per_elem, allow_zero=False)
    rep_sbh = s * b * (h // t) if sequence_parallel else s * b * h
    return rep_sbh * bytes_per_elem


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------

def per_layer(method: str, s: int, b: int, h: int, a: int, t: int = 1,
              sequence_parallel: bool = False, **kw) -> Bytes:
    """Activation bytes per layer per device for a recompute `method`.

    method: "none" (Table 2 rows 1-3, chosen by t and sequence_parallel),
    "selective" (rows 4-5) or "full" (row 6); see Korthikanti et al. 2022.
    `kw` may hold `bytes_per_elem`, `mask_bytes`, `dropout` (see
    `layer_terms`); all are validated even where a method ignores them.

    Raises:
      ValueError: unknown method (message lists the valid ones) or any bad
        value accepted by `layer_terms`.
      TypeError: an unknown keyword argument.
    """
    _check_method(method)
    _check_layer_kwargs(kw)
    # Validate everything up front, so "full" rejects a bad `a` too.
    terms = layer_terms(s, b, h, a, t, sequence_parallel=sequence_parallel, **kw)
    if method == "none":
        return terms.total
    if method == "selective":
        return terms.without_attention_core().total
    return full_recompute(s, b, h, t, sequence_parallel,
                          bytes_per_elem=kw.get("bytes_per_elem", 2))


def model_total(method: str, s: int, b: int, h: int, a: int, L: int, t: int = 1,
                sequence_parallel: bool = False, **kw) -> Bytes:
    """Activation bytes for L layers on one device: L * `per_layer(...)`.

    Korthikanti et al. 2022, Table 2 rows (per layer) multiplied by L, e.g.
    sbhL(34 + 5as/h) with no parallelism. Excludes embeddings, final norm,
    logits and loss, and pipeline-parallel schedules. Raises ValueError for
    a non-positive L and as `per_layer` otherwise.
    """
    _check_pos_int("L", L)
    return L * per_layer(method, s, b, h, a, t, sequence_parallel, **kw)
