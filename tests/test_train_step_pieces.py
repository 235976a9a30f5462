"""The pieces ``make_train_step`` is built from, each on its own and without ``muonclip``.

A hand-written two-head attention score (``_loss_fn``) stands in for a model: its maxima are
known in closed form, so every piece is checked against NumPy.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc
from muonclip_jax._clip import exact_clip_step
from muonclip_jax._train import (capturing_forward, loss_grads_maxima, maxima_on, optimizer_clip, optimizer_clip_metrics,
                                 step_threshold, view_opt_state)
from muonclip_jax.training import _apply_optimizer
from _exactness import assert_same_math

LAYOUT = mc.GQALayout(2, 2, 4)


def _params(seed=0):
  k = jax.random.split(jax.random.key(seed), 2)
  return {"attn": {"wq": {"kernel": jax.random.normal(k[0], (8, 8))},
                   "wk": {"kernel": jax.random.normal(k[1], (8, 8))}}}


def _logits(params, x):
  """``(B, H, T, T)`` scaled logits of two heads of width 4."""
  q = (x @ params["attn"]["wq"]["kernel"]).reshape(*x.shape[:2], 2, 4)
  k = (x @ params["attn"]["wk"]["kernel"]).reshape(*x.shape[:2], 2, 4)
  return jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0


def _loss_fn(params, x, rng=None):
  s = _logits(params, x)
  if rng is not None:
    s = s + jax.random.normal(rng, s.shape)
  maxima = jax.lax.stop_gradient(jnp.max(s, axis=(0, 2, 3)))
  return jnp.mean(jax.nn.softmax(s, axis=-1) ** 2), ({"attn": {"max_logits": maxima}}, {"first": x[0, 0, 0]})


X = jax.random.normal(jax.random.key(9), (4, 5, 8))


def test_forward_with_capture_flattens_the_maxima_and_casts_the_compute_copy():
  forward = capturing_forward(_loss_fn)
  loss, (maxima, aux) = forward(_params(), X)
  np.testing.assert_allclose(maxima["attn"], np.asarray(_logits(_params(), X)).max(axis=(0, 2, 3)), rtol=1e-6)
  assert loss.dtype == jnp.float32 and float(aux["first"]) == float(X[0, 0, 0])
  seen = []
  bf16 = capturing_forward(lambda p, x: (seen.append(p["attn"]["wq"]["kernel"].dtype) or jnp.zeros(()),
                                         {"attn": {"max_logits": jnp.zeros(2)}}), jnp.bfloat16)
  grads = jax.grad(lambda p: bf16(p, X)[0])(_params())
  assert seen == [jnp.bfloat16] and grads["attn"]["wq"]["kernel"].dtype == jnp.float32
  with pytest.raises(TypeError, match=r"loss_fn must return \(loss, intermediates\)"):
    capturing_forward(lambda p, x: jnp.zeros(()))(_params(), X)
  with pytest.raises(TypeError, match=r"loss_fn returned \(loss, <tuple of 3>\)"):
    capturing_forward(lambda p, x: (jnp.zeros(()), (1, 2, 3)))(_params(), X)


def test_microbatches_average_gradients_and_take_the_maximum():
  forward = capturing_forward(_loss_fn)
  rng = jax.random.key(3)
  loss, grads, maxima, aux = jax.jit(lambda p, x, r: loss_grads_maxima(forward, p, x, r, 2))(_params(), X, rng)
  keys = jax.random.split(rng, 2)
  halves = [(X[:2], keys[0]), (X[2:], keys[1])]
  ref = [jax.value_and_grad(lambda p, x=x, r=r: _loss_fn(p, x, r)[0])(_params()) for x, r in halves]
  assert float(loss) == pytest.approx(float(ref[0][0] + ref[1][0]) / 2, rel=1e-6)
  chex.assert_trees_all_close(grads, jax.tree.map(lambda a, b: (a + b) / 2, ref[0][1], ref[1][1]), rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(maxima["attn"], jnp.maximum(*[_loss_fn(_params(), x, r)[1][0]["attn"]["max_logits"]
                                                           for x, r in halves]))
  assert float(aux["first"]) == pytest.approx(float(X[0, 0, 0] + X[2, 0, 0]) / 2)
  one = maxima_on(forward, _params(), X, None, 1)
  chex.assert_trees_all_close(maxima_on(forward, _params(), X, None, 2), one)


def test_view_opt_state_finds_each_fact_wherever_it_sits():
  params = _params()
  injected = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  view = view_opt_state(injected.init(params))
  assert view.clip is None and view.running_max_logits is None and view.updated is None
  assert float(view.learning_rate) == pytest.approx(0.1) and int(view.count) == 0
  clipped = mc.multi_steps(optax.chain(optax.sgd(0.1), mc.qk_clip_transform(3.0, layout=LAYOUT)), 2, layout=LAYOUT)
  state = clipped.init(params)
  view = view_opt_state(state)
  assert isinstance(view.clip, mc.QKClipState) and view.clip is state.inner.inner_opt_state[1]
  assert set(view.running_max_logits) == {"attn"} and bool(view.updated)
  assert view.count is view.clip.count and view.learning_rate is None
  two = optax.chain(mc.qk_clip_transform(3.0, layout=LAYOUT), mc.qk_clip_transform(4.0, layout=LAYOUT))
  with pytest.raises(ValueError, match="make_train_step: the optimizer has 2 QK-Clip transforms"):
    view_opt_state(two.init(params))
  rates = view_opt_state(optax.chain(injected, optax.inject_hyperparams(optax.sgd)(learning_rate=0.2)).init(params))
  assert sorted(float(v) for v in rates.learning_rate.values()) == pytest.approx([0.1, 0.2])


def test_one_tau_per_step():
  params = _params()
  plain = view_opt_state(optax.adam(0.1).init(params))
  assert step_threshold(None, plain, plain) is None
  assert float(step_threshold(5.0, plain, plain)) == 5.0
  assert float(step_threshold(lambda count: 2.0 + count, plain, plain)) == 2.0  # at the count before the update
  assert np.isnan(float(step_threshold(-1.0, plain, plain)))  # as a schedule's invalid value shows
  no_count = view_opt_state(optax.sgd(0.1).init(params))
  with pytest.raises(ValueError, match="a qk_clip_threshold schedule needs a step count"):
    step_threshold(lambda count: 2.0, no_count, no_count)
  clip = view_opt_state(mc.qk_clip_transform(7.0, layout=LAYOUT).init(params))
  assert float(step_threshold(None, clip, clip)) == 7.0
  with pytest.raises(ValueError, match=r"make_train_step: qk_clip_threshold=5.0 was given, but the optimizer clips"):
    step_threshold(5.0, clip, clip)


@pytest.mark.parametrize("every_k", [1, 2])
def test_update_and_what_the_optimizers_clip_did(every_k):
  """One update through ``_apply_optimizer``, and the per-head record of the clip, which
  (under ``multi_steps``) acts only at the last micro-step, on the running maximum."""
  params = _params()
  tau = 3.0
  opt = optax.with_extra_args_support(
      mc.multi_steps(optax.chain(optax.sgd(0.0), mc.qk_clip_transform(tau, layout=LAYOUT)), every_k, layout=LAYOUT))
  state = opt.init(params)
  micro = [{"attn": jnp.array([6.0, 1.0])}, {"attn": jnp.array([1.0, 4.0])}][:every_k]
  grads = jax.tree.map(jnp.zeros_like, params)
  p = params
  for i, maxima in enumerate(micro):
    p, state, before, after = _apply_optimizer(opt, p, state, grads, maxima)
    scaled, gamma = optimizer_clip(before, after, maxima)
    metrics = optimizer_clip_metrics(before, after, maxima)
    last = i == every_k - 1
    assert bool(after.updated) == last
    if not last:
      chex.assert_trees_all_equal(p, params)
      assert scaled["attn"].tolist() == [False, False] and int(metrics["num_clipped"]) == 0
      continue
    hot = [6.0, 4.0] if every_k == 2 else [6.0, 1.0]  # the maximum over the micro-steps
    want = [s > tau for s in hot]
    assert scaled["attn"].tolist() == want and int(metrics["num_clipped"]) == sum(want)
    np.testing.assert_allclose(gamma["attn"], [min(1.0, tau / s) for s in hot], rtol=1e-6)
    assert float(metrics["min_gamma"]) == pytest.approx(min(tau / s for s in hot))
    ref = mc.qk_clip(params, {"attn": {"max_logits": jnp.array(hot)}}, qk_clip_threshold=tau, layout=LAYOUT)
    chex.assert_trees_all_close(p, ref, rtol=1e-6)


def test_exact_clip_step_acts_only_where_the_weights_changed():
  params, tau = _params(), 1.0
  measure = lambda p: maxima_on(capturing_forward(_loss_fn), p, X, None, 1)
  like = measure(params)
  assert float(jnp.max(like["attn"])) > tau
  kw = dict(qk_clip_threshold=tau, layout=LAYOUT, rtol=1e-4, like=like)
  out, passes, scaled, gamma, last = exact_clip_step(params, measure, updated=None, **kw)
  assert float(jnp.max(measure(out)["attn"])) <= tau * (1 + 1e-4) and int(passes) == 2  # one clip, measured
  chex.assert_trees_all_close(last, measure(out), rtol=1e-6)  # the last measurement: the returned params'
  assert scaled["attn"].tolist() == (like["attn"] > tau).tolist()
  skipped = exact_clip_step(params, measure, updated=jnp.asarray(False), **kw)
  chex.assert_trees_all_equal(skipped[0], params)
  assert int(skipped[1]) == 0 and not bool(jnp.any(skipped[2]["attn"])) and float(jnp.min(skipped[3]["attn"])) == 1.0
  assert_same_math(skipped[4], like, "the weights as they were: the forward pass's maxima")
  chex.assert_trees_all_close(exact_clip_step(params, measure, updated=jnp.asarray(True), **kw)[0], out)


