"""What the Linen and NNX attention modules share: field checks and call arguments.

``MultiHeadLatentAttention``, ``GroupedQueryAttention`` and their NNX twins take the same
attention fields (``impl``, ``block_size``, ``rope_theta``, ``yarn``) and the same call
arguments (``positions``, ``segment_ids``, ``padding_mask``, ``mask``); this module checks
the former (``validate_common``) and turns the latter into ``attention``'s keyword
arguments (``mask_kwargs``).

Renamed fields (``RENAMED_FIELDS``): ``causal`` is now ``is_causal`` and ``attention_impl``
is now ``impl``. The old spellings are still accepted for one release, with a
DeprecationWarning pointing at the caller's line; Linen takes them as trailing fields
(default None) that ``__post_init__`` moves over (``resolve_renamed_fields``), NNX as
keyword arguments (``renamed_fields``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax

from .._checks import check_bool, check_positive_int
from .._deprecation import renamed_value
from ._attention import ATTENTION_IMPLS
from ._rope import YarnScaling, default_positions

Initializer = Callable[..., jax.Array]

# (deprecated spelling, new spelling, the new field's default in every module)
RENAMED_FIELDS = (("causal", "is_causal", True), ("attention_impl", "impl", "auto"))


def renamed_fields(owner: str, given: Mapping[str, Any]) -> dict[str, Any]:
  """The renamed fields' values, ``{new name: value}``.

  ``given`` maps every old and new name of ``RENAMED_FIELDS`` to its value (None for an old
  name not passed). An old name that was passed wins, with a DeprecationWarning attributed to
  the user's line; a new name set to a different value too is
  a TypeError (see ``renamed_value``).
  """
  return {new: renamed_value(owner, old, new, old_value=given[old], new_value=given[new], new_default=default)
          for old, new, default in RENAMED_FIELDS}


def resolve_renamed_fields(module: Any) -> None:
  """For a Linen module's ``__post_init__``: moves each deprecated field to its new name.

  The deprecated fields are then cleared (None), so the clones Flax builds from the
  module's fields (``clone``, ``nn.scan``, ``nn.remat``, ``init``/``apply``) do not warn
  again: one warning per construction.
  """
  given = {name: getattr(module, name) for old, new, _ in RENAMED_FIELDS for name in (old, new)}
  for name, value in renamed_fields(type(module).__name__, given).items():
    object.__setattr__(module, name, value)
  for old, _, _ in RENAMED_FIELDS:
    object.__setattr__(module, old, None)


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
