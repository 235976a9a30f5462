"""Fast orthogonalization: Gram Newton–Schulz, "polar_express_4", Schatten-4
normalization, batched and serialized Muon updates: bands against the SVD, agreement with
the plain path, FLOP counts and the compiled update's temporary memory."""

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _muon_reference import ns_test_matrices, svd_response
import muonclip_jax as mc
from muonclip_jax._orthogonalize import gram_of, ns_flops, presets
from _exactness import assert_same_math

# the module, not the function _orthogonalize re-exports under the same name
SYM_MODULE = importlib.import_module("muonclip_jax._orthogonalize.symmetric")

CUTOFF = 3e-3
# (preset, dtype) -> band of output singular values (see newton_schulz's docstring), for
# both methods, with each preset's own step count. Measured over _matrices():
# muon [0.682, 1.197] f32, [0.665, 1.194] bf16; polar_express [0.859, 1.141] f32,
# [0.820, 1.143] bf16; polar_express_4 [0.779, 1.200] f32, [0.794, 1.215] bf16; deepseek_v4
# [1.000, 1.002] f32 (Gram with its restart at step 5; without it 1e20).
BANDS = {
    ("muon", jnp.float32): (0.66, 1.22),
    ("muon", jnp.bfloat16): (0.63, 1.22),
    ("polar_express", jnp.float32): (0.84, 1.16),
    ("polar_express", jnp.bfloat16): (0.80, 1.16),
    ("polar_express_4", jnp.float32): (0.77, 1.21),
    ("polar_express_4", jnp.bfloat16): (0.76, 1.23),
    ("deepseek_v4", jnp.float32): (0.99, 1.01),
}


def _matrices(seed=0):
  return ns_test_matrices(seed, [(48, 48), (32, 96), (96, 32)])


_response = svd_response


def _run(x, dtype, **kw):
  xq = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  y = mc.newton_schulz(jnp.asarray(x, dtype), steps=None, **kw)
  assert y.dtype == dtype and y.shape == x.shape
  return xq, np.asarray(y.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("preset,dtype", list(BANDS))
def test_every_preset_and_method_within_band(preset, dtype, method):
  lo, hi = BANDS[(preset, dtype)]
  for x in _matrices():
    xq, y = _run(x, dtype, coeffs=preset, method=method)
    proj, rel = _response(xq, y)
    d = np.diag(proj)[rel >= CUTOFF]
    assert d.min() >= lo and d.max() <= hi, (d.min(), d.max())
    assert np.linalg.svd(y, compute_uv=False).max() <= hi


@pytest.mark.parametrize("preset", presets.PRESETS)
def test_gram_matches_standard(preset):
  """Same polynomial, different rounding: equal up to float32 rounding amplified by the
  conditioning of the Gram matrix (measured <= 2.5e-3 at condition 1e6; 2e-5 when Gaussian)."""
  for i, x in enumerate(_matrices(1)):
    _, ys = _run(x, jnp.float32, coeffs=preset, method="standard")
    _, yg = _run(x, jnp.float32, coeffs=preset, method="gram")
    np.testing.assert_allclose(yg, ys, atol=5e-3 if i % 2 else 1e-4)


def test_gram_bf16_close_to_float32_on_band_directions():
  """bf16 Gram: ``m x n`` products in bf16 (float32 accumulation), the ``m x m`` iteration in
  float32 and a two-part final product, so it tracks the float32 result closely."""
  for x in _matrices(2):
    xq, yb = _run(x, jnp.bfloat16, coeffs="polar_express_4", method="gram")
    _, yf = _run(xq, jnp.float32, coeffs="polar_express_4", method="gram")
    pb, rel = _response(xq, yb)
    pf, _ = _response(xq, yf)
    keep = rel >= CUTOFF
    err = np.linalg.norm((pb - pf)[np.ix_(keep, keep)]) / np.linalg.norm(pf[np.ix_(keep, keep)])
    assert err <= 0.05, err


def test_polar_express_4_design():
  """The composition maps (0, 1] / 1.02 (Frobenius or Schatten-4 normalized): [3e-3, 1] into
  [0.778, 1.2], never above 1.2, and small values up by prod(a_k) / 1.02 ~ 290."""
  x = np.geomspace(1e-6, 1.0, 200_001)
  y = x / presets.POLAR_EXPRESS_NORM_SCALE
  for a, b, c in presets.POLAR_EXPRESS_4_COEFFS:
    y = a * y + b * y**3 + c * y**5
  assert y[x >= 3e-3].min() >= 0.778 and y.max() <= 1.2 + 1e-6
  assert y[0] / x[0] == pytest.approx(np.prod([r[0] for r in presets.POLAR_EXPRESS_4_COEFFS]) / 1.02, rel=1e-6)
  assert presets.resolve_steps(None, "polar_express_4") == 4


def test_schatten4_normalization_is_never_worse():
  """||x||_S4 <= ||x||_F, so every singular value starts at least as close to 1: the response
  to each direction is at least the Frobenius-normalized one, while it is below the band."""
  u, _, vt = np.linalg.svd(np.random.default_rng(3).standard_normal((64, 64)))
  x = (u * np.logspace(0, -5, 64)) @ vt
  _, yf = _run(x, jnp.float32, coeffs="polar_express_4", normalize="frobenius")
  _, ys = _run(x, jnp.float32, coeffs="polar_express_4", normalize="schatten4")
  df, rel = np.diag(_response(x, yf)[0]), _response(x, yf)[1]
  ds = np.diag(_response(x, ys)[0])
  below = df < 0.7
  assert below.any() and np.all(ds[below] >= df[below] - 1e-4)
  assert ds[rel >= CUTOFF].min() >= BANDS[("polar_express_4", jnp.float32)][0]


def _program(**kw):
  """The jaxpr of ``newton_schulz`` with these options, as text: equal texts are one program."""
  kw = {"steps": None, "coeffs": "polar_express_4", **kw}
  return lambda x: str(jax.make_jaxpr(lambda x: mc.newton_schulz(x, **kw))(x))


class GramVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_auto_batch_tall_restarts(self):
    x = jax.random.normal(jax.random.key(0), (3, 24, 80))
    gram = self.variant(lambda x: mc.newton_schulz(x, steps=None, coeffs="polar_express_4", method="gram"))
    auto = self.variant(lambda x: mc.newton_schulz(x, steps=None, coeffs="polar_express_4", method="auto"))
    y = gram(x)
    # 80 >= 2 * 24: auto is gram, the very same program (so the same bits on any machine)
    assert _program(method="auto")(x) == _program(method="gram")(x)
    np.testing.assert_array_equal(auto(x), y)
    for i in range(3):
      chex.assert_trees_all_close(y[i], gram(x[i]), atol=1e-5)
    chex.assert_trees_all_close(gram(jnp.swapaxes(x, 1, 2)), jnp.swapaxes(y, 1, 2), atol=1e-5)
    restarted = self.variant(lambda x: mc.newton_schulz(
        x, steps=None, coeffs="polar_express_4", method="gram", restarts=(1, 3)))
    chex.assert_trees_all_close(restarted(x), y, atol=1e-5)
    square = jax.random.normal(jax.random.key(1), (32, 32))
    assert _program(coeffs="muon", method="auto")(square) == _program(coeffs="muon", method="standard")(square)
    np.testing.assert_array_equal(
        self.variant(lambda x: mc.newton_schulz(x, coeffs="muon", method="auto"))(square),
        self.variant(lambda x: mc.newton_schulz(x, coeffs="muon", method="standard"))(square))

  @chex.variants(with_jit=True, without_jit=True)
  def test_zero_gives_zero(self):
    for method in ("standard", "gram"):
      y = self.variant(lambda x, m=method: mc.newton_schulz(x, steps=None, coeffs="polar_express_4", method=m))(
          jnp.zeros((8, 32)))
      chex.assert_trees_all_equal(y, jnp.zeros((8, 32)))


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_symmetric_block_products_match_full_products(method, monkeypatch):
  """Products known to be symmetric compute 3 of 4 blocks from SYMMETRIC_MIN (512) up; here
  lowered to 8 so small matrices take that path (odd sizes keep full products)."""
  x = jax.random.normal(jax.random.key(6), (2, 24, 72))
  odd = jax.random.normal(jax.random.key(7), (25, 25))
  kw = dict(steps=None, coeffs="polar_express_4", method=method)
  full = [mc.newton_schulz(x, **kw), mc.newton_schulz(jnp.swapaxes(x, 1, 2), **kw), mc.newton_schulz(odd, **kw)]
  monkeypatch.setattr(SYM_MODULE, "SYMMETRIC_MIN", 8)
  blocked = [mc.newton_schulz(x, **kw), mc.newton_schulz(jnp.swapaxes(x, 1, 2), **kw), mc.newton_schulz(odd, **kw)]
  chex.assert_trees_all_close(blocked, full, atol=2e-5)
  A = jax.random.normal(jax.random.key(8), (16, 40))
  chex.assert_trees_all_close(gram_of(A, False), A @ A.T, atol=1e-4)
  chex.assert_trees_all_close(gram_of(A.T, True), A @ A.T, atol=1e-4)


def test_the_gram_iterations_gram_matrix_is_summed_in_chunks():
  """``gram_in_chunks``: ``X X^T`` of a wide ``X`` (``X^T X`` of a tall one) as the sum of the Gram matrices
  of ``GRAM_CHUNK`` (256) columns (rows) and of the remainder, against float64; a batch; a short side of
  ``GRAM_CHUNK_BELOW`` (32) or more, or a long side under two chunks, is one product. On a mean-dominated 2x8192
  input of bfloat16 values its small eigenvalue is within 1% of float64's (one dot's was 30% off on this
  CPU, an error that depends on the dot's order of summation)."""
  def dots(shape, tall):
    jaxpr = jax.make_jaxpr(lambda x: SYM_MODULE.gram_in_chunks(x, tall, jnp.float32, jax.lax.Precision.HIGHEST))
    return [e.params["dimension_numbers"][1][0] for e in jaxpr(jnp.ones(shape)).jaxpr.eqns
            if e.primitive.name == "dot_general"]  # each dot's lhs batch dims

  rng = np.random.default_rng(0)
  for shape, tall, batch_dots in (((3, 1000), False, 1), ((2, 5, 600), False, 1), ((1100, 4), True, 1),
                                  ((3, 512), False, 1), ((32, 1024), False, 0), ((3, 300), False, 0)):
    x = rng.standard_normal(shape)
    got = SYM_MODULE.gram_in_chunks(jnp.asarray(x, jnp.float32), tall, jnp.float32, jax.lax.Precision.HIGHEST)
    want = np.swapaxes(x, -1, -2) @ x if tall else x @ np.swapaxes(x, -1, -2)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    chunked = [d for d in dots(shape, tall) if len(d) > len(shape) - 2]  # a batch axis beyond x's
    assert len(chunked) == batch_dots, (shape, dots(shape, tall))
  g = jnp.asarray(1.0 + 0.01 * rng.standard_normal((2, 8192)), jnp.bfloat16)
  g64 = np.asarray(g.astype(jnp.float32), np.float64)
  want = np.linalg.eigvalsh(g64 @ g64.T)[0]
  got = np.linalg.eigvalsh(np.asarray(SYM_MODULE.gram_in_chunks(g, False, jnp.float32, jax.lax.Precision.HIGHEST),
                                      np.float64))[0]
  assert abs(got - want) <= 0.01 * want, (got, want)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_traced_step_count_matches_static(method):
  """Under inject_hyperparams ns_steps may arrive traced: the generic loops give the same."""
  x = jax.random.normal(jax.random.key(4), (24, 72))
  static = mc.newton_schulz(x, steps=4, coeffs="polar_express_4", method=method, restarts=(2,) if method == "gram" else ())
  traced = jax.jit(lambda x, s: mc.newton_schulz(x, steps=s, coeffs="polar_express_4", method=method,
                                                 restarts=(2,) if method == "gram" else ()))(x, 4)
  chex.assert_trees_all_close(traced, static, atol=1e-5)


def test_flop_counts():
  m, n = 64, 256
  assert ns_flops((m, n), steps=5) == 5 * (4 * m * m * n + 2 * m**3)
  assert ns_flops((n, m), steps=5) == ns_flops((m, n), steps=5)
  # gram, 4 steps: G and Q X (4 m^2 n) + 13 m x m products (2 m^3 each)
  assert ns_flops((m, n), steps=4, method="gram") == 4 * m * m * n + 13 * 2 * m**3
  # a restart re-forms X and G (4 m^2 n); the next step is a first step (no H Q) and the step
  # before it needs no H R H: 10 m x m products
  assert ns_flops((m, n), steps=4, method="gram", restarts=(2,)) == 8 * m * m * n + 10 * 2 * m**3
  assert ns_flops((3, m, n), steps=4, method="gram") == 3 * ns_flops((m, n), steps=4, method="gram")
  assert ns_flops((m, m), steps=4, method="auto") == ns_flops((m, m), steps=4)
  # from SYMMETRIC_MIN on, X X^T and A A count 3/4
  assert ns_flops((512, 512), steps=1) == 2 * 512**3 * (0.75 + 0.75 + 1)
  # GPT-2 layer: the default needs 60% of Keller's five standard steps (both with symmetric
  # products), 51% of optax.contrib.muon's 5 (4 m^2 n + 2 m^3) per matrix
  shapes = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
  ours = sum(ns_flops(s, steps=None, coeffs="polar_express_4", method="auto") for s in shapes)
  keller = sum(ns_flops(s, steps=5) for s in shapes)
  optax_keller = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
  assert ours / keller == pytest.approx(0.6) and ours / optax_keller == pytest.approx(0.51)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="svd"), "method must be one of"),
        (dict(normalize="spectral"), "normalize must be one of"),
        (dict(method="gram", restarts=(0,)), r"restarts must be step indices in \[1, steps - 1\] = \[1, 4\]"),
        (dict(method="gram", restarts=(5,)), r"restarts must be step indices"),
        (dict(restarts="x"), "restarts must be a sequence of step indices"),
        (dict(method="gram", restarts=(1.5,)), r"step indices \(ints\), got \(1.5,\)"),  # not run as (1,)
        (dict(method="gram", restarts="12"), r"step indices \(ints\), got '12'"),  # not (1, 2)
        (dict(method="gram", restarts=(True,)), r"step indices \(ints\), got \(True,\)"),
        (dict(method="standard", restarts=(2,)), r"method 'standard' runs none, got \(2,\)"),  # not ignored
    ],
)
def test_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mc.newton_schulz(jnp.ones((4, 8)), **kwargs)


# ---------------------------------------------------------------- scale_by_muon


def _tree():
  k = jax.random.split(jax.random.key(5), 5)
  return {
      "a": jax.random.normal(k[0], (32, 96)),
      "b": jax.random.normal(k[1], (96, 32)),  # tall: groups with "a" when batched
      "c": jax.random.normal(k[2], (48, 48)),
      "d": jax.random.normal(k[3], (3, 32, 96)),  # a stack of three
      "e": jax.random.normal(k[4], (48, 48)),
  }


_AXES = {"a": None, "b": None, "c": None, "d": mc.MatrixAxes((-2,), (-1,)), "e": None}


def test_default_update_is_within_band_of_the_polar_factor():
  g = _tree()
  tx = mc.scale_by_muon(nesterov=False, rms_match=None, matrix_axes=_AXES)
  u, _ = jax.jit(tx.update)(g, tx.init(g))
  lo, hi = BANDS[("polar_express_4", jnp.float32)]
  for k in g:
    for x, y in zip(np.reshape(g[k], (-1,) + g[k].shape[-2:]), np.reshape(u[k], (-1,) + g[k].shape[-2:])):
      proj, rel = _response(np.asarray(x, np.float64), np.asarray(y, np.float64))
      d = np.diag(proj)[rel >= CUTOFF]
      assert lo <= d.min() and d.max() <= hi, (k, d.min(), d.max())


@pytest.mark.parametrize("ns_batch", [1, 2, 4, 100])
def test_batched_calls_give_the_same_updates(ns_batch):
  g = _tree()
  ref_tx = mc.scale_by_muon(matrix_axes=_AXES)
  ref, _ = jax.jit(ref_tx.update)(g, ref_tx.init(g))
  tx = mc.scale_by_muon(matrix_axes=_AXES, ns_batch=ns_batch)
  u, state = jax.jit(tx.update)(g, tx.init(g))
  chex.assert_trees_all_close(u, ref, atol=2e-5)
  chex.assert_trees_all_equal_shapes_and_dtypes(u, g)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))


def test_faster_paths_follow_the_plain_path():
  """Three optimizer steps: the default (Gram on wide/tall leaves, rolled standard elsewhere)
  against the plain standard iteration with the same coefficients, and the batched update."""
  params = _tree()
  opts = {
      "plain": mc.muon(0.02, ns_method="standard", matrix_axes=_AXES),
      "default": mc.muon(0.02, matrix_axes=_AXES),
      "batched": mc.muon(0.02, ns_batch=8, matrix_axes=_AXES),
      "gram": mc.muon(0.02, ns_method="gram", matrix_axes=_AXES),
  }
  out = {}
  for name, opt in opts.items():
    p, state, step = params, opt.init(params), jax.jit(opt.update)
    for t in range(3):
      g = jax.tree.map(lambda x: jnp.sin(3.0 * x + t), p)
      u, state = step(g, state, p)
      p = optax.apply_updates(p, u)
    out[name] = p
  for name in ("default", "batched", "gram"):
    chex.assert_trees_all_close(out[name], out["plain"], atol=2e-4)


def test_bf16_compute_dtype_through_scale_by_muon():
  g = _tree()
  tx = mc.scale_by_muon(matrix_axes=_AXES, compute_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16)
  u, state = jax.jit(tx.update)(g, tx.init(g))
  ref_tx = mc.scale_by_muon(matrix_axes=_AXES)
  ref, _ = jax.jit(ref_tx.update)(g, ref_tx.init(g))
  chex.assert_trees_all_equal_dtypes(u, g)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.mu))
  chex.assert_trees_all_close(u, ref, atol=0.1)  # bf16 rounding, as in test_muon


def test_one_matrix_per_call_keeps_the_temporaries_of_one_matrix():
  """ns_batch=1: matrices go one after another, and the compiled update's temporaries do not grow with the
  number of leaves (about two matrices for Gram, one for the rolled standard iteration)."""
  def temp_bytes(n_leaves, **kw):
    g = {f"w{i}": jnp.ones((128, 512)) if i % 2 else jnp.ones((512, 128)) for i in range(n_leaves)}
    tx = mc.scale_by_muon(ns_batch=1, **kw)
    return jax.jit(tx.update).lower(g, tx.init(g)).compile().memory_analysis().temp_size_in_bytes

  largest = 128 * 512 * 4
  for kw in ({}, dict(ns_coeffs="muon", ns_method="standard")):
    small, large = temp_bytes(2, **kw), temp_bytes(8, **kw)
    assert large <= small + 4096, (kw, small, large)
    assert large <= 3 * largest, (kw, large)


def test_bad_scale_by_muon_options():
  with pytest.raises(ValueError, match="ns_batch must be None or an int >= 1, got 0"):
    mc.scale_by_muon(ns_batch=0)
  with pytest.raises(ValueError, match="ns_method must be one of"):  # the argument's own name
    mc.muon(0.1, ns_method="fast")
  with pytest.raises(ValueError, match="ns_restarts must be step indices"):
    mc.muon_adamw(0.1, ns_method="gram", ns_restarts=(7,))
  with pytest.raises(ValueError, match="ns_restarts are the Gram iteration's"):
    mc.muon(0.1, ns_method="standard", ns_restarts=(2,))
  with pytest.raises(ValueError, match="ns_batch is static"):
    mc.scale_by_muon(ns_batch=jnp.asarray(2))
