"""Parameter layouts of the reference transformer: looped (one subtree per layer) and scanned
(one subtree, leaves stacked on a leading layer axis).

Looped: params["layers_0"], ..., params["layers_{L-1}"], for every schedule.
Scanned (`scan_layers=True`): params["layers"]["layer"], leaves [L, ...]; under
the nested schedule params["layers"]["group"]["layer"], leaves [L/g, g, ...].
Both converters keep every other entry (embeddings, final norm, lm_head)
as is, so a checkpoint of one layout loads into the other model.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from remat_kit.models.config import TransformerConfig


def _stack_keys(cfg: TransformerConfig) -> tuple[str, ...]:
    if not cfg.scan_layers:
        raise ValueError("the config describes a looped stack (scan_layers=False); pass the "
                         "config of the scanned model")
    nested = cfg.policy.schedule.group_size(cfg.num_layers) > 1
    return ("layers", "group", "layer") if nested else ("layers", "layer")


def _missing(params: Mapping, keys, what: str) -> ValueError:
    return ValueError(f"params have no {what} {'/'.join(keys)}; top-level keys: "
                      f"{sorted(params) if isinstance(params, Mapping) else type(params)}")


def unstack_layers(params: Mapping, cfg: TransformerConfig) -> dict:
    """Scanned parameters -> the looped layout (layers_0 .. layers_{L-1}).

    Args:
      params: the "params" collection of `Transformer(cfg)`.
      cfg: the scanned model's config (scan_layers=True); its schedule says
        whether the stack is nested.
    Returns:
      A new dict; layer i's leaves are the stacked leaves at index i
      (row-major over [groups, group size] when nested).
    Raises:
      ValueError: cfg is not scanned, or params lack the stacked subtree.
    """
    keys = _stack_keys(cfg)
    stacked = params
    for k in keys:
        if not isinstance(stacked, Mapping) or k not in stacked:
            raise _missing(params, keys, "scanned subtree")
        stacked = stacked[k]
    flat = jax.tree.map(lambda a: a.reshape((cfg.num_layers,) + a.shape[len(keys) - 1:]),
                        stacked)
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], flat)
                for i in range(cfg.num_layers)})
    return out


def stack_layers(params: Mapping, cfg: TransformerConfig) -> dict:
    """Looped parameters (layers_0 .. layers_{L-1}) -> the scanned layout of `cfg`.

    The inverse of `unstack_layers`.

    Raises:
      ValueError: cfg is not scanned, or params lack a layers_i entry.
    """
    keys = _stack_keys(cfg)
    names = [f"layers_{i}" for i in range(cfg.num_layers)]
    if any(n not in params for n in names):
        raise _missing(params, names[:1], f"{cfg.num_layers} layers like")
    size = cfg.policy.schedule.group_size(cfg.num_layers)
    lead = (cfg.num_layers,) if len(keys) == 2 else (cfg.num_layers // size, size)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape(lead + xs[0].shape),
                           *[params[n] for n in names])
    for k in reversed(keys[1:]):
        stacked = {k: stacked}
    out = {k: v for k, v in params.items() if k not in names}
    out["layers"] = stacked
    return out


__all__ = ["stack_layers", "unstack_layers"]
