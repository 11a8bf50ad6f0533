"""Seconds-long run of the `tiny` GPT-2 model, for smoke tests and quick checks.

python -m experiments.train --config=experiments/configs/tiny.py --workdir=runs/tiny
"""

import ml_collections
from ml_collections import config_dict

from experiments import data


def get_config() -> ml_collections.ConfigDict:
    """The training config; every field is overridable as --config.FIELD=VALUE."""
    config = ml_collections.ConfigDict()
    # Model (remat_kit.models.from_config_dict): a name from remat_kit.models.CONFIGS,
    # then overrides (None keeps the named config's value); max_len is seq_len.
    config.model = "tiny"
    config.vocab_size = data.VOCAB_SIZE  # byte-level: one token per byte value
    config.num_layers = config_dict.placeholder(int)
    config.d_model = config_dict.placeholder(int)
    config.num_heads = config_dict.placeholder(int)
    config.num_kv_heads = config_dict.placeholder(int)
    config.mlp_dim = config_dict.placeholder(int)
    config.dtype = "float32"
    config.dropout_rate = 0.0
    # Remat policy spec (see remat_kit.parse), e.g. none, full, selective, minimal.
    config.remat = "selective"

    # Data: "" = the running Python's standard-library .py files; else a text
    # file or a folder of text files.
    config.data = ""
    config.seq_len = 64
    config.batch_size = 8

    # Optimizer: AdamW, linear warmup then cosine decay, global-norm clipping.
    config.num_steps = 20
    config.learning_rate = 3e-3
    config.warmup_steps = 5
    config.end_lr_fraction = 0.1
    config.weight_decay = 0.1
    config.b1 = 0.9
    config.b2 = 0.95
    config.grad_clip_norm = 1.0

    config.log_every = 1
    config.eval_every = 10
    config.eval_batches = 2
    config.seed = 0

    # Checkpoints (orbax) in workdir/checkpoints: every checkpoint_every steps and
    # at the end, keeping the last keep_checkpoints. A second start with the same
    # workdir resumes from the latest.
    config.checkpoint_every = 10
    config.keep_checkpoints = 3
    config.tensorboard = False  # also write workdir/tensorboard (tensorboardX)
    # Testing aid: after this step (0 = never), finish the checkpoint writes and
    # wait for a signal, as a run pre-empted at a known step.
    config.hang_after_step = 0
    # Device memory per device the compiled train step may hold ("" = no limit),
    # e.g. "96MiB": checked before the first step (nothing enforces it on a CPU).
    config.memory_budget = ""

    # Sharding (remat_kit.mesh): "" = one device; else e.g. "data:2,fsdp:2,tensor:2",
    # whose product is the number of devices of all processes.
    config.mesh = ""
    # Multi-process (jax.distributed): coordinator "HOST:PORT" of process 0; ""
    # reads JAX_COORDINATOR_ADDRESS, and runs one process when that is unset too.
    config.coordinator = ""
    config.num_processes = 1
    config.process_id = 0
    config.distributed_timeout = 300  # seconds to wait for the coordinator and peers
    return config
