"""The Equinox recipes (examples/recipe_equinox_*.py), each on a model with two attention layers.

For each, trained through ``training.make_train_step`` on ``eqx.partition``ed params (the loss
calls ``eqx.combine``) with two microbatches:

1. the captured maxima (the step's ``max_logits``, the maximum over both microbatches) equal
   NumPy's scaled, causally masked logits of the q and k that reached the attention;
2. one ``muonclip`` step equals a ``muon_adamw`` step followed by the per-head rule applied in
   NumPy to the ``(out, in)`` storage of the ``Linear`` weights (rows of a head, and its bias);
   every other leaf is ``muon_adamw``'s (``_exactness.assert_same_math``);
3. the same step sharded on 8 devices (batch over ``data``, weights' output rows over
   ``model``) equals the single-device step;
4. after ``qk_clip`` with those maxima, layer 0 recomputed on the same batch gives every clipped
   head a maximum <= tau (1 + 1e-5), and every head whose q and k were untouched its old
   maximum bit for bit;

and the routing sends every norm gain, bias and embedding to AdamW, stacked or not.
"""

import os
import sys

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import sharding, training
from muonclip_jax._clip import nest_max_logits
from _exactness import assert_same_math

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from test_recipes import LR, check_step, clip_factors_np, flat, tau_between  # noqa: E402
import recipe_equinox_gpt  # noqa: E402
import recipe_equinox_llama  # noqa: E402

BATCH = 8  # two microbatches of 4, each split over the 4 devices of the mesh's data axis


def np_causal_max_logits(q, k):
  """Per-head max over batch, queries and causally allowed keys of q.k / sqrt(D) (float64);
  q (B, T, H, D), k (B, T, Hkv, D)."""
  q, k = np.float64(q), np.float64(k)
  k = np.repeat(k, q.shape[-2] // k.shape[-2], axis=-2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  return np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf).max(axis=(0, 2, 3))


def head_rows(x, f, head_dim):
  """``(out, in)`` storage (or a bias ``(out,)``), with optional leading layers: head h's rows by ``f[..., h]``."""
  rows = np.repeat(f, head_dim, axis=-1)
  x = np.asarray(x, np.float64)
  return x * (rows[..., :, None] if x.ndim == rows.ndim + 1 else rows)


def expected_labels(params):
  """The routing every recipe must get: Linear weights of the blocks to Muon; gains, biases,
  embedding tables and the LM head to AdamW."""
  out = {}
  for path in flat(params):
    parts = path.split("/")
    adam = (parts[-1] == "bias" or "norm" in path or "ln_" in path or "embed" in parts[0]
            or parts[0] == "lm_head")
    out[path] = "adam" if adam else "muon"
  return out


def mesh_shardings(params, mesh):
  """Weights' output rows (axis -2) over ``model`` where they divide; everything else replicated."""
  def one(x):
    spec = [None] * x.ndim
    if x.ndim >= 2 and x.shape[-2] % mesh.shape["model"] == 0:
      spec[-2] = "model"
    return NamedSharding(mesh, P(*spec))

  return jax.tree.map(one, params)


def check_recipe(mod, cfg, model, layout, probe, expected_fn, group):
  """``probe(params, tokens) -> ([(q, k) per layer], layer 0's maxima (H,))`` with the recipe's own code."""
  params, static = eqx.partition(model, eqx.is_array)
  num_heads = cfg.num_heads
  tokens = jax.random.randint(jax.random.key(5), (BATCH, cfg.seq_len + 1), 0, cfg.vocab)
  # routing: read from the layer types, stacked or not
  labels = {jax.tree_util.keystr(p, simple=True, separator="/"): label
            for p, label in jax.tree_util.tree_flatten_with_path(mc.muon_labels(params))[0]}
  assert labels == expected_labels(params)
  loss_fn = lambda p, t: mod.loss_fn(p, static, t)  # noqa: E731
  plain = mc.muon_adamw(LR)
  p_ref, _, m_ref = jax.jit(training.make_train_step(loss_fn, plain, num_microbatches=2))(
      params, plain.init(params), tokens)
  # 1. the maxima are NumPy's
  modules = sorted(m_ref["max_logits"])
  maxima = np.concatenate([np.asarray(m_ref["max_logits"][m]).reshape(-1, num_heads) for m in modules])
  probe = jax.jit(probe)
  qk, layer0 = probe(params, tokens[:, :-1])
  assert maxima.shape == (2, num_heads) and len(qk) == 2
  np.testing.assert_allclose(maxima, np.stack([np_causal_max_logits(q, k) for q, k in qk]), rtol=2e-5, atol=2e-6)
  # 2. one muonclip step = muon_adamw step + the per-head rule on (out, in) storage
  group_max = maxima.reshape(2, -1, group).max(-1)
  tau = tau_between(group_max[0])  # layer 0 has a clipped group and an untouched one
  clip = mod.optimizer(model if mod is recipe_equinox_gpt else mod.Config(), LR, tau)
  step = training.make_train_step(loss_fn, clip, num_microbatches=2)
  p_clip, _, m_clip = jax.jit(step)(params, clip.init(params), tokens)
  assert int(m_clip["num_clipped"]) == int((maxima > tau).sum()) > 0
  for m in modules:  # the same forward pass in both programs
    assert_same_math(m_clip["max_logits"][m], m_ref["max_logits"][m], err_msg=m)
  fq, fk = clip_factors_np(maxima, tau, group)
  check_step(p_clip, p_ref, expected_fn(flat(p_ref), fq, fk))
  # 3. sharded on 8 devices = one device
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  ps = mesh_shardings(params, mesh)
  sharded = jax.device_put(params, ps)
  state = sharding.init_state(clip, sharded, ps)
  bs = sharding.batch_shardings(tokens, mesh)
  jitted = sharding.jit_train_step(step, ps, jax.tree.map(lambda x: x.sharding, state), bs)
  p_sharded, _, m_sharded = jitted(sharded, state, jax.device_put(tokens, bs))
  assert p_sharded.blocks is not None and int(m_sharded["num_clipped"]) == int(m_clip["num_clipped"])
  chex.assert_trees_all_close(jax.device_get(p_sharded), p_clip, atol=1e-5, rtol=1e-5)
  # 4. the clip bounds layer 0's recomputed maxima; heads of untouched groups keep theirs bit for bit
  intermediates = nest_max_logits({m: m_ref["max_logits"][m] for m in modules})
  clipped = jax.jit(lambda p, s: mc.qk_clip(p, s, qk_clip_threshold=tau, layout=layout))(params, intermediates)
  _, after = probe(clipped, tokens[:, :-1])
  before, after = np.asarray(layer0), np.asarray(after)
  hot, untouched = before > tau, np.repeat(group_max[0] <= tau, group)
  assert hot.any() and untouched.any()
  assert (after[hot] <= tau * (1 + 1e-5)).all(), (after, tau)
  np.testing.assert_array_equal(after[untouched], before[untouched])


def test_recipe_equinox_gpt():
  mod, cfg = recipe_equinox_gpt, recipe_equinox_gpt.Config()
  model = mod.GPT(cfg, key=jax.random.key(0))
  d = cfg.dim // cfg.num_heads
  mask = jnp.tril(jnp.ones((cfg.seq_len, cfg.seq_len), bool))

  def probe(params, tokens):
    m = eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True))
    x = jax.vmap(lambda t: jax.vmap(m.embed)(t) + jax.vmap(m.pos_embed)(jnp.arange(t.shape[0])))(tokens)
    qk, layer0 = [], None
    for i, block in enumerate(m.blocks):
      h = jax.vmap(jax.vmap(block.ln_1))(x)
      proj = lambda lin: jax.vmap(jax.vmap(lin))(h).reshape(*h.shape[:2], cfg.num_heads, d)  # noqa: E731
      qk.append((proj(block.attn.query_proj), proj(block.attn.key_proj)))
      x, maxima = jax.vmap(lambda xb, b=block: b(xb, mask))(x)
      layer0 = maxima.max(axis=0) if i == 0 else layer0
    return qk, layer0

  def expected(ref, fq, fk):
    out = {}
    for i in range(cfg.num_layers):
      for name, f in (("query_proj/weight", fq[i]), ("query_proj/bias", fq[i]), ("key_proj/weight", fk[i])):
        name = f"blocks/{i}/attn/{name}"
        out[name] = head_rows(ref[name], f, d)
    return out

  assert model.blocks[0].attn.query_proj.weight.shape == (cfg.dim, cfg.dim)  # square (out, in), read by type
  check_recipe(mod, cfg, model, mod.layout(model), probe, expected, group=1)


def test_recipe_equinox_llama():
  mod, cfg = recipe_equinox_llama, recipe_equinox_llama.Config()
  model = mod.Llama(cfg, key=jax.random.key(0))
  group = cfg.num_heads // cfg.num_kv_heads

  def probe(params, tokens):
    m = eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True))
    dynamic, static = eqx.partition(m.blocks, eqx.is_array)
    x = jax.vmap(jax.vmap(m.embed))(tokens)
    qk, layer0 = [], None
    for i in range(cfg.num_layers):
      block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
      q, k, _ = jax.vmap(block.attn.qkv)(jax.vmap(jax.vmap(block.attn_norm))(x))
      qk.append((q, k))
      x, maxima = jax.vmap(block)(x)
      layer0 = maxima.max(axis=0) if i == 0 else layer0
    return qk, layer0

  def expected(ref, fq, fk):  # stacked (layers, out, in) weights, no biases
    return {"blocks/attn/wq/weight": head_rows(ref["blocks/attn/wq/weight"], fq, cfg.head_dim),
            "blocks/attn/wk/weight": head_rows(ref["blocks/attn/wk/weight"], fk, cfg.head_dim)}

  assert model.blocks.attn_norm.weight.shape == (cfg.num_layers, cfg.dim)  # stacked gains
  check_recipe(mod, cfg, model, cfg.layout, probe, expected, group=group)


def test_recipe_equinox_llama_per_head_muon_cuts_the_true_heads():
  """The recipe's layout names its four Linears by module alone; with "head+out" the (layers, out, in)
  value weight is cut into its heads' rows and the square output weight into its heads' columns."""
  from test_equinox import _cut

  cfg = recipe_equinox_llama.Config()
  params = eqx.filter(recipe_equinox_llama.Llama(cfg, key=jax.random.key(0)), eqx.is_array)
  attn = params.blocks.attn  # Muon's part of the stacked blocks (the norms go to AdamW)
  grads = jax.tree.map(lambda x: jnp.cos(5 * x) + x, attn)
  assert attn.wo.weight.shape == (cfg.num_layers, cfg.dim, cfg.dim)  # square: both readings fit
  opt = mc.scale_by_muon(layout=cfg.layout, muon_blocks="head+out")
  got = jax.jit(opt.update)(grads, opt.init(attn))[0]
  d = jax.tree.map(lambda g: 1.95 * g, grads)  # the first Nesterov step's direction, (1 + beta) g
  np.testing.assert_allclose(got.wv.weight, _cut(d.wv.weight, -2, 1), rtol=0, atol=2e-5)
  np.testing.assert_allclose(got.wo.weight, _cut(d.wo.weight, -1, 1), rtol=0, atol=2e-5)
  assert np.abs(got.wo.weight - _cut(d.wo.weight, -2, 1)).max() > 0.1  # the wrong (row) cut is far off
  recipe_equinox_llama.optimizer(cfg, muon_blocks="group:kv+out").init(params)  # GQA groups: the same layout


@pytest.mark.parametrize("module", [recipe_equinox_llama])
def test_equinox_recipe_runs(module, capsys):
  module.main(["--steps", "1"])
  assert "step   0  loss" in capsys.readouterr().out
