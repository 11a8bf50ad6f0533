"""Reference tagged decoder-only transformers (GPT-2 and Llama families)."""

from remat_kit.models.config import CONFIGS, TransformerConfig, get_config
from remat_kit.models.transformer import (DecoderLayer, Transformer, lm_loss, make_loss_fn)

__all__ = ["CONFIGS", "DecoderLayer", "Transformer", "TransformerConfig", "get_config",
           "lm_loss", "make_loss_fn"]
