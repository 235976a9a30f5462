"""``_util.powers_of_two.power_of_two_below``: the power of two from a float's exponent bits,
against NumPy's ``frexp`` in every float dtype the update scales (float32, bfloat16, float16)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from muonclip_jax._util.powers_of_two import power_of_two_below


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_power_of_two_below_is_frexp_clamped(dtype):
  """``2^clamp(t - k, lo, hi)`` for ``a = f 2^k`` (``frexp``): every normal ``a`` of the dtype and a
  few ``t``, ranges narrower than the dtype's; zero and subnormals read as ``k = 1 - bias``, inf and
  NaN as ``k = bias + 2``; a range outside the normal powers of two is refused."""
  info = ml_dtypes.finfo(dtype)
  bias = info.maxexp - 1
  rng = np.random.default_rng(0)
  a = np.exp2(rng.uniform(np.log2(float(info.smallest_normal)), np.log2(float(info.max)), 3000)).astype(dtype)
  a = np.concatenate([a, np.asarray([info.smallest_normal, info.max, 1.0, 0.5], dtype)])
  _, k = np.frexp(a.astype(np.float64))
  for t, lo, hi in ((0, 1 - bias, bias), (bias - 3, 1 - bias, bias), (0, -bias // 2, bias // 2), (3, 0, 5)):
    got = power_of_two_below(jnp.asarray(a), t, lo, hi)
    assert got.dtype == dtype
    assert np.all(np.asarray(got).astype(np.float64) == np.exp2(np.clip(t - k, lo, hi))), (t, lo, hi)
    edge = np.asarray([0.0, float(info.smallest_subnormal), np.inf, np.nan], dtype)
    got = np.asarray(power_of_two_below(jnp.asarray(edge), t, lo, hi)).astype(np.float64)
    low, high = (2.0 ** np.clip(t - kk, lo, hi) for kk in (1 - bias, bias + 2))
    assert list(got) == [low, low, high, high], (t, lo, hi)
  with pytest.raises(ValueError, match="lo=-200"):
    power_of_two_below(jnp.ones((), dtype), 0, -200, 0)
  with pytest.raises(ValueError, match="hi=200"):
    power_of_two_below(jnp.ones((), dtype), 0, 0, 200)
