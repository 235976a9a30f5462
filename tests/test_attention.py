"""Pure attention functions and rotary embeddings: references, dense vs chunked, masks, grads."""

from __future__ import annotations

import functools
import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings

from muonclip_jax import nn as mnn
import _nn_reference as ref
from _exactness import assert_same_math

B, H, HKV, D, DV = 2, 4, 2, 8, 6
SCALE = 0.4


def _qkv(tq, tk=None, *, h=H, hkv=HKV, seed=0, dtype=jnp.float32):
  tk = tq if tk is None else tk
  rng = np.random.default_rng(seed)  # NumPy: no RNG kernels to compile per shape
  q = jnp.asarray(rng.standard_normal((B, tq, h, D)), dtype)
  k = jnp.asarray(rng.standard_normal((B, tk, hkv, D)), dtype)
  v = jnp.asarray(rng.standard_normal((B, tk, hkv, DV)), dtype)
  return q, k, v


def _masks(kind, tq, tk):
  """Keyword masks for the pure functions (NumPy, converted to jnp where used)."""
  pad = np.arange(tk)[None, :] < np.array([[tk], [max(tk - 3, 1)]])
  qpad = np.arange(tq)[None, :] < np.array([[tq], [max(tq - 2, 1)]])
  segq = (np.arange(tq)[None, :] >= np.array([[tq // 2], [tq + 1]])).astype(np.int32)
  segk = (np.arange(tk)[None, :] >= np.array([[tk // 2], [tk + 1]])).astype(np.int32)
  head = np.ones((1, H, 1, tk), bool)
  head[0, 1] = False  # head 1 sees nothing
  if kind == "none":
    return {}
  if kind == "causal":
    return dict(is_causal=True)
  if kind == "padding":
    return dict(is_causal=True, q_mask=qpad, kv_mask=pad)
  if kind == "segments":
    return dict(is_causal=True, q_segment_ids=segq, kv_segment_ids=segk)
  if kind == "head_mask":
    return dict(mask=head)
  if kind == "all":
    return dict(
        is_causal=True, q_mask=qpad, kv_mask=pad, q_segment_ids=segq, kv_segment_ids=segk, mask=head
    )
  raise ValueError(kind)


def _reference(q, k, v, masks):
  b, tq, h, _ = q.shape
  allowed = ref.allowed_pairs(b, h, tq, k.shape[1], **masks)
  return ref.attention(np.asarray(q), np.asarray(k), np.asarray(v), SCALE, allowed)


def _jnp(masks):
  return {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in masks.items()}


@functools.partial(jax.jit, static_argnames=("impl", "block", "is_causal"))
def _forward(q, k, v, masks, *, impl="dense", block=8, is_causal=False):
  return mnn.attention(
      q, k, v, softmax_scale=SCALE, impl=impl, block_size=block, is_causal=is_causal,
      return_max_logits=True, **masks,
  )


@functools.partial(jax.jit, static_argnames=("impl", "block", "is_causal"))
def _value_and_grad(q, k, v, masks, *, impl, block=8, is_causal=False):
  def loss(q, k, v):
    out, m = mnn.attention(
        q, k, v, softmax_scale=SCALE, impl=impl, block_size=block, is_causal=is_causal,
        return_max_logits=True, **masks,
    )
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(out * w), (out, m)

  return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def _split(masks):
  """(jnp mask arrays, causal flag) from a ``_masks`` dict."""
  masks = dict(masks)
  is_causal = masks.pop("is_causal", False)
  return _jnp(masks), is_causal


class TestDense:

  @pytest.mark.parametrize("kind", ["none", "causal", "padding", "segments", "head_mask", "all"])
  def test_matches_numpy(self, kind):
    q, k, v = _qkv(7)
    masks = _masks(kind, 7, 7)
    arrays, is_causal = _split(masks)
    out, max_logits = _forward(q, k, v, arrays, is_causal=is_causal)
    ref_out, ref_max = _reference(q, k, v, masks)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(max_logits, ref_max.astype(np.float32), atol=1e-5, rtol=1e-5)
    assert max_logits.dtype == jnp.float32 and max_logits.shape == (H,)
    if kind in ("head_mask", "all"):
      assert max_logits[1] == -jnp.inf

  def test_max_only_when_asked(self):
    q, k, v = _qkv(7)
    for impl in ("dense", "chunked"):
      run = functools.partial(mnn.attention, softmax_scale=SCALE, impl=impl, block_size=8)
      out, none = jax.jit(run)(q, k, v)
      assert none is None
      assert_same_math(out, _forward(q, k, v, {}, impl=impl)[0])


class TestChunked:

  @pytest.mark.parametrize("t,kind", [(1, "all"), (13, "all"), (21, "causal")])
  def test_matches_dense(self, t, kind):
    q, k, v = _qkv(t, seed=t)
    masks, is_causal = _split(_masks(kind, t, t))
    (_, (out_d, max_d)), grads_d = _value_and_grad(q, k, v, masks, impl="dense", is_causal=is_causal)
    (_, (out_c, max_c)), grads_c = _value_and_grad(q, k, v, masks, impl="chunked", is_causal=is_causal)
    chex.assert_trees_all_close(out_c, out_d, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads_c, grads_d, atol=1e-5, rtol=1e-5)
    assert_same_math(max_c, max_d)  # the same products, in another program (_exactness)
    for g in grads_c:
      assert np.isfinite(np.asarray(g)).all()

  def test_cross_lengths_and_mha(self):
    """Tq != Tk (causal is bottom-right aligned: query i sees keys j <= i + Tk - Tq), MHA."""
    q, k, v = _qkv(6, 11, h=3, hkv=3)
    (_, (out_d, max_d)), grads_d = _value_and_grad(q, k, v, {}, impl="dense", is_causal=True)
    (_, (out_c, max_c)), grads_c = _value_and_grad(
        q, k, v, {}, impl="chunked", block=4, is_causal=True
    )
    ref_out, ref_max = _reference(q, k, v, dict(is_causal=True))
    chex.assert_trees_all_close(out_d, ref_out.astype(np.float32), atol=1e-5)
    chex.assert_trees_all_close(max_d, ref_max.astype(np.float32), atol=1e-5)
    chex.assert_trees_all_close((out_c, grads_c), (out_d, grads_d), atol=1e-5, rtol=1e-5)
    assert_same_math(max_c, max_d)

  @settings(max_examples=8)
  @given(
      t=st.integers(1, 20),
      block=st.integers(1, 9),
      is_causal=st.booleans(),
      pad=st.integers(0, 5),
  )
  def test_property_matches_reference(self, t, block, is_causal, pad):
    q, k, v = _qkv(t, seed=3)
    kv_mask = np.arange(t)[None, :] < np.array([[t], [max(t - pad, 0)]])
    masks = dict(is_causal=is_causal, kv_mask=kv_mask)
    out, m = _forward(
        q, k, v, _jnp(dict(kv_mask=kv_mask)), impl="chunked", block=block, is_causal=is_causal
    )
    ref_out, ref_max = _reference(q, k, v, masks)
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(m, ref_max.astype(np.float32), atol=1e-5, rtol=1e-5)

  def test_does_not_materialize_logits(self):
    """Compiled fwd+bwd temp memory stays far below one (B, H, T, T) float32 matrix."""
    t, block = 1024, 32
    q, k, v = (x[:1] for x in _qkv(t))
    logits_bytes = H * t * t * 4

    def temp_bytes(impl):
      def loss(q, k, v):
        out, _ = mnn.attention(
            q, k, v, softmax_scale=SCALE, impl=impl, block_size=block, is_causal=True,
            return_max_logits=True,
        )
        return jnp.sum(out)

      f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("dense") >= logits_bytes
    assert temp_bytes("chunked") < logits_bytes / 4


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_fully_masked_rows_and_heads(impl):
  q, k, v = _qkv(6)
  kv_mask = jnp.zeros((B, 6), bool).at[0, :3].set(True)  # batch 1 has no key at all
  mask = jnp.ones((1, H, 1, 1), bool).at[0, 2].set(False)  # head 2 has no pair
  masks = dict(kv_mask=kv_mask, mask=mask)
  (_, (out, m)), grads = _value_and_grad(q, k, v, masks, impl=impl, block=4)
  assert np.isfinite(np.asarray(out)).all()
  chex.assert_trees_all_equal(out[1], jnp.zeros_like(out[1]))
  chex.assert_trees_all_equal(out[:, :, 2], jnp.zeros_like(out[:, :, 2]))
  assert m[2] == -jnp.inf and np.isfinite(np.asarray(m)[[0, 1, 3]]).all()
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  chex.assert_trees_all_equal(grads[0][1], jnp.zeros_like(grads[0][1]))
  ref_out, ref_max = _reference(q, k, v, dict(kv_mask=np.asarray(kv_mask), mask=np.asarray(mask)))
  chex.assert_trees_all_close(out, ref_out.astype(np.float32), atol=1e-5)
  chex.assert_trees_all_close(m, ref_max.astype(np.float32), atol=1e-5)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_capture_does_not_change_gradients(impl):
  q, k, v = _qkv(9)

  def loss(capture):
    def f(q, k, v):
      out, _ = mnn.attention(q, k, v, softmax_scale=SCALE, impl=impl, block_size=4, is_causal=True,
                             return_max_logits=capture)
      return jnp.sum(jnp.sin(out))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  assert_same_math(loss(True)(q, k, v), loss(False)(q, k, v))


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_capture_adds_no_pass_over_the_logits(impl):
  """XLA's cost analysis: capture adds far less traffic than one read of the logits."""
  t = 256
  q, k, v = _qkv(t)

  def cost(capture):
    def loss(q, k, v):
      out, m = mnn.attention(q, k, v, softmax_scale=SCALE, impl=impl, block_size=64,
                             is_causal=True, return_max_logits=capture)
      return jnp.sum(out), m

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    return grad.lower(q, k, v).compile().cost_analysis()["bytes accessed"]

  assert cost(True) - cost(False) < B * H * t * t * 4 / 16


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_bf16_inputs_report_float32(impl):
  q, k, v = _qkv(10, dtype=jnp.bfloat16)
  out, m = _forward(q, k, v, {}, impl=impl, block=4, is_causal=True)
  assert out.dtype == jnp.bfloat16 and m.dtype == jnp.float32
  _, ref_max = _reference(q.astype(jnp.float32), k.astype(jnp.float32), v, dict(is_causal=True))
  # The maxima are float32 products of the bf16 inputs.
  chex.assert_trees_all_close(m, ref_max.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_max_logits_have_no_gradient():
  q, k, v = _qkv(5)
  for impl in ("dense", "chunked"):
    maxima = functools.partial(_forward, impl=impl, block=2)
    g = jax.jit(jax.grad(lambda q, f=maxima: jnp.sum(f(q, k, v, {})[1])))(q)
    chex.assert_trees_all_equal(g, jnp.zeros_like(g))


def test_single_trace_under_jit():
  q, k, v = _qkv(6)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(q, k, v):
    return mnn.attention(
        q, k, v, softmax_scale=SCALE, impl="chunked", block_size=4, is_causal=True, return_max_logits=True
    )

  f(q, k, v)
  f(q + 1.0, k, v)


def test_validation():
  q, k, v = _qkv(4)
  with pytest.raises(ValueError, match="impl"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="flash")
  with pytest.raises(ValueError, match=r"window=\(2, 0\) is supported only with impl='splash', got impl='chunked'"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="chunked", window=(2, 0))
  with pytest.raises(ValueError, match="block_size"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="chunked", block_size=0)
  with pytest.raises(ValueError, match="must divide"):
    mnn.attention(q, jnp.ones((B, 4, 3, D)), jnp.ones((B, 4, 3, DV)), softmax_scale=SCALE, impl="dense")
  with pytest.raises(ValueError, match="expected q"):
    mnn.attention(q[0], k, v, softmax_scale=SCALE, impl="dense")
  with pytest.raises(ValueError, match="inconsistent"):
    mnn.attention(q, k[..., :4], v, softmax_scale=SCALE, impl="dense")
  with pytest.raises(ValueError, match="both"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="dense", q_segment_ids=jnp.zeros((B, 4), jnp.int32))
  with pytest.raises(ValueError, match="kv_mask"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="dense", kv_mask=jnp.ones((B, 5), bool))
  with pytest.raises(ValueError, match="broadcastable"):
    mnn.attention(q, k, v, softmax_scale=SCALE, impl="chunked", mask=jnp.ones((B, 3, 4, 4), bool))


class TestRope:

  def test_matches_numpy_and_preserves_norm(self):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 3, 8)), jnp.float32)
    pos = jnp.array([[0, 1, 2, 3, 4], [7, 3, 100, 0, 2]], jnp.int32)
    y = mnn.apply_rope(x, pos, base=10000.0)
    expected = ref.rope(np.asarray(x), np.asarray(pos), 10000.0).astype(np.float32)
    chex.assert_trees_all_close(y, expected, atol=1e-5)
    chex.assert_trees_all_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)

  def test_relative_positions(self):
    """<R_m q, R_n k> depends only on m - n (RoFormer Sec. 3.4)."""
    q, k = jnp.asarray(np.random.default_rng(2).standard_normal((2, 1, 1, 1, 16)), jnp.float32)
    yarn = mnn.YarnScaling(factor=4.0, original_max_position=64)

    def dot(m, n, **kw):
      rq = mnn.apply_rope(q, jnp.full((1, 1), m, jnp.int32), **kw)
      rk = mnn.apply_rope(k, jnp.full((1, 1), n, jnp.int32), **kw)
      return jnp.sum(rq * rk)

    for kw in ({}, dict(yarn=yarn)):
      np.testing.assert_allclose(dot(5, 2, **kw), dot(103, 100, **kw), rtol=1e-4, atol=1e-5)

  def test_yarn_frequencies(self):
    dim, base = 64, 10000.0
    plain = mnn.rope_frequencies(dim, base=base)
    yarn = mnn.YarnScaling(factor=40.0, original_max_position=4096)
    scaled = mnn.rope_frequencies(dim, base=base, yarn=yarn)
    expected = ref.rope_frequencies(dim, base, dict(factor=40.0, original_max_position=4096))
    np.testing.assert_allclose(scaled, expected)
    np.testing.assert_allclose(scaled[:4], plain[:4])  # fast dimensions kept
    np.testing.assert_allclose(scaled[-4:], plain[-4:] / 40.0)  # slow ones interpolated
    assert np.all(scaled <= plain + 1e-15)
    np.testing.assert_allclose(mnn.rope_frequencies(dim, yarn=mnn.YarnScaling(1.0, 4096)), plain)

  def test_softmax_scale(self):
    assert mnn.softmax_scale(192) == pytest.approx(192**-0.5)
    assert mnn.yarn_mscale(1.0) == 1.0
    m = 0.1 * math.log(40.0) + 1.0
    assert mnn.yarn_mscale(40.0) == pytest.approx(m)
    assert mnn.softmax_scale(192, mnn.YarnScaling(40.0, 4096)) == pytest.approx(192**-0.5 * m * m)
    assert mnn.softmax_scale(192, mnn.YarnScaling(40.0, 4096)) == pytest.approx(
        ref.yarn_softmax_scale(192, dict(factor=40.0, original_max_position=4096)))

  def test_validation(self):
    with pytest.raises(ValueError, match="factor"):
      mnn.YarnScaling(factor=0.5, original_max_position=10)
    with pytest.raises(ValueError, match="even"):
      mnn.rope_frequencies(7)
    with pytest.raises(ValueError, match="positions"):
      mnn.apply_rope(jnp.ones((1, 3, 1, 4)), jnp.zeros((1, 2), jnp.int32))


class VariantsTest(chex.TestCase):
  """jit and no-jit give the same results (chex variants)."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("dense", "dense"), ("chunked", "chunked"))
  def test_variants(self, impl):
    q, k, v = _qkv(6)
    fn = self.variant(functools.partial(
        mnn.attention, softmax_scale=SCALE, impl=impl, block_size=4, is_causal=True,
        return_max_logits=True,
    ))
    out, m = fn(q, k, v)
    ref_out, ref_max = _reference(q, k, v, dict(is_causal=True))
    chex.assert_trees_all_close(out, ref_out.astype(np.float32), atol=1e-5)
    chex.assert_trees_all_close(m, ref_max.astype(np.float32), atol=1e-5)
