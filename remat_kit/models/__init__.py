"""models: our reference tagged decoder-only transformers (GPT-2 and Llama families), one
provider of a `Workload` among others (`program.workload`), and the answers for a
config (`shortcuts`: `rk.measure_config`, `rk.layer_residuals`, `rk.fit` and
`rk.step_memory` on a `TransformerConfig`, `config_planner`, `resolve_config`).

May import: `remat_kit.decide`, `remat_kit.measure` and every part below them (the
shortcuts alone use decide and measure; the models themselves use the policy language
and the mesh rules). Nothing below this part imports it.

Public names: `TransformerConfig`, `get_config`, `CONFIGS`, `from_config_dict`,
`Transformer`, `DecoderLayer`, `lm_loss`, `make_loss_fn`, `stack_layers`,
`unstack_layers`, `workload`.
"""

from remat_kit.models.config import CONFIGS, TransformerConfig, from_config_dict, get_config
from remat_kit.models.layout import stack_layers, unstack_layers
from remat_kit.models.transformer import (DecoderLayer, Transformer, lm_loss, make_loss_fn)
from remat_kit.models.program import workload

__all__ = ["CONFIGS", "DecoderLayer", "Transformer", "TransformerConfig", "from_config_dict",
           "get_config", "lm_loss", "make_loss_fn", "stack_layers", "unstack_layers", "workload"]
