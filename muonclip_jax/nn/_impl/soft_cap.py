"""Logit soft-capping (Gemma 2): ``cap * tanh(s / cap)`` before the softmax.

QK-Clip counts the logit *before* the cap: the cap hides the growth of ``q . k`` but does not
stop it, and a maximum taken after it never exceeds ``cap``, so the clip would never see
the growth it exists to stop (at a threshold at or above the cap) or would act on a
saturated number (below it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_soft_cap(cap, impl: str, where: str) -> None:
  """ValueError unless ``cap`` is None or a positive Python number, and ``impl`` supports it."""
  if cap is None:
    return
  if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or cap == float("inf"):
    raise ValueError(f"{where}: logits_soft_cap must be None or a positive finite Python number (static), got {cap!r}")
  if impl not in ("dense", "splash", "auto"):  # "auto" resolves to one that takes the cap
    raise ValueError(f"{where}: logits_soft_cap is supported only with impl='dense' (and 'splash' without max "
                     f"logits) so far, got impl={impl!r}: the other kernels' online softmax keeps no pre-cap "
                     "maximum yet")


def soft_cap(s: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(s / cap)`` (Gemma 2's logit soft-capping), keeping ``-inf`` (masked) as ``-inf``."""
  if cap is None:
    return s
  c = jnp.float32(cap)
  return jnp.where(jnp.isneginf(s), s, c * jnp.tanh(s / c))
