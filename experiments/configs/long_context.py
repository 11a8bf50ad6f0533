"""Long context within a memory budget: `tiny` at seq_len 512 under selective remat,
where no remat does not fit the declared 96 MiB per device.

    python -m experiments.train --config=experiments/configs/long_context.py \
        --workdir=runs/long_context

The sizes come from the fit command (XLA CPU compile, batch 4, AdamW):

    remat-kit fit --config tiny --budget 96MiB --vary seq --batch 4 \
        --policies none,selective,full

which finds seq 384 for none, 640 for selective and 512 for full. Before the first step the run
checks its compiled train step against memory_budget and refuses, with the numbers, if it
is over: this run's step (AdamW with clipping) holds 64.2 MiB under selective and would
hold 131.4 MiB under --config.remat=none, which is refused.
"""

import ml_collections

from experiments.configs import tiny


def get_config() -> ml_collections.ConfigDict:
    """The tiny config at seq_len 512 with a 96 MiB budget, under selective remat."""
    config = tiny.get_config()
    config.seq_len = 512
    config.batch_size = 4
    config.remat = "selective"
    config.memory_budget = "96MiB"
    config.num_steps = 60
    config.warmup_steps = 6  # at most num_steps: lower both for a shorter run
    config.eval_every = 20
    config.log_every = 10
    config.checkpoint_every = 20
    return config
