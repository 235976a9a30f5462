"""A tiny MLA language model and a repetitive byte batch for the optimizer tests."""

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from mla_lm import MATRIX_AXES as matrix_axes  # noqa: E402
from mla_lm import LMConfig, init_params, make_loss_fn  # noqa: E402

CFG = LMConfig(dim=32, num_layers=2, num_heads=2, q_lora_rank=16, kv_lora_rank=16,
               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mlp_dim=64)
_TEXT = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 4, np.uint8)
# Two alternating batches of 4 sequences of 16+1 bytes: easy to memorize, so Muon at a high
# learning rate drives the attention logits up within a few steps.
BATCHES = [jnp.asarray(np.stack([_TEXT[i:i + 17] for i in range(o, o + 4)]), jnp.int32) for o in (0, 7)]

__all__ = ["CFG", "BATCHES", "init_params", "make_loss_fn", "matrix_axes"]
