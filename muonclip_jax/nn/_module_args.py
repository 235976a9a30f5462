"""What the Linen and NNX attention modules share: field checks and call arguments.

``MultiHeadLatentAttention``, ``GroupedQueryAttention`` and their NNX twins take the same
attention fields (``impl``, ``block_size``, ``rope_theta``, ``yarn``) and the same call
arguments (``positions``, ``segment_ids``, ``padding_mask``, ``mask``); this module checks
the former (``validate_common``) and turns the latter into ``attention``'s keyword
arguments (``mask_kwargs``).
"""

from __future__ import annotations

from typing import Callable

import jax

from .._util import check_bool, check_positive_int
from ._attention import ATTENTION_IMPLS
from ._rope import YarnScaling, default_positions

Initializer = Callable[..., jax.Array]


def validate_common(
    name: str,
    *,
    impl: str,
    block_size: int,
    rope_theta: float,
    yarn: YarnScaling | None,
    is_causal: bool,
    eager_sharding: bool | None = False,
) -> None:
  """Checks the fields shared by the attention modules.

  ValueError for a bad value; TypeError for a boolean field that is not a bool
  (``is_causal="False"`` would otherwise be truthy, hence causal).
  """
  check_bool(f"{name}: is_causal", is_causal)
  check_bool(f"{name}: eager_sharding", eager_sharding, allow_none=True)
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"{name}: impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  check_positive_int(f"{name}: block_size", block_size)
  if not (isinstance(rope_theta, (int, float)) and rope_theta > 1.0):
    raise ValueError(f"{name}: rope_theta must be a number > 1, got {rope_theta!r}")
  if yarn is not None and not isinstance(yarn, YarnScaling):
    raise ValueError(f"{name}: yarn must be a YarnScaling or None, got {type(yarn).__name__}")


def check_input(name: str, x: jax.Array) -> None:
  """ValueError unless ``x`` is ``(batch, seq, dim)``."""
  if x.ndim != 3:
    raise ValueError(f"{name}: expected x of shape (batch, seq, dim), got {x.shape}")


def mask_kwargs(x, *, positions, segment_ids, padding_mask, mask, is_causal) -> tuple[jax.Array, dict]:
  """Module call arguments -> (positions, keyword arguments of ``attention``).

  ``padding_mask`` ``(B, T)`` (True = real token) masks padded keys and padded queries;
  ``segment_ids`` ``(B, T)`` keeps attention inside each packed sequence; ``mask`` is a
  Flax-style boolean ``(B|1, H|1, T, T)`` mask; ``is_causal`` uses token indices, so packed
  sequences need ``segment_ids``. ``positions`` ``(B, T)`` only feed RoPE.
  """
  b, t = x.shape[:2]
  named = (positions, "positions"), (segment_ids, "segment_ids"), (padding_mask, "padding_mask")
  for arg, label in named:
    if arg is not None and tuple(arg.shape) != (b, t):
      raise ValueError(f"{label} must have shape {(b, t)} (batch, seq), got {tuple(arg.shape)}")
  if positions is None:
    positions = default_positions(b, t)
  kw = dict(
      is_causal=is_causal, mask=mask, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
      q_mask=padding_mask, kv_mask=padding_mask,
  )
  return positions, kw
