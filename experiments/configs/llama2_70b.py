"""Llama 2 70B shapes (Touvron et al. 2023: 80 layers, d8192, 64 query / 8 kv heads of
128, MLP 28672, vocab 32000), bfloat16, layers scanned: the 70B-shaped config of issue
49's `fit` benchmark (`benchmarks/plan_speed.py`, case c), compiled ahead of time for a
TPU v5p slice:

    remat-kit fit --config experiments/configs/llama2_70b.py --batch 64 --budget 95GiB \
        --vary seq --policies full --target tpu:v5p:4x4x4 --mesh fsdp:16,tensor:4
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    """The tiny config with Llama 2 70B's sizes, in bfloat16, scanned."""
    config = tiny.get_config()
    config.model = "llama_1b"
    config.vocab_size = 32000
    config.num_layers = 80
    config.d_model = 8192
    config.num_heads = 64
    config.num_kv_heads = 8
    config.head_dim = 128
    config.mlp_dim = 28672
    config.dtype = "bfloat16"
    config.param_dtype = "bfloat16"
    config.scan_layers = True
    config.remat = "full"
    config.batch_size = 64
    config.seq_len = 4096
    return config
