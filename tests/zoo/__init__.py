"""Language models written the way model libraries write them, not the way ours is.

Each module's `make(batch, seq)` returns (model, params, forward) at tiny size
with random init: forward(params, tokens int32 [batch, seq]) -> logits float32
[batch, seq, vocab]. `nano_moe` wraps a real third-party model from PyPI
(`nano-moe-jax`, pinned in requirements.txt).
"""
