"""newton_schulz against the SVD polar factor, its bands, and its validation."""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _muon_reference import ns_test_matrices, svd_response
from muonclip_jax import newton_schulz
from _exactness import assert_same_math

# (preset, dtype) -> band of output singular values for input singular values >= CUTOFF of
# the Frobenius norm, with 5 steps. Measured: muon [0.68, 1.21] f32 / [0.66, 1.20] bf16,
# polar_express [0.86, 1.15] f32 / [0.82, 1.14] bf16; the bands below add a small margin.
CUTOFF = 3e-3
BANDS = {
    ("muon", jnp.float32): (0.66, 1.22),
    ("muon", jnp.bfloat16): (0.63, 1.22),
    ("polar_express", jnp.float32): (0.84, 1.16),
    ("polar_express", jnp.bfloat16): (0.80, 1.16),
}


def _matrices(seed):
  return ns_test_matrices(seed, [(48, 48), (32, 80), (80, 32)])


def _svd_response(x, y):
  """Input singular values (relative to ||x||_F) and diag(U^T y V): p(s) per direction."""
  proj, rel = svd_response(x, y)
  return rel, proj


@pytest.mark.parametrize("preset,dtype", list(BANDS))
def test_band_and_polar_factor(preset, dtype):
  lo, hi = BANDS[(preset, dtype)]
  for x in _matrices(0):
    xq = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    y = newton_schulz(jnp.asarray(x, dtype), coeffs=preset)
    assert y.dtype == dtype and y.shape == x.shape
    y = np.asarray(y.astype(jnp.float32), np.float64)
    rel, proj = _svd_response(xq, y)
    d = np.diag(proj)
    keep = rel >= CUTOFF
    assert d[keep].min() >= lo and d[keep].max() <= hi, (d[keep].min(), d[keep].max())
    assert np.linalg.svd(y, compute_uv=False).max() <= hi
    if dtype == jnp.float32:
      # Same singular vectors as the polar factor U V^T: U^T y V is diagonal.
      assert np.abs(proj - np.diag(d)).max() <= 2e-3
    else:
      # bf16 rounds every step: on the directions in the band, close to the float32 result.
      y32 = np.asarray(newton_schulz(jnp.asarray(xq, jnp.float32), coeffs=preset), np.float64)
      p32 = _svd_response(xq, y32)[1][np.ix_(keep, keep)]
      assert np.linalg.norm(proj[np.ix_(keep, keep)] - p32) <= 0.15 * np.linalg.norm(p32)  # measured up to 0.11


def test_many_steps_converge_to_polar_factor():
  x = np.random.default_rng(1).standard_normal((24, 40))
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  y = newton_schulz(jnp.asarray(x, jnp.float32), steps=12, coeffs="polar_express")
  np.testing.assert_allclose(np.asarray(y), u @ vt, atol=2e-4)


class NewtonSchulzVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_batch_and_tall_matrices(self):
    x = jax.random.normal(jax.random.key(0), (3, 40, 24))
    fn = self.variant(lambda x: newton_schulz(x, coeffs="polar_express"))
    y = fn(x)
    chex.assert_shape(y, (3, 40, 24))
    for i in range(3):
      chex.assert_trees_all_close(y[i], newton_schulz(x[i], coeffs="polar_express"), atol=1e-5)
    # A tall matrix is the transpose of the wide one's result.
    chex.assert_trees_all_close(y[0], newton_schulz(x[0].T, coeffs="polar_express").T, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_zero_gives_zero(self):
    y = self.variant(newton_schulz)(jnp.zeros((8, 16)))
    chex.assert_trees_all_equal(y, jnp.zeros((8, 16)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_zero_gives_zero_in_every_dtype_method_and_orientation(dtype):
  # the Schatten-4 scale of a zero matrix is 1, not eps: 1 / eps overflowed a float16 iterate
  for coeffs, steps in (("polar_express_4", None), ("muon", 5)):
    for method in ("standard", "gram"):
      for shape in ((8, 32), (32, 8)):
        y = newton_schulz(jnp.zeros(shape, dtype), steps=steps, coeffs=coeffs, method=method)
        assert y.dtype == dtype and not np.any(np.asarray(y, np.float32)), (coeffs, method, shape)


def test_custom_coefficients_match_presets():
  x = jax.random.normal(jax.random.key(1), (16, 32))
  assert_same_math(newton_schulz(x, coeffs=(3.4445, -4.7750, 2.0315)), newton_schulz(x, coeffs="muon"))
  table = np.tile([3.4445, -4.7750, 2.0315], (3, 1))
  assert_same_math(newton_schulz(x, steps=3, coeffs=table), newton_schulz(x, steps=3))


def test_compute_dtype_bf16_keeps_output_dtype():
  x = jax.random.normal(jax.random.key(2), (16, 32))
  y = newton_schulz(x, compute_dtype=jnp.bfloat16)
  assert y.dtype == jnp.float32
  chex.assert_trees_all_close(y, newton_schulz(x), atol=5e-2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(coeffs="adam"), "coeffs must be one of"),
        (dict(coeffs=np.ones((2, 3))), r"coeffs must have shape \(3,\) or \(steps, 3\) = \(5, 3\), got .* \(2, 3\)"),
        (dict(coeffs=np.ones(4)), r"coeffs must have shape .* got .* \(4,\)"),
        (dict(steps=0), "steps must be an int >= 1, got 0"),
        (dict(steps=2.5), "steps must be an int >= 1, got 2.5"),
        (dict(compute_dtype=jnp.int32), "compute_dtype must be a floating dtype of 16 bits or more, got int32"),
        (dict(compute_dtype=jnp.float8_e4m3fn), "compute_dtype must be a floating dtype of 16 bits or more"),
        (dict(eps=-50.0), r"eps must be > 0.0 and < inf, got -50.0"),  # the result's sign flipped
        (dict(eps=float("nan")), r"eps must be > 0.0 and < inf, got nan"),  # all NaN
        (dict(eps=0.0), r"eps must be > 0.0"),
    ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    newton_schulz(jnp.ones((4, 4)), **kwargs)


@pytest.mark.parametrize("compute_dtype", [None, jnp.float32])
def test_an_integer_input_is_refused_whatever_the_compute_dtype(compute_dtype):
  """The result has ``x``'s dtype: an integer ``x`` with a floating ``compute_dtype`` came back
  truncated to zeros."""
  with pytest.raises(ValueError, match="needs a floating x, got x of int32"):
    newton_schulz(jnp.ones((4, 4), jnp.int32), compute_dtype=compute_dtype)
  with pytest.raises(ValueError, match="needs x of a floating dtype of 16 bits or more, got float8_e4m3fn; pass "
                                       "compute_dtype="):
    newton_schulz(jnp.ones((4, 4), jnp.float8_e4m3fn))
  assert newton_schulz(jnp.eye(4, dtype=jnp.float8_e4m3fn), compute_dtype=jnp.float32).dtype == jnp.float8_e4m3fn


def test_rank_one_input_raises():
  with pytest.raises(ValueError, match=r"rank >= 2, got shape \(4,\)"):
    newton_schulz(jnp.ones(4))


@given(
    x=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=2, max_side=24),
        elements=st.floats(-100, 100, width=32, allow_subnormal=False),
    )
)
def test_property_output_bounded_and_finite(x):
  """For any finite input: finite output whose singular values stay below the band's top."""
  y = np.asarray(newton_schulz(jnp.asarray(x)), np.float64)
  assert np.all(np.isfinite(y))
  assert np.linalg.svd(y, compute_uv=False).max() <= BANDS[("muon", jnp.float32)][1]


@pytest.mark.parametrize("method,normalize", [("standard", "frobenius"), ("gram", "schatten4")])
def test_huge_inputs_give_the_output_of_the_input_scaled_down(method, normalize):
  """Orthogonalization is scale-invariant: a largest entry of 1e19 up to float32's largest
  (squares overflow from ~1.8e19; the reciprocal of anything above 2^126 = 8.5e37 is
  subnormal, flushed to zero by XLA:CPU) gives the output of the same matrix at a normal
  scale, not zero or NaN; in float32 and bfloat16."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 24)), jnp.float32)
  x = x / jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)  # largest entry 1 in each matrix
  kw = dict(steps=4, coeffs="polar_express_4", method=method, normalize=normalize)
  ref = newton_schulz(x, **kw)
  assert float(jnp.min(jnp.linalg.svd(ref, compute_uv=False))) > 0.5
  ns = jax.jit(lambda x: newton_schulz(x, **kw))
  for scale in (1e19, 1e30, 8.4e37, 8.6e37, 1e38, float(np.finfo(np.float32).max)):
    out = ns(x * jnp.float32(scale))
    chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=0)
  bf16 = x.astype(jnp.bfloat16)
  ref16 = ns(bf16).astype(jnp.float32)
  out16 = ns(bf16 * jnp.bfloat16(2.0**127)).astype(jnp.float32)  # exact: a power of two, 1.7e38
  chex.assert_trees_all_close(out16, ref16, atol=1e-2, rtol=0)
  # Tiny inputs hit the eps floor (documented): divided by ~eps, not by their norm.
  tiny = newton_schulz(x * 1e-30, **kw)
  assert float(jnp.max(jnp.abs(tiny))) < 1e-6  # against ~0.3 for the same matrix at scale 1


def test_inputs_are_scaled_by_normal_powers_of_two():
  """``power_of_two_scale(v, hi)`` is a normal float32 power of two ``2^-e`` with ``v 2^-e`` in
  [1/2, 1) for every ``v`` in [2^-hi, 2^126), ``2^-126`` above (``2^-127`` is subnormal) and
  ``2^hi`` below (zero and subnormals included). Two of them, as ``newton_schulz`` applies them
  (below the largest magnitude, ``hi = None``: 126, then below the norm of the result, ``hi =
  NORM_CAP``), bring every matrix whose largest entry is normal to a Frobenius norm in [1/2, 1)
  with entries below 4; give a matrix of subnormals, where they are kept (NumPy here, as on a
  GPU: XLA:CPU flushes them), a norm that is not 0 after the first (else ``first_scale`` would
  take the matrix for zero and drop the ``eps`` floor); and a zero one a finite ``2^127``."""
  from muonclip_jax._orthogonalize.newton_schulz import NORM_CAP, power_of_two_scale
  LARGEST_CAP = 126  # hi=None's, for float32
  assert NORM_CAP == 1
  rng = np.random.default_rng(0)
  for hi in (LARGEST_CAP, NORM_CAP):
    v = np.concatenate([np.float32([2.0**-hi, 1.0, 0.5, 0.75, 2.0**125, np.nextafter(np.float32(2.0**126), 0)]),
                        np.exp2(rng.uniform(-hi, 126, 4000)).astype(np.float32)])
    s = np.asarray(power_of_two_scale(jnp.asarray(v), hi), np.float64)
    mant, _ = np.frexp(s)
    assert np.all(mant == 0.5) and np.all(s >= np.finfo(np.float32).tiny)
    assert np.all((v * s >= 0.5) & (v * s < 1.0))
    top = np.float32([2.0**126, 1e38, np.finfo(np.float32).max, np.inf])
    assert np.all(np.asarray(power_of_two_scale(jnp.asarray(top), hi)) == np.float32(2.0**-126))
    low = np.float32([np.nextafter(np.float32(2.0**-hi), 0), 2.0**-127, 1e-40, 1e-45, 0.0])
    assert np.all(np.asarray(power_of_two_scale(jnp.asarray(low), hi)) == np.float32(2.0**hi))

  def scaled(x):  # newton_schulz's two scales, the products in NumPy's float32 (subnormals kept)
    e = np.asarray(power_of_two_scale(jnp.asarray(np.abs(x).max(axis=(-2, -1), keepdims=True))))
    y = x * e
    norm = np.sqrt(np.sum(y * y, axis=(-2, -1), keepdims=True))
    k = np.asarray(power_of_two_scale(jnp.asarray(norm), NORM_CAP))
    return (y * k).astype(np.float64), norm, e * k  # e * k in float32, as newton_schulz's floor

  base = rng.standard_normal((1, 3, 5))
  base[0, 0, 0] = 4 * np.abs(base).max()  # one large entry: the two scales differ
  p = np.arange(-125, 128, 3.0) + 0.3  # off the powers of two, where rounding decides the octave
  x = np.float32(base * np.exp2(p)[:, None, None] / np.linalg.norm(base))  # norms 2^-124.7 ... 2^127.3
  X, _, ek = scaled(x)
  norms = np.linalg.norm(X, axis=(-2, -1))
  assert np.all((norms >= 0.5) & (norms < 1.0)) and np.all(np.abs(X) < 4) and np.all(np.isfinite(ek)), norms
  sub = np.float32(np.sign(base) * 2.0**-149 * np.arange(1, 16).reshape(1, 3, 5))  # all subnormal
  _, norm, ek = scaled(sub)
  assert float(norm.squeeze()) > 0 and np.isfinite(ek).all()
  X0, norm0, ek0 = scaled(np.zeros((1, 3, 5), np.float32))
  assert np.all(X0 == 0) and float(norm0.squeeze()) == 0
  assert ek0.dtype == np.float32 and float(ek0.squeeze()) == 2.0**127


def test_zero_size_matrices_give_an_empty_output():
  """(0, 8), (8, 0), a (3, 0, 4) stack and an empty batch: the empty result, no reduction error."""
  for shape in ((0, 8), (8, 0), (3, 0, 4), (0, 4, 4)):
    for method in ("standard", "gram"):
      out = newton_schulz(jnp.ones(shape, jnp.bfloat16), method=method, coeffs="polar_express_4", steps=None)
      assert out.shape == shape and out.dtype == jnp.bfloat16


def test_float64_input_keeps_its_range_and_precision():
  """A float64 ``x`` (``jax_enable_x64``) is scaled and normed in float64: entries far beyond
  float32's range (1e39, 1e200) give the polar factor, not NaN, and 12 Polar Express steps at
  ``HIGHEST`` reach it to float64's rounding, not to the float32-rounded input's (1.3e-8 when
  the input was cast to float32 first)."""
  x = np.random.default_rng(0).standard_normal((16, 48))
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  with jax.enable_x64(True):
    for scale in (1.0, 1e39, 1e200):
      out = newton_schulz(jnp.asarray(x * scale), steps=12, coeffs="polar_express", precision="highest")
      assert out.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(out), u @ vt, atol=1e-12, err_msg=f"scale {scale}")
