"""make_train_step on models deeper than one attention layer: the exact clip, metrics, rng."""

import jax
import jax.numpy as jnp
import pytest

import muonclip_jax as mc
from muonclip_jax import training
from muonclip_jax._qk_clip import collect_max_logits
from _deep_lm import DeepConfig, batches, init_params, make_loss_fn

AXES = mc.MatrixAxes((-2,), (-1,))
CONFIGS = [DeepConfig(a, s) for a in ("mla", "gqa") for s in (True, False)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.attention}-{'scan' if c.scan else 'unrolled'}")
def test_exact_clip_bounds_every_layer_of_a_deep_model(cfg):
  # tau = 1 sits below the initial max logits (about 2 to 4.6), and Muon at lr 0.05 pushes
  # them further up: every step clips, in every layer, and clipping layer l moves the input
  # of layer l+1 (one clip with one forward pass left up to 1.23 tau here).
  tau, loss_fn = 1.0, make_loss_fn(cfg)
  opt = mc.muon_adamw(0.05, matrix_axes=AXES)
  step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=tau, layout=cfg.layout, exact_clip=True))
  params = init_params(cfg)
  state = opt.init(params)
  passes = []
  for batch in batches(3):
    params, state, metrics = step(params, state, batch)
    after = collect_max_logits(loss_fn(params, batch)[1])
    assert sum(s.size // s.shape[-1] for s in after.values()) == cfg.num_layers
    worst = max(float(jnp.max(s)) for s in after.values())
    assert worst <= tau * (1 + 1e-4), (worst, int(metrics["exact_clip_passes"]))
    assert float(metrics["max_logit"]) > tau  # the step's forward pass was above tau
    passes.append(int(metrics["exact_clip_passes"]))
    assert metrics["exact_clip_passes"].dtype == jnp.int32
  assert all(1 <= p <= cfg.num_layers for p in passes), passes
  assert max(passes) > 1, passes  # the extra passes did the work
