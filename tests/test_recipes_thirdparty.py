"""Recipes on model code others wrote (examples/recipe_hf_*.py, recipe_gemma.py), two attention layers each.

For each recipe:
1. the patched model's output equals the unpatched one's;
2. the sown maxima equal NumPy's scaled, masked (pre-cap) logits of the q and k that reached
   the attention;
3. one ``muonclip`` step equals ``muon_adamw`` followed by the per-head rule applied in NumPy
   to that kernel storage; every other leaf (value and output kernels included) is bit for
   bit ``muon_adamw``'s;
4. after ``qk_clip`` with those maxima, the forward recomputed on the same batch, each
   attention layer fed the inputs it had in the measured pass (``nn.intercept_methods``),
   gives every clipped head a maximum <= tau (1 + 1e-5) and every head whose q and k
   columns were untouched its old maximum bit for bit.
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
import muonclip_jax.nn as mcnn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _exactness import assert_same_math  # noqa: E402
from test_recipes import (LR, check_clip_bounds, check_step, clip_factors_np, flat, replaying_inputs,  # noqa: E402
                          scaled, sown_by_layer, tau_between)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers: "Flax classes are deprecated"


@pytest.fixture(autouse=True)
def _third_party_rank_promotion():
  """Hugging Face's Flax code relies on NumPy rank promotion (e.g. a norm weight (D,) times (B, T, D))."""
  with jax.numpy_rank_promotion("allow"):
    yield


def recording(store, fn=mcnn.dot_product_attention_weights):
  """``dot_product_attention_weights`` that hands q, k and bias to the host, in call order."""

  def wrapped(query, key, bias=None, *args, **kw):
    jax.debug.callback(lambda q, k, b: store.append((np.asarray(q), np.asarray(k), np.asarray(b))),
                       query, key, bias, ordered=True)
    return fn(query, key, bias, *args, **kw)

  return wrapped


def np_hf_max_logits(q, k, bias):
  """Per-head max over batch, queries and causally allowed keys of q.k / sqrt(D) + bias (float64)."""
  s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / np.sqrt(q.shape[-1]) + np.float64(bias)
  allowed = np.tril(np.ones(s.shape[-2:], bool))
  return np.where(allowed, s, -np.inf).max(axis=(0, 2, 3))


def hf_recipe_check(monkeypatch, mod, hf_module, attention_cls, expected_fn, group=1, exact_slices=()):
  cfg = mod.Config()
  module, params = mod.model_and_params(cfg)
  tokens = next(mod.batches(cfg, batch_size=2))
  ours = jax.jit(lambda p, t: mod.forward(p, module, t)[0])(params, tokens[:, :-1])
  # 1. the one-line patch changes no output
  monkeypatch.setattr(hf_module, "dot_product_attention_weights", nn.dot_product_attention_weights)
  positions = jnp.broadcast_to(jnp.arange(cfg.seq_len), tokens[:, :-1].shape)
  theirs = jax.jit(lambda p, t: module.apply({"params": p}, t, jnp.ones_like(t), positions).logits)(
      params, tokens[:, :-1])
  np.testing.assert_allclose(theirs, ours, rtol=1e-6, atol=1e-6)
  # 2. the sown maxima are NumPy's
  store = []
  monkeypatch.setattr(hf_module, "dot_product_attention_weights", recording(store))
  (_, intermediates), grads = jax.jit(jax.value_and_grad(lambda p, t: mod.loss_fn(p, module, t), has_aux=True))(
      params, tokens)
  jax.effects_barrier()
  monkeypatch.undo()
  maxima = sown_by_layer(intermediates, cfg.num_heads)
  assert maxima.shape == (cfg.num_layers, cfg.num_heads) and len(store) == cfg.num_layers
  np.testing.assert_allclose(maxima, np.stack([np_hf_max_logits(*rec) for rec in store]), rtol=2e-5, atol=1e-7)
  # 3. one muonclip step = muon_adamw (the same layout: Muon's matrices) + the per-head rule on the kernels' storage
  tau = tau_between(maxima)
  clip, plain = mod.optimizer(cfg, LR, tau), mc.muon_adamw(LR, layout=cfg.layout)
  u, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=intermediates)
  v, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  p_clip, p_ref = optax.apply_updates(params, u), optax.apply_updates(params, v)
  fq, fk = clip_factors_np(maxima, tau, group=group)
  check_step(p_clip, p_ref, expected_fn(cfg, flat(p_ref), fq, fk), exact_slices(cfg) if exact_slices else ())
  # 4. the clip bounds the recomputed maxima; heads of groups without a clipped head are untouched
  group_max = maxima.reshape(cfg.num_layers, -1, group).max(-1)
  tau = tau_between(group_max)  # some groups keep q and k
  untouched = np.repeat(group_max <= tau, group, axis=-1)
  check_clip_bounds(lambda p: mod.forward(p, module, tokens[:, :-1])[1], attention_cls, params,
                    intermediates, tau, cfg.layout, cfg.num_heads, untouched)


def test_recipe_hf_llama(monkeypatch):
  import recipe_hf_llama as mod
  import transformers.models.llama.modeling_flax_llama as hf_llama

  def expected(cfg, ref, fq, fk):  # q_proj/k_proj kernels (in, heads * head_dim): columns
    out = {}
    for i in range(cfg.num_layers):
      for proj, f in (("q_proj", fq[i]), ("k_proj", fk[i])):
        name = f"model/layers/{i}/self_attn/{proj}/kernel"
        out[name] = scaled(ref[name], f, cfg.head_dim, "columns")
    return out

  assert mod.Config().num_kv_heads < mod.Config().num_heads
  hf_recipe_check(monkeypatch, mod, hf_llama, hf_llama.FlaxLlamaAttention, expected,
                  group=mod.Config().num_heads // mod.Config().num_kv_heads)


def test_recipe_hf_gpt2(monkeypatch):
  import recipe_hf_gpt2 as mod
  import transformers.models.gpt2.modeling_flax_gpt2 as hf_gpt2

  def expected(cfg, ref, fq, fk):  # c_attn kernel (3 * dim, dim), torch-style: q rows, k rows, v rows
    out = {}
    for i in range(cfg.num_layers):
      rows = np.concatenate([np.repeat(fq[i], cfg.head_dim), np.repeat(fk[i], cfg.head_dim),
                             np.ones(cfg.dim)])
      name = f"transformer/h/{i}/attn/c_attn/"
      out[name + "kernel"] = np.asarray(ref[name + "kernel"], np.float64) * rows[:, None]
      out[name + "bias"] = np.asarray(ref[name + "bias"], np.float64) * rows
    return out

  def value_rows(cfg):
    return [(f"transformer/h/{i}/attn/c_attn/{leaf}", slice(2 * cfg.dim, 3 * cfg.dim))
            for i in range(cfg.num_layers) for leaf in ("kernel", "bias")]

  hf_recipe_check(monkeypatch, mod, hf_gpt2, hf_gpt2.FlaxGPT2Attention, expected, exact_slices=value_rows)


def test_hf_bloom_query_key_value_is_grouped_by_head(monkeypatch):
  """Bloom's fused ``query_key_value`` (``(dim, heads * 3 * head_dim)``: every head's q, k, v in turn),
  declared ``Projection(..., grouped=True)``: after ``qk_clip`` with the heads' maxima of q.k / sqrt(D)
  on a batch, the recomputed q.k of every head is gamma_h times the old (tau for the clipped
  heads, the old for the others, to the suite's tolerance), in both layers, and every value column is kept."""
  bloom = pytest.importorskip("transformers.models.bloom.modeling_flax_bloom")
  heads, dim, layers = 4, 16, 2
  model = bloom.FlaxBloomForCausalLM(bloom.BloomConfig(vocab_size=64, hidden_size=dim, n_layer=layers,
                                                       n_head=heads), seed=0)
  params = jax.tree.map(lambda x: x * 4, model.params)  # logits of a few units
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)

  def qk(params):  # per layer: (heads, batch * queries * keys) q.k / sqrt(D), causal
    store = []
    monkeypatch.setattr(bloom, "dot_product_attention_weights", recording(store))
    model(tokens, params=params)
    jax.effects_barrier()
    monkeypatch.undo()
    out = []
    for q, k, _ in store:
      s = np.einsum("bqhd,bkhd->hbqk", np.float64(q), np.float64(k)) / np.sqrt(q.shape[-1])
      out.append(np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf).reshape(heads, -1))
    return out

  before = qk(params)
  maxima = np.stack([s.max(-1) for s in before]).astype(np.float32)
  tau = float(np.median(maxima))
  layout = mc.GQALayout(heads, heads, dim // heads, "query", qkv=mc.Projection("query_key_value", grouped=True),
                        out="dense")
  tree = {"transformer": {"h": {str(i): {"self_attention": {"max_logits": maxima[i]}} for i in range(layers)}}}
  clipped = mc.qk_clip(params, tree, qk_clip_threshold=tau, layout=layout)
  for i in range(layers):  # every value column kept
    for leaf in ("kernel", "bias"):
      w = params["transformer"]["h"][str(i)]["self_attention"]["query_key_value"][leaf]
      c = clipped["transformer"]["h"][str(i)]["self_attention"]["query_key_value"][leaf]
      v = lambda x: np.asarray(x).reshape(*x.shape[:-1], heads, 3, -1)[..., 2, :]  # noqa: E731
      assert_same_math(v(c), v(w))
  # layer 0 sees the same input in a second pass: clip it alone (layer 1's maxima below tau)
  only_first = {"transformer": {"h": {str(i): {"self_attention": {"max_logits": maxima[i] * (i == 0)}}
                                      for i in range(layers)}}}
  after = qk(mc.qk_clip(params, only_first, qk_clip_threshold=tau, layout=layout))[0]
  gamma = np.where(maxima[0] > tau, tau / maxima[0].astype(np.float64), 1.0)
  for h in range(heads):
    finite = np.isfinite(before[0][h])
    if gamma[h] == 1.0:
      assert_same_math(after[h], before[0][h])
    else:
      np.testing.assert_allclose(after[h][finite], gamma[h] * before[0][h][finite], rtol=2e-5, atol=1e-6)
  assert (gamma < 1).any() and (gamma == 1).any()
  np.testing.assert_allclose(np.max(after, axis=-1), np.minimum(maxima[0], tau), rtol=2e-5)
  # ALiBi: Bloom's bias is slope_h * key position (>= 0, growing with the sequence), which the plain patch
  # line's maxima would count and the clip never scales. docs/your-model.md's less_alibi_row_max (its block,
  # run here) sows the maxima of q.k / sqrt(D) + the bias less its row maximum (<= 0); the model's output is
  # the same, and a clip of layer 0 with them bounds its logits by tau on the same batch. The batch's
  # second row is left-padded: its first queries see no key, and keep their bias.
  less_alibi_row_max = _docs_alibi_wrapper(bloom)
  mask = jnp.ones_like(tokens).at[1, :3].set(0)

  def recorded_logits(params, fn):  # per layer: (heads, ...) q.k / sqrt(D) + the shifted bias, unmasked
    store = []
    monkeypatch.setattr(bloom, "dot_product_attention_weights", recording(store, fn))
    model(tokens, attention_mask=mask, params=params)
    jax.effects_barrier()
    monkeypatch.undo()
    out = []
    for q, k, b in store:
      allowed = b > -1e30  # Bloom folds its masks into the bias: float32's lowest there
      shift = np.maximum(np.max(b, axis=-1, keepdims=True), 0.0)
      s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / np.sqrt(q.shape[-1]) + (b - shift)
      out.append(np.where(allowed, s, -np.inf).transpose(1, 0, 2, 3).reshape(heads, -1))
    return out

  plain = model(tokens, attention_mask=mask, params=params).logits
  monkeypatch.setattr(bloom, "dot_product_attention_weights", less_alibi_row_max)
  np.testing.assert_allclose(model(tokens, attention_mask=mask, params=params).logits, plain, rtol=1e-5, atol=1e-5)
  _, state = model.module.apply({"params": params}, tokens, mask, mutable=["intermediates"])
  monkeypatch.undo()
  sown = np.stack([state["intermediates"]["transformer"]["h"][str(i)]["self_attention"]["max_logits"]
                   for i in range(layers)])
  logits = recorded_logits(params, less_alibi_row_max)
  np.testing.assert_allclose(sown, np.stack([s.max(-1) for s in logits]), rtol=2e-5)
  tau = float(np.median(sown[0]))
  first_only = {"transformer": {"h": {str(i): {"self_attention": {"max_logits": sown[i] * (i == 0)}}
                                      for i in range(layers)}}}
  opt = mc.muonclip(0.0, layout=layout, qk_clip_threshold=tau, weight_decay=0.0)
  u, opt_state = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params, max_logits=first_only)
  stepped = optax.apply_updates(params, u)
  (clip_state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, mc.QKClipState))
                   if isinstance(x, mc.QKClipState)]
  assert int(clip_state.num_clipped) == int(np.sum(sown[0] > tau)) > 0
  bound = recorded_logits(stepped, less_alibi_row_max)[0].max(-1)
  assert np.all(bound <= tau * (1 + 1e-5)), (bound, tau)
  first = lambda p: np.asarray(p["transformer"]["h"]["0"]["self_attention"]["query_key_value"]["kernel"])  # noqa: E731
  value_columns = lambda p: first(p).reshape(dim, heads, 3, -1)[:, :, 2]  # noqa: E731
  assert_same_math(value_columns(stepped), value_columns(params))


def _docs_alibi_wrapper(bloom):
  """``less_alibi_row_max`` as docs/your-model.md defines it: its python block run (the block's own patch of
  Bloom's module undone at once)."""
  with open(os.path.join(os.path.dirname(__file__), "..", "docs", "your-model.md")) as f:
    blocks = [b.split("```")[0] for b in f.read().split("```python\n")[1:]]
  (block,) = [b for b in blocks if "def less_alibi_row_max" in b]
  original, scope = bloom.dot_product_attention_weights, {}
  try:
    exec(compile(block, "docs/your-model.md", "exec"), scope)
  finally:
    bloom.dot_product_attention_weights = original
  return scope["less_alibi_row_max"]


@pytest.mark.parametrize("name", ["recipe_hf_gpt2"])
def test_thirdparty_recipe_runs(name, capsys):
  __import__(name).main(["--steps", "1"])
  assert "step   0  loss" in capsys.readouterr().out


def np_gemma_max_logits(cfg, attn_params, x, positions, mask):
  """NumPy forward of one Gemma-style attention layer up to its pre-cap, masked logits; per-head max."""
  x = np.float64(x)
  q = np.einsum("btd,ndh->btnh", x, np.float64(attn_params["q_einsum"]["w"]))
  k = np.einsum("bsd,kdh->bskh", x, np.float64(attn_params["kv_einsum"]["w"][0]))
  if cfg.qk_norm:
    def rms(y, scale):
      return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + 1e-6) * (1 + np.float64(scale))
    q, k = rms(q, attn_params["_query_norm"]["scale"]), rms(k, attn_params["_key_norm"]["scale"])

  def rope(y):
    half = y.shape[-1] // 2
    angle = (np.float64(positions)[..., None] / 10_000.0 ** (2 * np.arange(half) / y.shape[-1]))[..., None, :]
    a, b = y[..., :half], y[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=-1)

  q, k = rope(q) / np.sqrt(cfg.head_dim), np.repeat(rope(k), cfg.num_heads // cfg.num_kv_heads, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k)
  return np.where(np.asarray(mask)[:, None], s, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("variant", ["soft_cap", "qk_norm"])
def test_recipe_gemma(variant):
  import recipe_gemma as mod

  cfg = mod.Config(soft_cap=2.0 if variant == "soft_cap" else None, qk_norm=variant == "qk_norm")
  group = cfg.num_heads // cfg.num_kv_heads
  model = mod.Gemma(cfg)
  tokens = next(mod.batches(cfg, batch_size=2))
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  # 2. sown maxima = NumPy's pre-cap logits, from each attention layer's recorded inputs
  @jax.jit
  def measured(p, t):
    (_, intermediates), grads = jax.value_and_grad(mod.loss_fn, has_aux=True)(p, model, t)
    store = {}
    with replaying_inputs(mod.Attention, store, "record"):
      model.apply({"params": p}, t[:, :-1])
    return intermediates, grads, {path[0]: args for path, (args, _) in store.items()}

  intermediates, grads, inputs = measured(params, tokens)
  maxima = sown_by_layer(intermediates, cfg.num_heads)
  want = np.stack([np_gemma_max_logits(cfg, params[f"layer_{i}"]["attn"], *inputs[f"layer_{i}"])
                   for i in range(cfg.num_layers)])
  np.testing.assert_allclose(maxima, want, rtol=2e-5, atol=1e-6)
  if cfg.soft_cap is not None:
    assert (maxima > cfg.soft_cap).any()  # what a capture after the cap could never report
  # 3. one muonclip step = muon_adamw (the same layout: Muon's matrices) + the per-head rule on this storage
  tau = tau_between(maxima)
  clip = mod.optimizer(cfg, LR, tau)
  plain = mc.muon_adamw(LR, layout=cfg.layout)
  u, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=intermediates)
  v, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  p_clip, p_ref = optax.apply_updates(params, u), optax.apply_updates(params, v)
  fq, fk = clip_factors_np(maxima, tau, group=group)
  ref, expected, exact = flat(p_ref), {}, []
  for i in range(cfg.num_layers):
    attn = f"layer_{i}/attn"
    if cfg.qk_norm:  # a scale shared by heads: one factor per layer, sqrt(min gamma), on (1 + scale)
      c = np.sqrt(np.where(maxima[i] > tau, tau / maxima[i], 1.0).min())
      for norm in ("_query_norm", "_key_norm"):
        expected[f"{attn}/{norm}/scale"] = c * (1 + np.float64(ref[f"{attn}/{norm}/scale"])) - 1
    else:  # q_einsum/w (heads, embed, head_dim); kv_einsum/w (2, kv_heads, embed, head_dim), k then v
      expected[f"{attn}/q_einsum/w"] = np.float64(ref[f"{attn}/q_einsum/w"]) * fq[i][:, None, None]
      kv = np.float64(ref[f"{attn}/kv_einsum/w"]).copy()
      kv[0] *= fk[i][:, None, None]
      expected[f"{attn}/kv_einsum/w"] = kv
      exact.append((f"{attn}/kv_einsum/w", 1))  # the value part
  check_step(p_clip, p_ref, expected, exact)
  # 4. the clip bounds the recomputed maxima; heads whose q and k were not scaled keep theirs bit for bit
  if cfg.qk_norm:  # the shared scale shrinks every head of a layer with a clipped head
    tau = tau_between(maxima.max(-1))
    untouched = np.repeat((maxima.max(-1) <= tau)[:, None], cfg.num_heads, axis=1)
  else:
    group_max = maxima.reshape(cfg.num_layers, -1, group).max(-1)
    tau = tau_between(group_max)
    untouched = np.repeat(group_max <= tau, group, axis=-1)
  forward = lambda p: model.apply({"params": p}, tokens[:, :-1], mutable=["intermediates"])[1]["intermediates"]  # noqa: E731
  check_clip_bounds(forward, mod.Attention, params, intermediates, tau, cfg.layout, cfg.num_heads, untouched)
