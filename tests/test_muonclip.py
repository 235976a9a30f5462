"""muonclip end to end on a tiny MLA transformer: the bound, composition, accumulation, I/O."""

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import muonclip_jax as mc
from muonclip_jax import training
from muonclip_jax._clip import collect_max_logits
from _exactness import assert_same_math
from _tiny_lm import BATCHES, CFG, init_params, make_loss_fn, matrix_axes

LR = 0.1  # high enough for plain Muon's max logit to pass TAU within a few steps
TAU = 5.0  # the initial max logit is ~3.7
STEPS = 8
LOSS_FN = make_loss_fn(CFG)

# Two separately compiled programs round differently (_exactness: by machine, XLA flags and
# the programs' fusion); three training steps at this high learning rate amplify that through
# the forward pass, Newton-Schulz and Adam (whose second moment is near zero on some lm_head
# entries): measured 4e-6 to 6e-5, varying with the machine, the emitters and the compiled
# programs (any change of the update's HLO moves it). A missing clip moves weights by ~1e-2.
RUN_ATOL = 1e-4


@jax.jit
def _max_logits(params, batch):
  """The forward pass's maxima, compiled once per dtype (eager, each call took ~1 s)."""
  return collect_max_logits(LOSS_FN(params, batch)[1])


def _muonclip(**kw):
  kw.setdefault("qk_clip_threshold", TAU)
  return mc.muonclip(LR, layout=CFG.layout, matrix_axes=matrix_axes, **kw)


_STEPS = {}  # compiled train steps, shared by the tests of one process (compiling dominates)
_TRACES = collections.Counter()  # (step key, params' dtypes) -> times that step was traced


def _run(opt, steps=STEPS, params=None, state=None, start=0, **step_kw):
  params = init_params(CFG, 0) if params is None else params
  state = opt.init(params) if state is None else state
  key = (id(opt), tuple(sorted(step_kw.items())))
  if key not in _STEPS:
    # tau for the metrics of an optimizer that does not clip; one that clips has its own
    clips = any(isinstance(x, mc.QKClipState) for x in jax.tree.leaves(
        jax.eval_shape(opt.init, params), is_leaf=lambda x: isinstance(x, mc.QKClipState)))
    tau = {} if clips else {"qk_clip_threshold": TAU}
    inner = training.make_train_step(LOSS_FN, opt, **tau, **step_kw)

    def counted(params, *args, _key=key):
      _TRACES[_key, tuple(sorted({str(x.dtype) for x in jax.tree.leaves(params)}))] += 1
      return inner(params, *args)

    _STEPS[key] = (opt, jax.jit(counted))
  step = _STEPS[key][1]
  history = []
  for t in range(start, start + steps):
    params, state, metrics = step(params, state, BATCHES[t % 2])
    history.append((params, metrics, BATCHES[t % 2]))
  return params, state, history


MUON = mc.muon_adamw(LR, matrix_axes=matrix_axes)
CLIP = _muonclip()
MUON_UPDATE = jax.jit(MUON.update)


def test_plain_muon_passes_tau_and_exact_muonclip_holds_it():
  _, _, muon_hist = _run(MUON)
  assert max(float(m["max_logit"]) for _, m, _ in muon_hist) > TAU * 1.1
  _, _, clip_hist = _run(_muonclip(), exact_clip=True, layout=CFG.layout)
  clipped_steps = 0
  for params, metrics, batch in clip_hist:
    after = _max_logits(params, batch)
    for module, s in after.items():
      assert float(jnp.max(s)) <= TAU * (1 + 1e-4), (module, s)
    clipped_steps += int(metrics["num_clipped"] > 0)
  assert clipped_steps >= 2  # the clip did the work


def test_forward_maxima_clip_is_qk_clip_of_the_update():
  """muonclip's update equals qk_clip(params + muon_adamw update, forward maxima)."""
  params = init_params(CFG, 0)
  grads_fn = jax.jit(jax.grad(lambda p, b: LOSS_FN(p, b)[0]))
  clip = _muonclip(qk_clip_threshold=3.0)
  sb, sc = MUON.init(params), clip.init(params)
  p_ref = p_clip = params
  forward = jax.jit(lambda p, b: LOSS_FN(p, b)[1])
  base_update, clip_update = MUON_UPDATE, jax.jit(clip.update)
  clip_fn = jax.jit(lambda p, m: mc.qk_clip(p, m, qk_clip_threshold=3.0, layout=CFG.layout))
  for t in range(3):
    batch = BATCHES[t % 2]
    maxima = forward(p_clip, batch)
    g = grads_fn(p_clip, batch)
    ub, sb = base_update(g, sb, p_clip)
    p_ref = clip_fn(optax.apply_updates(p_clip, ub), maxima)
    uc, sc = clip_update(g, sc, p_clip, max_logits=maxima)
    p_clip = optax.apply_updates(p_clip, uc)
    # Two programs (muonclip's update, muon_adamw's): equal to the suite's rounding, far below a
    # clip factor's 1 - gamma. (One float32 ulp of the weights held before Newton–Schulz's input
    # was scaled by powers of two; since, the two round wkv_a's update apart by up to 2.1e-7.)
    assert_same_math(p_clip, p_ref)
  # and the clip did fire
  assert any(float(jnp.max(s)) > 3.0 for s in _max_logits(params, BATCHES[0]).values())


def test_loss_decreases_with_every_optimizer():
  for opt in (optax.adamw(1e-2), MUON, CLIP):
    _, _, hist = _run(opt)
    losses = [float(m["loss"]) for _, m, _ in hist]
    assert losses[-1] < 0.5 * losses[0], losses


def test_unreachable_or_no_threshold_equals_muon_adamw():
  ref, _, _ = _run(MUON, steps=3)
  p, _, _ = _run(_muonclip(qk_clip_threshold=None), steps=3)  # off: the same arithmetic, another program
  chex.assert_trees_all_close(p, ref, rtol=0, atol=RUN_ATOL)
  params = init_params(CFG, 0)
  # A Gaussian gradient: cos of these small weights is nearly rank one, with singular values at
  # polar_express_4's cutoff, where one ulp of the input moves the update by ~1600 ulps
  # (_exactness: the rule holds for inputs away from the cutoff)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  g = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params)
  off = _muonclip(qk_clip_threshold=float("inf"))  # off too, and needs no max_logits
  jax.tree.map(assert_same_math, jax.jit(off.update)(g, off.init(params), params)[0],
               MUON_UPDATE(g, MUON.init(params), params)[0])
  # A finite but unreachable tau keeps every update (jnp.where picks it), but XLA fuses the
  # larger program differently, so the Muon arithmetic rounds differently (RUN_ATOL).
  p, _, _ = _run(_muonclip(qk_clip_threshold=1e9), steps=3)
  chex.assert_trees_all_close(p, ref, rtol=0, atol=RUN_ATOL)


def test_missing_max_logits_is_an_error_and_none_turns_clip_off():
  params = init_params(CFG, 0)
  g = jax.tree.map(jnp.ones_like, params)
  opt = _muonclip()
  with pytest.raises(ValueError, match="max_logits is missing, but the clip threshold is 5.0.*Flax's "
                                       "TrainState.apply_gradients passes no extra arguments"):
    jax.jit(opt.update)(g, opt.init(params), params)
  off = _muonclip(qk_clip_threshold=None)
  u, _ = jax.jit(off.update)(g, off.init(params), params)  # no max_logits needed
  chex.assert_tree_all_finite(u)
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="qk_clip_threshold must be > 0"):
      _muonclip(qk_clip_threshold=bad)


def test_chain_inject_hyperparams_and_schedule():
  chained = optax.chain(optax.clip_by_global_norm(1.0), _muonclip())
  p, _, hist = _run(chained, steps=3)
  chex.assert_tree_all_finite(p)
  injected = optax.inject_hyperparams(mc.muonclip)(
      learning_rate=optax.cosine_decay_schedule(LR, 10), layout=CFG.layout, qk_clip_threshold=TAU,
      matrix_axes=matrix_axes,
  )
  p_inj, state, _ = _run(injected, steps=3)
  # inject_hyperparams hands every hyperparameter over as a float32 array. Constants are
  # not rounded the same way: optax's Adam computes 1 - b1 from a Python float in float64
  # (0.1 once rounded) but from float32(0.9) in float32 (0.10000002), and the same for b2;
  # a 2e-7 relative difference in AdamW's first update, which Newton–Schulz and Adam's
  # normalization amplify to ~1e-5 in three steps at this learning rate (JAX 0.12 measured
  # 1.6e-5 on lm_head). Given the same float32 betas, every hyperparameter rounds
  # identically, and the two programs agree to their compilations' rounding (RUN_ATOL). That
  # tolerance is above the betas' 1.6e-5: this test no longer sees a hyperparameter rounded
  # differently, only a wrong one (a different schedule or tau moves weights by ~1e-2).
  p_ref, _, _ = _run(mc.muonclip(optax.cosine_decay_schedule(LR, 10), layout=CFG.layout,
                                  qk_clip_threshold=TAU, matrix_axes=matrix_axes,
                                  adam_b1=np.float32(0.9), adam_b2=np.float32(0.95)), steps=3)
  chex.assert_trees_all_close(p_inj, p_ref, atol=RUN_ATOL, rtol=0)  # traced vs constant hyperparameters
  assert float(state.hyperparams["qk_clip_threshold"]) == TAU


def _planted(k, hot):
  """k microbatches of max_logits for the tiny LM; microbatch `hot` holds the largest logit."""
  out = []
  for i in range(k):
    s = jnp.full((CFG.num_layers, CFG.num_heads), 1.0)
    if i == hot:
      s = s.at[1, 0].set(50.0)
    out.append({"layers": {"attn": {"max_logits": s}}})
  return out


def test_multi_steps_clips_once_with_the_max_over_all_microbatches():
  params = init_params(CFG, 0)
  k, tau = 3, 10.0
  opt = mc.multi_steps(_muonclip(qk_clip_threshold=tau), k, layout=CFG.layout)
  state = opt.init(params)
  grads = [jax.tree.map(lambda p, i=i: jnp.cos(p * (i + 1)), params) for i in range(k)]
  p = params
  update = jax.jit(opt.update)
  for i, m in enumerate(_planted(k, hot=0)):  # the largest logit is in the first microbatch
    u, state = update(grads[i], state, p, max_logits=m)
    if i < k - 1:
      chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))  # no update, no clip yet
    p = optax.apply_updates(p, u)
  # Reference: one muonclip step on the mean gradient with the max over the microbatches.
  ref_opt = _muonclip(qk_clip_threshold=tau)
  mean = jax.tree.map(lambda *g: sum(g) / k, *grads)
  planted = _planted(1, hot=0)[0]
  u, _ = jax.jit(ref_opt.update)(mean, ref_opt.init(params), params, max_logits=planted)
  # Two programs' rounding of the Newton–Schulz iteration: ~1e-5 on updates of ~3e-2;
  # taking the last microbatch instead of the maximum would change the hot head by ~1e-1.
  chex.assert_trees_all_close(p, optax.apply_updates(params, u), atol=5e-5)
  # the running maximum starts again after the real update
  np.testing.assert_array_equal(np.asarray(state.max_logits["layers"]["attn"]["max_logits"]), -np.inf)
  # with the plain optax.MultiSteps the first microbatch's logit would be lost:
  plain = optax.MultiSteps(_muonclip(qk_clip_threshold=tau), k)
  ps, pp, plain_update = plain.init(params), params, jax.jit(plain.update)
  for i, m in enumerate(_planted(k, hot=0)):
    u, ps = plain_update(grads[i], ps, pp, max_logits=m)
    pp = optax.apply_updates(pp, u)
  assert not np.allclose(pp["layers"]["attn"]["wq_b"]["kernel"][1], p["layers"]["attn"]["wq_b"]["kernel"][1])


def test_scan_microbatches_in_the_train_step_use_the_max_over_all():
  params = init_params(CFG, 0)
  hot_value = 50.0

  def loss_fn(p, batch):  # a loss whose max logits are planted by the batch
    loss, _ = LOSS_FN(p, batch["tokens"])
    return loss, {"layers": {"attn": {"max_logits": batch["planted"][0]}}}

  k = 4
  planted = jnp.ones((k, CFG.num_layers, CFG.num_heads)).at[1, 0, 1].set(hot_value)  # microbatch 1
  tokens = jnp.concatenate([BATCHES[0]] * 2)[: 2 * k]
  batch = {"tokens": tokens, "planted": planted}
  opt = _muonclip(qk_clip_threshold=10.0)
  step = jax.jit(training.make_train_step(loss_fn, opt, num_microbatches=k))
  p, _, metrics = step(params, opt.init(params), batch)
  assert float(metrics["max_logit"]) == hot_value
  assert int(metrics["num_clipped"]) == 1
  assert float(metrics["min_gamma"]) == pytest.approx(10.0 / hot_value)
  # Reference: mean gradient over the microbatches, one clip with the planted maximum.
  grad_fn = jax.jit(jax.grad(lambda q, b: LOSS_FN(q, b)[0]))
  grads = [grad_fn(params, tokens[2 * i:2 * i + 2]) for i in range(k)]
  mean = jax.tree.map(lambda *g: sum(g) / k, *grads)
  u, _ = jax.jit(opt.update)(mean, opt.init(params), params,
                             max_logits={"layers": {"attn": {"max_logits": planted.max(axis=0)}}})
  # Two programs' rounding of the Newton–Schulz iteration: ~1e-5 on updates of ~3e-2;
  # taking the last microbatch instead of the maximum would change the hot head by ~1e-1.
  chex.assert_trees_all_close(p, optax.apply_updates(params, u), atol=5e-5)


def test_checkpoint_save_restore_continue(tmp_path):
  opt = CLIP
  full, _, _ = _run(opt, steps=4)
  half, state, _ = _run(opt, steps=2)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "step2", {"params": half, "opt_state": state})
  ckpt.wait_until_finished()
  target = jax.eval_shape(lambda: {"params": half, "opt_state": state})
  restored = ckpt.restore(tmp_path / "step2", target)
  chex.assert_trees_all_equal(restored["params"], half)
  resumed, _, _ = _run(opt, steps=2, params=restored["params"], state=restored["opt_state"], start=2)
  chex.assert_trees_all_equal(resumed, full)


def test_a_checkpoint_saved_before_mu_scale_restores_without_a_target_and_trains_on(tmp_path):
  """The recipe of docs/training.md: Orbax's raw restore of a state saved without mu_scale, brought
  forward by upgrade_opt_state, resumes as the uninterrupted run (one program: bit for bit)."""
  opt = CLIP
  full, _, _ = _run(opt, steps=4)
  half, state, _ = _run(opt, steps=2)
  old = jax.tree.map(lambda x: {"mu": x.mu} if isinstance(x, mc.ScaleByMuonState) else x, state,
                     is_leaf=lambda x: isinstance(x, mc.ScaleByMuonState))  # as saved before the field
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "old", {"params": half, "opt_state": old})
  ckpt.wait_until_finished()
  with pytest.raises(ValueError):  # onto today's structure it does not restore
    ckpt.restore(tmp_path / "old", jax.eval_shape(lambda: {"params": half, "opt_state": state}))
  raw = ckpt.restore(tmp_path / "old")
  upgraded = mc.upgrade_opt_state(raw["opt_state"], opt, raw["params"])
  resumed, _, _ = _run(opt, steps=2, params=raw["params"], state=upgraded, start=2)
  chex.assert_trees_all_equal(resumed, full)


def test_no_retracing_across_steps():
  # the step of float32 params is traced once (here or by an earlier test): each step's
  # state has the structure, shapes and dtypes of the one before
  _run(CLIP, steps=3)
  assert _TRACES[(id(CLIP), ()), ("float32",)] == 1


def test_mixed_precision_master_params_are_clipped_and_bf16_params_work():
  # float32 master params, bfloat16 compute copy: the clip acts on the master params.
  opt = CLIP
  p32, _, hist = _run(opt, compute_dtype=jnp.bfloat16, exact_clip=True, layout=CFG.layout)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p32))
  for params, _, batch in hist:
    # The exact clip measured the bf16 copy the model runs, and scaled the master weights;
    # the next copy is cast from them, so both hold the bound to bf16 precision (2^-8).
    copy = optax.tree.cast(params, jnp.bfloat16)
    for s in _max_logits(copy, batch).values():
      assert float(jnp.max(s)) <= TAU * (1 + 1e-2)
    for s in _max_logits(params, batch).values():
      assert float(jnp.max(s)) <= TAU * (1 + 1e-2)
  # bf16-only params
  p16 = optax.tree.cast(init_params(CFG, 0), jnp.bfloat16)
  out, state, hist = _run(opt, params=p16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))
  chex.assert_tree_all_finite(out)
  assert float(hist[-1][1]["loss"]) < float(hist[0][1]["loss"])


@pytest.mark.parametrize("skipped_at", [0, 1])
def test_multi_steps_drops_the_maxima_of_a_skipped_micro_step_wherever_it_falls(skipped_at):
  """``should_skip_update_fn`` skips a micro-step with a non-finite gradient: its maxima are
  dropped with its gradient, first in the accumulation or not. Here they alone are above tau."""
  layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
  params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
  opt = mc.multi_steps(optax.chain(optax.sgd(0.0), mc.qk_clip_transform(100.0, layout=layout)), 2, layout=layout,
                       should_skip_update_fn=optax.skip_not_finite)
  zeros, nan = jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  cold, hot = ({"attn": {"max_logits": jnp.array(m)}} for m in ([50.0, 60.0], [400.0, 50.0]))
  calls = [(zeros, cold), (zeros, cold)]
  calls.insert(skipped_at, (nan, hot))
  state, p, update, running = opt.init(params), params, jax.jit(opt.update), []
  for grads, maxima in calls:
    u, state = update(grads, state, p, max_logits=maxima)
    p = optax.apply_updates(p, u)
    running.append(np.asarray(state.max_logits["attn"]["max_logits"]))
  assert int(state.inner.gradient_step) == 1 and int(state.inner.skip_state["num_not_finite"]) == 0
  assert_same_math(p, params, "the cold maxima are below tau: nothing clipped")
  empty, first = [-np.inf, -np.inf], [50.0, 60.0]  # the running maximum after each call
  want = [empty, first, empty] if skipped_at == 0 else [first, first, empty]
  assert_same_math(np.stack(running), np.asarray(want, np.float32), "the running maximum")
