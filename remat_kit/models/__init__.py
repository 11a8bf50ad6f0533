"""models: our reference tagged decoder-only transformers (GPT-2 and Llama families), one provider
of a `Workload` among others (`program.workload`), beside `flax`.
May import: `remat_kit.flax` (the chunked loss), `remat_kit.trace` and every part below them;
`measure` and `decide` never import it.
Public names: `TransformerConfig`, `get_config`, `CONFIGS`, `from_config_dict`, `Transformer`,
`DecoderLayer`, `lm_loss`, `make_loss_fn`, `stack_layers`, `unstack_layers`, `workload`.
Where it sits: docs/architecture.md; scanned stacks: docs/scan.md.
"""

from remat_kit.models.config import CONFIGS, TransformerConfig, from_config_dict, get_config
from remat_kit.models.layout import stack_layers, unstack_layers
from remat_kit.models.transformer import (DecoderLayer, Transformer, lm_loss, make_loss_fn)
from remat_kit.models.program import workload

__all__ = ["CONFIGS", "DecoderLayer", "Transformer", "TransformerConfig", "from_config_dict",
           "get_config", "lm_loss", "make_loss_fn", "stack_layers", "unstack_layers", "workload"]
