"""Parameter layouts of the reference transformer: looped (one subtree per layer) and scanned
(one subtree, leaves stacked on a leading layer axis).

Looped: params["layers_0"], ..., params["layers_{L-1}"]; scanned: params["layers"]["layer"],
leaves [L, ...]. `stack_layers` and `unstack_layers` convert, keeping every other entry and the
logical "layers" axis name of boxed parameters, so a checkpoint of one loads into the other.
Docs: docs/scan.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_kit.models.config import TransformerConfig


_STACK = ("layers", "layer")
_BOX = lambda a: isinstance(a, nn.LogicallyPartitioned)


def _layer_map(fn, *trees):
    """fn over the leaves of trees of arrays or of logically partitioned boxes."""
    def one(*leaves):
        value, names = fn(*(getattr(a, "value", a) for a in leaves))
        return leaves[0].replace(value=value, names=names(leaves[0].names)) if _BOX(
            leaves[0]) else value
    return jax.tree.map(one, *trees, is_leaf=_BOX)


def _check_scanned(cfg: TransformerConfig) -> None:
    if not cfg.scan_layers:
        raise ValueError("the config describes a looped stack (scan_layers=False); pass the "
                         "config of the scanned model")


def _missing(params: Mapping, keys, what: str) -> ValueError:
    return ValueError(f"params have no {what} {'/'.join(keys)}; top-level keys: "
                      f"{sorted(params) if isinstance(params, Mapping) else type(params)}")


def unstack_layers(params: Mapping, cfg: TransformerConfig) -> dict:
    """Scanned parameters -> the looped layout (layers_0 .. layers_{L-1}).

    Args:
      params: the "params" collection of `Transformer(cfg)`.
      cfg: the scanned model's config (scan_layers=True).
    Returns:
      A new dict; layer i's leaves are the stacked leaves at index i.
    Raises:
      ValueError: cfg is not scanned, or params lack the stacked subtree.
    """
    _check_scanned(cfg)
    if not isinstance(params.get("layers"), Mapping) or "layer" not in params["layers"]:
        raise _missing(params, _STACK, "scanned subtree")
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers_{i}": _layer_map(lambda a, i=i: (a[i], lambda n: n[1:]),
                                          params["layers"]["layer"])
                for i in range(cfg.num_layers)})
    return out


def stack_layers(params: Mapping, cfg: TransformerConfig) -> dict:
    """Looped parameters (layers_0 .. layers_{L-1}) -> the scanned layout of `cfg`.

    The inverse of `unstack_layers`.

    Raises:
      ValueError: cfg is not scanned, or params lack a layers_i entry.
    """
    _check_scanned(cfg)
    names = [f"layers_{i}" for i in range(cfg.num_layers)]
    if any(n not in params for n in names):
        raise _missing(params, names[:1], f"{cfg.num_layers} layers like")
    out = {k: v for k, v in params.items() if k not in names}
    out["layers"] = {"layer": _layer_map(lambda *xs: (jnp.stack(xs), lambda n: ("layers",) + n),
                                         *[params[n] for n in names])}
    return out


__all__ = ["stack_layers", "unstack_layers"]
