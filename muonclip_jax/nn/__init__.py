"""Flax attention modules that report per-head max logits for QK-Clip."""
