"""MaxText's own pipelined decoder, for `remat-kit compare/explain/plan --model`.

    remat-kit compare --model benchmarks/maxtext_pipeline.py:model --batch 8 --seq 512 \\
        --target tpu:v5p:2x2x1 --policies none,full,minimal --wide

MaxText 0.2.5's llama2 decoder (4 layers, emb 128, MLP 512, 4 heads of 32, vocab 256,
seq 512, bf16 activations) with `ici_pipeline_parallelism=4` and
`num_pipeline_microbatches=4` (one layer a stage, its `pipeline.py` with its own remat per
iteration), its mesh built over the 4 chips of tpu:v5p:2x2x1 (compiled ahead of time, no TPU
needed), as /work/shared/recipes/maxtext.md builds it. `MT_PP=1` gives the same decoder
with the 4 chips as fsdp instead, for comparison. Needs maxtext 0.2.5 (`pip install
--no-deps maxtext==0.2.5` in a scratch environment, see benchmarks/vs_estimator.py) and
`ALLOW_MULTIPLE_LIBTPU_LOAD=1`. Each TPU compile is one to two minutes of CPU here.
Figures: docs/models.md ("Pipelines").
"""

import os

import jax.numpy as jnp
from flax import nnx

PP = int(os.environ.get("MT_PP", "4"))
TARGET = "tpu:v5p:2x2x1"


def config():
    """MaxText's config for the decoder above (MaxText sizes its global batch by this
    host's devices: 8 a device on one CPU device)."""
    import maxtext
    from maxtext.configs import pyconfig
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    layout = (dict(ici_pipeline_parallelism=PP, num_pipeline_microbatches=4,
                   ici_fsdp_parallelism=1) if PP > 1 else dict(ici_fsdp_parallelism=4))
    return pyconfig.initialize(
        [None, base], run_name="pipeline", model_name="default", decoder_block="llama2",
        hardware="tpu", attention="dot_product", scan_layers=True, remat_policy="full",
        base_num_decoder_layers=4, base_emb_dim=128, base_mlp_dim=512,
        base_num_query_heads=4, base_num_kv_heads=4, head_dim=32, vocab_size=256,
        per_device_batch_size=8, max_target_length=512, dtype="bfloat16",
        dataset_type="synthetic", enable_checkpointing=False,
        skip_jax_distributed_system=True, **layout)


class TokensToLogits(nnx.Module):
    """MaxText's Transformer called as tokens [batch, seq] -> logits."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        segments = jnp.ones((b, t), jnp.int32)
        return self.inner(tokens, positions, decoder_segment_ids=segments,
                          enable_dropout=False)


def model():
    """The abstract decoder on its mesh over the target's chips."""
    from maxtext.utils import maxtext_utils, model_creation_utils

    from remat_kit.measure import targets
    cfg = config()
    mesh = maxtext_utils.get_mesh_from_config(cfg, targets.devices(TARGET))
    _, abstract = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
    return TokensToLogits(abstract)
