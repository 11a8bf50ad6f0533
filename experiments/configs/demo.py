"""The `make demo` run: a small Llama on the standard library's Python sources, under
selective remat, in about 2 to 4 minutes on 2 CPU cores, to under 2 nats/byte.

python -m experiments.train --config=experiments/configs/demo.py --workdir=runs/demo
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    """The tiny config with demo sizes and schedule."""
    config = tiny.get_config()
    # Llama (RoPE, SwiGLU) reached a given loss in about half the FLOPs of GPT-2
    # at this size on this corpus, so the demo uses it.
    config.model = "tiny_llama"
    config.num_layers = 3
    config.d_model = 128
    config.num_heads = 4
    config.num_kv_heads = 2
    config.mlp_dim = 384
    config.remat = "selective"
    config.seq_len = 128
    config.batch_size = 32
    config.num_steps = 250
    config.learning_rate = 3e-3
    config.warmup_steps = 25
    config.log_every = 10
    config.eval_every = 50
    config.eval_batches = 8
    config.checkpoint_every = 50
    return config
