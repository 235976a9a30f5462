"""Shared cases for the accelerator attention tests: every impl against ``impl="dense"``.

Small shapes on purpose: ``"splash"`` runs in Pallas interpret mode on the CPU. Lengths
(37, 20) are not multiples of the 16-token tiles; head widths 24 (q/k) and 16 (v) are a
small analogue of MLA's 192/128; 4 query heads share 2 key/value heads (GQA).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from muonclip_jax import nn as mnn

B, H, HKV, D, DV = 2, 4, 2, 24, 16
SCALE = 0.3
BLOCK = 16


def qkv(tq, tk=None, *, h=H, hkv=HKV, d=D, dv=DV, seed=0, dtype=jnp.float32):
  tk = tq if tk is None else tk
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, tq, h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((B, tk, hkv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((B, tk, hkv, dv)), dtype)
  return q, k, v


def masks(kind: str, tq: int, tk: int) -> dict:
  """Keyword masks of ``attention``; batch row 1 is the one with padding / two segments."""
  kv_mask = jnp.asarray(np.arange(tk)[None, :] < np.array([[tk], [tk - 5]]))
  q_mask = jnp.asarray(np.arange(tq)[None, :] < np.array([[tq], [tq - 3]]))
  seg_q = jnp.asarray((np.arange(tq)[None, :] >= np.array([[tq + 1], [tq // 2]])).astype(np.int32))
  seg_k = jnp.asarray((np.arange(tk)[None, :] >= np.array([[tk + 1], [tk // 2]])).astype(np.int32))
  segments = dict(q_segment_ids=seg_q, kv_segment_ids=seg_k)
  padding = dict(q_mask=q_mask, kv_mask=kv_mask)
  return {
      "none": {},
      "causal": dict(is_causal=True),
      "segments": dict(is_causal=True, **segments),
      "padding": dict(is_causal=True, **padding),
      "all": dict(is_causal=True, **segments, **padding),
      "bidirectional_padding": dict(**segments, **padding),
  }[kind]


@functools.partial(jax.jit, static_argnames=("impl", "is_causal", "block"))
def _run(q, k, v, arrays, *, impl, is_causal, block):
  def loss(q, k, v):
    out, m = mnn.attention(
        q, k, v, softmax_scale=SCALE, impl=impl, block_size=block, is_causal=is_causal,
        return_max_logits=True, **arrays,
    )
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    return jnp.sum(out.astype(jnp.float32) * w), (out, m)

  return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def value_and_grad(q, k, v, kw: dict, impl: str, block: int = BLOCK):
  """``((loss, (out, max_logits)), (dq, dk, dv))`` of a fixed weighted sum of the output."""
  kw = dict(kw)
  is_causal = kw.pop("is_causal", False)
  return _run(q, k, v, kw, impl=impl, is_causal=is_causal, block=block)


def assert_matches_dense(q, k, v, kw: dict, impl: str, block: int = BLOCK) -> None:
  """Outputs, gradients of q, k, v and maxima equal ``impl="dense"``'s.

  float32: 1e-5. bfloat16: outputs and gradients to a few bf16 roundings (both round
  the probabilities to bf16 before ``P V``, at different points); the maxima are float32
  products of the same bf16 inputs, so 1e-5 still.
  """
  (_, (out, m)), grads = value_and_grad(q, k, v, kw, impl, block)
  (_, (out_d, m_d)), grads_d = value_and_grad(q, k, v, kw, "dense")
  tol = 1e-5 if q.dtype == jnp.float32 else 2e-2
  assert out.dtype == out_d.dtype and m.dtype == jnp.float32 and m.shape == (q.shape[2],)
  chex.assert_trees_all_close(out, out_d, atol=tol, rtol=tol)
  for g, g_d in zip(grads, grads_d, strict=True):
    assert g.dtype == g_d.dtype and np.isfinite(np.asarray(g, np.float32)).all()
    chex.assert_trees_all_close(g.astype(jnp.float32), g_d.astype(jnp.float32), atol=tol, rtol=tol)
  chex.assert_trees_all_close(m, m_d, atol=1e-5, rtol=1e-5)
