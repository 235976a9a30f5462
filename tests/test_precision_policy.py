"""Newton–Schulz at the accelerators' default matmul precision, emulated on the CPU.

A float32 product that names no precision runs in one bfloat16 pass on a TPU and in TF32 on an
NVIDIA GPU. ``_emulated_backend.emulate`` runs the update on the CPU as if there (the backend's
name, its operand rounding); the precision policy (``_orthogonalize.precision``) must keep
Muon's update in its band on every backend: every response along an input singular direction
above 3e-3 of the norm within [0.70, 1.25] and the largest singular value at most 1.25
(``polar_express_4``'s band is [0.779, 1.200]; bfloat16 compute rounds to its grid next to 1.2).
"""

import sys

import jax
import jax.numpy as jnp
import pytest

import muonclip_jax as mc
from muonclip_jax._orthogonalize import ns_flops, precision
from _emulated_backend import band, emulate, INPUT_KINDS, make_input, moonlight_scale, products, weighted_flops

SHAPES = {"wide": (64, 256), "tall": (256, 64), "square": (64, 64), "experts": (4, 48, 160)}
STACK = mc.MatrixAxes((-2,), (-1,))


def _grads():
  return {f"{name}_{kind}": jnp.asarray(make_input(kind, shape)) for name, shape in SHAPES.items()
          for kind in INPUT_KINDS}


def _axes(tree):
  return {k: STACK if v.ndim == 3 else None for k, v in tree.items()}


# Lowered program text -> executable: a program met again is compiled once (the TPU's "auto" is
# its "standard", its "gram" the CPU's).
_COMPILED = {}


def _compiled(fn, *args):
  lowered = jax.jit(fn).lower(*args)
  text = lowered.as_text()
  if text not in _COMPILED:
    _COMPILED[text] = lowered.compile()
  return _COMPILED[text]


@pytest.mark.parametrize("backend", ["tpu", "gpu", "cpu"])
def test_the_update_holds_its_band_at_each_backends_default_precision(backend):
  """The default optimizer and each ns_method, float32 and bfloat16 compute: wide, tall, square and an
  expert stack; Gaussian, low-rank plus noise and condition-1e6 gradients. The Gram iteration, whose
  factor is rounded once (to float16 on a GPU), keeps polar_express_4's [0.779, 1.200] to 0.01 even
  with bfloat16 compute (its float16 step matrices in square form: 0.771 on the emulated GPU's
  wide low-rank gradient with bfloat16 compute, 0.778 before; the form it replaced gave 0.69 and
  0.76 on two 2x8192 Gaussian ones). A zero gradient gives a zero update."""
  grads = _grads()
  for method in ("auto", "standard", "gram"):
    for compute in (None, jnp.bfloat16):
      opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=method, compute_dtype=compute, matrix_axes=_axes)
      with emulate(backend):
        step = _compiled(opt.update, grads, opt.init(grads), grads)
        updates, _ = step(grads, opt.init(grads), grads)
        # a zero gradient (an unused layer) gives a zero update: the float16 Gram path gave NaN
        zero, _ = step(jax.tree.map(jnp.zeros_like, grads), opt.init(grads), grads)
      assert all(not jnp.any(z) for z in jax.tree.leaves(zero)), (backend, method, compute)
      for key, g in grads.items():
        got = band(-updates[key], g, scale=moonlight_scale(g.shape))
        where = f"{backend} {method} {compute} {key}: {got}"
        assert got.top <= 1.25 and 0.70 <= got.low and got.high <= 1.25, where
        if method == "gram":  # its float32 m x m iteration (or float16 operands, restarted): the float32 band
          assert got.top <= 1.205 and got.low >= 0.769, where


def _trace(fn, args, backend, flag):
  with emulate(backend):
    if flag is None:
      return str(jax.make_jaxpr(fn)(*args))
    with jax.default_matmul_precision(flag):
      return str(jax.make_jaxpr(fn)(*args))


def test_no_product_depends_on_the_global_matmul_precision():
  """Every dot of the update names its precision: setting jax_default_matmul_precision changes nothing.
  Whole matrices, stacks, per-head blocks, and matrices placed or split over a mesh go through one policy."""
  grads = {"wide": jnp.ones((16, 48)), "stack": jnp.ones((2, 16, 16))}
  heads = {"wq": {"kernel": jnp.ones((6, 8))}, "wk": {"kernel": jnp.ones((6, 8))}}
  mesh = jax.make_mesh((8,), ("model",))
  split = {"w": jax.random.normal(jax.random.key(0), (16, 128))}
  cases = [(mc.muon(1.0, ns_method=m, matrix_axes=_axes), grads) for m in ("auto", "standard", "gram")]
  cases += [(mc.muon(1.0, layout=mc.GQALayout(2, 2, 4, value=None), muon_blocks="head"), heads),
            (mc.muon(1.0, ns_method="gram", shard_orthogonalization=mesh, shard_split="always"), split)]
  for i, (opt, tree) in enumerate(cases):
    state = opt.init(tree)
    for backend in ("tpu", "gpu", "cpu"):
      # emulated, a dot rounds its operands by the precision it names, else by the flag
      traced = {_trace(opt.update, (tree, state, tree), backend, flag) for flag in (None, "bfloat16", "float32")}
      assert len(traced) == 1, (i, backend)


def test_the_update_lowers_for_the_accelerators_platforms(monkeypatch):
  """The default update, traced as on a GPU (a TPU), lowers to StableHLO for CUDA (TPU): the
  target's own lowering rules, which the CPU never runs. On CUDA every ``dot_general`` takes two
  float16 operands; on the TPU every one runs at ``DEFAULT`` (the standard iteration in one pass)
  but a small matrix's (at most ``SMALL_ENTRIES``), at ``HIGHEST``. (JAX writes ``DEFAULT`` for a
  dot that names no precision too, so this cannot show that each names one:
  ``test_no_product_depends_on_the_global_matmul_precision`` does.)"""
  import re
  large = {"wide": jnp.ones((64, 160)), "square": jnp.ones((72, 72)), "stack": jnp.ones((2, 64, 96))}
  small = {"small": jnp.ones((16, 48))}
  for backend, platform in (("gpu", "cuda"), ("tpu", "tpu")):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    for compute in (None, jnp.bfloat16):
      opt = mc.muon(1.0, compute_dtype=compute, matrix_axes=_axes)
      for grads, tpu_precision in ((large, "DEFAULT"), (small, "HIGHEST")):
        text = jax.jit(lambda t, o=opt: o.update(t, o.init(t), t)).trace(grads).lower(
            lowering_platforms=(platform,)).as_text()
        dots = re.findall(r"stablehlo.dot_general .*", text)
        assert len(dots) >= 3 * len(grads), (platform, compute, len(dots))  # three products or more a matrix
        operands = {re.search(r": \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", d).groups() for d in dots}
        if platform == "cuda":
          assert operands == {("f16", "f16")}, (compute, operands)
        else:
          assert all(f"precision = [{tpu_precision}, {tpu_precision}]" in d for d in dots), (compute, tpu_precision)


def test_the_policy_per_backend_and_its_override():
  """CPU: Gram where it saves FLOPs, every product exact; GPU: the same choice, every product on
  float16 operands, the Gram iteration restarted before step 2; TPU: "auto" is the standard iteration
  at the one-pass rate, a Gram iteration keeps exact products; ns_precision picks any of them anywhere."""
  highest, default, f16 = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT, precision.FLOAT16
  for backend, gram, standard, gram_products in (("cpu", True, highest, highest), ("gpu", True, f16, f16),
                                                 ("tpu", False, default, highest)):
    with emulate(backend):
      assert precision.uses_gram("auto", 64, 256, None, 2) is gram
      assert precision.products(None, False, 64, 256) == standard
      assert precision.products(None, True, 64, 256) == gram_products
      assert precision.uses_gram("auto", 64, 256, "highest", 2) and precision.uses_gram("auto", 64, 256, "float16", 2)
      assert not precision.uses_gram("auto", 64, 256, "default", 2)
      assert ns_flops((64, 256), steps=4, method="auto") == ns_flops(
          (64, 256), steps=4, method="gram" if gram else "standard")
  # the restart is counted where it runs: float16 Gram products, more than 2 steps, none given
  assert precision.restarts((), (), 4, f16) == (2,) and precision.restarts((), (), 2, f16) == ()
  assert precision.restarts((), (), 5, f16) == (2, 4) and precision.restarts((3,), (), 4, f16) == (2, 3)
  assert precision.restarts((), (), 4, highest) == () and precision.restarts((), (5,), 10, highest) == (5,)
  assert precision.restarts((), (5,), 10, f16) == (2, 4, 5, 6, 8)
  # exact products: one every 5 steps past the presets' counts (DeepSeek-V4's own is the same)
  assert precision.restarts((), (), 5, highest) == () and precision.restarts((), (), 12, highest) == (5, 10)
  assert ns_flops((64, 256), steps=4, method="gram", precision="float16") == ns_flops(
      (64, 256), steps=4, method="gram", precision="highest", restarts=(2,))
  # the standard iteration's first step in two parts where its products are narrower than float32
  exact = ns_flops((64, 256), steps=4, precision="highest")
  for pol, compute in (("default", None), ("float16", None), ("highest", jnp.bfloat16)):
    assert ns_flops((64, 256), steps=4, precision=pol, compute_dtype=compute) == exact + 2 * 64 * 64 * 256
    with emulate("cpu"):
      traced = sum(f for _, f, _ in products(jax.make_jaxpr(lambda x: mc.newton_schulz(
          x, steps=4, precision=pol, compute_dtype=compute))(jnp.ones((64, 256))).jaxpr))
    assert traced == exact + 2 * 64 * 64 * 256, (pol, compute, traced)
  # the Gram iteration's Q X_0 in two parts for a 16-bit X_0 (not under "float16": one float16 product)
  for pol, compute, parts in (("highest", None, 1), ("highest", jnp.bfloat16, 2), ("float16", jnp.bfloat16, 1)):
    with emulate("cpu"):
      traced = sum(f for _, f, _ in products(jax.make_jaxpr(lambda x: mc.newton_schulz(
          x, steps=4, method="gram", precision=pol, compute_dtype=compute))(jnp.ones((64, 256))).jaxpr))
    counted = ns_flops((64, 256), steps=4, method="gram", precision=pol, compute_dtype=compute)
    restarted = len(precision.restarts((), (), 4, precision.products(pol, True, 64, 256)))
    assert traced == counted == ns_flops((64, 256), steps=4, method="gram", precision=pol) + (parts - 1) * (
        1 + restarted) * 2 * 64 * 64 * 256, (pol, compute, traced, counted)
  x = jnp.asarray(make_input("cond_1e6", (64, 256)))
  for backend, pol in (("tpu", "highest"), ("tpu", "float16"), ("cpu", "float16")):  # another backend's policy
    with emulate(backend):
      out = mc.newton_schulz(x, coeffs="polar_express_4", method="auto", precision=pol)
    got = band(out, x)
    assert got.top <= 1.25 and got.low >= 0.70, (backend, pol, got)
  with pytest.raises(ValueError, match=r"ns_precision .* must be None .* one of \('highest', 'float16', 'default'\), "
                                       r"got 'fast'"):
    mc.muon(1.0, ns_precision="fast")
  for method in ("gram", "standard", "auto"):
    with pytest.raises(ValueError, match="got 'fast'"):
      mc.newton_schulz(x, method=method, precision="fast")


def test_without_its_restart_the_float16_gram_iteration_leaves_the_band(monkeypatch):
  """What the restart is for: float16 operands, polar_express_4's update of a condition-1e6 256x1024
  gradient on an emulated GPU. With the restart before step 2 the band holds; without it the largest
  singular value reaches 1.28."""
  g = jnp.asarray(make_input("cond_1e6", (256, 1024)))
  opt = mc.muon(1.0, weight_decay=0.0, beta=0.0)

  def top():
    with emulate("gpu"):
      updates, _ = jax.jit(opt.update)(g, opt.init(g), g)
    return band(-updates, g, scale=moonlight_scale(g.shape)).top

  assert top() <= 1.21
  ns_module = sys.modules["muonclip_jax._orthogonalize.newton_schulz"]  # the function's module
  monkeypatch.setattr(ns_module, "policy_restarts", lambda given, own, steps, prec: given or own)
  jax.clear_caches()
  assert top() > 1.25


def test_restarts_a_caller_asks_for_add_to_the_policys():
  """``restarts`` adds restarts, never removes those the products need: DeepSeek-V4's own restart
  spelled out (``restarts=(5,)``) on float16 products was NaN when it replaced the policy's every two
  steps. Now it is the same iteration as without it, and an extra restart (3) keeps the others."""
  assert precision.restarts((3,), (5,), 10, precision.FLOAT16) == (2, 3, 4, 5, 6, 8)
  assert precision.restarts((3,), (), 12, jax.lax.Precision.HIGHEST) == (3, 5, 10)
  x = jnp.asarray(make_input("cond_1e6", (64, 256)))
  ns = lambda **kw: mc.newton_schulz(x, steps=None, coeffs="deepseek_v4", method="gram", precision="float16", **kw)  # noqa: E731
  got, want = band(ns(restarts=(5,)), x), band(ns(), x)
  assert abs(got.top - want.top) <= 1e-3 and abs(got.low - want.low) <= 1e-3, (got, want)
  assert 0.99 <= got.low and got.top <= 1.01, got


def test_a_float32_gram_iteration_longer_than_its_preset_keeps_its_band():
  """More steps than a preset's own, with exact float32 Gram products (the CPU's default, a TPU's
  ``method="gram"``): without a restart the factor's rounding grows unchecked (polar_express_4 at 10
  steps: largest singular value 70; "muon" at 10: 3e19; 16 steps: not finite). Restarted every 5
  steps they hold the band, also with a traced step count (``inject_hyperparams``)."""
  x = jnp.asarray(make_input("cond_1e6", (64, 256)))
  for coeffs, steps, top in (("polar_express_4", 10, 1.01), ("muon", 12, 1.21), ("polar_express", 16, 1.01)):
    fn = jax.jit(lambda x, s: mc.newton_schulz(x, steps=s, coeffs=coeffs, method="gram"))
    with emulate("cpu"):
      static = mc.newton_schulz(x, steps=steps, coeffs=coeffs, method="gram")
      traced = fn(x, steps)
    for out in (static, traced):
      got = band(out, x)
      assert got.top <= top and got.low >= 0.67, (coeffs, steps, got)
  with emulate("tpu"):  # a TPU's Gram iteration, asked for by name: exact products too
    got = band(jax.jit(lambda x: mc.newton_schulz(x, steps=10, method="gram"))(x), x)
  assert got.top <= 1.21 and got.low >= 0.67, got


def test_every_preset_keeps_its_band_with_float16_gram_products():
  """The float16 Gram iteration of each preset against the same iteration with exact float32 products, on
  a condition-1e6 256x1024 input: the largest singular value and the responses within 0.01. DeepSeek-V4's
  ten steps (eight of Keller's, which grow small singular values ~2e4-fold) need a restart every 2
  steps: with only its own before step 5 the float16 iteration overflows, with 2 and 5 its largest
  singular value is 2.2."""
  x = jnp.asarray(make_input("cond_1e6", (256, 1024)))
  for coeffs in ("muon", "polar_express", "polar_express_4", "deepseek_v4"):
    with emulate("gpu"):
      got, want = (jax.jit(lambda x, p=p: mc.newton_schulz(x, steps=None, coeffs=coeffs, method="gram",
                                                           precision=p))(x) for p in ("float16", "highest"))
    got, want = band(got, x), band(want, x)
    assert abs(got.top - want.top) <= 0.01 and abs(got.low - want.low) <= 0.01, (coeffs, got, want)
    assert abs(got.high - want.high) <= 0.01, (coeffs, got, want)


def test_the_gpu_path_multiplies_16_bit_operands_only_and_fewer_weighted_flops_than_optax():
  """What a CPU can check of the GPU path's speed: on an emulated GPU, the default update's
  products all take float16 operands (whole, stacked and per-head matrices; float32 and bfloat16
  compute), and its matmul FLOPs, a float32 product counted at twice a 16-bit one, against
  ``optax.contrib.muon``'s (its defaults: 5 steps of the standard iteration on float32 operands) on the
  same matrices: <= 0.6 on wide 64x256, <= 0.8 on square 64x64, <= 0.65 on a 4x64x224 expert stack
  (the time goals on an H100 against optax, taken as FLOPs). The stack is one Newton–Schulz call: every
  product batches its 4 experts, none a zero-padded slot. Where the program has no loop (XLA's
  cost analysis counts a loop's body once; the standard iteration, which the square matrix takes,
  runs its steps in a rolled loop), the traced count is XLA's cost analysis of the lowered update
  less its elementwise work (at most 10%)."""
  from optax import contrib
  cases = {"wide": ((64, 256), 0.6), "square": ((64, 64), 0.8), "experts": ((4, 64, 224), 0.65)}
  for name, (shape, goal) in cases.items():
    g = {"w": jnp.asarray(make_input("gaussian", shape))}
    dims = {"w": contrib.MuonDimensionNumbers((1,), (2,))} if len(shape) == 3 else None
    theirs_opt = contrib.muon(1.0, muon_weight_dimension_numbers=dims)
    theirs_fn = lambda t, o=theirs_opt: o.update(t, o.init(t), t)  # noqa: E731
    theirs, _, _ = weighted_flops(theirs_fn, g)
    for compute in (None, jnp.bfloat16):
      opt = mc.muon(1.0, compute_dtype=compute, matrix_axes=_axes)
      ours_fn = lambda t, o=opt: o.update(t, o.init(t), t)  # noqa: E731
      ours, dtypes, batches = weighted_flops(ours_fn, g)
      assert dtypes == {jnp.dtype(jnp.float16)}, (name, compute, dtypes)
      assert batches == {shape[0] if len(shape) == 3 else 1}, (name, batches)
      assert ours <= goal * theirs, (name, compute, ours / theirs)
      if compute is None and name != "square":  # ours: float16 products, weight 1; optax's: float32, 2
        for fn, traced in ((ours_fn, ours), (theirs_fn, theirs / 2)):
          with emulate("gpu"):
            xla = jax.jit(fn).lower(g).cost_analysis()["flops"]
          assert traced <= xla <= 1.1 * traced, (name, xla / traced)
  heads = {"wq": {"kernel": jnp.ones((6, 8))}, "wk": {"kernel": jnp.ones((6, 8))}}
  opt = mc.muon(1.0, layout=mc.GQALayout(2, 2, 4, value=None), muon_blocks="head")
  _, dtypes, _ = weighted_flops(lambda t: opt.update(t, opt.init(t), t), heads)
  assert dtypes == {jnp.dtype(jnp.float16)}, dtypes


def test_a_step_matrix_in_square_form_is_the_steps_polynomial():
  """``a I + b A + c A^2 = c (A - alpha I)^2 + b' A + gamma I`` (``square_form``, float64 NumPy) for every
  preset's rows and a custom table with a ``c = 0`` row, and ``step_matrix``'s ``B + gamma I`` equals it
  in float32; every preset's step has ``c > 0`` and ``gamma > 0``: two positive semi-definite terms."""
  import numpy as np
  from muonclip_jax._orthogonalize.newton_schulz import square_form, step_matrix
  from muonclip_jax._orthogonalize.presets import PRESETS, resolve_coeffs
  rng = np.random.default_rng(0)
  x = rng.standard_normal((6, 10))
  a_mat = x @ x.T / 10
  eye = np.eye(6)
  custom = np.array([[1.5, -0.5, 0.0], [3.0, -3.2, 1.2]])
  for table in [resolve_coeffs(p, None)[0] for p in PRESETS] + [custom]:
    for (a, b, c), row in zip(table, square_form(table)):
      want = a * eye + b * a_mat + c * a_mat @ a_mat
      d = a_mat - row[1] * eye
      np.testing.assert_allclose(row[0] * d @ d + row[2] * a_mat + row[3] * eye, want, rtol=1e-12, atol=1e-12)
      B, gamma = step_matrix(jnp.asarray(a_mat, jnp.float32), jnp.asarray(row, jnp.float32),
                             jax.lax.Precision.HIGHEST)
      np.testing.assert_allclose(np.asarray(B) + float(gamma) * eye, want, rtol=1e-5, atol=1e-5)
      if table is not custom:
        assert row[0] > 0 and row[3] > 0, (table, row)


def test_a_flat_spectrum_keeps_its_band_with_8_bit_operands():
  """Two rows of Gaussian noise (singular values within 6% of each other) sit where polar_express_4's
  first step multiplies by 0.03, from terms of 8 to 17. Formed as ``a X + (b A + c A^2) X`` with ``c A^2``
  from bfloat16 operands, that step was wrong by its whole value there: on this stack of three 2x1024
  gradients the smallest response was 0.55 on an emulated TPU (one bf16 pass; the standard iteration
  is its default) and -0.10 with bfloat16 compute on the CPU. Formed in float32 in square form
  (``step_matrix``, the first step's ``B`` in two parts), 0.988 on both."""
  g = jnp.asarray(make_input("gaussian", (3, 2, 1024), seed=1))
  for backend, compute in (("tpu", None), ("cpu", jnp.bfloat16)):
    with emulate(backend):
      out = jax.jit(lambda x: mc.newton_schulz(x, coeffs="polar_express_4", method="standard",
                                               compute_dtype=compute))(g)
    got = band(out, g)
    assert got.top <= 1.25 and 0.70 <= got.low and got.high <= 1.25, (backend, compute, got)


def test_a_mean_dominated_gradient_of_bfloat16_values_keeps_the_gram_band():
  """The Gram iteration forms ``G = X_0 X_0^T`` once and never corrects its rounding. Two 2x8192
  gradients holding bfloat16 values, ones plus 1% noise (second singular value 0.7% of the first):
  summed by one dot over the 8192 columns, ``G``'s float32 rounding moved its small eigenvalue by
  about 30% and the update's largest singular value was 1.276 on the CPU (its default, ``"auto"``,
  runs the Gram iteration) and on an emulated TPU's ``"gram"``, with float32 and bfloat16 compute
  (JAX 0.10.2; 1.206 and 1.217 under JAX 0.12, whose dot sums in another order). Summed in chunks
  of 256 columns (``symmetric.gram_in_chunks``): 1.200 under both."""
  import numpy as np
  rng = np.random.default_rng(0)
  g = jnp.asarray(1.0 + 0.01 * rng.standard_normal((2, 2, 8192)), jnp.bfloat16).astype(jnp.float32)
  for backend, method in (("cpu", "auto"), ("tpu", "gram"), ("gpu", "auto")):
    for compute in (None, jnp.bfloat16):
      opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=method, compute_dtype=compute, matrix_axes=STACK)
      with emulate(backend):
        updates, _ = jax.jit(opt.update)(g, opt.init(g), g)
      got = band(-updates, g, scale=moonlight_scale(g.shape))
      assert got.top <= 1.205 and got.low >= 0.769, (backend, method, compute, got)


def test_small_gradients_of_bfloat16_values_keep_the_band():
  """Bfloat16 gradients (so bfloat16 compute, the default) of 4x4 matrices whose spectra fall
  geometrically from 1 to 3.2e-3, the smallest singular value just above the cutoff. Divided by
  their norm before the iteration, they were rounded to bfloat16 a second time, which moved some
  smallest singular values below where polar_express_4 maps into its band: lowest response 0.657
  (CPU), 0.689 (emulated GPU), 0.647 (emulated TPU) on this stack of 40. Scaled by powers of two
  instead (``newton_schulz.power_of_two_scale``, exact), the norm folded into the first step, they
  reach the iteration unrounded: 0.788-0.794."""
  import numpy as np
  rng = np.random.default_rng([0, 4, 4])
  mats = []
  for _ in range(40):
    u, v = (q * np.sign(np.diag(r)) for q, r in (np.linalg.qr(rng.standard_normal((4, 4))) for _ in range(2)))
    mats.append((u * np.geomspace(1.0, 3.2e-3, 4)) @ v.T)
  g = jnp.asarray(np.stack(mats), jnp.bfloat16)
  opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, matrix_axes=STACK)
  for backend in ("cpu", "gpu", "tpu"):
    with emulate(backend):
      updates, _ = jax.jit(opt.update)(g, opt.init(g), g)
    got = band(-updates.astype(jnp.float32), g.astype(jnp.float32), scale=moonlight_scale(g.shape))
    assert got.top <= 1.25 and 0.70 <= got.low and got.high <= 1.25, (backend, got)


def test_small_matrices_of_float32_values_keep_the_band_on_a_tpu():
  """A float32 gradient whose spectrum is one large singular value and the rest at 1.007 times
  the cutoff (3.02e-3 of the norm), float32 compute: rounded to 8 bits in one TPU pass, an 8x8
  matrix's small singular values fell below the cutoff (lowest response 0.572 on this stack of 40).
  A matrix of at most ``SMALL_ENTRIES`` entries multiplies at ``HIGHEST`` there."""
  import numpy as np
  for m in (8, 16):
    rng = np.random.default_rng([7, m])
    small = 3.02e-3 / np.sqrt(1 - (m - 1) * 3.02e-3**2)  # of the norm, with the top one at 1
    mats = []
    for _ in range(40):
      u, v = (np.linalg.qr(rng.standard_normal((m, m)))[0] for _ in range(2))
      mats.append((u * np.array([1.0] + [small] * (m - 1))) @ v.T)
    g = jnp.asarray(np.stack(mats), jnp.float32)
    opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, matrix_axes=STACK)
    with emulate("tpu"):
      updates, _ = jax.jit(opt.update)(g, opt.init(g), g)
    got = band(-updates, g, scale=moonlight_scale(g.shape))
    assert got.top <= 1.25 and 0.70 <= got.low and got.high <= 1.25, (m, got)
