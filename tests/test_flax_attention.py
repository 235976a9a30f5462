"""muonclip_jax.nn.dot_product_attention: Flax's attention function plus per-head max logits."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from muonclip_jax.nn import dot_product_attention as dpa
from _exactness import assert_same_math


def _qkv(rng, batch, tq, tk, h, d, hkv=None):
  hkv = hkv or h
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return f(*batch, tq, h, d), f(*batch, tk, hkv, d), f(*batch, tk, hkv, d)


def np_max_logits(q, k, bias=None, mask=None, causal=False):
  """Per-head max of q.k/sqrt(D) + bias over unmasked pairs, all batch axes and queries."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  h, hkv = q.shape[-2], k.shape[-2]
  k = np.repeat(k, h // hkv, axis=-2)
  s = np.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  allowed = np.ones(s.shape, bool)
  if mask is not None:
    allowed &= np.broadcast_to(np.asarray(mask, bool), s.shape)
  if causal:
    allowed &= np.tril(np.ones(s.shape[-2:], bool))
  s = np.where(allowed, s, -np.inf)
  return s.reshape(-1, h, *s.shape[-2:]).max(axis=(0, 2, 3))


class Probe(nn.Module):
  """Calls the function from inside a Linen module, as MultiHeadDotProductAttention does."""

  fn: object = dpa

  @nn.compact
  def __call__(self, q, k, v, **kw):
    return self.fn(q, k, v, **kw)


def _sown(q, k, v, fn=dpa, **kw):
  out, state = Probe(fn).apply({}, q, k, v, mutable=["intermediates"], **kw)
  return out, state["intermediates"]["max_logits"]


CASES = {
    "plain": {},
    "mask": {"mask": "mask"},
    "bias": {"bias": "bias"},
    "bias_mask": {"bias": "bias", "mask": "mask"},
    "dropout": {"mask": "mask", "dropout_rate": 0.3, "dropout_rng": "rng"},
    "dropout_per_head": {"mask": "mask", "dropout_rate": 0.3, "dropout_rng": "rng", "broadcast_dropout": False},
    "dropout_deterministic": {"mask": "mask", "dropout_rate": 0.3, "deterministic": True},
}


@pytest.mark.parametrize("batch, case", [((), "mask"), ((2, 3), "bias_mask"), ((2, 3), "dropout")]
                         + [((2,), case) for case in CASES])
def test_matches_flax_and_numpy(batch, case):
  rng = np.random.default_rng(len(batch) * 10 + len(case))
  q, k, v = _qkv(rng, batch, 5, 7, 4, 8)
  mask = rng.random((*batch, 1, 5, 7)) > 0.4
  mask[..., 0, 2, :] = False  # one query row with every key masked: Flax attends uniformly
  kw = {}
  for name, val in CASES[case].items():
    kw[name] = {"mask": jnp.asarray(mask), "bias": jnp.asarray(rng.standard_normal((*(1,) * len(batch), 4, 5, 7)), jnp.float32),
                "rng": jax.random.key(3)}.get(val, val)
  want = nn.dot_product_attention(q, k, v, **kw)
  out, sown = _sown(q, k, v, **kw)
  chex.assert_trees_all_close(out, want, atol=2e-6, rtol=2e-6)
  assert sown.dtype == jnp.float32 and sown.shape == (4,)
  np.testing.assert_allclose(sown, np_max_logits(q, k, kw.get("bias"), kw.get("mask")), rtol=1e-6, atol=1e-6)


def test_chunked_impl_and_gradients_match_flax():
  rng = np.random.default_rng(1)
  q, k, v = _qkv(rng, (2,), 9, 9, 2, 4)
  mask = jnp.asarray(nn.make_causal_mask(jnp.ones((2, 9))))
  chunked = functools.partial(dpa, impl="chunked", block_size=4)
  out, sown = _sown(q, k, v, fn=chunked, mask=mask)
  chex.assert_trees_all_close(out, nn.dot_product_attention(q, k, v, mask=mask), atol=2e-6)
  np.testing.assert_allclose(sown, np_max_logits(q, k, mask=mask), rtol=1e-6)
  bias = jnp.asarray(rng.standard_normal((1, 2, 9, 9)), jnp.float32)
  for fn, kw in ((chunked, {"mask": mask}), (dpa, {"mask": mask, "bias": bias})):
    ours = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a, **kw))), argnums=(0, 1, 2))(q, k, v)
    flax = jax.grad(lambda *a: jnp.sum(jnp.sin(nn.dot_product_attention(*a, **kw))), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(ours, flax, atol=1e-5)


@settings(deadline=None, max_examples=6)
@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from([(1, 1), (2, 1), (4, 2)]), st.integers(0, 2**31 - 1))
def test_nnx_grouped_query_and_is_causal(tq, tk, heads, seed):
  h, hkv = heads
  rng = np.random.default_rng(seed)
  q, k, v = _qkv(rng, (2,), tq, tk, h, 4, hkv)
  mask = jnp.asarray(rng.random((2, h, tq, tk)) > 0.3)
  for kw in ({"is_causal": True}, {"mask": mask, "is_causal": True}):
    # compiled: run eagerly, every drawn shape compiled each operation on its own
    want = jax.jit(functools.partial(nnx.dot_product_attention, **kw))(q, k, v)
    out, sown = jax.jit(functools.partial(_sown, **kw))(q, k, v)
    chex.assert_trees_all_close(out, want, atol=3e-6, rtol=3e-6)
    ref = np_max_logits(q, k, mask=kw.get("mask"), causal=kw.get("is_causal", False))
    np.testing.assert_allclose(sown, ref, rtol=1e-6, atol=1e-6)


def test_jit_bf16_and_dtype():
  rng = np.random.default_rng(2)
  q, k, v = _qkv(rng, (2,), 4, 4, 2, 8)
  out = jax.jit(dpa)(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  assert dpa(q, k, v, dtype=jnp.bfloat16).dtype == jnp.bfloat16
  chex.assert_trees_all_close(out.astype(jnp.float32), nn.dot_product_attention(q, k, v), atol=3e-2)


def test_linen_module_needs_only_attention_fn():
  """MultiHeadDotProductAttention: max logits sown on the module itself, no weights, running max."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 16)), jnp.float32)

  class TwoCalls(nn.Module):
    @nn.compact
    def __call__(self, x, sow_weights=False):
      attn = nn.MultiHeadDotProductAttention(4, attention_fn=dpa, name="attn")
      return attn(x, sow_weights=sow_weights) + attn(2.0 * x, sow_weights=sow_weights)

  model = TwoCalls()
  params = model.init(jax.random.key(0), x)
  assert "intermediates" not in params
  default = nn.MultiHeadDotProductAttention(4, name="attn")
  want = default.apply({"params": params["params"]["attn"]}, x) + default.apply({"params": params["params"]["attn"]}, 2 * x)
  for sow_weights in (False, True):
    y, state = model.apply(params, x, sow_weights=sow_weights, mutable=["intermediates"])
    assert jax.tree.structure(state) == jax.tree.structure({"intermediates": {"attn": {"max_logits": 0}}})
    chex.assert_trees_all_close(y, want, atol=1e-5)
    # running maximum over both calls = the maximum of the second (scaled) call's logits
    _, q_state = default.apply({"params": params["params"]["attn"]}, 2 * x,
                               capture_intermediates=lambda m, _: m.name in ("query", "key"),
                               mutable=["intermediates"])
    qk = q_state["intermediates"]
    ref = np.maximum(np_max_logits(qk["query"]["__call__"][0], qk["key"]["__call__"][0]), 0)
    np.testing.assert_allclose(state["intermediates"]["attn"]["max_logits"], ref, rtol=1e-5)
  # not mutable: plain output, nothing sown
  chex.assert_trees_all_close(model.apply(params, x), want, atol=1e-5)


def test_nnx_module_sow_weights_hands_over_the_module():
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5, 12)), jnp.float32)
  attn = nnx.MultiHeadAttention(4, 12, qkv_features=16, attention_fn=dpa, decode=False, rngs=nnx.Rngs(0))
  ref = nnx.MultiHeadAttention(4, 12, qkv_features=16, decode=False, rngs=nnx.Rngs(0))
  y, inter = nnx.capture(lambda m, x: m(x, sow_weights=True, is_causal=True), nnx.Intermediate)(attn, x)
  chex.assert_trees_all_close(y, ref(x, is_causal=True), atol=1e-5)
  pure = nnx.to_pure_dict(inter)
  assert set(pure) == {"max_logits"} and pure["max_logits"].shape == (4,)
  q, k = attn.query(x), attn.key(x)
  np.testing.assert_allclose(pure["max_logits"], np_max_logits(q, k, causal=True), rtol=1e-5)
  # outside nnx.capture: no sow, same output
  assert_same_math(attn(x, sow_weights=True, is_causal=True), y)


def test_bad_inputs():
  rng = np.random.default_rng(5)
  q, k, v = _qkv(rng, (2,), 4, 4, 2, 8)
  with pytest.raises(ValueError, match="qk_attn_weights_einsum is not supported"):
    dpa(q, k, v, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match=r"impl='chunked' supports neither an additive bias"):
    dpa(q, k, v, bias=jnp.zeros((2, 4, 4)), impl="chunked")
  with pytest.raises(ValueError, match=r"same rank >= 3.*\(2, 4, 2, 8\), \(4, 2, 8\)"):
    dpa(q, k[0], v)
  with pytest.raises(ValueError, match=r"key \(2, 4, 3, 8\) must have .* dividing query's 2"):
    dpa(q, jnp.zeros((2, 4, 3, 8)), jnp.zeros((2, 4, 3, 8)))
  with pytest.raises(ValueError, match=r"mask of shape \(1, 3, 4, 4\) is not broadcastable to .*\(2, 2, 4, 4\)"):
    dpa(q, k, v, mask=jnp.ones((3, 4, 4), bool))
  with pytest.raises(ValueError, match="needs dropout_rng"):
    dpa(q, k, v, dropout_rate=0.1)
  with pytest.raises(TypeError, match="module must be a Flax Linen or NNX module"):
    dpa(q, k, v, module="attn")
  with pytest.raises(ValueError, match="precision must be None"):
    dpa(q, k, v, precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))


def _splash_vs_dense(q, k, v, **kw):
  """Outputs and sown maxima of the drop-in with impl='splash' and with impl='dense'."""
  splash = functools.partial(dpa, impl="splash")
  return _sown(q, k, v, fn=splash, **kw), _sown(q, k, v, **kw)


def test_fused_kernel_is_causal_and_key_padding_match_dense():
  """impl='splash' (a fused kernel: no explicit mask) through attention_fn: is_causal=True without a mask, and key padding masks."""
  rng = np.random.default_rng(6)
  q, k, v = _qkv(rng, (2,), 12, 12, 2, 8, hkv=1)
  key_valid = np.ones((2, 12), bool)
  key_valid[0, 9:] = False
  key_valid[1, :] = False  # a batch row without any key: Flax attends uniformly
  cases = [
      {"is_causal": True},
      {"mask": jnp.asarray(key_valid[:, None, None, :])},  # (B, 1, 1, Tk)
      {"mask": jnp.asarray(key_valid[0])},  # (Tk,): shared by the whole batch
      {"mask": jnp.asarray(key_valid[:, None, None, :]), "is_causal": True},
  ]
  for kw in cases:
    (out, sown), (want, want_max) = _splash_vs_dense(q, k, v, **kw)
    chex.assert_trees_all_close(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(sown, want_max, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sown, np_max_logits(q, k, mask=kw.get("mask"), causal=kw.get("is_causal", False)),
                               rtol=1e-5, atol=1e-5)
  # Linen's MultiHeadDotProductAttention never passes is_causal: the partial sets it
  x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
  causal_fn = functools.partial(dpa, impl="splash", is_causal=True)
  attn = nn.MultiHeadDotProductAttention(2, attention_fn=causal_fn)
  params = attn.init(jax.random.key(0), x)
  y, state = attn.apply(params, x, mutable=["intermediates"])
  ref = nn.MultiHeadDotProductAttention(2).apply(params, x, mask=nn.make_causal_mask(jnp.ones((2, 8))))
  chex.assert_trees_all_close(y, ref, atol=1e-5)
  assert state["intermediates"]["max_logits"].shape == (2,)


def test_fused_kernel_rejects_general_masks_with_the_way_out():
  rng = np.random.default_rng(7)
  q, k, v = _qkv(rng, (2,), 8, 8, 2, 8)
  fused = functools.partial(dpa, impl="splash")
  hint = r"is_causal=True\) with no mask.*key padding masks of shape \(B, 1, 1, Tk\).*'dense', 'chunked' or 'dpa_max'"
  with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 8, 8\).*" + hint):
    fused(q, k, v, mask=nn.make_causal_mask(jnp.ones((2, 8))))
  with pytest.raises(ValueError, match=r"mask of shape \(2, 2, 1, 8\).*" + hint):  # per head
    fused(q, k, v, mask=jnp.ones((2, 2, 1, 8), bool))
  with pytest.raises(ValueError, match=r"is_causal=True with q_length != kv_length.*" + hint):
    fused(q, k[:, :6], v[:, :6], is_causal=True)
  # the same mask is fine with the other implementations
  dpa(q, k, v, mask=nn.make_causal_mask(jnp.ones((2, 8))), impl="chunked")


def test_bad_impl_is_named_before_anything_else():
  rng = np.random.default_rng(8)
  q, k, v = _qkv(rng, (2,), 4, 4, 2, 8)
  for kw in ({}, {"bias": jnp.zeros((2, 4, 4))}, {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}):
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'dense', 'chunked', 'dpa_max', 'splash', 'tokamax_gpu'\), got 'flash'"):
      dpa(q, k, v, impl="flash", **kw)
