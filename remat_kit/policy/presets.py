"""The named presets: every codebase's remat policy names, as specs in the clause language.

One table, `PRESET_TABLE` (codebase, name, spec, meaning), drives every preset; bare names
resolve through `BARE_NAMES`, a codebase prefix picks one where two codebases share a word;
`JAX_NAME_FUNCTIONS` are JAX's policy factories that take tag names.
Sources: jax.checkpoint_policies, MaxText remat_policy, Praxis AutodiffCheckpointType, Levanter,
Megatron-LM, Korthikanti et al. 2022, Chen et al. 2016. The table: docs/policies.md.
"""

from __future__ import annotations

_QKV = "query_proj,key_proj,value_proj,kv_proj,qkv_proj"
# MaxText names its MoE gate and down matmuls both `mlpwi_0`/`mlpwo` and `moe_mlpwi_0`/
# `moe_mlpwo`, its up matmul only `moe_mlpwi_1` (layers/moe.py, sparse path), so its presets
# that save mlpwi_0 or mlpwo save those experts' too, and never the up matmul's.
_MINIMAL = f"{_QKV},out_proj,mlpwi,mlpwi_0,mlpwi_1,mlpwo,moe_mlpwi_0,moe_mlpwo"

# (codebase, name, spec, source / meaning). Specs use only the clause language.
PRESET_TABLE: tuple[tuple[str, str, str, str], ...] = (
    ("remat_kit", "none", "none", "no remat wrapper at all; every residual is kept"),
    ("remat_kit", "full", "full", "recompute everything; save only the layer inputs"),
    ("remat_kit", "everything", "everything", "remat wrapper that saves every residual"),
    ("remat_kit", "dots", "dots", "save every dot_general/conv output (JAX dots_saveable)"),
    ("remat_kit", "dots_no_batch", "dots_no_batch",
     "save dot_general outputs without batch dims (JAX dots_with_no_batch_dims_saveable)"),
    ("remat_kit", "selective", "recompute:attn_logits,attn_probs",
     "Korthikanti et al. 2022 selective recompute: recompute attention scores and "
     "softmax, save every other tag (Megatron-LM --recompute-granularity selective)"),
    ("remat_kit", "nested", "full@nested",
     "Chen et al. 2016 sqrt(N): groups of ~sqrt(L) layers rematerialized whole, full remat "
     "inside; `nested:G` sets the group size (see Layer schedules)"),
    # JAX jax.checkpoint_policies (jax/_src/ad_checkpoint.py)
    ("jax", "nothing_saveable", "full", "JAX nothing_saveable"),
    ("jax", "everything_saveable", "everything", "JAX everything_saveable"),
    ("jax", "dots_saveable", "dots", "JAX dots_saveable"),
    ("jax", "checkpoint_dots", "dots", "JAX checkpoint_dots (= dots_saveable)"),
    ("jax", "dots_with_no_batch_dims_saveable", "dots_no_batch",
     "JAX dots_with_no_batch_dims_saveable"),
    ("jax", "checkpoint_dots_with_no_batch_dims", "dots_no_batch",
     "JAX checkpoint_dots_with_no_batch_dims"),
    # MaxText remat_policy (MaxText/layers/decoders.py)
    ("maxtext", "full", "full", "MaxText: save nothing"),
    ("maxtext", "minimal", f"save:{_MINIMAL}", "MaxText: save q/k/v, out_proj and MLP matmuls"),
    ("maxtext", "minimal_with_context", f"save:{_MINIMAL},context", "MaxText: minimal + context"),
    ("maxtext", "save_dot_with_context_except_mlp", f"save:{_QKV},context,out_proj",
     "MaxText: attention matmuls and context"),
    ("maxtext", "save_dot_except_mlpwi", f"save:{_QKV},out_proj,mlpwo,moe_mlpwo",
     "MaxText: all matmuls but the MLP input"),
    ("maxtext", "save_dot_except_mlp", f"save:{_QKV},out_proj", "MaxText: attention matmuls"),
    ("maxtext", "save_qkv_proj", f"save:{_QKV}", "MaxText: q/k/v projections"),
    ("maxtext", "save_out_proj", "save:out_proj", "MaxText: attention output projection"),
    ("maxtext", "qkv_proj_offloaded", "offload:query_proj,key_proj,value_proj,kv_proj",
     "MaxText: offload q/k/v to pinned host, save nothing"),
    ("maxtext", "minimal_offloaded", f"offload:{_MINIMAL}", "MaxText: offload the minimal set"),
    # Praxis AutodiffCheckpointType (praxis/layers/checkpoint_policy.py)
    ("praxis", "save_nothing", "full", "Praxis SAVE_NOTHING"),
    ("praxis", "save_everything", "everything", "Praxis SAVE_EVERYTHING"),
    ("praxis", "save_dot_only", "dots", "Praxis SAVE_DOT_ONLY"),
    ("praxis", "save_dot_with_no_batch_dims", "dots_no_batch",
     "Praxis SAVE_DOT_WITH_NO_BATCH_DIM"),
    ("praxis", "save_qkv_out_proj", "save:query_proj,key_proj,value_proj,qkv_proj,out_proj",
     "Praxis SAVE_QKV_OUT_PROJ"),
    ("praxis", "save_out_proj", "save:out_proj", "Praxis SAVE_OUT_PROJ"),
    ("praxis", "save_context", "save:context", "Praxis SAVE_CONTEXT"),
    ("praxis", "save_encoded_and_out_proj", "save:context,out_proj",
     "Praxis SAVE_ENCODED_AND_OUT_PROJ"),
    ("praxis", "save_dot_except_logits_ffn1",
     "save:query_proj,key_proj,value_proj,qkv_proj,context,out_proj,mlpwo",
     "Praxis SAVE_DOT_EXCEPT_LOGITS_FFN1"),
    ("praxis", "save_dot_except_logits",
     "save:query_proj,key_proj,value_proj,qkv_proj,context,out_proj,mlpwi,mlpwo",
     "Praxis SAVE_DOT_EXCEPT_LOGITS"),
    ("praxis", "save_transformer_layer_output", "save:decoder_layer_output",
     "Praxis SAVE_TRANSFORMER_LAYER_OUTPUT"),
    # Levanter gradient_checkpointing (levanter/grad_accum & haliax ScanCheckpointPolicy)
    ("levanter", "true", "full", "Levanter gradient_checkpointing=true"),
    ("levanter", "false", "none", "Levanter gradient_checkpointing=false"),
    ("levanter", "full", "full", "Levanter 'full'"),
    ("levanter", "recompute", "full", "Levanter 'recompute'"),
    ("levanter", "save_all", "everything", "Levanter 'save_all'"),
    ("levanter", "offload", "offload:decoder_layer_input",
     "Levanter 'offload': layer inputs (scan carries) to host, recompute the rest"),
    ("levanter", "nested", "full@nested",
     "Levanter 'nested': sqrt(N) nested scan checkpointing (haliax ScanCheckpointPolicy)"),
    # Megatron-LM --recompute-granularity
    ("megatron", "selective", "recompute:attn_logits,attn_probs",
     "Megatron-LM --recompute-granularity selective"),
    ("megatron", "full", "full", "Megatron-LM --recompute-granularity full"),
)

PRESETS: dict[tuple[str, str], tuple[str, str]] = {
    (cb, name): (spec, doc) for cb, name, spec, doc in PRESET_TABLE}
CODEBASES = tuple(dict.fromkeys(cb for cb, *_ in PRESET_TABLE))

# A bare word means the first codebase in CODEBASES order that defines it.
BARE_NAMES: dict[str, tuple[str, str]] = {}
for _cb, _name, *_ in PRESET_TABLE:
    BARE_NAMES.setdefault(_name, (_cb, _name))
BARE_NAMES["recompute"] = ("levanter", "recompute")

# JAX policy factories that take tag names: name -> clauses they become.
JAX_NAME_FUNCTIONS = {
    "save_only_these_names": "save:{}",
    "save_any_names_but_these": "save:*;recompute:{}",
    "save_anything_except_these_names": "everything;recompute:{}",
}


__all__ = ["BARE_NAMES", "CODEBASES", "JAX_NAME_FUNCTIONS", "PRESETS", "PRESET_TABLE"]
