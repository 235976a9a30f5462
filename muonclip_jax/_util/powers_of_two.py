"""Powers of two read from a float's exponent bits: exact scales for the iteration and the momentum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def power_of_two_below(a: jax.Array, t: int, lo: int, hi: int) -> jax.Array:
  """``2^clamp(t - k, lo, hi)`` for ``a = f 2^k``, ``f`` in [1/2, 1) (``frexp``'s ``k``): the
  largest power of two ``c`` with ``a c < 2^t``, for a finite ``a > 0`` of a normal exponent, kept
  within ``[2^lo, 2^hi]``, in ``a``'s dtype. ``a`` must not be negative (its sign bit would be read
  as part of the exponent): the callers pass largest magnitudes and norms.

  Read from ``a``'s exponent bits (biased exponent ``E``: ``k = E - bias + 1``), by a handful of
  integer operations where ``frexp`` and ``ldexp`` take a few dozen (they handle subnormals, which
  no caller needs exactly). A zero or subnormal ``a`` has ``E = 0``, read as ``k = 1 - bias`` (the
  smallest normal's); an inf or NaN has ``E = 2 bias + 1``, read as ``k = bias + 2``. ``[lo, hi]``
  lies within ``[1 - bias, bias]``: the result is a normal power of two, and multiplying by it is
  exact (but where the product underflows).
  """
  info = jnp.finfo(a.dtype)
  bias, itype = info.maxexp - 1, np.dtype(f"int{info.bits}")
  if not 1 - bias <= lo <= hi <= bias:
    raise ValueError(f"power_of_two_below needs 1 - bias <= lo <= hi <= bias (bias {bias} for {a.dtype}), got "
                     f"lo={lo}, hi={hi}")
  const = lambda v: np.asarray(v, itype)  # noqa: E731
  biased = lax.shift_right_logical(lax.bitcast_convert_type(a, itype), const(info.nmant))
  # c's biased exponent: t - k + bias = t - biased + 2 bias - 1
  ec = lax.clamp(const(lo + bias), lax.sub(const(t - 1 + 2 * bias), biased), const(hi + bias))
  return lax.bitcast_convert_type(lax.shift_left(ec, const(info.nmant)), a.dtype)
