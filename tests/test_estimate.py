"""Tests for remat_kit.measure.estimate against Korthikanti et al. 2022 (arXiv 2205.05198).

Expected values are written out independently of the module: closed forms
from Table 2 and coefficients from Section 4.1, evaluated on GPT-3-175B-like
shapes (s=2048, b=1, h=12288, a=96, t=8).
"""

from __future__ import annotations

import dataclasses

import pytest

from remat_kit.measure import estimate as est

S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H            # 25_165_824
AS2B = A * S * S * B       # 402_653_184


# ---------------------------------------------------------------- no parallelism

def test_no_parallelism_matches_closed_form():
    expected = SBH * (34 + 5 * A * S / H)          # Table 2 row 1
    got = est.no_parallelism(S, B, H, A)
    assert got == expected
    assert got == 2_868_903_936                    # 2.67 GiB per layer
    assert isinstance(got, int)


@pytest.mark.parametrize("field, coeff_sbh, coeff_as2b", [
    # Section 4.1, 16-bit activations, 1-byte masks.
    ("qkv_input", 2, 0),
    ("qk_inputs", 4, 0),
    ("softmax_output", 0, 2),
    ("attn_dropout_mask", 0, 1),
    ("attn_dropout_output", 0, 2),
    ("values", 2, 0),
    ("out_proj_input", 2, 0),
    ("attn_out_dropout_mask", 1, 0),
    ("fc1_input", 2, 0),
    ("gelu_input", 8, 0),
    ("fc2_input", 8, 0),
    ("mlp_dropout_mask", 1, 0),
    ("ln1_input", 2, 0),
    ("ln2_input", 2, 0),
])
def test_each_term_is_paper_coefficient(field, coeff_sbh, coeff_as2b):
    terms = est.layer_terms(S, B, H, A)
    assert getattr(terms, field) == coeff_sbh * SBH + coeff_as2b * AS2B


def test_block_subtotals():
    terms = est.layer_terms(S, B, H, A)
    assert terms.attention == 11 * SBH + 5 * AS2B
    assert terms.attention_core == 5 * AS2B
    assert terms.mlp == 19 * SBH
    assert terms.layernorm == 4 * SBH


def test_terms_sum_to_total_and_closed_form():
    terms = est.layer_terms(S, B, H, A)
    assert sum(terms.as_dict().values()) == terms.total == 34 * SBH + 5 * AS2B
    assert len(terms.as_dict()) == 14


def test_terms_are_frozen():
    terms = est.layer_terms(S, B, H, A)
    with pytest.raises(dataclasses.FrozenInstanceError):
        terms.qkv_input = 0


# ---------------------------------------------------------------- parallel rows

def test_tensor_parallel_t8():
    expected = SBH * (10 + 24 / T + 5 * A * S / (H * T))   # Table 2 row 2
    got = est.tensor_parallel(S, B, H, A, T)
    assert got == expected == 578_813_952
    assert isinstance(got, int)


def test_tensor_parallel_replicated_and_split_terms():
    terms = est.layer_terms(S, B, H, A, T)
    # The paper's "10": terms tensor parallelism leaves replicated.
    replicated = (terms.qkv_input + terms.attn_out_dropout_mask + terms.fc1_input
                  + terms.mlp_dropout_mask + terms.ln1_input + terms.ln2_input)
    assert replicated == 10 * SBH
    assert terms.gelu_input == 8 * SBH // T
    assert terms.softmax_output == 2 * AS2B // T


def test_tensor_parallel_t1_equals_no_parallelism():
    assert est.tensor_parallel(S, B, H, A, 1) == est.no_parallelism(S, B, H, A)
    assert est.tensor_sequence_parallel(S, B, H, A, 1) == est.no_parallelism(S, B, H, A)


def test_tensor_sequence_parallel_t8():
    expected = SBH * (34 / T + 5 * A * S / (H * T))        # Table 2 row 3
    got = est.tensor_sequence_parallel(S, B, H, A, T)
    assert got == expected == 358_612_992
    assert got * T == est.no_parallelism(S, B, H, A)
    # Sequence parallelism splits every term, not just the total.
    full = est.layer_terms(S, B, H, A).as_dict()
    split = est.layer_terms(S, B, H, A, T, sequence_parallel=True).as_dict()
    assert {k: v * T for k, v in split.items()} == full


# ---------------------------------------------------------------- recompute rows

def test_selective_no_parallelism_is_34sbh():
    assert est.selective_recompute(S, B, H, A) == 34 * SBH == 855_638_016


def test_selective_tensor_parallel():
    expected = SBH * (10 + 24 / T)                           # Table 2 row 4
    assert est.selective_recompute(S, B, H, A, T) == expected == 327_155_712


def test_selective_tensor_sequence_parallel():
    expected = SBH * 34 / T                                  # Table 2 row 5
    got = est.selective_recompute(S, B, H, A, T, sequence_parallel=True)
    assert got == expected == 106_954_752


def test_selective_drops_exactly_attention_core():
    terms = est.layer_terms(S, B, H, A, T)
    sel = terms.without_attention_core()
    assert terms.total - sel.total == 5 * AS2B // T
    assert (sel.softmax_output, sel.attn_dropout_mask, sel.attn_dropout_output) == (0, 0, 0)
    assert sel.qk_inputs == terms.qk_inputs  # Q, K kept: recompute needs them


def test_full_recompute():
    assert est.full_recompute(S, B, H) == 2 * SBH == 50_331_648     # Table 2 row 6
    assert est.full_recompute(S, B, H, T) == 2 * SBH                 # input replicated
    assert est.full_recompute(S, B, H, T, sequence_parallel=True) == 2 * SBH // T


# ---------------------------------------------------------------- dispatch and totals

@pytest.mark.parametrize("method, t, sp, expected", [
    ("none", 1, False, 2_868_903_936),
    ("none", T, False, 578_813_952),
    ("none", T, True, 358_612_992),
    ("selective", 1, False, 855_638_016),
    ("selective", T, False, 327_155_712),
    ("selective", T, True, 106_954_752),
    ("full", 1, False, 50_331_648),
    ("full", T, False, 50_331_648),
    ("full", T, True, 6_291_456),
])
def test_per_layer_dispatch(method, t, sp, expected):
    assert est.per_layer(method, S, B, H, A, t, sp) == expected


def test_model_total_multiplies_by_layers():
    L = 96
    assert est.model_total("none", S, B, H, A, L) == L * SBH * (34 + 5 * A * S / H)
    assert est.model_total("selective", S, B, H, A, L, T, sequence_parallel=True) \
        == L * 34 * SBH // T
    assert est.model_total("full", S, B, H, A, L) == 96 * 50_331_648


# ---------------------------------------------------------------- generalizations

def test_f32_doubles_activations_not_masks():
    f32 = est.layer_terms(S, B, H, A, bytes_per_elem=4)
    # 16-bit total is 34sbh + 5as²b with 2sbh + as²b of 1-byte masks;
    # f32 doubles the other 32sbh + 4as²b.
    assert f32.total == 66 * SBH + 9 * AS2B
    assert f32.attn_dropout_mask == AS2B
    assert f32.softmax_output == 4 * AS2B
    assert est.no_parallelism(S, B, H, A, bytes_per_elem=4) == f32.total
    assert est.full_recompute(S, B, H, bytes_per_elem=4) == 4 * SBH
    assert est.per_layer("selective", S, B, H, A, bytes_per_elem=4) == 66 * SBH


def test_mask_bytes():
    assert est.no_parallelism(S, B, H, A, mask_bytes=0) == 32 * SBH + 4 * AS2B
    packed = est.no_parallelism(S, B, H, A, mask_bytes=0.125)  # bit-packed masks
    assert isinstance(packed, float)
    assert packed == 32 * SBH + 4 * AS2B + 0.125 * (2 * SBH + AS2B)


def test_no_dropout():
    terms = est.layer_terms(S, B, H, A, dropout=False)
    assert terms.total == 32 * SBH + 2 * AS2B
    assert terms.attn_dropout_output == 0 and terms.mlp_dropout_mask == 0
    assert isinstance(terms.total, int)
    assert est.selective_recompute(S, B, H, A, dropout=False) == 32 * SBH


def test_small_shapes_by_hand():
    # s=4, b=2, h=8, a=2: sbh=64, as²b=64 -> 34*64 + 5*64 = 2496.
    assert est.no_parallelism(4, 2, 8, 2) == 2496
    # t=2: 10*64 + 24*64/2 + 5*64/2 = 640 + 768 + 160.
    assert est.tensor_parallel(4, 2, 8, 2, 2) == 1568


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, match", [
    (dict(s=0), r"s must be a positive int, got 0"),
    (dict(b=-1), r"b must be a positive int, got -1"),
    (dict(h=12288.0), r"h must be a positive int, got 12288\.0"),
    (dict(a=True), r"a must be a positive int, got True"),
])
def test_bad_dims(kwargs, match):
    args = dict(s=S, b=B, h=H, a=A) | kwargs
    with pytest.raises(ValueError, match=match):
        est.no_parallelism(**args)


def test_t_must_divide_a_and_h():
    with pytest.raises(ValueError, match=r"t=5 must divide a=96.*valid t: \[1, 2, 3, 4, 6, 8"):
        est.tensor_parallel(S, B, H, A, 5)
    with pytest.raises(ValueError, match=r"t=16 must divide a=24"):
        est.tensor_parallel(S, B, 4096, 24, 16)
    with pytest.raises(ValueError, match=r"t=7 must divide h=12288"):
        est.full_recompute(S, B, H, 7)
    with pytest.raises(ValueError, match=r"t must be a positive int, got 0"):
        est.selective_recompute(S, B, H, A, 0)


def test_unknown_method():
    with pytest.raises(ValueError, match=r"unknown method 'partial'.*'none', 'selective', 'full'"):
        est.per_layer("partial", S, B, H, A)
    with pytest.raises(ValueError, match=r"unknown method 'Full'"):
        est.model_total("Full", S, B, H, A, 4)


def test_bad_bytes_and_layers():
    with pytest.raises(ValueError, match=r"bytes_per_elem must be a positive number of bytes, got 0"):
        est.no_parallelism(S, B, H, A, bytes_per_elem=0)
    with pytest.raises(ValueError, match=r"mask_bytes must be a non-negative .* got -1"):
        est.no_parallelism(S, B, H, A, mask_bytes=-1)
    with pytest.raises(ValueError, match=r"L must be a positive int, got 0"):
        est.model_total("none", S, B, H, A, 0)


def test_full_method_still_validates_a():
    with pytest.raises(ValueError, match=r"a must be a positive int, got 0"):
        est.per_layer("full", S, B, H, 0)


def test_unknown_keyword():
    with pytest.raises(TypeError, match=r"bytes_per_element"):
        est.per_layer("none", S, B, H, A, bytes_per_element=4)
