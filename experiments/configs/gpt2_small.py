"""GPT-2 small shapes (124M parameters with the 50257 vocab; 86M with bytes) under
MaxText's `minimal` policy, at GPT-2's context of 1024 bytes. Sized for an
accelerator; on a CPU, shrink it with overrides such as --config.num_steps.

python -m experiments.train --config=experiments/configs/gpt2_small.py --workdir=runs/gpt2
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    """The tiny config with GPT-2 small sizes and a longer schedule."""
    config = tiny.get_config()
    config.model = "gpt2_small"
    config.remat = "minimal"
    config.dropout_rate = 0.1
    config.seq_len = 1024
    config.batch_size = 8
    config.num_steps = 20_000
    config.learning_rate = 6e-4
    config.warmup_steps = 1_000
    config.log_every = 50
    config.eval_every = 1_000
    config.eval_batches = 16
    config.checkpoint_every = 1_000
    return config
