"""Runnable research scripts for remat_kit, driven by ml_collections config files and absl flags."""
