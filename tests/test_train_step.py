"""make_train_step on models deeper than one attention layer: the exact clip, metrics, rng."""

import dataclasses
import functools
import json

import chex
import flax.linen as nn
import jax
import numpy as np
import jax.numpy as jnp
import optax
import pytest

import muonclip_jax as mc
from muonclip_jax import training
from muonclip_jax._clip import collect_max_logits
from _deep_lm import DeepConfig, batches, init_params, make_loss_fn

AXES = mc.MatrixAxes((-2,), (-1,))
CONFIGS = [DeepConfig(a, s) for a in ("mla", "gqa") for s in (True, False)]
MLA = DeepConfig("mla", True)


@functools.cache
def _forward(loss_fn):
  """``loss_fn``'s intermediates, compiled once per loss (eager, a 3-layer forward compiles op by op)."""
  return jax.jit(lambda p, b: loss_fn(p, b)[1])


def _head_factors(before, after):
  """Per (layer, head) factor of an MLA head's logits: its q^R columns scale by exactly gamma_h."""
  def rope(p):
    k = np.asarray(nn.unbox(p)["layers"]["attn"]["wq_b"]["kernel"])  # (L, q_lora, H * (nope + rope))
    return k.reshape(*k.shape[:2], MLA.layout.num_heads, -1)[..., MLA.layout.qk_nope_head_dim:]
  return np.median(rope(after) / rope(before), axis=(1, 3))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.attention}-{'scan' if c.scan else 'unrolled'}")
def test_exact_clip_bounds_every_layer_of_a_deep_model(cfg):
  # tau = 1 sits below the initial max logits (about 2 to 4.6), and Muon at lr 0.05 pushes
  # them further up: every step clips, in every layer, and clipping layer l moves the input
  # of layer l+1 (one clip with one forward pass left up to 1.23 tau here).
  # Metrics: num_clipped / min_gamma say what the step did to the weights, the
  # product of the factors over all passes (read off the MLA q^R columns, which scale by
  # exactly gamma_h); without the exact clip, muon_adamw clips nothing (the forward pass's
  # count above tau is num_above_threshold).
  tau, loss_fn = 1.0, make_loss_fn(cfg)
  opt = mc.muon_adamw(0.05, matrix_axes=AXES)
  step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=tau, layout=cfg.layout, exact_clip=True))
  check_metrics = cfg == MLA
  if check_metrics:
    plain = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=tau))
  params = init_params(cfg)
  state = opt.init(params)
  passes, clipped = [], []
  for batch in batches(3):
    if check_metrics:
      above, _ = _stats(loss_fn, params, batch, tau)
      stepped, _, m_plain = plain(params, state, batch)  # the update alone: nothing is clipped
      assert int(m_plain["num_clipped"]) == 0 and float(m_plain["min_gamma"]) == 1.0
      assert float(m_plain["clipped_fraction"]) == 0.0
      assert int(m_plain["num_above_threshold"]) == above > 0
    params, state, metrics = step(params, state, batch)
    if check_metrics:
      gamma = _head_factors(stepped, params)  # (layers, heads): all passes together
      assert int(metrics["num_above_threshold"]) == above
      assert int(metrics["num_clipped"]) == int(np.sum(gamma < 1 - 1e-4))
      clipped.append(int(metrics["num_clipped"]))
      assert float(metrics["min_gamma"]) == pytest.approx(float(gamma.min()), rel=1e-4)
      assert float(metrics["clipped_fraction"]) == pytest.approx(int(metrics["num_clipped"]) / gamma.size)
    after = collect_max_logits(_forward(loss_fn)(params, batch))
    assert sum(s.size // s.shape[-1] for s in after.values()) == cfg.num_layers
    worst = max(float(jnp.max(s)) for s in after.values())
    assert worst <= tau * (1 + 1e-4), (worst, int(metrics["exact_clip_passes"]))
    # the exact clip's last measurement is that of the params it returns
    assert float(metrics["exact_clip_max_logit"]) == pytest.approx(worst, rel=1e-5)
    assert float(metrics["max_logit"]) > tau  # the step's forward pass was above tau
    passes.append(int(metrics["exact_clip_passes"]))
    assert metrics["exact_clip_passes"].dtype == jnp.int32
  assert all(1 <= p <= cfg.num_layers + 1 for p in passes), passes  # a measurement after each clip
  assert max(passes) > 1, passes  # the extra passes did the work
  assert not check_metrics or sum(clipped) > 0



def _stats(loss_fn, params, batch, tau):
  stats = mc.qk_clip_stats(_forward(loss_fn)(params, batch), qk_clip_threshold=tau).values()
  return sum(int(jnp.sum(s["num_clipped"])) for s in stats), min(float(jnp.min(s["min_gamma"])) for s in stats)


@pytest.mark.parametrize("wrap", ["plain", "chain", "inject"])
def test_metrics_report_the_clip_of_a_muonclip_optimizer_without_a_threshold(wrap):
  tau, loss_fn, params = 2.0, make_loss_fn(MLA), init_params(MLA)
  lr = optax.linear_schedule(0.05, 0.01, 10)
  if wrap == "inject":
    opt = optax.inject_hyperparams(mc.muonclip)(learning_rate=lr, layout=MLA.layout, qk_clip_threshold=tau,
                                                 matrix_axes=AXES)
  else:
    opt = mc.muonclip(lr, layout=MLA.layout, qk_clip_threshold=tau, matrix_axes=AXES)
    if wrap == "chain":
      opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
  step = jax.jit(training.make_train_step(loss_fn, opt))  # no qk_clip_threshold: read from the optimizer
  state = opt.init(params)
  for batch in batches(2):
    num_clipped, min_gamma = _stats(loss_fn, params, batch, tau)
    assert num_clipped > 0
    params, state, metrics = step(params, state, batch)
    assert int(metrics["num_clipped"]) == num_clipped
    assert float(metrics["min_gamma"]) == pytest.approx(min_gamma, rel=1e-6)
    assert float(metrics["qk_clip_threshold"]) == tau
    (clip_state,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mc.QKClipState))
                     if isinstance(x, mc.QKClipState)]
    assert int(clip_state.num_clipped) == num_clipped
  assert ("learning_rate" in metrics) == (wrap == "inject")
  if wrap == "inject":
    assert float(metrics["learning_rate"]) == pytest.approx(float(lr(1)))


def test_tau_schedule_in_muonclip_and_in_make_train_step():
  loss_fn, params = make_loss_fn(MLA), init_params(MLA)
  schedule = optax.linear_schedule(3.0, 1.5, 2)  # 3.0, 2.25, 1.5
  opt = mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=schedule, matrix_axes=AXES)
  # no qk_clip_threshold, no layout: the metrics and the exact clip take the optimizer's tau of
  # the step, and its layout (layout= is not needed: muonclip holds one)
  step = jax.jit(training.make_train_step(loss_fn, opt, exact_clip=True))
  state, p = opt.init(params), params
  for t, batch in enumerate(batches(3)):
    num_clipped, _ = _stats(loss_fn, p, batch, float(schedule(t)))
    p, state, metrics = step(p, state, batch)
    assert float(metrics["qk_clip_threshold"]) == float(schedule(t))
    assert int(metrics["num_above_threshold"]) == num_clipped  # what the optimizer's clip scaled
    assert int(metrics["num_clipped"]) >= num_clipped  # and the exact clip's passes on top
    worst = max(float(jnp.max(s)) for s in collect_max_logits(_forward(loss_fn)(p, batch)).values())
    assert worst <= float(schedule(t)) * (1 + 1e-4)
  # a schedule given to make_train_step, for the exact clip after a Muon step without clip
  opt = mc.muon_adamw(0.05, matrix_axes=AXES)
  step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=schedule, layout=MLA.layout,
                                          exact_clip=True))
  state, p = opt.init(params), params
  for t, batch in enumerate(batches(3)):
    p, state, metrics = step(p, state, batch)
    assert float(metrics["qk_clip_threshold"]) == float(schedule(t))
    worst = max(float(jnp.max(s)) for s in collect_max_logits(_forward(loss_fn)(p, batch)).values())
    assert worst <= float(schedule(t)) * (1 + 1e-4)


def test_exact_clip_takes_the_layout_the_optimizer_holds():
  """The exact clip's layout: the optimizer's QK-Clip's, else its Muon's (through chain and
  inject_hyperparams), else ``layout=``; none, or one that contradicts the clip, is a ValueError
  at the first trace (traced only here: ``jax.eval_shape``)."""
  loss_fn, params = make_loss_fn(MLA), init_params(MLA)
  batch = batches(1)[0]
  other = dataclasses.replace(MLA.layout, v_head_dim=MLA.layout.v_head_dim + 1)

  def trace(opt, **kw):
    step = training.make_train_step(loss_fn, opt, exact_clip=True, **kw)
    return jax.eval_shape(step, params, opt.init(params), batch)

  held = optax.inject_hyperparams(mc.muonclip, static_args=("layout",))(
      learning_rate=0.05, layout=MLA.layout, qk_clip_threshold=1.0, matrix_axes=AXES)
  trace(optax.chain(optax.clip_by_global_norm(1.0), held))
  trace(held, layout=MLA.layout)  # the same layout again: accepted
  trace(mc.muon_adamw(0.05, layout=MLA.layout, matrix_axes=AXES), qk_clip_threshold=1.0)  # Muon's declaration
  with pytest.raises(ValueError, match=r"layout=MLALayout.* differs from the layout of the optimizer's QK-Clip"):
    trace(held, layout=other)
  with pytest.raises(ValueError, match=r"exact_clip=True needs the attention layout, and the optimizer holds none "
                                       r".*pass layout=module.layout"):
    trace(mc.muon_adamw(0.05, matrix_axes=AXES), qk_clip_threshold=1.0)
  with pytest.raises(TypeError, match=r"make_train_step: layout must be an MLALayout"):
    training.make_train_step(loss_fn, held, layout="mla")


def test_dropout_rng_aux_outputs_grad_norm_and_float_metrics_with_microbatches():
  cfg = DeepConfig("gqa", True, dropout=0.5)
  base, params = make_loss_fn(cfg), init_params(cfg)

  def loss_fn(p, tokens, rng):
    loss, intermediates = base(p, tokens, rng)
    return loss, (intermediates, {"first_token": tokens[0, 0].astype(jnp.float32)})

  opt = optax.adamw(1e-3)
  step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=2.0, num_microbatches=2))
  batch, rng = batches(1)[0], jax.random.key(7)
  _, _, metrics = step(params, opt.init(params), batch, rng)
  keys = jax.random.split(rng, 2)
  halves = [(batch[:2], keys[0]), (batch[2:], keys[1])]
  loss_of = jax.jit(lambda p, b, r: loss_fn(p, b, r)[0])  # compiled once (eager: op by op)
  losses = [loss_of(params, b, r) for b, r in halves]
  assert float(metrics["loss"]) == pytest.approx(float(sum(losses) / 2), rel=1e-5)
  assert float(loss_of(params, batch[:2], keys[1])) != pytest.approx(float(losses[0]), rel=1e-5)  # dropout is on
  grad_of = jax.jit(jax.grad(loss_of))
  grads = [grad_of(params, b, r) for b, r in halves]
  norm = optax.tree.norm(jax.tree.map(lambda a, b: (a + b) / 2, *grads))
  assert float(metrics["grad_norm"]) == pytest.approx(float(norm), rel=1e-4)
  assert float(metrics["aux"]["first_token"]) == pytest.approx(float(batch[0, 0] + batch[2, 0]) / 2)
  assert float(step(params, opt.init(params), batch, jax.random.key(8))[2]["loss"]) != float(metrics["loss"])
  flat = training.metrics_to_floats(metrics)
  assert json.loads(json.dumps(flat)) == flat
  assert all(type(v) is float for v in flat.values())
  assert flat["aux/first_token"] == float(metrics["aux"]["first_token"])
  assert [flat[f"max_logit_per_layer/layers/attn/{i}"] for i in range(3)] == (
      metrics["max_logit_per_layer"]["layers/attn"].tolist())
  # a key inside the batch cannot be split into microbatches: the error says what to do
  with pytest.raises(ValueError, match=r"batch leaf \['key'\] of shape \(\) .* step\(\.\.\., rng=key\)"):
    jax.jit(training.make_train_step(base, opt, num_microbatches=2))(
        params, opt.init(params), {"tokens": batch, "key": jax.random.key(0)})


def test_a_batch_of_one_array_that_does_not_split_is_named_as_such():
  from muonclip_jax._train.microbatches import split_microbatches

  with pytest.raises(ValueError, match=r"make_train_step: the batch \(one array\) of shape \(2, 8, 32\) has no "
                                       r"leading axis divisible by num_microbatches=3"):
    split_microbatches(jnp.ones((2, 8, 32)), 3)
  assert split_microbatches(jnp.ones((6, 8)), 3).shape == (3, 2, 8)


def test_multi_steps_metrics_and_exact_clip_act_only_at_the_real_update():
  """Under multi_steps the optimizer clips only at its last micro-step: the metrics say so,
  and the exact clip does not rescale weights while gradients are still accumulating."""
  tau, loss_fn = 1.0, make_loss_fn(MLA)
  params = init_params(MLA)
  clipping = mc.multi_steps(mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=tau, matrix_axes=AXES), 2,
                            layout=MLA.layout)
  plain = mc.multi_steps(mc.muon_adamw(0.05, matrix_axes=AXES), 2, layout=MLA.layout)
  for opt, exact in ((clipping, False), (plain, True)):
    step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=None if opt is clipping else tau,
                                            layout=MLA.layout, exact_clip=exact))
    p, state = params, opt.init(params)
    for t, batch in enumerate(batches(2)):
      assert _stats(loss_fn, p, batch, tau)[0] > 0  # this microbatch alone is above tau
      new_p, state, metrics = step(p, state, batch)
      if t % 2 == 0:  # accumulating: nothing changed, nothing clipped
        chex.assert_trees_all_equal(new_p, p)
        assert int(metrics["num_clipped"]) == 0 and float(metrics["min_gamma"]) == 1.0
        if exact:
          assert int(metrics["exact_clip_passes"]) == 0
      elif exact:
        assert int(metrics["exact_clip_passes"]) >= 1
        worst = max(float(jnp.max(s)) for s in collect_max_logits(_forward(loss_fn)(new_p, batch)).values())
        assert worst <= tau * (1 + 1e-4)
      else:
        (clip_state,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mc.QKClipState))
                         if isinstance(x, mc.QKClipState)]
        assert int(metrics["num_clipped"]) == int(clip_state.num_clipped) > 0
        assert float(metrics["min_gamma"]) == float(clip_state.min_gamma) < 1.0
      p = new_p


@pytest.mark.parametrize("explicit,batch_size", [(True, 4), (False, 8)])
def test_jit_train_step_passes_the_dropout_rng_on_a_mesh(explicit, batch_size):
  """``sharding.jit_train_step`` hands ``rng`` on, and microbatches split a batch sharded on an
  explicit mesh: the sharded step equals the unsharded one."""
  from muonclip_jax import sharding

  import flax.linen as nn

  cfg = DeepConfig("gqa", True, dropout=0.5)
  loss_fn, params = make_loss_fn(cfg), nn.unbox(init_params(cfg))
  opt = optax.adamw(1e-2)
  step = training.make_train_step(loss_fn, opt, num_microbatches=2)
  batch, rng = batches(1, batch=batch_size)[0], jax.random.key(3)
  ref_params, _, ref = jax.jit(step)(params, opt.init(params), batch, rng)
  if explicit:  # jax.make_mesh's default: explicit axes
    mesh = jax.make_mesh((4, 2), ("data", "model"))
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  ps = sharding.param_shardings(params, mesh)
  sharded = jax.device_put(params, ps)
  state = sharding.init_state(opt, sharded, ps)
  bs = sharding.batch_shardings(batch, mesh)
  jitted = sharding.jit_train_step(step, ps, jax.tree.map(lambda x: x.sharding, state), bs)
  new_params, _, metrics = jitted(sharded, state, jax.device_put(batch, bs), rng)
  assert float(metrics["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
  chex.assert_trees_all_close(jax.device_get(new_params), ref_params, atol=1e-5)
  no_rng = jitted(sharded, state, jax.device_put(batch, bs))[2]["loss"]  # deterministic, no key
  assert float(no_rng) != pytest.approx(float(metrics["loss"]), rel=1e-5)


def test_microbatches_of_a_batch_sharded_on_an_explicit_mesh():
  """Microbatch i is rows [i B/k, (i+1) B/k), sharded like the batch where B/k divides."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from muonclip_jax._train import split_microbatches

  mesh = jax.make_mesh((4, 2), ("data", "model"))
  x = jax.device_put(jnp.arange(16 * 3).reshape(16, 3), NamedSharding(mesh, P("data")))
  for k, lead in ((2, "data"), (8, None)):
    out = jax.jit(lambda b, k=k: split_microbatches(b, k))(x)
    np.testing.assert_array_equal(out, np.arange(16 * 3).reshape(k, 16 // k, 3))
    assert out.sharding.spec[:2] == P(None, lead)[:2], out.sharding


@pytest.mark.parametrize("bad", ["scale", "clip_by_global_norm"])
def test_a_transform_after_the_clip_is_refused_wherever_the_state_is_seen(bad):
  from muonclip_jax import sharding

  loss_fn, params = make_loss_fn(MLA), init_params(MLA)
  clip = mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=1.0, matrix_axes=AXES)
  after = optax.scale(0.5) if bad == "scale" else optax.clip_by_global_norm(1e-3)
  opt = optax.chain(clip, after)
  match = r"a transform follows the QK-Clip in an optax.chain .*opt_state\[1\]"
  with pytest.raises(ValueError, match="make_train_step: " + match):
    jax.jit(training.make_train_step(loss_fn, opt))(params, opt.init(params), batches(1)[0])
  with pytest.raises(ValueError, match="check_opt_state: " + match):
    mc.check_opt_state(opt.init(params))
  with pytest.raises(ValueError, match="multi_steps: a transform follows the QK-Clip"):
    mc.multi_steps(opt, 2, layout=MLA.layout).init(params)
  with pytest.raises(ValueError, match="init_state: a transform follows"):
    sharding.init_state(opt, params, None)
  with pytest.raises(ValueError, match="a transform follows the QK-Clip"):  # nested chains
    mc.check_opt_state(optax.chain(optax.identity(), optax.chain(clip, after)).init(params))
  # Transforms before the clip, wrappers around it, and multi_steps are fine.
  for ok in (optax.chain(after, clip), optax.inject_hyperparams(mc.muonclip)(
      learning_rate=0.05, layout=MLA.layout, qk_clip_threshold=1.0, matrix_axes=AXES),
             mc.multi_steps(optax.chain(after, clip), 2, layout=MLA.layout)):
    mc.check_opt_state(ok.init(params), optimizer=ok, params=params)


def test_plain_optax_multisteps_around_a_clip_names_the_cause():
  loss_fn, params = make_loss_fn(MLA), init_params(MLA)
  clip = mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=1.0, matrix_axes=AXES)
  match = r"a plain optax.MultiSteps .* wraps a QK-Clip: .*muonclip_jax.multi_steps"
  for opt in (optax.MultiSteps(clip, 2), optax.MultiSteps(clip, 2).gradient_transformation()):
    with pytest.raises(ValueError, match="make_train_step: " + match):
      jax.jit(training.make_train_step(loss_fn, opt))(params, opt.init(params), batches(1)[0])
    with pytest.raises(ValueError, match=match):
      mc.check_opt_state(opt.init(params))
  plain_muon = optax.MultiSteps(mc.muon_adamw(0.05, matrix_axes=AXES), 2)  # no clip inside: fine
  mc.check_opt_state(plain_muon.init(params))


def test_a_state_that_does_not_fit_the_params_is_refused_at_the_first_trace():
  """A 1-layer model's state would broadcast onto a 3-layer model's params without an error."""
  one, three = DeepConfig("mla", True, num_layers=1), MLA
  opt = mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=1.0, matrix_axes=AXES)
  step = jax.jit(training.make_train_step(make_loss_fn(three), opt))
  params = init_params(three)
  with pytest.raises(ValueError, match=r"make_train_step: the optimizer state does not fit the params: "
                     r"opt_state.*\['layers'\].* has shape \(1, 8\), optimizer.init\(params\) gives \(3, 8\)"):
    step(params, opt.init(init_params(one)), batches(1)[0])
  with pytest.raises(ValueError, match="does not have the structure optimizer.init"):
    step(params, optax.adamw(1e-3).init(params), batches(1)[0])
  mc.check_opt_state(opt.init(params), optimizer=opt, params=params)  # the right state passes


def test_an_invalid_traced_tau_is_flagged_in_the_state_and_the_metrics():
  """A schedule or an injected tau that becomes 0, negative or NaN clips nothing under jit (it
  cannot raise there): the state's threshold is NaN and the metrics say qk_clip_threshold_valid=False."""
  loss_fn, params, batch = make_loss_fn(MLA), init_params(MLA), batches(1)[0]
  taus = jnp.array([1.0, 0.0, -1.0, jnp.nan])
  schedule = lambda count: taus[jnp.minimum(count, 3)]
  injected = optax.inject_hyperparams(mc.muonclip)(learning_rate=0.05, layout=MLA.layout, qk_clip_threshold=1.0,
                                                    matrix_axes=AXES)
  for opt in (mc.muonclip(0.05, layout=MLA.layout, qk_clip_threshold=schedule, matrix_axes=AXES), injected):
    step = jax.jit(training.make_train_step(loss_fn, opt))
    p, state = params, opt.init(params)
    for t in range(4):
      if opt is injected:
        state.hyperparams["qk_clip_threshold"] = taus[t]
      p, state, m = step(p, state, batch)
      (clip_state,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mc.QKClipState))
                       if isinstance(x, mc.QKClipState)]
      assert bool(m["qk_clip_threshold_valid"]) == (t == 0)
      assert int(m["num_above_threshold"]) > 0 if t == 0 else int(m["num_above_threshold"]) == 0
      if t:
        assert np.isnan(float(m["qk_clip_threshold"])) and np.isnan(float(clip_state.threshold))
        assert int(m["num_clipped"]) == 0 and float(m["min_gamma"]) == 1.0
      else:
        assert float(clip_state.threshold) == 1.0 and int(m["num_clipped"]) > 0
    assert training.metrics_to_floats(m)["qk_clip_threshold_valid"] == 0.0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_microbatch_gradients_near_float32s_largest_are_averaged_without_overflow(k):
  """The full-batch gradient is 1.49e38 and every microbatch's is finite: each share is divided by k
  before it is added (a sum first overflows at k = 4). The step matches float64."""
  rows = np.linspace(1.0, 1.5, 12)[:, None] * np.array([[1.49e38, -0.7e38, 1e3]])  # (batch 12, 3)

  def loss_fn(p, batch):
    return jnp.mean(batch @ p["w"]), {}  # d loss / d w = the mean row

  params = {"w": jnp.zeros(3, jnp.float32)}
  opt = optax.sgd(1e-37)
  new, _, metrics = jax.jit(training.make_train_step(loss_fn, opt, num_microbatches=k))(
      params, opt.init(params), jnp.asarray(rows, jnp.float32))
  want = -1e-37 * rows.mean(0)  # float64
  np.testing.assert_allclose(np.asarray(new["w"], np.float64), want, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["grad_norm"]), np.linalg.norm(rows.mean(0)), rtol=1e-6)  # not inf
