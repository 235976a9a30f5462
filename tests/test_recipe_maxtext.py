"""The MaxText-style recipe (examples/recipe_maxtext_scanned.py): scanned on axis 1, logical names,
its own ``(batch, heads)`` maxima under ``attention_op``, two layers.

Checks: the sown maxima (reduced over the batch) equal NumPy's scaled, masked logits of the q
and k that reached the attention; one ``muonclip`` step equals ``muon_adamw`` plus the per-head
rule applied by hand to the ``(embed, layers, heads, head_dim)`` storage; after ``qk_clip``,
recomputing each layer's attention on the same inputs gives every clipped head's maximum
<= tau (1 + 1e-5) and every unclipped head's bit for bit; value and output kernels untouched.
"""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc
from test_recipes import LR, check_step, flat, np_max_logits, tau_between

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import recipe_maxtext_scanned as mod  # noqa: E402


def _record():
  """Sows what reached each layer's attention (its input x) and its attention_op (q, k); stacked by
  the scan on axis 0, so layers come out in order."""
  def interceptor(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, mod.AttentionOp):
      context.module.sow("intermediates", "probe_q", args[0])
      context.module.sow("intermediates", "probe_k", args[1])
    elif context.method_name == "__call__" and isinstance(context.module, mod.Attention):
      context.module.sow("intermediates", "probe_x", args[0])
    return next_fun(*args, **kwargs)

  return nn.intercept_methods(interceptor)


def _layer_maxima(cfg, attn_params, inputs):
  """Each layer's attention, run alone on its recorded input: per-head max over the batch."""
  run = jax.jit(lambda p, x: mod.Attention(cfg).apply({"params": p}, x, mutable=["intermediates"])[1])
  out = []
  for layer, x in enumerate(inputs):
    p = jax.tree.map(lambda a, i=layer: jnp.take(a, i, axis=1), nn.unbox(attn_params))  # layer axis 1
    out.append(np.asarray(run(p, x)["intermediates"]["attention_op"]["max_logits"]).max(axis=0))
  return np.stack(out)


def test_recipe_maxtext_scanned():
  cfg = mod.Config()
  model = mod.Transformer(cfg)
  tokens = next(mod.batches(cfg, batch_size=2))
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  attn = params["layers"]["self_attention"]
  assert attn["query"]["kernel"].names == ("embed", "layers", "q_heads", "kv")
  assert attn["query"]["kernel"].value.shape == (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.head_dim)
  # 1. MaxText's own maxima (layers, batch, heads); reduced over the batch = NumPy on the q, k
  with _record():
    (_, inter), grads = jax.jit(jax.value_and_grad(mod.loss_fn, has_aux=True), static_argnums=1)(
        params, model, tokens)
  op = inter["layers"]["self_attention"]["attention_op"]
  store_qk = list(zip(np.asarray(op["probe_q"][0]), np.asarray(op["probe_k"][0])))
  store_x = list(np.asarray(inter["layers"]["self_attention"]["probe_x"][0]))
  raw = op["max_logits"]
  assert raw.shape == (cfg.num_layers, 2, cfg.num_heads) and len(store_qk) == cfg.num_layers == len(store_x)
  reduced = mc.reduce_max_logits(inter)
  maxima = np.asarray(reduced["layers"]["self_attention"]["max_logits"])
  np.testing.assert_allclose(maxima, np.stack([np_max_logits(q, k, None, True) for q, k in store_qk]),
                             rtol=2e-5, atol=2e-6)
  tau = tau_between(maxima)
  with pytest.raises(ValueError, match=r"attention_op/max_logits of shape \(2, 2, 4\) lies below the attention "
                                       r"module 'layers/self_attention'.*reduce_max_logits"):
    mc.qk_clip(params, inter, qk_clip_threshold=tau, layout=cfg.layout)  # the batch axis is never read as layers
  # 2. one muonclip step = muon_adamw + query head h of layer l scaled by gamma (clip_mode="query")
  clip, plain = mod.optimizer(cfg, LR, tau), mc.muon_adamw(LR)
  u, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=reduced)
  v, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  p_clip, p_ref = optax.apply_updates(params, u), optax.apply_updates(params, v)
  gamma = np.where(maxima > tau, tau / maxima, 1.0)  # (layers, heads)
  name = "layers/self_attention/query/kernel"
  expected = {name: np.asarray(flat(p_ref)[name], np.float64) * gamma[None, :, :, None]}
  check_step(p_clip, p_ref, expected)  # every other leaf, value and out included: muon_adamw's
  # 3. after the clip, each layer recomputed on its same input: clipped heads <= tau, others bit for bit
  clipped = mc.qk_clip(params, reduced, qk_clip_threshold=tau, layout=cfg.layout)
  before = _layer_maxima(cfg, attn, store_x)
  after = _layer_maxima(cfg, clipped["layers"]["self_attention"], store_x)
  np.testing.assert_allclose(before, maxima, rtol=2e-5, atol=2e-6)
  hit = maxima > tau
  assert np.all(after[hit] <= tau * (1 + 1e-5)), (after, tau)
  np.testing.assert_array_equal(after[~hit], before[~hit])
  for proj in ("key", "value", "out"):
    np.testing.assert_array_equal(clipped["layers"]["self_attention"][proj]["kernel"].value, attn[proj]["kernel"].value)
  # 4. multi_steps takes the same reduced maxima (running max over microbatches)
  acc = mc.multi_steps(mc.qk_clip_transform(tau, layout=cfg.layout), 2, layout=cfg.layout)
  _, state = acc.update(grads, acc.init(params), params, max_logits=reduced)
  np.testing.assert_array_equal(state.max_logits["layers"]["self_attention"]["max_logits"], maxima)


def test_recipe_maxtext_runs(capsys):
  mod.main(["--steps", "1"])
  assert "step   0  loss" in capsys.readouterr().out
