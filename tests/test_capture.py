"""Capture in hand-written attention: sow_max_logits, dot_product_attention_weights, logits_soft_cap,
and the private Flax APIs the capture reads (muonclip_jax.nn._capture.flax_private)."""

import types

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from muonclip_jax.nn._capture import flax_private
from muonclip_jax.nn import attention, dot_product_attention, dot_product_attention_weights, sow_max_logits
from _exactness import assert_same_math


def _normal(seed, *shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _np_head_max(logits, mask, head_axis):
  s = np.where(np.broadcast_to(mask, logits.shape), np.asarray(logits, np.float64), -np.inf)
  return np.moveaxis(s, head_axis, 0).reshape(s.shape[head_axis], -1).max(axis=1)


class _GemmaStyle(nn.Module):
  """Logits as Gemma writes them, (B, T, N, S), head axis 2, sown twice (a running maximum)."""

  @nn.compact
  def __call__(self, logits, mask):
    sow_max_logits(self, logits, mask=mask, head_axis=2)
    sow_max_logits(self, logits - 1.0, mask=mask, head_axis=2)
    return logits


class _GemmaStyleNNX(nnx.Module):
  def __call__(self, logits, mask):
    sow_max_logits(self, logits, mask=mask, head_axis=2)
    return logits


def test_sow_max_logits_linen_and_nnx():
  logits = _normal(0, 2, 5, 3, 5, scale=3.0)  # (B, T, N, S)
  mask = np.tril(np.ones((5, 5), bool))[None, :, None, :]  # causal, (1, T, 1, S)
  mask[..., 0] = False  # a masked column holding real values: must not count
  want = _np_head_max(logits, mask, 2)
  _, state = jax.jit(lambda x: _GemmaStyle().apply({}, x, mask, mutable=["intermediates"]))(logits)
  np.testing.assert_allclose(state["intermediates"]["max_logits"], want, rtol=1e-6)
  assert state["intermediates"]["max_logits"].dtype == jnp.float32
  _, plain = _GemmaStyle().apply({}, logits, mask, mutable=["params"])
  assert "intermediates" not in plain  # nothing sown unless captured
  model = _GemmaStyleNNX()
  _, captured = nnx.capture(model, nnx.Intermediate)(logits, mask)
  np.testing.assert_allclose(nnx.to_pure_dict(captured)["max_logits"], want, rtol=1e-6)
  model(logits, mask)  # outside nnx.capture: no sow, no warning, no attribute
  assert not hasattr(model, "max_logits")
  with pytest.raises(ValueError, match=r"head_axis must be an int in \[-4, 4\).*\(2, 5, 3, 5\).*got 4"):
    _GemmaStyle().apply({}, logits, mask, mutable=["intermediates"], method=lambda m, x, k: sow_max_logits(
        m, x, mask=k, head_axis=4))
  with pytest.raises(ValueError, match=r"mask of shape \(5, 4\) is not broadcastable.*\(2, 5, 3, 5\)"):
    _GemmaStyle().apply({}, logits, np.ones((5, 4), bool), mutable=["intermediates"])
  with pytest.raises(TypeError, match="sow_max_logits: module must be a Flax Linen or NNX module"):
    sow_max_logits(object(), logits)


class _HFStyle(nn.Module):
  """Calls dot_product_attention_weights without module=, as Hugging Face's Flax models do."""

  @nn.compact
  def __call__(self, q, k, bias, mask, rng):
    return dot_product_attention_weights(q, k, bias=bias, mask=mask, dropout_rng=rng, dropout_rate=0.25)


def test_dot_product_attention_weights_is_flax_plus_max_logits():
  q, k = _normal(1, 2, 6, 4, 8, scale=2.0), _normal(2, 2, 6, 4, 8)
  bias = _normal(3, 1, 4, 6, 6)
  mask = nn.make_causal_mask(jnp.ones((2, 6)))  # (2, 1, 6, 6)
  rng = jax.random.key(7)
  weights, state = jax.jit(lambda *a: _HFStyle().apply({}, *a, mutable=["intermediates"]))(q, k, bias, mask, rng)
  theirs = nn.dot_product_attention_weights(q, k, bias=bias, mask=mask, dropout_rng=rng, dropout_rate=0.25)
  assert_same_math(weights, theirs)  # the same weights, dropout included
  s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / np.sqrt(8) + np.float64(bias)
  np.testing.assert_allclose(state["intermediates"]["max_logits"], _np_head_max(s, np.asarray(mask), 1), rtol=1e-5)
  # outside any module, or not captured: Flax's weights, nothing sown
  assert_same_math(dot_product_attention_weights(q, k, mask=mask),
                                nn.dot_product_attention_weights(q, k, mask=mask))
  assert _HFStyle().apply({}, q, k, bias, mask, rng, mutable=["params"])[1] == {}
  # module= an NNX module under nnx.capture
  target = _Holder()
  _, captured = nnx.capture(target, nnx.Intermediate)(q, k, mask)
  s0 = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / np.sqrt(8)
  np.testing.assert_allclose(nnx.to_pure_dict(captured)["max_logits"], _np_head_max(s0, np.asarray(mask), 1),
                             rtol=1e-5)
  with pytest.raises(ValueError, match="einsum_dot_general is not supported"):
    dot_product_attention_weights(q, k, einsum_dot_general=jax.lax.dot_general)


class _Holder(nnx.Module):
  def __call__(self, q, k, mask):
    return dot_product_attention_weights(q, k, mask=mask, module=self)


def _np_attention(q, k, v, scale, cap, bias=None, mask=None):
  s = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) * scale
  if bias is not None:
    s = s + np.float64(bias)
  pre = s
  s = cap * np.tanh(s / cap)
  allowed = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
  s = np.where(allowed, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p, np.float64(v)), _np_head_max(pre, allowed, 1)


def test_logits_soft_cap_softmax_reads_capped_capture_counts_pre_cap():
  q, k, v = _normal(4, 2, 6, 2, 8, scale=4.0), _normal(5, 2, 6, 2, 8, scale=4.0), _normal(6, 2, 6, 2, 8)
  cap = 3.0
  causal = np.tril(np.ones((6, 6), bool))[None, None]
  want_out, want_max = _np_attention(q, k, v, 8 ** -0.5, cap, mask=causal)
  assert (want_max > cap).all()  # the cap would hide these
  out, got_max = jax.jit(lambda *a: attention(*a, softmax_scale=8 ** -0.5, is_causal=True, logits_soft_cap=cap,
                                              return_max_logits=True))(q, k, v)
  np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got_max, want_max, rtol=1e-5)
  grads = jax.grad(lambda x: attention(x, k, v, softmax_scale=0.35, is_causal=True, logits_soft_cap=cap)[0].sum())(q)
  assert np.isfinite(grads).all()
  # the drop-in, through attention() and through the bias path, on a Linen module
  bias = _normal(7, 1, 2, 6, 6)
  for b in (None, bias):
    want_out, want_max = _np_attention(q, k, v, 8 ** -0.5, cap, bias=b, mask=causal)
    out, state = _linen_dpa(q, k, v, b, causal, cap)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state["intermediates"]["max_logits"], want_max, rtol=1e-5)
  for impl in ("chunked", "dpa_max"):
    with pytest.raises(ValueError, match=f"logits_soft_cap is supported only with impl='dense'.*{impl}"):
      attention(q, k, v, softmax_scale=1.0, impl=impl, logits_soft_cap=cap)
    with pytest.raises(ValueError, match="logits_soft_cap is supported only with impl='dense'"):
      dot_product_attention(q, k, v, impl=impl, logits_soft_cap=cap)
  for bad in (0.0, -1.0, float("inf"), True, jnp.float32(2.0)):
    with pytest.raises(ValueError, match="logits_soft_cap must be None or a positive finite Python number"):
      attention(q, k, v, softmax_scale=1.0, logits_soft_cap=bad)


class _DPA(nn.Module):
  cap: float

  @nn.compact
  def __call__(self, q, k, v, bias, mask):
    return dot_product_attention(q, k, v, bias=bias, mask=mask, logits_soft_cap=self.cap)


def _linen_dpa(q, k, v, bias, mask, cap):
  return jax.jit(lambda *a: _DPA(cap).apply({}, *a, mutable=["intermediates"]))(q, k, v, bias, mask)


def test_private_flax_apis_are_found_and_their_loss_is_loud(monkeypatch):
  """Fails when a Flax release moves flax.linen.module._context or nnx's __captures__."""
  flax_private._check_linen.cache_clear()
  flax_private._check_nnx.cache_clear()
  flax_private._check_linen()  # the probes pass on the installed Flax
  flax_private._check_nnx()

  class Finder(nn.Module):
    @nn.compact
    def __call__(self):
      return flax_private.linen_calling_module() is self

  assert Finder().apply({}) is True
  assert flax_private.linen_calling_module() is None  # outside Linen
  q = k = jnp.ones((1, 4, 2, 8))
  # Linen's private stack gone: capture raises at trace time instead of returning without sowing
  moved = types.SimpleNamespace()  # flax.linen.module without _context
  stale = types.SimpleNamespace(_context=types.SimpleNamespace(module_stack=[None]))  # a stack nobody pushes on
  for fake, why in ((moved, "found NoneType, not a list"), (stale, "its top is not the module whose method runs")):
    monkeypatch.setattr(flax_private, "_linen_module", fake)
    flax_private._check_linen.cache_clear()
    with pytest.raises(RuntimeError, match=rf"flax.linen.module._context.module_stack \({why}\).*read from flax 0.12"):
      jax.jit(lambda a, b: _HFStyle().apply({}, a, b, None, None, jax.random.key(0), mutable=["intermediates"]))(q, k)
    monkeypatch.undo()
  flax_private._check_linen.cache_clear()
  # nnx.capture that no longer marks modules with __captures__
  real_capture = nnx.capture

  def capture_without_marks(fn, *types_, **kw):
    return lambda *a, **k: (fn(*a, **k), nnx.State({}))

  monkeypatch.setattr(nnx, "capture", capture_without_marks)
  flax_private._check_nnx.cache_clear()
  with pytest.raises(RuntimeError, match=r"__captures__"):
    _Holder()(q, k, None)
  monkeypatch.setattr(nnx, "capture", real_capture)
  flax_private._check_nnx.cache_clear()
  flax_private._check_nnx()
  assert_same_math(_Holder()(q, k, None), nn.dot_product_attention_weights(q, k))
