"""scale_by_muon and muon: the Moonlight reference, RMS matching, and the optax battery."""

import inspect
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc
from _muon_reference import np_muon_step, np_newton_schulz
from _exactness import assert_same_math

LR = 0.02
# The Moonlight reference (tests/_muon_reference.py) runs Keller Jordan's five quintic steps on
# the full matrix; the library's default is the faster "polar_express_4" with Gram
# Newton–Schulz on wide matrices, compared with the SVD in tests/test_fast_orthogonalization.py.
KELLER = dict(ns_coeffs="muon", ns_steps=5, ns_method="standard")


def _grads(shapes, step, seed=0):
  rng = np.random.default_rng(seed * 1000 + step)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_moonlight_reference(nesterov):
  """Four steps on rectangular, square, tall and stacked matrices, in float32.

  Tolerance: the NumPy reference runs in float64; float32 Newton–Schulz multiplies a
  rounding error of ~1e-7 by up to a^5 ~ 5e2 (a = 3.4445), so entries of O agree to ~1e-4
  relative, and the update is lr * 0.2 * sqrt(max dim) * O.
  """
  shapes = {"wide": (24, 40), "square": (32, 32), "tall": (40, 24), "stack": (3, 16, 24)}
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  opt = mc.muon(LR, nesterov=nesterov, **KELLER, matrix_axes={"wide": None, "square": None, "tall": None,
                                                    "stack": mc.MatrixAxes((-2,), (-1,))})
  state = opt.init(params)
  step = jax.jit(opt.update)
  ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
  bufs = {k: np.zeros(s) for k, s in shapes.items()}
  p = params
  for t in range(4):
    g = _grads(shapes, t)
    updates, state = step(g, state, p)
    p = optax.apply_updates(p, updates)
    for k in shapes:
      if k == "stack":
        outs = [np_muon_step(ref[k][i], g[k][i], bufs[k][i], lr=LR, nesterov=nesterov) for i in range(3)]
        ref[k] = np.stack([o[0] for o in outs])
        bufs[k] = np.stack([o[1] for o in outs])
      else:
        ref[k], bufs[k] = np_muon_step(ref[k], g[k], bufs[k], lr=LR, nesterov=nesterov)
  for k in shapes:
    np.testing.assert_allclose(np.asarray(p[k]), ref[k], rtol=1e-4, atol=2e-5, err_msg=k)


def test_rms_modes():
  g = {"w": jax.random.normal(jax.random.key(0), (16, 64))}
  o = jax.tree.map(lambda x: np_newton_schulz(np.asarray(x)), g)["w"]
  for mode, factor in [("moonlight", 0.2 * 8.0), ("keller", 2.0), (None, 1.0)]:
    tx = mc.scale_by_muon(rms_match=mode, nesterov=False, **KELLER)
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(np.asarray(u["w"]), factor * o, rtol=1e-4, atol=1e-5, err_msg=str(mode))
  tx = mc.scale_by_muon(rms_scale=0.3, nesterov=False, **KELLER)
  u, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(np.asarray(u["w"]), 0.3 * 8.0 * o, rtol=1e-4, atol=1e-5)


def test_moonlight_update_rms_matches_adamw_scale():
  """0.2 * sqrt(max(A, B)) makes the RMS of the update ~0.2 (Moonlight, section 2.2)."""
  g = {"w": jax.random.normal(jax.random.key(1), (256, 512))}
  tx = mc.scale_by_muon(ns_coeffs="polar_express")
  u, _ = tx.update(g, tx.init(g))
  rms = float(jnp.sqrt(jnp.mean(u["w"] ** 2)))
  assert 0.17 < rms < 0.22, rms


def test_stacked_and_per_head_kernels():
  k = jax.random.split(jax.random.key(2), 3)
  stacked = jax.random.normal(k[0], (4, 16, 24))
  per_head = jax.random.normal(k[1], (16, 4, 6))  # DenseGeneral (in, heads, head_dim)
  out_proj = jax.random.normal(k[2], (4, 6, 16))  # (heads, head_dim, out)
  g = {"stacked": stacked, "per_head": per_head, "out": out_proj}
  axes = {"stacked": mc.MatrixAxes((-2,), (-1,)), "per_head": mc.MatrixAxes((0,), (1, 2)),
          "out": mc.MatrixAxes((0, 1), (2,))}
  tx = mc.scale_by_muon(matrix_axes=axes, nesterov=False)
  u, _ = tx.update(g, tx.init(g))
  for i in range(4):  # each layer on its own, never one big matrix
    ref = tx.update({"w": stacked[i]}, tx.init({"w": stacked[i]}))[0]["w"]
    chex.assert_trees_all_close(u["stacked"][i], ref, atol=1e-5)
  ref = tx.update({"w": per_head.reshape(16, 24)}, tx.init({"w": per_head.reshape(16, 24)}))[0]["w"]
  chex.assert_trees_all_close(u["per_head"], ref.reshape(16, 4, 6), atol=1e-5)
  ref = tx.update({"w": out_proj.reshape(24, 16)}, tx.init({"w": out_proj.reshape(24, 16)}))[0]["w"]
  chex.assert_trees_all_close(u["out"], ref.reshape(4, 6, 16), atol=1e-5)


def test_single_matrix_axes_and_callable():
  g = {"a": jnp.ones((2, 8, 12)), "b": jnp.ones((3, 12, 8))}
  tx1 = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((-2,), (-1,)))
  tx2 = mc.scale_by_muon(matrix_axes=lambda p: jax.tree.map(lambda _: mc.MatrixAxes((1,), (2,)), p))
  chex.assert_trees_all_close(tx1.update(g, tx1.init(g))[0], tx2.update(g, tx2.init(g))[0])


def test_ambiguous_tensor_raises_with_path_and_shape():
  tx = mc.scale_by_muon()
  with pytest.raises(ValueError, match=r"layers/attn/kernel: .*shape \(4, 8, 8\)"):
    tx.init({"layers": {"attn": {"kernel": jnp.ones((4, 8, 8))}}})
  bad = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((0,), (3,)))
  with pytest.raises(ValueError, match=r"w: .* names axis 3, but the parameter has shape \(8, 8\)"):
    bad.init({"w": jnp.ones((8, 8))})
  with pytest.raises(ValueError, match="at least one fan_in"):
    mc.MatrixAxes((), (1,))


# ---------------------------------------------------------------- the optax battery


def _params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(3), 2)
  return {"w1": jax.random.normal(k[0], (16, 32), dtype), "w2": jax.random.normal(k[1], (32, 8), dtype)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_no_retrace_and_dtype_kept(dtype):
  chex.clear_trace_counter()
  params = _params(dtype)
  opt = mc.muon(LR)
  state = opt.init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state):
    grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32)).astype(p.dtype), params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(3):
    params, state = step(params, state)
  chex.assert_trees_all_equal_dtypes(params, _params(dtype))
  chex.assert_trees_all_equal_dtypes(state[0].mu, _params(dtype))
  assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(params))


def test_state_is_arrays_only_and_init_on_shape_dtype_struct():
  params = _params()
  opt = mc.muon_adamw(LR)
  state = opt.init(params)
  leaves = jax.tree.leaves(state)
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  abstract_state = jax.eval_shape(opt.init, abstract)
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract_state, state)
  state2 = mc.muon(LR).init(abstract)  # init directly on ShapeDtypeStruct leaves
  chex.assert_trees_all_equal_shapes(state2, mc.muon(LR).init(params))


def test_mu_dtype_and_compute_dtype():
  params = _params()
  opt = mc.scale_by_muon(mu_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
  state = opt.init(params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.mu))
  u, state = opt.update(params, state)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))
  ref, _ = mc.scale_by_muon().update(params, mc.scale_by_muon().init(params))
  chex.assert_trees_all_close(u, ref, atol=0.1)


def _run(opt, params, steps=3):
  state = opt.init(params)
  for t in range(steps):
    g = jax.tree.map(lambda p: jnp.cos(p * (t + 1)), params)
    updates, state = jax.jit(opt.update)(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_composes_with_chain_masked_clip_multisteps_and_apply_if_finite():
  params = _params()
  chained = optax.chain(optax.clip_by_global_norm(1.0), mc.muon(LR))
  p, _ = _run(chained, params)
  chex.assert_tree_all_finite(p)
  masked = optax.masked(mc.muon(LR), {"w1": True, "w2": False})
  p, _ = _run(masked, params)
  assert not np.allclose(p["w1"], params["w1"])  # masked-out w2 gets the raw gradients
  chex.assert_trees_all_close(p["w2"], _run(optax.identity(), {"w2": params["w2"]})[0]["w2"])
  # MultiSteps(k=2) over 4 micro-steps equals 2 plain steps on the mean gradients.
  ms = optax.MultiSteps(mc.muon(LR), every_k_schedule=2)
  state, ms_update = ms.init(params), jax.jit(ms.update)  # eagerly, each call compiled its cond anew
  plain = mc.muon(LR)
  pstate, plain_update = plain.init(params), jax.jit(plain.update)
  p_ms, p_plain = params, params
  for t in range(2):
    g1 = jax.tree.map(lambda x: jnp.sin(x * (t + 1)), params)
    g2 = jax.tree.map(lambda x: jnp.cos(x * (t + 2)), params)
    for g in (g1, g2):
      u, state = ms_update(g, state, p_ms)
      p_ms = optax.apply_updates(p_ms, u)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    u, pstate = plain_update(mean, pstate, p_plain)
    p_plain = optax.apply_updates(p_plain, u)
  chex.assert_trees_all_close(p_ms, p_plain, atol=1e-5)
  # apply_if_finite: a NaN step is skipped and the momentum is kept.
  safe = optax.apply_if_finite(mc.muon(LR), max_consecutive_errors=3)
  state, safe_update = safe.init(params), jax.jit(safe.update)
  g = jax.tree.map(jnp.sin, params)
  _, state = safe_update(g, state, params)
  mu_before = state.inner_state[0].mu
  bad = {"w1": g["w1"].at[0, 0].set(jnp.nan), "w2": g["w2"]}
  u, state = safe_update(bad, state, params)
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(state.inner_state[0].mu, mu_before)
  assert int(state.notfinite_count) == 1


def test_inject_hyperparams_and_schedules():
  params = _params()
  sched = optax.linear_schedule(LR, 0.0, 10)
  for factory, kwargs in [(mc.muon, dict(weight_decay=0.1, beta=0.9, rms_scale=0.2)),
                          (mc.muon_adamw, dict(weight_decay=0.1, adam_b2=0.95))]:
    opt = optax.inject_hyperparams(factory)(learning_rate=LR, **kwargs)
    p_inj, state = _run(opt, params)
    p_ref, _ = _run(factory(LR, **kwargs), params)
    chex.assert_trees_all_close(p_inj, p_ref, atol=1e-6)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(LR)
    p_sched, _ = _run(factory(sched, **kwargs), params)
    chex.assert_tree_all_finite(p_sched)
  # a hyperparameter can change between steps without retracing
  opt = optax.inject_hyperparams(mc.muon)(learning_rate=LR, weight_decay=0.0)
  state = opt.init(params)
  state.hyperparams["weight_decay"] = jnp.asarray(0.5)
  u, _ = opt.update(jax.tree.map(jnp.zeros_like, params), state, params)
  chex.assert_trees_all_close(u, jax.tree.map(lambda p: -LR * 0.5 * p, params), rtol=1e-6)


def test_zero_gradient_gives_zero_update_and_nan_leaf_is_isolated():
  params = _params()
  tx = mc.scale_by_muon()
  u, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params))
  chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))
  for dtype in (jnp.float16, jnp.bfloat16):  # the default Schatten-4 scale of a zero matrix gave float16 a NaN
    low = jax.tree.map(lambda p, dtype=dtype: p.astype(dtype), params)
    u, _ = tx.update(jax.tree.map(jnp.zeros_like, low), tx.init(low))
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, low))
  for bad_value in (jnp.nan, jnp.inf):
    g = jax.tree.map(jnp.sin, params)
    g["w1"] = g["w1"].at[1, 2].set(bad_value)
    u, state = tx.update(g, tx.init(params))
    clean, _ = tx.update({"w2": g["w2"]}, tx.init({"w2": params["w2"]}))
    assert_same_math(u["w2"], clean["w2"])
    chex.assert_tree_all_finite(state.mu["w2"])
    # documented (docs/training.md, the input contract): w1's momentum stays NaN, its scale 1
    later, state = tx.update(jax.tree.map(jnp.sin, params), state)
    assert np.isnan(np.asarray(later["w1"])).all() and float(state.mu_scale["w1"]) == 1.0


@pytest.mark.parametrize("shape", [(16, 32), (1, 16), (8, 16, 1)])
def test_an_update_of_another_shape_than_its_parameter_names_the_path(shape):
  params = {"block": {"w": jnp.ones((8, 16))}}
  opt = mc.muon(0.1)
  with pytest.raises(ValueError, match=rf"the update at block/w has shape {re.escape(str(shape))}, but its "
                                       r"momentum \(the parameter's shape at init\) is \(8, 16\)"):
    opt.update({"block": {"w": jnp.ones(shape)}}, opt.init(params), params)


@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        (mc.muon, dict(weight_decay=-0.1), r"weight_decay must be >= 0.0 and < inf, got -0.1"),
        (mc.muon_adamw, dict(adam_weight_decay=-1.0), r"adam_weight_decay must be >= 0.0 and < inf, got -1.0"),
        (mc.muon, dict(ns_coeffs="nope"), r"ns_coeffs must be one of .* got 'nope'"),
        (mc.muon, dict(ns_coeffs=np.ones((2, 2))), r"coeffs must have shape .* got .* \(2, 2\)"),
        (mc.muon, dict(ns_steps=0), r"ns_steps must be an int >= 1, got 0"),
        (mc.muon, dict(beta=1.0), r"beta must be >= 0.0 and < 1.0, got 1.0"),
        (mc.muon, dict(rms_match="adam"), r"rms_match must be one of .* got 'adam'"),
        # values that would give an inf or NaN update
        (mc.muon, dict(rms_scale=float("inf")), r"rms_scale must be >= 0.0 and < inf, got inf"),
        (mc.muon, dict(eps=0.0), r"eps must be > 0.0 and < inf, got 0.0"),  # a zero gradient: 0 / 0
        (mc.muon, dict(weight_decay=float("inf")), r"weight_decay must be >= 0.0 and < inf, got inf"),
        (mc.muon_adamw, dict(adam_b1=1.0), r"adam_b1 must be >= 0.0 and < 1.0, got 1.0"),
        (mc.muon_adamw, dict(adam_b2=1.0), r"adam_b2 must be >= 0.0 and < 1.0, got 1.0"),
        (mc.muon_adamw, dict(adam_learning_rate=np.float32("inf")), r"adam_learning_rate must be >= 0.0 and < inf"),
        (mc.muonclip, dict(adam_eps=float("inf"), layout=mc.GQALayout(2, 2, 4)), r"adam_eps must be >= 0.0 and < inf"),
    ],
)
def test_bad_hyperparameters(factory, kwargs, match):
  with pytest.raises(ValueError, match=match):
    factory(LR, **kwargs)


@pytest.mark.parametrize("factory", [mc.muon, mc.muon_adamw])
def test_an_infinite_learning_rate_is_refused(factory):
  with pytest.raises(ValueError, match=r"learning_rate must be >= 0.0 and < inf, got inf"):
    factory(float("inf"))


def test_weight_decay_mask_reaches_both_halves_of_muon_adamw():
  # Zero gradients: the update is the weight decay alone (-lr * wd * theta where decayed).
  params = {"embed": {"embedding": jnp.ones((8, 4))}, "dense": {"kernel": jnp.ones((4, 6)), "bias": jnp.ones((6,))},
            "norm": {"scale": jnp.ones((4,))}}
  zeros = jax.tree.map(jnp.zeros_like, params)
  labels = mc.muon_labels(params)
  assert labels["dense"]["kernel"] == "muon" and labels["embed"]["embedding"] == "adam"

  def update(injected=False, **kw):
    factory = (optax.inject_hyperparams(mc.muon_adamw, static_args=("weight_decay_mask",)) if injected else
               mc.muon_adamw)
    opt = factory(1.0, weight_decay=0.1, **kw)
    return jax.tree.map(lambda u: round(float(u.ravel()[0]), 6), opt.update(zeros, opt.init(params), params)[0])

  decayed = {"embed": {"embedding": -0.1}, "dense": {"kernel": -0.1, "bias": -0.1}, "norm": {"scale": -0.1}}
  assert update() == decayed
  none = jax.tree.map(lambda _: 0.0, decayed)
  assert update(weight_decay_mask=jax.tree.map(lambda _: False, params)) == none
  assert update(weight_decay_mask=lambda p: jax.tree.map(lambda _: False, p)) == none
  # matrices only (embedding and kernel), as a callable and as a whole-params pytree
  matrices = {"embed": {"embedding": -0.1}, "dense": {"kernel": -0.1, "bias": 0.0}, "norm": {"scale": 0.0}}
  assert update(weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)) == matrices
  assert update(weight_decay_mask=jax.tree.map(lambda x: x.ndim >= 2, params)) == matrices
  # under inject_hyperparams, a callable named in static_args (the docstrings' advice) is a mask
  assert update(True, weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)) == matrices


@pytest.mark.parametrize(
    "factory,kwargs,name",
    [
        (mc.muon, dict(beta="0.95"), "beta"),
        (mc.muon_adamw, dict(weight_decay="0.1"), "weight_decay"),
        (mc.muon_adamw, dict(adam_weight_decay="0.1"), "adam_weight_decay"),
        (mc.muon_adamw, dict(adam_b2="0.95"), "adam_b2"),
        (mc.muon, dict(rms_scale=True), "rms_scale"),
        (mc.muon, dict(eps=None), "eps"),
        (mc.muon, dict(beta=optax.constant_schedule(0.9)), "beta"),  # not a schedule-taking option
        (mc.muonclip, dict(layout=mc.MLALayout(2, 4, 4, 4), qk_clip_threshold="100"), "qk_clip_threshold"),
    ],
)
def test_string_and_bool_hyperparameters_are_rejected_at_construction(factory, kwargs, name):
  with pytest.raises(TypeError, match=rf"^{name} must be a real number( or a schedule)?, got"):
    factory(LR, **kwargs)
  with pytest.raises(TypeError, match="^learning_rate must be a real number or a schedule, got str"):
    factory("0.02", **{k: v for k, v in kwargs.items() if k == "layout"})


def test_numpy_jax_scalars_and_schedules_are_accepted():
  params = _params()
  for beta in (np.float32(0.9), jnp.asarray(0.9), jnp.asarray(0.9, jnp.bfloat16), 0.9):
    opt = mc.muon_adamw(optax.constant_schedule(LR), beta=beta, weight_decay=optax.constant_schedule(0.1),
                        adam_weight_decay=np.float64(0.1), rms_scale=jnp.asarray(0.2), adam_b1=np.float32(0.9))
    chex.assert_tree_all_finite(opt.update(jax.tree.map(jnp.sin, params), opt.init(params), params)[0])


@pytest.mark.parametrize("outer,inner", [(mc.muon, mc.scale_by_muon), (mc.muon_adamw, mc.muon),
                                         (mc.muonclip, mc.muon_adamw)])
def test_signatures_are_written_out_with_every_option_of_the_inner_optimizer(outer, inner):
  """Each optimizer's signature lists, keyword-only, every option of the one it builds on,
  with the same default (IDEs, type checkers and ``inject_hyperparams`` read it), and takes
  no ``**kwargs``: an unknown keyword is Python's TypeError naming the function."""
  params = inspect.signature(outer).parameters
  assert all(p.kind is not p.VAR_KEYWORD for p in params.values())
  for name, p in inspect.signature(inner).parameters.items():
    if name == "learning_rate":
      continue
    assert name in params, (outer.__name__, name)
    if outer is mc.muonclip and name == "layout":  # required there: the clip's and Muon's declaration
      assert params[name].kind is p.KEYWORD_ONLY and params[name].default is p.empty
      continue
    assert params[name].kind is p.KEYWORD_ONLY and params[name].default == p.default, (outer.__name__, name)
    assert params[name].annotation == p.annotation, (outer.__name__, name)
  extra = dict(layout=mc.MLALayout(2, 4, 4, 4)) if outer is mc.muonclip else {}
  with pytest.raises(TypeError, match=rf"{outer.__name__}\(\) got an unexpected keyword argument 'betta'"):
    outer(LR, betta=0.9, **extra)


@pytest.mark.parametrize("fn", [mc.muon, mc.muon_adamw, mc.muonclip, mc.scale_by_muon, mc.qk_clip_transform,
                                mc.multi_steps, mc.qk_clip, mc.training.make_train_step])
def test_no_option_is_typed_any(fn):
  """Options carry optax's and jax's types (``ScalarOrSchedule``, ``DTypeLike``, ``ArrayLike``)."""
  untyped = [n for n, p in inspect.signature(fn).parameters.items() if p.annotation in ("Any", "Any | None")]
  assert not untyped, (fn.__name__, untyped)


# A value other than the default for every option of scale_by_muon.
_MUON_OPTIONS = dict(beta=0.9, nesterov=False, ns_steps=3, ns_coeffs="muon", ns_method="gram",
                     ns_normalize="frobenius", ns_restarts=(1,), ns_precision="highest", ns_batch=2, eps=1e-6,
                     compute_dtype=jnp.bfloat16,
                     mu_dtype=jnp.bfloat16, rms_match="keller", rms_scale=0.3,
                     matrix_axes=mc.MatrixAxes((-2,), (-1,)), layout=mc.MLALayout(2, 4, 4, 4), muon_blocks="part",
                     shard_orthogonalization=object(), shard_split="never")


def test_every_option_reaches_scale_by_muon(monkeypatch):
  """The written-out signatures forward each option (none silently left at its default)."""
  from muonclip_jax._muon import alias

  assert set(_MUON_OPTIONS) == set(inspect.signature(mc.scale_by_muon).parameters)
  seen = []
  monkeypatch.setattr(alias, "scale_by_muon", lambda *a, **kw: seen.append(
      dict(zip(["beta"], a)) | kw) or optax.identity())
  mc.muon(LR, **_MUON_OPTIONS)
  mc.muon_adamw(LR, **_MUON_OPTIONS)
  mc.muonclip(LR, **_MUON_OPTIONS)  # its layout is Muon's too
  assert seen == [_MUON_OPTIONS] * 3


def test_every_option_reaches_muon_adamw(monkeypatch):
  import muonclip_jax._muonclip as muonclip_module

  options = dict(weight_decay=0.2, labels="adam", adam_learning_rate=0.1, adam_b1=0.8, adam_b2=0.9, adam_eps=1e-6,
                 adam_weight_decay=0.3, weight_decay_mask=object(), **_MUON_OPTIONS)
  assert set(options) | {"learning_rate"} == set(inspect.signature(mc.muon_adamw).parameters)
  seen = []
  monkeypatch.setattr(muonclip_module, "muon_adamw", lambda lr, **kw: seen.append(kw) or optax.identity())
  mc.muonclip(LR, **options)
  assert seen == [options]


def test_extreme_gradient_scales_give_the_update_of_the_gradient_scaled_down():
  """Gradients of 1e19 to 1e38 made the Frobenius norm overflow float32 (update exactly 0, or NaN);
  the update of a scaled gradient is that of the gradient (momentum is linear, the
  orthogonalization scale-invariant)."""
  params = _params()
  g = jax.tree.map(jnp.sin, params)
  tx = mc.scale_by_muon()
  update = jax.jit(tx.update)
  ref, _ = update(g, tx.init(params))
  assert all(float(jnp.max(jnp.abs(u))) > 0.1 for u in jax.tree.leaves(ref))
  for scale in (1e19, 1e25, 1e30, 1e38):  # 1e38: the direction (1 + beta) g is above 2^126
    u, state = update(jax.tree.map(lambda x: x * scale, g), tx.init(params))
    chex.assert_trees_all_close(u, ref, atol=1e-5, rtol=0)
    chex.assert_tree_all_finite(state.mu)


def test_a_gradient_near_float32_max_gives_the_update_of_the_gradient_scaled_down():
  """With max|G| = 3e38, the step-1 Nesterov direction (1 + beta) G ~ 5.9e38 overflows
  float32 unless scaled (a NaN update). The momentum is stored divided by a power of two (``mu_scale``), the
  direction too, and Newton–Schulz is scale-invariant: the update is exactly that of G 2^-100,
  and the float64 reference's (Keller's five steps, to float32 Newton–Schulz's ~1e-4)."""
  g = np.random.default_rng(0).standard_normal((16, 32))
  big = (g / np.abs(g).max() * 3e38).astype(np.float32)
  tx = mc.scale_by_muon(**KELLER)
  update = jax.jit(tx.update)
  state0 = tx.init({"w": jnp.zeros((16, 32))})
  u, state = update({"w": jnp.asarray(big)}, state0)
  small, _ = update({"w": jnp.asarray(big * np.float32(2.0 ** -100))}, state0)
  chex.assert_tree_all_finite((u, state))
  np.testing.assert_allclose(u["w"], small["w"], rtol=1e-6, atol=1e-7)
  ref = np_newton_schulz(1.95 * big.astype(np.float64)) * 0.2 * np.sqrt(32)
  np.testing.assert_allclose(u["w"], ref, rtol=1e-4, atol=2e-5)
  scale = float(state.mu_scale["w"])
  assert scale > 1 and np.log2(scale) == int(np.log2(scale)), scale  # a power of two
  np.testing.assert_array_equal(np.asarray(state.mu["w"], np.float64) * scale, big)  # M_1 = G, exactly


@pytest.mark.parametrize("mu_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_constant_huge_gradient_never_overflows_the_momentum(mu_dtype):
  """A constant gradient of max 2e37 (17x below float32's largest): the momentum
  2e37 (1 - beta^t) / (1 - beta) would pass float32's largest at step 36, and every later
  update would be NaN. Now 60 such steps, then 60 of max 1, keep the momentum and the updates finite (a
  float16 momentum, largest 65504, included), and the run is the same run on the gradients
  times 2^-120 (where nothing overflows and ``mu_scale`` stays 1), scaled: ``mu * mu_scale``
  is 2^120 times that run's momentum bit for bit (powers of two commute with rounding), the
  updates equal to eps's effect. In float32 the momentum is the float64 one to 3e-6, and
  ``mu_scale`` is back at 1 once the momentum fits."""
  tx = mc.scale_by_muon(mu_dtype=mu_dtype)
  base = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.0, (8, 16)) * np.sign(np.arange(16) - 7.5),
                     jnp.float32)

  def grad(t, factor):
    return base * jnp.where(t < 60, jnp.float32(2e37), jnp.float32(1.0)) * factor

  @jax.jit
  def run(factor):
    def body(t, carry):
      state, _, finite, top = carry
      u, state = tx.update({"w": grad(t, factor)}, state)
      finite &= jnp.isfinite(u["w"]).all() & jnp.isfinite(state.mu["w"]).all()
      return state, u["w"], finite, jnp.maximum(top, state.mu_scale["w"])

    return jax.lax.fori_loop(0, 120, body, (tx.init({"w": base}), base, jnp.bool_(True), jnp.float32(1)))

  def momentum(state):
    return np.asarray(state.mu["w"], np.float64) * float(state.mu_scale["w"])

  state, last, finite, top = run(jnp.float32(1))
  small, small_last, small_finite, small_top = run(jnp.float32(2.0 ** -120))
  assert bool(finite) and bool(small_finite) and float(top) > 1 and float(small_top) == 1
  np.testing.assert_array_equal(momentum(state), momentum(small) * 2.0 ** 120)
  np.testing.assert_allclose(last, small_last, rtol=0, atol=1e-6)
  if mu_dtype == jnp.float32:
    beta, ref = float(np.float32(0.95)), np.zeros((8, 16))
    for t in range(120):
      ref = beta * ref + np.asarray(grad(t, 1.0), np.float64)
    np.testing.assert_allclose(momentum(state), ref, rtol=3e-6)
    assert float(state.mu_scale["w"]) == 1.0  # the true momentum, ~1.8e37, fits again
    first, _ = tx.update({"w": base}, tx.init({"w": base}))  # the direction stays parallel to base
    np.testing.assert_allclose(last, first["w"], rtol=0, atol=1e-5)  # M's roundings, through NS


@pytest.mark.parametrize("mu_dtype", [jnp.float32, jnp.bfloat16])
def test_while_the_scale_is_one_the_stored_momentum_is_the_plain_formula(mu_dtype):
  """The default computes each stack's momentum in its loop, ``beta (m c) + g / s_new`` with
  ``c = s / s_new``: while the scale stays 1 that is ``beta m + g`` bit for bit (the promised
  identity, checked inside one program: nine leaves that share a loop, one that does not)."""
  rng = np.random.default_rng(3)
  shapes = {**{f"w{i}": (8, 16) for i in range(9)}, "x": (16, 4)}
  g1, g2 = ({k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()} for _ in range(2))
  tx = mc.scale_by_muon(mu_dtype=mu_dtype)
  _, state = jax.jit(tx.update)(g1, tx.init(g1))

  @jax.jit
  def both(g, state):
    _, new = tx.update(g, state)
    return new, jax.tree.map(lambda m, x: (0.95 * m + x).astype(m.dtype), state.mu, g)

  new, plain = both(g2, state)
  assert all(float(s) == 1.0 for s in jax.tree.leaves(new.mu_scale))
  for k in shapes:
    assert np.asarray(new.mu[k]).tobytes() == np.asarray(plain[k]).tobytes(), k


def test_rescale_follows_its_rule_exactly_on_every_edge():
  """``rescale``'s scale against its documented rule, in NumPy: with ``a = max(max|m|, max|g| /
  s)`` and ``T = 2^t``, ``t = maxexp - 3`` of the narrower dtype, a finite ``a = f 2^k > 0``
  gives ``s_new = max(1, s 2^(k - t))`` (the smallest power of two >= 1 that puts the entries
  below T); ``a = 0`` gives 1; a non-finite ``a`` keeps ``s``. The momentum is carried over
  exactly (``m s / s_new``, but for entries pushed below the smallest normal), and where
  nothing changes it is ``m`` itself. Zeros, subnormals,
  values at and around T, float32's largest, inf and NaN, with float32, bfloat16 and float16
  momentum and scales from 1 to 2^100."""
  from muonclip_jax._muon.momentum_scale import rescale
  values = [0.0, 1e-40, 1.0, 7e4, 2.0 ** 125, 4.5e37, 3.4e38, np.inf, np.nan]
  for mdt, gdt in ((jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32)):
    t = min(jnp.finfo(mdt).maxexp, jnp.finfo(gdt).maxexp) - 3
    cases = [(jnp.full((2, 3), vm, jnp.float32).at[0, 0].set(vm / 2).astype(mdt),
              jnp.full((2, 3), vg, jnp.float32).at[1, 1].set(-vg).astype(gdt), jnp.float32(s))
             for vm in values for vg in values for s in (1.0, 8.0, 2.0 ** 100)]
    got = jax.jit(rescale)(*map(list, zip(*cases)))
    for (m, g, s), (m_in, s_new) in zip(cases, got):
      s, s_new = float(s), float(s_new)
      a = float(np.maximum(np.abs(np.asarray(m, np.float32)).max(), np.abs(np.asarray(g, np.float32)).max() / s))
      if not np.isfinite(a):
        want = s
      elif a == 0:
        want = 1.0
      else:
        want = max(1.0, s * 2.0 ** (np.frexp(a)[1] - t))
      assert s_new == want, (mdt, gdt, m[0, 1], g[0, 0], s, s_new, want)
      if s_new == s == 1.0:  # the very bits (selected, not multiplied by 1)
        assert np.asarray(m_in).tobytes() == np.asarray(m).tobytes()
      elif np.isfinite(a):  # exact but for subnormal entries (XLA:CPU flushes them to zero)
        tiny = float(jnp.finfo(mdt).tiny) * max(s, s_new)  # subnormal m, or m_in, flushed to zero
        np.testing.assert_allclose(np.asarray(m_in, np.float64) * s_new, np.asarray(m, np.float64) * s, rtol=0, atol=tiny)


def test_the_update_compiles_to_few_instructions_per_leaf():
  """The compile-time guard of a deep unscanned model (``benchmarks/bench_compile.py``), as a
  count: XLA's optimized HLO instructions that more layers add, per matrix leaf, against
  ``optax.adamw``'s on the same tree (16 and 32 layers: every shape stacked, as many loops at
  both depths). Per-leaf code (the momentum's scale in particular) is what made the update
  compile slowly. Measured on this tree (JAX 0.10.2 and 0.12): 0.75x AdamW's 50; 0.99x while
  a loop read its matrices through a ``lax.switch`` of one branch per matrix, 1.27x while the
  stored momentum was computed leaf by leaf outside the loops, 3.05x before the scales and
  directions moved into the loops (``frexp``/``ldexp`` per leaf were more)."""
  import re

  def per_leaf(make):
    counts = []
    for layers in (16, 32):
      params = {f"layer_{i}": {n: jnp.ones(s) for n, s in (("q", (32, 32)), ("o", (32, 32)), ("up", (32, 64)),
                                                              ("down", (64, 32)))} for i in range(layers)}
      opt = make()
      hlo = jax.jit(opt.update).lower(params, opt.init(params), params).compile().as_text()
      counts.append(len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", hlo, re.M)))
    return (counts[1] - counts[0]) / 64

  adamw, muon = per_leaf(lambda: optax.adamw(1e-3)), per_leaf(lambda: mc.muon_adamw(1e-3))
  assert muon <= 0.9 * adamw, (muon, adamw)


def test_float16_adam_leaves_with_an_eps_that_underflows_are_refused_at_init():
  """Inherited from optax: adam_eps=1e-8 is 0 in float16, and AdamW's update of a zero
  gradient is then 0/0 = NaN (plain optax.adamw does the same). muon_adamw's init says so."""
  params = {"embed": jnp.ones((4, 8), jnp.float16), "w": jnp.ones((8, 8), jnp.float16)}
  g = {"embed": jnp.zeros((4, 8), jnp.float16), "w": jnp.full((8, 8), 0.1, jnp.float16)}
  plain = optax.adamw(0.01)
  assert bool(jnp.isnan(plain.update(g, plain.init(params), params)[0]["embed"]).any())  # what it guards
  with pytest.raises(ValueError, match=r"muon_adamw: embed is float16 and goes to AdamW, whose adam_eps=1e-08 is 0"):
    mc.muon_adamw(0.01).init(params)
  with pytest.raises(ValueError, match=r"is 0 in float16"):  # a float32 first moment does not help
    mc.muon_adamw(0.01, mu_dtype=jnp.float32).init(params)
  opt = mc.muon_adamw(0.01, adam_eps=1e-4)
  u, _ = opt.update(g, opt.init(params), params)
  chex.assert_tree_all_finite(u)
  mc.muon_adamw(0.01).init(optax.tree.cast(params, jnp.bfloat16))  # bfloat16 holds 1e-8


def test_boxed_params_at_init_and_bare_arrays_at_update():
  """Linen boxes at init (their names decide the matrices), bare arrays at update: the update of the
  unboxed tree, and a state whose mu keeps its boxes while mu_scale carries none (its names would be
  the parameter's, wrong for a scalar: the state could not be sharded by nn.get_partition_spec)."""
  import flax.linen as nn
  g = jax.random.normal(jax.random.key(0), (3, 8, 12))
  boxed = {"w": nn.Partitioned(jnp.zeros((3, 8, 12)), names=("layers", "embed", "mlp"))}
  opt = mc.scale_by_muon()
  state = opt.init(boxed)
  assert isinstance(state.mu["w"], nn.Partitioned) and not isinstance(state.mu_scale["w"], nn.Partitioned)
  assert nn.get_partition_spec(state).mu_scale["w"] == jax.sharding.PartitionSpec()
  updates, new = jax.jit(opt.update)({"w": g}, state)
  plain = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((-2,), (-1,)))
  want, _ = jax.jit(plain.update)({"w": g}, plain.init({"w": g}))
  assert_same_math(updates["w"], want["w"])
  assert jax.tree.structure(new) == jax.tree.structure(state)  # the boxes stay where init put them
  boxed_updates, _ = jax.jit(opt.update)({"w": nn.Partitioned(g, names=boxed["w"].names)}, state)
  assert_same_math(boxed_updates["w"].value, want["w"])
  # muon_adamw (AdamW's half is optax's): a Linen model's boxed params at init, bare arrays at update
  dense = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)  # noqa: E731
  model = nn.Sequential([nn.Dense(8, kernel_init=dense(("embed", "mlp"))),
                         nn.Dense(4, kernel_init=dense(("mlp", "embed")))])
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  bare = nn.unbox(params)
  grads = jax.tree.map(lambda x: jnp.cos(3 * x) + 0.1, bare)
  opt = mc.muon_adamw(1e-2)  # muonclip chains it: the same state
  state = opt.init(params)
  updates, new = jax.jit(opt.update)(grads, state, bare)
  ref, _ = jax.jit(opt.update)(grads, opt.init(bare), bare)
  chex.assert_trees_all_equal_structs(updates, ref)
  jax.tree.map(assert_same_math, updates, ref)
  assert jax.tree.structure(new) == jax.tree.structure(state)  # the state's boxes stay


def test_a_state_cast_as_a_whole_and_bad_dtypes_are_refused():
  """mu_scale cast to float16 would overflow past 65504; complex parameters, integer momentum."""
  params = {"w": jnp.ones((4, 8))}
  opt = mc.scale_by_muon()
  cast = optax.tree.cast(opt.init(params), jnp.float16)
  with pytest.raises(TypeError, match=r"mu_scale at w is float16, but a momentum of float16 needs float32"):
    opt.update({"w": jnp.full((4, 8), 7e4)}, cast)
  with pytest.raises(ValueError, match=r"opt_state.mu\['w'\] is float16, optimizer.init\(params\) gives float32"):
    mc.check_opt_state(cast, optimizer=opt, params=params)
  half = mc.scale_by_muon(mu_dtype=jnp.float16)  # the way to a float16 momentum: finite past 65504
  u, _ = half.update({"w": jnp.full((4, 8), 7e4)}, half.init(params))
  assert np.isfinite(np.asarray(u["w"])).all()
  for dtype in (jnp.int32, jnp.bool_, "foo", 3, jnp.float8_e4m3fn):  # refused when built, by name
    for name in ("mu_dtype", "compute_dtype"):
      with pytest.raises(TypeError, match=f"{name} must be a floating dtype of 16 bits or more"):
        mc.muon_adamw(1e-2, **{name: dtype})
  with pytest.raises(TypeError, match=r"the parameter at w is complex \(complex64\)"):
    opt.init({"w": jnp.ones((4, 8), jnp.complex64)})
  with pytest.raises(ValueError, match=r"muon_blocks must be one of .*got 'group:²'"):
    mc.scale_by_muon(layout=mc.GQALayout(2, 2, 4), muon_blocks="group:²")


def test_a_state_from_before_mu_scale_is_brought_forward():
  """upgrade_opt_state: a state saved without mu_scale, or with one scalar for an expert stack, in
  today's structure; the update from it equals the update from today's init with that momentum."""
  stack = mc.MatrixAxes((-2,), (-1,))
  params = {"experts": {"w": jnp.zeros((3, 4, 8))}, "mlp": {"kernel": jnp.zeros((4, 8))},
            "norm": {"scale": jnp.ones(4)}}
  opt = mc.muon_adamw(1e-2, matrix_axes={"experts": {"w": stack}, "mlp": {"kernel": None}, "norm": {"scale": None}})
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape), params)
  state = jax.jit(opt.update)(grads, opt.init(params), params)[1]
  muon = state.inner_states["muon"].inner_state[0]
  old = {"inner_states": {"adam": state.inner_states["adam"], "muon": {"inner_state": [{"mu": muon.mu}]}}}
  new = mc.upgrade_opt_state(old, opt, params)
  mc.check_opt_state(new, optimizer=opt, params=params)
  chex.assert_trees_all_equal(new, state)  # the scales were 1: the same state, bit for bit
  scalar = {"inner_states": {"adam": state.inner_states["adam"], "muon": {"inner_state": [
      {"mu": muon.mu, "mu_scale": {"experts": {"w": jnp.float32(2.0)}, "mlp": {"kernel": jnp.float32(1.0)}}}]}}}
  up = mc.upgrade_opt_state(scalar, opt, params).inner_states["muon"].inner_state[0].mu_scale
  np.testing.assert_array_equal(up["experts"]["w"], np.full((3, 1, 1), 2.0))
  with pytest.raises(ValueError, match=r"no leaf at 'inner_states/muon/inner_state/0/mu/experts/w'"):
    mc.upgrade_opt_state({"inner_states": {"adam": state.inner_states["adam"], "muon": {"inner_state": [{}]}}},
                         opt, params)
  with pytest.raises(ValueError, match=r"leaves optimizer.init\(params\) does not hold: \['extra'\]"):
    mc.upgrade_opt_state({**old, "extra": jnp.ones(2)}, opt, params)
  wrong = jax.tree.map(lambda x: x[:2] if x.ndim == 3 else x, old)
  with pytest.raises(ValueError, match=r"mu/experts/w' is float32\[2, 4, 8\]"):
    mc.upgrade_opt_state(wrong, opt, params)
