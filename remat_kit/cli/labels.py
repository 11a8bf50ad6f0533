"""Moved to `remat_kit.api.labels` (round 5): the front floor holds what the user typed and
the reports; this path works for one round, with a DeprecationWarning."""

from remat_kit.moved import moved

__getattr__ = moved(__name__, "remat_kit.api.labels")
