"""The suite's one rule for comparing two results.

**The same program: bit for bit.** Running one compiled program twice, or two programs with
the same HLO (XLA's compiler is deterministic for a given machine and flags), gives the same
bits. So does an identity that the code promises whatever the compiler does: a leaf the clip
leaves alone is passed through (selected, never multiplied by 1), a momentum multiplied by a
power of two is that power of two times the other, a frozen leaf keeps its value. Those tests
use ``np.testing.assert_array_equal`` / ``chex.assert_trees_all_equal`` directly.

**Separately compiled programs that compute the same math: to ``ULPS`` ulps of the leaf's
largest magnitude** (``assert_same_math``). Their float32 sums may run in different orders,
with or without fused multiply-adds, blocked and vectorized as the CPU and XLA's flags decide
(measured: an Intel Xeon with AVX-512 FP16 and an AMD EPYC give two such programs results
1.8e-6 apart, and XLA:CPU's legacy and default fusion emitters differ likewise). Bit equality
between them is a property of one machine's code generation, not of the library.

The bound, and why it holds on any machine: each program is a float32 evaluation of the same
exact result, so the two differ by at most twice one evaluation's error against exact
arithmetic. The largest results compared here come through Newton–Schulz, where every
product's rounding (about ``sqrt(n) eps`` relative for an inner dimension ``n``) is carried
through the remaining steps' polynomials (Polar Express's first step has slope up to 8 at
zero). ``test_exactness.py`` measures that error against a float64 evaluation of the same
updates, for every method and preset, whole matrices, per-head blocks and expert stacks,
and asserts it stays within ``ULPS / 2`` ulps of the largest entry (it measures up to 51 on
the suite's shapes). The exception is the Gram iteration forced onto ill-conditioned or
square inputs, which squares the condition number (100-3000 ulps): the tests that compare
those results state their own, measured tolerance. So is an input with singular values at the
preset's cutoff (``polar_express_4``: about 3e-3 of the largest), where the composed
polynomial is steepest: one ulp of such an input moves the output by more than the bound (the
cosine of a small model's initial weights, nearly rank one: ~1600 ulps, a probe of
``test_muonclip.py``'s first version), so the tests that compare programs give Gaussian
gradients, or their own tolerance. ``ULPS = 256`` is then a bound for any
two float32 evaluations, about ``3e-5`` of the leaf's largest entry: far below what the cases these tests guard against
change (a wrong cut, axis or block changes entries by their own size; a clip factor by
``1 - gamma``, which the tests keep above 1e-3). A result stored in a 16-bit float is compared
to 2 of its own ulps (the float32 results within the bound round to neighbouring values at
most); a float32 result against a float64 reference, in float32's ulps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ULPS = 256


def same_math_atol(desired, dtype=None) -> float:
  """The tolerance of ``assert_same_math``: ``ULPS`` ulps of ``desired``'s largest magnitude in a
  float32 (or wider) ``dtype`` (default: ``desired``'s); in a 16-bit float, 2 of its ulps (two
  float32 results within the bound round to at most neighbouring 16-bit values); 0 for
  integers and booleans."""
  desired = np.asarray(desired)
  dtype = np.dtype(desired.dtype if dtype is None else dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or not desired.size:
    return 0.0
  info = jnp.finfo(dtype)
  ulps = ULPS if info.bits >= 32 else 2
  return ulps * float(info.eps) * float(np.abs(desired.astype(np.float64)).max())


def _kinds(x: np.ndarray) -> np.ndarray:
  """0 for a finite entry, 1 NaN, 2 +inf, 3 -inf."""
  x = x.astype(np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else np.zeros(x.shape)
  return np.select([np.isnan(x), np.isposinf(x), np.isneginf(x)], [1, 2, 3], 0)


def assert_same_math(actual, desired, err_msg: str = "") -> None:
  """``actual`` and ``desired``, from two separately compiled programs, equal to ``ULPS`` ulps
  of ``desired``'s largest magnitude (pytrees: leaf by leaf). Shapes must match; infinities
  and NaNs must sit in the same places."""
  leaves_a, tree_a = jax.tree.flatten(actual)
  leaves_d, tree_d = jax.tree.flatten(desired)
  if tree_a != tree_d:
    raise AssertionError(f"{err_msg}: tree structures differ: {tree_a} != {tree_d}")
  for a, d in zip(leaves_a, leaves_d):
    a, d = np.asarray(a), np.asarray(d)
    if a.shape != d.shape:
      raise AssertionError(f"{err_msg}: shapes differ: {a.shape} != {d.shape}")
    finite = np.isfinite(d)
    if not np.array_equal(_kinds(a), _kinds(d)):  # where each has NaN, +inf, -inf: no rounding decides that
      raise AssertionError(f"{err_msg}: NaN or inf entries in different places")
    # the ulps of the less precise of the two (a float64 NumPy reference against a float32 result)
    coarser = max((a.dtype, d.dtype), key=lambda t: float(jnp.finfo(t).eps) if jnp.issubdtype(t, jnp.floating) else 0.0)
    atol = same_math_atol(d[finite], coarser) if finite.any() else 0.0
    np.testing.assert_allclose(a[finite].astype(np.float64), d[finite].astype(np.float64), rtol=0, atol=atol,
                               err_msg=err_msg)
