"""Max logits from a flash kernel's per-row softmax residuals.

A flash-attention kernel keeps, for each head ``h`` and query row ``i``, the running
maximum ``m_hi`` of the softmax inputs it has seen (Dao et al., arXiv 2205.14135,
Alg. 1). Once every key block is seen and the kernel rescales on every new maximum, it
is the row's max logit in the kernel's own units. Maintained kernels differ in those
units, and this module turns them into QK-Clip's ``max_j s_hij`` (Kimi K2,
arXiv 2507.20534, Sec. 2.1):

* scale: the logit is ``softmax_scale * q.k``. Kernels that take the scale (tokamax's
  ``logits_scale``) or that we feed pre-scaled queries return it in logit units already.
* base 2: a kernel that computes ``exp2`` keeps ``m * log2(e)``; ``log2_units=True``
  divides by ``log2(e)`` (tokamax's Triton op with ``use_base2=True`` does not divide;
  its splash kernel and Mosaic GPU op do, so theirs are already natural units).
* masked rows: a kernel masks with a large finite negative value (splash:
  ``-0.7 * float32 max``; tokamax's XLA and Triton ops: ``float32 min``), so a row with
  no visible key reports that value, not ``-inf``. Any residual at or below
  ``masked_at`` becomes ``-inf``. ``masked_at`` must lie above every mask value and
  below every logit; ``-1e37`` does both (a real logit of that size overflows the
  softmax anyway).
* soft-capping: a kernel that caps logits as ``c * tanh(s / c)`` before the maximum
  reports the capped maximum. ``tanh`` is increasing, so the pre-cap maximum is
  ``c * artanh(m / c)``, but in float32 ``tanh`` saturates to 1 for ``s / c`` above
  about 9 and loses digits well before: the inversion is not offered; callers raise.

All conversions are elementwise, keep shape, and return float32 under ``stop_gradient``;
``_impl.masking.head_max`` then reduces the rows to the per-head maxima.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
MASKED_AT = -1e37


def row_max_from_residual(m: jax.Array, *, log2_units: bool = False,
                          masked_at: float = MASKED_AT) -> jax.Array:
  """Per-row max logits (natural units, ``-inf`` for rows without a visible key)."""
  m = jax.lax.stop_gradient(jnp.asarray(m, jnp.float32))
  natural = m / jnp.float32(LOG2E) if log2_units else m
  return jnp.where(m <= jnp.float32(masked_at), -jnp.inf, natural)

