"""The four recipes of the README (examples/recipe_*.py), each on a model with two attention layers.

For each: the output with ``muonclip_jax.nn.dot_product_attention`` equals Flax's default
attention; the sown maxima equal a NumPy computation of the scaled, masked logits of the q
and k that reached the attention; one ``muonclip`` step equals a ``muon_adamw`` step followed
by the per-head rule applied in NumPy to that kernel form; every other leaf (value and output
kernels included) is the ``muon_adamw`` result, to the rounding of two separately compiled
programs (``_exactness``).
"""

import contextlib
import functools
import os
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muonclip_jax as mc
from muonclip_jax.nn import dot_product_attention
from _exactness import assert_same_math

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import recipe_gpt2_fused  # noqa: E402
import recipe_linen_gpt  # noqa: E402
import recipe_llama_gqa  # noqa: E402
import recipe_nnx_gpt  # noqa: E402

LR = 3e-3


def recorder(store):
  """``dot_product_attention`` that also hands its q, k and mask to the host, in call order."""

  @functools.wraps(dot_product_attention)
  def fn(query, key, value, *args, **kw):
    causal = bool(kw.get("is_causal", False))
    jax.debug.callback(lambda q, k, m: store.append((np.asarray(q), np.asarray(k), m, causal)),
                       query, key, kw.get("mask"), ordered=True)
    return dot_product_attention(query, key, value, *args, **kw)

  return fn


def np_max_logits(q, k, mask, causal):
  """Per-head max over batch, queries and unmasked keys of q.k / sqrt(D) (float64)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[-2] // k.shape[-2], axis=-2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  allowed = np.ones(s.shape, bool)
  if mask is not None:
    allowed &= np.broadcast_to(np.asarray(mask, bool), s.shape)
  if causal:
    allowed &= np.tril(np.ones(s.shape[-2:], bool))
  return np.where(allowed, s, -np.inf).max(axis=(0, 2, 3))


def sown_by_layer(intermediates, num_heads):
  """The sown maxima as ``(layers, heads)``, layers in path order (one leaf per layer or stacked)."""
  leaves = jax.tree_util.tree_leaves(nnx.to_pure_dict(intermediates) if isinstance(intermediates, nnx.State)
                                     else intermediates)
  return np.concatenate([np.asarray(x).reshape(-1, num_heads) for x in leaves])


def clip_factors_np(s, tau, group):
  """Query factors sqrt(gamma_h) and key factors sqrt(min gamma of the group) (GQA "split")."""
  gamma = np.where(s > tau, tau / s, 1.0)
  return np.sqrt(gamma), np.sqrt(gamma.reshape(*gamma.shape[:-1], -1, group).min(axis=-1))


def scaled(x, f, head_dim, form):
  """``x`` with head h scaled by ``f[..., h]``: DenseGeneral ``(..., in, H, D)`` / bias ``(..., H, D)``,
  or 2-D ``(..., in, H*D)`` / bias ``(..., H*D)`` ("columns")."""
  x = np.asarray(x, np.float64)
  is_kernel = x.ndim > f.ndim + (1 if form == "dense_general" else 0)
  if form == "dense_general":
    return x * (f[..., None, :, None] if is_kernel else f[..., :, None])
  fc = np.repeat(f, head_dim, axis=-1)
  return x * (fc[..., None, :] if is_kernel else fc)


def flat(tree):
  return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(nn.unbox(tree))}


def check_step(p_clip, p_ref, expected, exact_slices=()):
  """Clipped leaves match the NumPy rule applied to muon_adamw's, every other leaf is muon_adamw's,
  both to the rounding of two separately compiled programs (``_exactness.assert_same_math``:
  a wrong clip factor moves entries by ``1 - gamma``, above 1e-3 of them)."""
  got, ref = flat(p_clip), flat(p_ref)
  assert set(got) == set(ref) and set(expected) <= set(got), sorted(set(expected) - set(got))
  for path, x in got.items():
    assert_same_math(x, expected.get(path, ref[path]), err_msg=path)
  for path, sl in exact_slices:  # e.g. the value columns of a fused kernel
    assert_same_math(got[path][sl], ref[path][sl], err_msg=path)


def tau_between(maxima):
  """A threshold with heads on both sides of it."""
  tau = float(np.median(maxima))
  assert (maxima > tau).any() and (maxima <= tau).any()
  return tau


@contextlib.contextmanager
def replaying_inputs(attention_cls, store, mode):
  """Records (``mode="record"``) or replays (``"replay"``) the inputs of every ``attention_cls`` call, by path."""

  def interceptor(next_fun, args, kwargs, context):
    if isinstance(context.module, attention_cls) and context.method_name == "__call__":
      if mode == "record":
        store[context.module.path] = (args, kwargs)
      else:
        args, kwargs = store[context.module.path]
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


def check_clip_bounds(forward, attention_cls, params, intermediates, tau, layout, num_heads, untouched):
  """Check 4 of the module docstring; ``untouched`` (layers, heads) marks heads whose q and k stay as they were."""
  clipped_params = mc.qk_clip(params, intermediates, qk_clip_threshold=tau, layout=layout)

  @jax.jit
  def both(p, p2):
    store = {}
    with replaying_inputs(attention_cls, store, "record"):
      before = forward(p)
    with replaying_inputs(attention_cls, store, "replay"):
      after = forward(p2)
    return before, after

  before, after = both(params, clipped_params)
  before, after = sown_by_layer(before, num_heads), sown_by_layer(after, num_heads)
  clipped = before > tau
  assert clipped.any() and untouched.any()
  assert (after[clipped] <= tau * (1 + 1e-5)).all(), (after, tau)
  np.testing.assert_array_equal(after[untouched], before[untouched])


def captured_qk(model, params, tokens):
  """Per layer ``(q, k, causal mask, False)`` from Flax's own ``query``/``key`` DenseGeneral outputs.

  For scanned models: a ``jax.debug.callback`` inside an ``nn.scan`` body is refused by flax >= 0.12.12
  ("broadcasted variable has a data dependency on the scan body"), so ``recorder`` cannot be used there.
  """
  _, state = model.apply({"params": params}, tokens, mutable=["intermediates"],
                         capture_intermediates=lambda mdl, _: mdl.name in ("query", "key"))
  found = {p: np.asarray(x) for p, x in flat(state["intermediates"]).items() if p.endswith("__call__/0")}
  qs = sorted(p for p in found if p.endswith("/query/__call__/0"))
  t = tokens.shape[-1]
  mask = np.tril(np.ones((t, t), bool))
  out = []
  for path in qs:
    q, k = found[path], found[path.replace("/query/", "/key/")]
    for ql, kl in (zip(q, k) if q.ndim == 5 else [(q, k)]):  # a scanned stack: (layers, B, T, H, D)
      out.append((ql, kl, mask, False))
  return out


def linen_recipe_check(module, cfg, model_cls, flax_attention, expected_fn, matrix_axes=None, exact_slices=(),
                       records=None):
  """``records``: ``(model, params, inputs) -> [(q, k, mask, causal)]`` per layer; default: ``recorder``."""
  tokens = next(module.batches(cfg, batch_size=4))
  model = model_cls(cfg)
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  # 1. same output as Flax's own attention
  ours = jax.jit(model.apply)({"params": params}, tokens[:, :-1])
  theirs = jax.jit(model_cls(cfg, flax_attention).apply)({"params": params}, tokens[:, :-1])
  chex.assert_trees_all_close(ours, theirs, atol=1e-5, rtol=1e-5)
  # 2. sown maxima = NumPy on the q, k that reached the attention
  store = []
  probe = model_cls(cfg, recorder(store)) if records is None else model
  grad_fn = jax.jit(jax.value_and_grad(lambda p, t: module.loss_fn(p, probe, t), has_aux=True))
  (_, intermediates), grads = grad_fn(params, tokens)
  jax.effects_barrier()
  if records is not None:
    store = records(model, params, tokens[:, :-1])
  maxima = sown_by_layer(intermediates, cfg.num_heads)
  assert maxima.shape == (cfg.num_layers, cfg.num_heads) and len(store) == cfg.num_layers
  np.testing.assert_allclose(maxima, np.stack([np_max_logits(*rec) for rec in store]), rtol=2e-5, atol=2e-6)
  # 3. one muonclip step = muon_adamw step, then the per-head rule in NumPy
  tau = tau_between(maxima)
  clip, plain = module.optimizer(cfg, LR, tau), mc.muon_adamw(LR, matrix_axes=matrix_axes)
  u, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=intermediates)
  v, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  p_clip, p_ref = optax.apply_updates(params, u), optax.apply_updates(params, v)
  check_step(p_clip, p_ref, expected_fn(flat(p_ref), maxima, tau), exact_slices)


def dense_general_expected(ref, maxima, tau, cfg, prefix):
  """Flax's attention modules: query/key kernels (in, H, D) and biases (H, D), per layer."""
  fq, fk = clip_factors_np(maxima, tau, group=1)
  d, out = cfg.dim // cfg.num_heads, {}
  for i, path in enumerate(prefix):
    sel = (lambda f: f) if path.startswith("layers") else (lambda f, i=i: f[i])
    for proj, f in (("query", fq), ("key", fk)):
      for leaf in ("kernel", "bias"):
        name = f"{path}/attn/{proj}/{leaf}"
        out[name] = scaled(ref[name], sel(f), d, "dense_general")
    if path.startswith("layers"):
      break
  return out


@pytest.mark.parametrize("scan", [False, True])
def test_recipe_linen_gpt(scan):
  mod, cfg = recipe_linen_gpt, recipe_linen_gpt.Config(scan=scan)
  prefix = ["layers"] if scan else [f"block_{i}" for i in range(cfg.num_layers)]
  axes = None if scan else mc.attention_matrix_axes(cfg.layout)
  linen_recipe_check(mod, cfg, mod.GPT, nn.dot_product_attention,
                     lambda ref, s, tau: dense_general_expected(ref, s, tau, cfg, prefix), matrix_axes=axes,
                     records=captured_qk if scan else None)


def test_recipe_llama_gqa():
  mod, cfg = recipe_llama_gqa, recipe_llama_gqa.Config()

  def expected(ref, maxima, tau):
    fq, fk = clip_factors_np(maxima, tau, group=cfg.num_heads // cfg.num_kv_heads)
    out = {}
    for i in range(cfg.num_layers):
      for proj, f in (("q_proj", fq[i]), ("k_proj", fk[i])):
        name = f"layers_{i}/self_attn/{proj}/kernel"
        out[name] = scaled(ref[name], f, cfg.head_dim, "columns")
    return out

  assert cfg.num_kv_heads < cfg.num_heads
  linen_recipe_check(mod, cfg, mod.Llama, nnx.dot_product_attention, expected)  # Flax's GQA attention


def test_recipe_gpt2_fused():
  mod, cfg = recipe_gpt2_fused, recipe_gpt2_fused.Config()
  e, d = cfg.dim, cfg.dim // cfg.num_heads

  def expected(ref, maxima, tau):
    fq, fk = clip_factors_np(maxima, tau, group=1)
    out = {}
    for i in range(cfg.num_layers):
      ones = np.ones(cfg.num_heads)
      f = np.concatenate([np.repeat(fq[i], d), np.repeat(fk[i], d), np.repeat(ones, d)])
      for leaf in ("kernel", "bias"):
        name = f"h_{i}/attn/c_attn/{leaf}"
        out[name] = np.asarray(ref[name], np.float64) * f
    return out

  value_cols = [(f"h_{i}/attn/c_attn/{leaf}", (..., slice(2 * e, 3 * e)))
                for i in range(cfg.num_layers) for leaf in ("kernel", "bias")]
  linen_recipe_check(mod, cfg, mod.GPT2, nn.dot_product_attention, expected, exact_slices=value_cols)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")  # Flax's attention, as reference
def test_recipe_nnx_gpt():
  mod, cfg = recipe_nnx_gpt, recipe_nnx_gpt.Config()
  tokens = next(mod.batches(cfg, batch_size=4))
  model = mod.GPT(cfg, rngs=nnx.Rngs(0))
  flax_model = mod.GPT(cfg, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  chex.assert_trees_all_close(nnx.jit(lambda m, x: m(x))(model, tokens[:, :-1]),
                              nnx.jit(lambda m, x: m(x))(flax_model, tokens[:, :-1]), atol=1e-5, rtol=1e-5)
  store = []
  probe = mod.GPT(cfg, attention_fn=recorder(store), rngs=nnx.Rngs(0))
  (_, intermediates), grads = nnx.jit(nnx.value_and_grad(mod.loss_fn, has_aux=True))(probe, tokens)
  jax.effects_barrier()
  maxima = sown_by_layer(intermediates, cfg.num_heads)
  assert maxima.shape == (cfg.num_layers, cfg.num_heads) and len(store) == cfg.num_layers
  np.testing.assert_allclose(maxima, np.stack([np_max_logits(*rec) for rec in store]), rtol=2e-5, atol=2e-6)
  tau = tau_between(maxima)
  nnx.Optimizer(model, mod.optimizer(cfg, LR, tau), wrt=nnx.Param).update(model, grads, max_logits=intermediates)
  ref_model = mod.GPT(cfg, rngs=nnx.Rngs(0))
  nnx.Optimizer(ref_model, mc.muon_adamw(LR, matrix_axes=mc.attention_matrix_axes(cfg.layout)),
                wrt=nnx.Param).update(ref_model, grads)
  p_clip = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  p_ref = nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))
  fq, fk = clip_factors_np(maxima, tau, group=1)
  ref, expected = flat(p_ref), {}
  for i in range(cfg.num_layers):
    for proj, f in (("query", fq[i]), ("key", fk[i])):
      for leaf in ("kernel", "bias"):
        name = f"blocks/{i}/attn/{proj}/{leaf}"
        expected[name] = scaled(ref[name], f, cfg.dim // cfg.num_heads, "dense_general")
  check_step(p_clip, p_ref, expected)


@pytest.mark.parametrize("module", [recipe_nnx_gpt])
def test_recipe_runs(module, capsys):
  module.main(["--steps", "1"])
  assert "step   0  loss" in capsys.readouterr().out



def _zeros_params(model, tokens):
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def test_recipes_bad_inputs_name_path_shape_and_expectation():
  tokens = jnp.zeros((2, 8), jnp.int32)
  llama = recipe_llama_gqa.Config()
  params = _zeros_params(recipe_llama_gqa.Llama(llama), tokens)
  maxima = {f"layers_{i}": {"self_attn": {"max_logits": jnp.ones(4)}} for i in range(2)}
  with pytest.raises(ValueError, match=r"layers_0/self_attn.*wq/kernel.*q_proj/kernel"):  # layout without names
    mc.qk_clip(params, maxima, qk_clip_threshold=0.5, layout=mc.GQALayout(4, 2, 8))
  with pytest.raises(ValueError, match=r"k_proj/kernel has shape \(32, 16\).*expected 4 heads"):  # wrong kv heads
    mc.qk_clip(params, maxima, qk_clip_threshold=0.5, layout=mc.GQALayout(4, 4, 8, query="q_proj", key="k_proj"))
  gpt = recipe_linen_gpt.Config()
  params = _zeros_params(recipe_linen_gpt.GPT(gpt), tokens)
  with pytest.raises(ValueError, match=r"block_0/attn/key/kernel: .*shape \(32, 4, 8\).*DenseGeneral"):
    mc.muon_adamw(1e-3).init(params)  # DenseGeneral kernels without matrix_axes
