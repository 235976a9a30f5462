"""Capture adapters: Flax attention functions and sowing of max logits."""

from .flax_attention import dot_product_attention
from .flax_weights import dot_product_attention_weights
from .gemma import capture_gemma
from .sow import capturing, sow_head_max, sow_max_logits
from .tunix import capture_tunix, tunix_layout
from .tunix_trainer import capture_tunix_trainer

__all__ = [
    "capture_gemma", "capture_tunix", "capture_tunix_trainer", "capturing", "dot_product_attention", "dot_product_attention_weights", "sow_head_max", "sow_max_logits",
    "tunix_layout",
]
