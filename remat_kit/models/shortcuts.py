"""Moved to `remat_kit.api.configs` (round 5): the answers for a reference config are
the front floor's. This path works for one round, with a DeprecationWarning."""

from remat_kit.moved import moved

__getattr__ = moved(__name__, "remat_kit.api.configs")
