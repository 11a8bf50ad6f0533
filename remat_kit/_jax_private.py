"""Every import from jax._src, in one place, behind version checks.

JAX's public API has `print_saved_residuals` but no function that *returns*
the saved residuals; `jax._src.ad_checkpoint.saved_residuals` does. If a JAX
release moves it, only this module changes.
"""

from __future__ import annotations

import jax

_MIN, _MAX = (0, 12), (0, 13)
_version = tuple(int(p) for p in jax.__version__.split(".")[:2])
if not _MIN <= _version < _MAX:
    raise ImportError(f"remat_kit needs jax >= {_MIN[0]}.{_MIN[1]} and < {_MAX[0]}.{_MAX[1]} "
                      f"(it reads jax._src.ad_checkpoint.saved_residuals); found {jax.__version__}")

from jax._src.ad_checkpoint import saved_residuals  # noqa: E402

__all__ = ["saved_residuals"]
