"""Attention implementations that also return each head's max logit."""

from .auto import resolve_impl
from .chunked import chunked_attention
from .dense import dense_attention
from .dpa_max import dpa_max_attention
from .masking import head_max
from .soft_cap import check_soft_cap, soft_cap
from .splash import splash_attention
from .tokamax_gpu import tokamax_gpu_attention

__all__ = [
    "check_soft_cap", "chunked_attention", "dense_attention", "dpa_max_attention", "head_max", "resolve_impl",
    "soft_cap", "splash_attention", "tokamax_gpu_attention",
]
