"""Reference tagged decoder-only transformers (GPT-2 and Llama families)."""

from remat_kit.models.config import CONFIGS, TransformerConfig, from_config_dict, get_config
from remat_kit.models.layout import stack_layers, unstack_layers
from remat_kit.models.transformer import (DecoderLayer, Transformer, lm_loss, make_loss_fn)
from remat_kit.models.program import workload

__all__ = ["CONFIGS", "DecoderLayer", "Transformer", "TransformerConfig", "from_config_dict",
           "get_config", "lm_loss", "make_loss_fn", "stack_layers", "unstack_layers", "workload"]
