"""Llama 3.2 1B shapes (`llama_1b`, untied output layer: 1.50e9 parameters) sized
for one TPU v5e chip (16 GiB of HBM).

bfloat16 weights, activations and AdamW moments (optax keeps the moments in
the parameters' dtype), and the layers as one `nn.scan`, as MaxText runs them.
In float32 the weights, their gradients and the AdamW moments alone take
1.50e9 x 16 bytes = 22.3 GiB, more than the chip holds, so the float32 model
needs several chips (fsdp) whatever the remat policy.

The README's fit table for one v5e chip comes from (ahead-of-time XLA:TPU
compiles, no TPU needed):

    remat-kit fit --config experiments/configs/llama_1b_v5e.py --budget 16GiB \
        --vary seq --target tpu:v5e:1x1
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    """The tiny config with llama_1b's sizes and vocabulary, in bfloat16, scanned."""
    config = tiny.get_config()
    config.model = "llama_1b"
    config.vocab_size = 128256
    config.dtype = "bfloat16"
    config.param_dtype = "bfloat16"
    config.scan_layers = True
    config.remat = "full"
    config.batch_size = 1
    config.seq_len = 4096
    return config
