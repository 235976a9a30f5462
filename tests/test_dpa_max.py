"""The any-backend fast path (``impl="dpa_max"``): dot_product_attention + a max-only pass."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import _attention_cases as cases
from muonclip_jax import nn as mnn
from _exactness import assert_same_math


@pytest.mark.parametrize(
    "kind,tq,tk",
    [
        ("none", 37, 37),
        ("causal", 37, 37),  # jax's is_causal
        ("causal", 20, 37),  # bottom-right causal needs an explicit mask (jax's is top-left)
        ("causal", 37, 20),  # ... and leaves the first 17 rows without keys
        ("segments", 37, 37),
        ("padding", 37, 37),
        ("all", 20, 37),
        ("bidirectional_padding", 37, 20),
    ],
)
def test_matches_dense(kind, tq, tk):
  q, k, v = cases.qkv(tq, tk, seed=tq + tk)
  cases.assert_matches_dense(q, k, v, cases.masks(kind, tq, tk), "dpa_max")


@pytest.mark.parametrize("d,dv", [(16, 16), (8, 20)])  # equal widths; v wider than q/k
def test_head_widths_match_dense(d, dv):
  q, k, v = cases.qkv(21, d=d, dv=dv)
  cases.assert_matches_dense(q, k, v, cases.masks("causal", 21, 21), "dpa_max")


def test_explicit_mask_matches_dense():
  """The (B, H, Tq, Tk) boolean mask, which the fused kernel does not take."""
  q, k, v = cases.qkv(13)
  mask = jnp.asarray(np.random.default_rng(5).random((cases.B, cases.H, 13, 13)) < 0.6)
  mask = mask.at[:, 1].set(False)  # head 1 sees nothing
  cases.assert_matches_dense(q, k, v, dict(is_causal=True, mask=mask), "dpa_max")
  (_, (out, m)), grads = cases.value_and_grad(q, k, v, dict(mask=mask), "dpa_max")
  assert m[1] == -jnp.inf and np.isfinite(np.asarray(m)[[0, 2, 3]]).all()
  chex.assert_trees_all_equal(out[:, :, 1], jnp.zeros_like(out[:, :, 1]))
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()


def test_bf16_matches_dense():
  q, k, v = cases.qkv(37, dtype=jnp.bfloat16, seed=1)
  cases.assert_matches_dense(q, k, v, cases.masks("all", 37, 37), "dpa_max")


def test_fully_masked_rows_give_zeros():
  q, k, v = cases.qkv(9)
  kv_mask = jnp.zeros((cases.B, 9), bool).at[0, :4].set(True)  # batch 1 has no key
  (_, (out, m)), grads = cases.value_and_grad(q, k, v, dict(kv_mask=kv_mask), "dpa_max")
  chex.assert_trees_all_equal(out[1], jnp.zeros_like(out[1]))
  chex.assert_trees_all_equal(grads[0][1], jnp.zeros_like(grads[0][1]))
  assert np.isfinite(np.asarray(m)).all()
  (_, (out, m)), _ = cases.value_and_grad(q, k, v, dict(kv_mask=kv_mask.at[0].set(False)),
                                          "dpa_max")
  chex.assert_trees_all_equal(m, jnp.full((cases.H,), -jnp.inf, jnp.float32))
  chex.assert_trees_all_equal(out, jnp.zeros_like(out))


def test_max_pass_has_no_gradient_and_is_memory_bounded():
  t, block = 1024, 32
  q, k, v = cases.qkv(t, h=2, hkv=2, d=8, dv=8)

  def maxima(q, k, v):  # the attention output is unused: XLA keeps only the max pass
    return mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="dpa_max", block_size=block,
                         is_causal=True, return_max_logits=True)[1]

  logits_bytes = cases.B * 2 * t * t * 4
  temp = jax.jit(maxima).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
  assert temp < logits_bytes / 4
  g = jax.jit(jax.grad(lambda q: jnp.sum(maxima(q, k, v))))(q)
  chex.assert_trees_all_equal(g, jnp.zeros_like(g))


def test_without_capture_is_plain_dot_product_attention():
  q, k, v = cases.qkv(12, h=2, hkv=2, d=8, dv=8)
  out, none = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="dpa_max", is_causal=True)
  assert none is None
  expected = jax.nn.dot_product_attention(q, k, v, scale=cases.SCALE, is_causal=True)
  assert_same_math(out, expected)


def test_validation():
  q, k, v = cases.qkv(4)
  with pytest.raises(ValueError, match="block_size"):
    mnn.attention(q, k, v, softmax_scale=1.0, impl="dpa_max", block_size=0)
  with pytest.raises(ValueError, match=r"attention\(impl='dpa_max'\): kv_mask"):
    mnn.attention(q, k, v, softmax_scale=1.0, impl="dpa_max", kv_mask=jnp.ones((cases.B, 5), bool))


def _dot_generals(jaxpr) -> int:
  """Counts ``dot_general`` equations, recursing into sub-jaxprs."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _dot_generals(sub)
  return count


def test_capture_is_one_more_qk_pass():
  """The traced forward: with capture, exactly one ``Q K^T`` more than without (the max pass)."""
  q, k, v = cases.qkv(37)

  def jaxpr(capture):
    f = lambda q, k, v: mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="dpa_max", block_size=cases.BLOCK,
                                      is_causal=True, return_max_logits=capture)
    return jax.make_jaxpr(f)(q, k, v).jaxpr

  assert _dot_generals(jaxpr(True)) == _dot_generals(jaxpr(False)) + 1


# ----------------------------------------------------------------------------- modules

MLA = dict(num_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, block_size=cases.BLOCK)
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=cases.BLOCK)


class _Stack(nn.Module):
  """Two scanned GQA layers: the sown maxima are stacked per layer."""

  impl: str

  @nn.compact
  def __call__(self, x, *, segment_ids, padding_mask):
    impl = self.impl

    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        attn = mnn.GroupedQueryAttention(**GQA, impl=impl, name="attn")
        return x + attn(x, segment_ids=segment_ids, padding_mask=padding_mask), None

    scanned = nn.scan(Layer, variable_axes={"params": 0, "intermediates": 0},
                      split_rngs={"params": True}, length=2,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(name="layers")(x, None)[0]


@pytest.mark.parametrize("name", ["MLA", "GQA_scanned"])
def test_modules_sow_the_same_maxima_as_dense(name):
  """The modules with ``impl="dpa_max"``: the same maxima as dense (the max pass computes the
  same products, in another program: ``_exactness``), and the same loss and gradients."""
  b, t, dim = 2, 21, 32
  x = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, dim)), jnp.float32)
  segment_ids = jnp.asarray((np.arange(t)[None] >= np.array([[t], [9]])).astype(np.int32))
  padding_mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 4]]))
  if name == "MLA":
    make = lambda impl: mnn.MultiHeadLatentAttention(**MLA, impl=impl)
  else:
    make = lambda impl: _Stack(impl)
  kw = dict(segment_ids=segment_ids, padding_mask=padding_mask)
  params = jax.jit(make("dense").init)(jax.random.key(0), x, **kw)

  def run(impl):
    def loss(params):
      y, state = make(impl).apply(params, x, mutable=["intermediates"], **kw)
      return jnp.sum(jnp.sin(y)), state["intermediates"]
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (l_d, inter_d), g_d = run("dense")
  maxima = jax.tree.leaves(inter_d)
  assert maxima and all(np.isfinite(np.asarray(m)).all() for m in maxima)
  (l, inter), g = run("dpa_max")
  assert_same_math(inter, inter_d)
  chex.assert_trees_all_close(l, l_d, rtol=1e-5)
  chex.assert_trees_all_close(nn.unbox(g), nn.unbox(g_d), rtol=1e-4, atol=2e-5)
