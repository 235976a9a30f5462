"""impl="splash": tokamax's TPU splash kernel, in Pallas interpret mode on the CPU.

Small on purpose: every call compiles an interpret-mode kernel (blocks of 128, the
minimum splash allows). Cases: GQA (4 query heads on 2 kv heads), MLA widths
(q/k 24, v 16), uneven lengths, causal, segment ids, padding, windows, float32 and
bfloat16, gradients of q, k, v; the modules and the Flax drop-in.
"""

from __future__ import annotations

import functools
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _attention_cases as cases
from muonclip_jax import nn as mnn

pytest.importorskip("tokamax")

from muonclip_jax.nn._impl.splash import splash_attention  # noqa: E402


@pytest.mark.parametrize(
    "kind,tq,tk,dtype,hkv",
    [
        ("all", 13, 13, jnp.float32, 2),  # causal + segments + padding, GQA, MLA widths
        ("segments", 16, 16, jnp.bfloat16, 2),
        ("bidirectional_padding", 9, 20, jnp.float32, 2),  # cross lengths
        ("causal", 9, 20, jnp.float32, 1),  # bottom-right aligned causal, Tq < Tk; MQA
    ],
)
def test_matches_dense(kind, tq, tk, dtype, hkv):
  q, k, v = cases.qkv(tq, tk, seed=tq + tk, dtype=dtype, hkv=hkv)
  if dtype == jnp.float32:
    cases.assert_matches_dense(q, k, v, cases.masks(kind, tq, tk), "splash")
    return
  # bf16: splash multiplies q by the scale and by log2(e) (its exp2) in bf16, so its
  # logits, and their maxima, carry two bf16 roundings of q (relative 2^-9 each).
  (_, (out, m)), grads = cases.value_and_grad(q, k, v, cases.masks(kind, tq, tk), "splash")
  (_, (out_d, m_d)), grads_d = cases.value_and_grad(q, k, v, cases.masks(kind, tq, tk), "dense")
  assert out.dtype == jnp.bfloat16 and m.dtype == jnp.float32
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  chex.assert_trees_all_close(f32((out, grads)), f32((out_d, grads_d)), atol=3e-2, rtol=3e-2)
  chex.assert_trees_all_close(m, m_d, rtol=2**-7)


def _np_attention(q, k, v, scale, allowed, cap=None):
  """NumPy reference ``(out (B, Tq, H, Dv), row_max (B, H, Tq))``; empty rows give 0 / -inf."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = scale * np.einsum("bqhd,bkhd->bhqk", q, k)
  if cap is not None:
    s = cap * np.tanh(s / cap)
  s = np.where(allowed, s, -np.inf)
  m = s.max(-1)
  p = np.exp(s - np.where(np.isinf(m), 0, m)[..., None])
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhqk,bkhd->bqhd", p, v), s.max(-1)


def test_window_padding_and_empty_rows():
  """A local window with key padding: equals dense with the same explicit mask; rows
  without any visible key give zeros, zero gradients and no max; a head with no pair -inf."""
  tq = tk = 12
  q, k, v = cases.qkv(tq, seed=3)
  window = (3, 1)
  i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
  win = (j >= i - window[0]) & (j <= i + window[1])
  kv_mask = np.ones((cases.B, tk), bool)
  kv_mask[1, :8] = False  # batch 1: queries 0..4 see no key (window of keys 0..5)
  allowed = win[None, None] & kv_mask[:, None, None, :]

  def loss(q, k, v, kv_mask):
    out, m = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="splash", window=window,
                           kv_mask=kv_mask, return_max_logits=True)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))), (out, m)

  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, (out, m)), grads = vg(q, k, v, jnp.asarray(kv_mask))
  want_out, want_rows = _np_attention(q, k, v, cases.SCALE, allowed)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(m, want_rows.max(axis=(0, 2)), rtol=1e-6)
  chex.assert_trees_all_equal(out[1, :5], jnp.zeros_like(out[1, :5]))
  chex.assert_trees_all_equal(grads[0][1, :5], jnp.zeros_like(grads[0][1, :5]))
  mask4 = jnp.asarray(allowed[:, :1].repeat(cases.H, 1))
  dense = jax.grad(lambda q, k, v: loss_dense(q, k, v, mask4), argnums=(0, 1, 2))(q, k, v)
  chex.assert_trees_all_close(grads, dense, atol=1e-5, rtol=1e-5)
  # nothing visible anywhere: every head reports -inf, outputs and gradients are zero
  (_, (out, m)), grads = vg(q, k, v, jnp.zeros((cases.B, tk), bool))
  chex.assert_trees_all_equal(m, jnp.full((cases.H,), -jnp.inf, jnp.float32))
  chex.assert_trees_all_equal(out, jnp.zeros_like(out))
  for g in grads:
    chex.assert_trees_all_equal(g, jnp.zeros_like(g))


def loss_dense(q, k, v, mask):
  out, _ = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="dense", mask=mask)
  return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape)))


def test_soft_cap():
  """Capped output equals NumPy's; the max logit would be post-cap, so capture is refused."""
  q, k, v = cases.qkv(10, seed=5)
  q = q * 4.0  # logits well beyond the cap
  cap = 2.0
  out, m = jax.jit(functools.partial(splash_attention, softmax_scale=cases.SCALE, is_causal=True,
                                     logits_soft_cap=cap))(q, k, v)
  assert m is None
  allowed = np.tril(np.ones((10, 10), bool))[None, None]
  np.testing.assert_allclose(out, _np_attention(q, k, v, cases.SCALE, allowed, cap)[0], atol=1e-5)
  with pytest.raises(ValueError, match="after the cap.*pre-cap max logit"):
    splash_attention(q, k, v, softmax_scale=0.1, logits_soft_cap=cap, return_max_logits=True)


def test_validation_and_missing_extra(monkeypatch):
  q, k, v = cases.qkv(8)
  with pytest.raises(ValueError, match="explicit boolean `mask`.*static"):
    mnn.attention(q, k, v, softmax_scale=1.0, impl="splash", mask=jnp.ones((1, 1, 8, 8), bool))
  with pytest.raises(ValueError, match=r"causal with Tq 8 > Tk 4 leaves query row 0 .*chunked"):
    splash_attention(q, k[:, :4], v[:, :4], softmax_scale=1.0, is_causal=True)
  with pytest.raises(ValueError, match=r"window=\(0, 0\) leaves query row 0 "):  # offset -4
    splash_attention(q, k[:, :4], v[:, :4], softmax_scale=1.0, window=(0, 0))
  from muonclip_jax.nn._impl.splash import _first_static_empty_row as first_empty

  assert first_empty(128, 128, is_causal=True, window=None, offset=0) is None
  assert first_empty(128, 128, is_causal=False, window=(3, 1), offset=0) is None
  assert first_empty(256, 128, is_causal=False, window=(2, 2), offset=0) == 130  # a padded row
  assert first_empty(128, 256, is_causal=True, window=(1, None), offset=5) is None
  with pytest.raises(ValueError, match="window"):
    splash_attention(q, k, v, softmax_scale=1.0, window=(-1, 0))
  from muonclip_jax.nn._impl.splash import _default_interpret

  assert _default_interpret("tpu") is False and _default_interpret("cpu") is True
  with pytest.raises(ValueError, match="TPU kernel.*use impl='auto', 'tokamax_gpu'"):
    _default_interpret("gpu")
  monkeypatch.setitem(sys.modules, "tokamax", None)  # as if not installed
  for name in [m for m in sys.modules if m.startswith("tokamax.")]:
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(ImportError, match=r"impl='splash' needs tokamax.*muonclip_jax\[tokamax\]"):
    splash_attention(q, k, v, softmax_scale=1.0)
  with pytest.raises(ImportError, match=r"impl='tokamax_gpu' needs tokamax.*muonclip_jax\[tokamax\]"):
    mnn.attention(q, k, v, softmax_scale=1.0, impl="tokamax_gpu")


def test_lowers_to_mosaic_for_tpu():
  """Forward with capture and backward lower to Mosaic TPU custom calls (no TPU needed)."""
  shapes = ((1, 200, 4, 128), (1, 200, 2, 128), (1, 200, 2, 128))
  seg = jax.ShapeDtypeStruct((1, 200), jnp.int32)

  def f(q, k, v, sq, sk):
    def loss(q, k, v):
      out, m = splash_attention(q, k, v, softmax_scale=0.1, is_causal=True, q_segment_ids=sq,
                                kv_segment_ids=sk, return_max_logits=True, interpret=False)
      return jnp.sum(out.astype(jnp.float32)), m
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [seg, seg]
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") >= 2  # forward (with residuals), fused backward


# ----------------------------------------------------------------------------- modules

def test_modules_and_drop_in_sow_the_same_maxima():
  """GQA (Linen and NNX), MLA and the Flax drop-in with impl 'splash' and 'auto' (dense on
  CPU) sow the maxima of impl='dense'."""
  from flax import nnx

  b, t, dim = 2, 10, 32
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((b, t, dim)), jnp.float32)
  seg = jnp.asarray((np.arange(t)[None] >= np.array([[t], [4]])).astype(np.int32))
  pad = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 3]]))
  kw = dict(segment_ids=seg, padding_mask=pad)
  gqa = lambda impl: mnn.GroupedQueryAttention(num_heads=4, num_kv_heads=2, head_dim=8,
                                               impl=impl)
  mla = lambda impl: mnn.MultiHeadLatentAttention(
      num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
      v_head_dim=8, impl=impl)
  assert mnn.GroupedQueryAttention(num_heads=2, num_kv_heads=1, head_dim=8).impl == "auto"
  for make in (gqa, mla):
    params = make("dense").init(jax.random.key(0), x, **kw)
    run = lambda impl: jax.jit(functools.partial(make(impl).apply, mutable=["intermediates"]))(
        params, x, **kw)
    y_d, s_d = run("dense")
    for impl in ("splash", "auto"):
      y, s = run(impl)
      chex.assert_trees_all_close(y, y_d, atol=1e-5)
      chex.assert_trees_all_close(s, s_d, rtol=1e-6, atol=1e-6)
    assert np.isfinite(np.asarray(jax.tree.leaves(s_d)[0])).all()

  model = mnn.GroupedQueryAttentionNNX(dim, num_heads=4, num_kv_heads=2, head_dim=8,
                                       impl="splash", rngs=nnx.Rngs(0))
  y, inter = nnx.capture(model, nnx.Intermediate)(x, **kw)
  model.impl = "dense"
  y_d, inter_d = nnx.capture(model, nnx.Intermediate)(x, **kw)
  chex.assert_trees_all_close(y, y_d, atol=1e-5)
  chex.assert_trees_all_close(jax.tree.leaves(inter), jax.tree.leaves(inter_d), rtol=1e-6)

  # the Flax drop-in: causal self-attention and key padding (B, 1, 1, Tk)
  attn = nn.MultiHeadDotProductAttention(
      4, attention_fn=functools.partial(mnn.dot_product_attention, impl="splash", is_causal=True))
  ref = nn.MultiHeadDotProductAttention(4, attention_fn=mnn.dot_product_attention)
  p = ref.init(jax.random.key(1), x)
  mask = pad[:, None, None, :]
  y, st = attn.apply(p, x, mask=mask, mutable=["intermediates"])
  y_d, st_d = ref.apply(p, x, mask=mask & nn.make_causal_mask(jnp.ones((b, t))).astype(bool),
                        mutable=["intermediates"])  # impl='auto': dense on CPU
  chex.assert_trees_all_close(y, y_d, atol=1e-5)
  chex.assert_trees_all_close(st, st_d, rtol=1e-6, atol=1e-6)
