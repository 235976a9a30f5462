"""The emulated-backend helper (``_emulated_backend.py``): operand rounding, precisions,
``jax.default_backend()``, jit re-tracing, ``band``, the inputs, and the private JAX names
it patches."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _emulated_backend as eb
from _exactness import assert_same_math, same_math_atol

P = jax.lax.Precision
A = jax.lax.DotAlgorithmPreset


def _operands(seed=0, m=8, k=4, n=8):
  """Entries +-(1 + j / 4096): 13 significant bits, so bf16 and TF32 both round them.

  Rounded to bf16 (8 bits) or TF32/float16 (11 bits), products have at most 22 significant
  bits on a 2^-20 grid and sums of ``k = 4`` of them stay below 16: the float32 result of
  rounded operands is exact, whatever the order of accumulation.
  """
  rng = np.random.default_rng(seed)

  def draw(shape):
    sign = rng.choice([-1.0, 1.0], size=shape)
    return (sign * (1.0 + rng.integers(0, 4096, size=shape) / 4096.0)).astype(np.float32)

  return draw((m, k)), draw((k, n))


_ROUND_NP = {
    "bf16": lambda x: x.astype(jnp.bfloat16).astype(np.float32),
    "tf32": eb.tf32_round_numpy,
    "f16": lambda x: x.astype(np.float16).astype(np.float32),
}


def _reference(a, b, mode):
  """float64 NumPy product of the operands as ``mode`` rounds them."""
  if mode == "exact":
    return a.astype(np.float64) @ b.astype(np.float64)
  r = _ROUND_NP[mode.removesuffix("_x3")]
  ah, bh = r(a), r(b)
  out = ah.astype(np.float64) @ bh.astype(np.float64)
  if mode.endswith("_x3"):
    al, bl = r(a - ah), r(b - bh)
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    out += f64(ah) @ f64(bl) + f64(al) @ f64(bh)
  return out


def _assert_f32_accurate(out, ref, a, b):
  """``out`` is ``ref`` up to float32 accumulation: ``8 eps |a| |b|`` entrywise (k = 4 terms)."""
  bound = 8 * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(b))
  assert (np.abs(out - ref) <= bound).all(), np.abs(out - ref).max()


_ENTRY_POINTS = {
    "matmul": jnp.matmul,
    "operator@": lambda a, b: a @ b,
    "einsum": lambda a, b: jnp.einsum("ik,kn->in", a, b),
    "jnp.dot": jnp.dot,
    "tensordot": lambda a, b: jnp.tensordot(a, b, axes=1),
    "lax.dot": lambda a, b: jax.lax.dot(a, b),
    "lax.dot_general": lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ()))),
    "vmap": jax.vmap(lambda a, b: a @ b, in_axes=(0, None)),
}


@pytest.mark.parametrize("backend,mode", [("tpu", "bf16"), ("gpu", "tf32"), ("cpu", "exact")])
def test_default_precision_rounds_operands_like_the_backend(backend, mode):
  a, b = _operands()
  exact = _reference(a, b, "exact")
  ref = _reference(a, b, mode)
  with eb.emulate(backend):
    outs = {name: np.asarray(jax.jit(f)(a, b)) for name, f in _ENTRY_POINTS.items()}
  for name, out in outs.items():
    if mode == "exact":
      _assert_f32_accurate(out, exact, a, b)
    else:  # the product of the rounded operands (to the suite's tolerance), far from the exact product
      assert_same_math(out, ref.astype(np.float32), err_msg=name)
      assert np.abs(out - exact).max() > 8 * same_math_atol(exact, np.float32), name


@pytest.mark.parametrize("backend", eb.BACKENDS)
def test_highest_is_exact_on_every_backend(backend):
  a, b = _operands(1)
  f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=P.HIGHEST))
  plain = np.asarray(f(a, b))
  with eb.emulate(backend):
    out = np.asarray(f(a, b))
    preset = np.asarray(jnp.matmul(a, b, precision=A.F32_F32_F32))
    with jax.default_matmul_precision("float32"):  # honoured for dots that name none
      by_config = np.asarray(jax.jit(jnp.matmul)(a, b))
  assert_same_math(out, plain)  # traced again inside (another program)
  for got in (out, preset, by_config):
    _assert_f32_accurate(got, _reference(a, b, "exact"), a, b)


@pytest.mark.parametrize("backend,precision,mode", [
    ("tpu", P.DEFAULT, "bf16"), ("gpu", P.DEFAULT, "tf32"), ("cpu", P.DEFAULT, "exact"),
    ("tpu", A.DEFAULT, "bf16"), ("tpu", P.HIGH, "bf16_x3"), ("gpu", P.HIGH, "tf32"),
    ("cpu", P.HIGH, "exact"), ("cpu", "BF16_BF16_F32", "bf16"), ("gpu", A.BF16_BF16_F32, "bf16"),
    ("tpu", A.BF16_BF16_F32_X3, "bf16_x3"), ("cpu", A.TF32_TF32_F32, "tf32"),
    ("tpu", A.TF32_TF32_F32_X3, "tf32_x3"), ("tpu", A.F16_F16_F32, "f16"),
    ("gpu", "bfloat16", "tf32"),  # JAX's alias of DEFAULT: the backend's default
    ("tpu", (P.DEFAULT, P.HIGHEST), "exact"),  # a pair: the higher of the two
])
def test_explicit_precision_is_honoured_by_its_operand_type(backend, precision, mode):
  a, b = _operands(2)
  with eb.emulate(backend):
    out = np.asarray(jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))(a, b))
  ref = _reference(a, b, mode)
  if mode in ("bf16", "tf32", "f16"):
    assert_same_math(out, ref.astype(np.float32))
    assert np.abs(out - _reference(a, b, "exact")).max() > 8 * same_math_atol(ref, np.float32)
  else:  # exact and hi/lo x 3: float32 accumulation of 26-bit or split products
    _assert_f32_accurate(out, ref, a, b)
    if mode != "exact":
      assert np.abs(out - _reference(a, b, mode.removesuffix("_x3"))).max() > 8 * same_math_atol(ref, np.float32)


@pytest.mark.parametrize("precision", [A.BF16_BF16_F32_X6, A.F16_F16_F16, A.ANY_F8_ANY_F8_F32])
def test_other_presets_raise(precision):
  a, b = _operands()
  with eb.emulate("gpu"), pytest.raises(NotImplementedError, match=precision.name):
    jnp.matmul(a, b, precision=precision)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_non_float32_operands_pass_unchanged(dtype):
  a, b = (x.astype(dtype) for x in _operands(3))
  f = jax.jit(lambda a, b: (a @ b, jnp.matmul(a, b, preferred_element_type=jnp.float32)))
  plain = [np.asarray(x) for x in f(a, b)]
  for backend in ("gpu", "tpu"):
    with eb.emulate(backend):
      for got, want in zip(f(a, b), plain):  # re-traced inside: another program, the same math
        assert_same_math(np.asarray(got), want)


def test_a_float32_operand_beside_a_16_bit_one_is_rounded_as_a_float32_dot():
  """JAX multiplies bfloat16 x float32 as float32 x float32 (the narrower converted), so on "tpu" the
  float32 operand goes through one bfloat16 pass, and a float16 operand is rounded to bfloat16 too."""
  a, b = _operands()
  for narrow in (jnp.bfloat16, jnp.float16):
    a16 = a.astype(narrow)
    want = _reference(a16.astype(jnp.float32), b, "bf16").astype(np.float32)
    with eb.emulate("tpu"):
      got = np.asarray(jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))(a16, b))
    assert_same_math(got, want)
    exact = np.asarray(a16, np.float64) @ np.asarray(b, np.float64)
    assert np.abs(got - exact).max() > 8 * same_math_atol(exact, np.float32), narrow


def test_rounding_matches_numpy_bit_for_bit():
  rng = np.random.default_rng(4)
  x = (rng.standard_normal(4096) * np.exp2(rng.integers(-30, 30, 4096))).astype(np.float32)
  bits = x.view(np.uint32)
  ties = ((bits & np.uint32(0xFFFFE000)) | np.uint32(0x1000)).view(np.float32)  # TF32 halfway
  ties16 = ((bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)).view(np.float32)  # bf16 halfway
  x = np.concatenate([x, ties, ties16, np.float32([0.0, -0.0, 1e-41, 6e-8, 65519.0, 7e4])])
  rounded = jax.jit(lambda v: (eb.bf16_round(v), eb.tf32_round(v), eb.f16_round(v)))(x)
  with np.errstate(over="ignore"):  # rounding one value to a narrower format is defined to the bit (IEEE
    for name, got in zip(("bf16", "tf32", "f16"), rounded):  # round to nearest even): no sum, no order
      np.testing.assert_array_equal(np.asarray(got), _ROUND_NP[name](x), err_msg=name)


def test_default_backend_inside_and_restored():
  originals = (jax.default_backend, jax.lax.dot_general, jax.lax.dot,
               jax._src.lax.lax.dot_general, jnp.einsum.__kwdefaults__["_dot_general"])
  real = jax.default_backend()
  for backend in eb.BACKENDS:
    with eb.emulate(backend):
      assert jax.default_backend() == backend
      with eb.emulate("tpu"):  # nested: the inner one wins, the outer one comes back
        assert jax.default_backend() == "tpu"
      assert jax.default_backend() == backend
  with pytest.raises(RuntimeError), eb.emulate("gpu"):
    raise RuntimeError("restored on the way out")
  assert jax.default_backend() == real
  now = (jax.default_backend, jax.lax.dot_general, jax.lax.dot,
         jax._src.lax.lax.dot_general, jnp.einsum.__kwdefaults__["_dot_general"])
  assert all(x is y for x, y in zip(now, originals))
  with pytest.raises(ValueError, match="backend"), eb.emulate("rocm"):
    pass


def test_jit_traced_outside_is_retraced_inside():
  a, b = _operands(5)
  traces = []

  @jax.jit
  def f(a, b):
    traces.append(jax.default_backend())
    return a @ b

  exact = np.asarray(f(a, b))
  with eb.emulate("tpu"):
    tpu = np.asarray(f(a, b))
  with eb.emulate("gpu"):
    gpu = np.asarray(f(a, b))
  again = np.asarray(f(a, b))  # the first trace, from the cache
  assert traces == ["cpu", "tpu", "gpu"]
  assert_same_math(tpu, _reference(a, b, "bf16").astype(np.float32))
  assert_same_math(gpu, _reference(a, b, "tf32").astype(np.float32))
  assert np.abs(tpu - gpu).max() > 8 * same_math_atol(exact)  # each its own rounding
  np.testing.assert_array_equal(again, exact)  # the first program, from the cache
  _assert_f32_accurate(exact, _reference(a, b, "exact"), a, b)


def test_private_jax_names_have_not_moved():
  """What ``_emulated_backend`` relies on (JAX 0.10.2 and 0.12.0.1); the behaviour of each
  entry point is checked by ``test_default_precision_rounds_operands_like_the_backend``."""
  from jax._src.lax import lax as lax_src
  from jax._src.numpy import tensor_contractions
  from jax._src import xla_bridge
  assert eb._ORIGINAL_DOT_GENERAL is jax.lax.dot_general is lax_src.dot_general
  assert eb._ORIGINAL_PUBLIC_DOT is jax.lax.dot is lax_src.dot
  # jnp.matmul / jnp.dot / tensordot / @ look up ``lax.dot_general`` on that module at call time
  assert tensor_contractions.lax is lax_src
  for fn in (tensor_contractions.matmul, tensor_contractions.dot, tensor_contractions.tensordot):
    assert "lax.dot_general(" in inspect.getsource(inspect.unwrap(fn))
  # jnp.einsum binds it as the default of its private keyword at import
  assert jnp.einsum.__kwdefaults__[eb.EINSUM_KWARG] is jax.lax.dot_general
  # the wrapper passes (lhs, rhs, dimension_numbers, precision, preferred_element_type) by position
  params = list(inspect.signature(lax_src.dot_general).parameters)
  assert params[:5] == ["lhs", "rhs", "dimension_numbers", "precision", "preferred_element_type"]
  # jax.default_backend is xla_bridge's function (left unpatched there, see the docstring)
  assert eb._ORIGINAL_DEFAULT_BACKEND is jax.default_backend is xla_bridge.default_backend
  assert callable(jax.make_user_context)


def test_band_and_inputs():
  for kind in eb.INPUT_KINDS:
    g = eb.make_input(kind, (3, 24, 40), seed=1)
    assert g.shape == (3, 24, 40) and g.dtype == np.float32
    np.testing.assert_array_equal(g, eb.make_input(kind, (3, 24, 40), seed=1))  # seeded NumPy, no XLA program
    np.testing.assert_allclose(np.linalg.norm(g, axis=(-2, -1)), 1.0, rtol=1e-5)
    u, s, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    polar = u @ vt
    got = eb.band(3.0 * polar, g, scale=3.0)
    np.testing.assert_allclose(got, (1.0, 1.0, 1.0), atol=1e-9)
    assert eb.band(3.0 * polar, g, scale=3.0, svd=(u, s, vt)) == got
    if kind == "cond_1e6":
      np.testing.assert_allclose(s[:, 0] / s[:, -1], 1e6, rtol=1e-2)
    if kind == "low_rank":
      assert (s[:, 16] < 1e-2 * s[:, 15]).all()
  # X = U (S / s_1) V^T: responses s_i / s_1, the smallest one kept is the floor's
  g = eb.make_input("cond_1e6", (16, 24))
  u, s, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
  x = (u * (s / s[0])) @ vt
  top, low, high = eb.band(x, g)
  kept = s[s >= eb.BAND_FLOOR * np.linalg.norm(s)]
  np.testing.assert_allclose((top, low, high), (1.0, kept[-1] / s[0], 1.0), rtol=1e-9)
  assert eb.moonlight_scale((8, 128, 512)) == pytest.approx(0.2 * 512**0.5)
