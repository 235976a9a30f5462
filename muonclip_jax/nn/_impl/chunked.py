"""``impl="chunked"``: online-softmax ("flash") attention in a ``lax.scan`` over key blocks.

The pass of Dao et al. (arXiv 2205.14135, Alg. 1; Rabe & Staats arXiv 2112.05682) over
key blocks of ``block_size``: ``O(Tq * block_size)`` logits at a time, forward and
backward (a custom VJP that recomputes each block's logits, Alg. 2 of Dao et al.). Its
running row maximum ``m_i = max_j s_{ij}`` is exactly the row's max logit, so the capture
is one extra reduction of ``m`` over batch and queries; no second pass over ``Q K^T``.
(The log-sum-exp is not the max: ``max <= LSE <= max + log Tk``.)

Same contract as ``dense_attention`` (masks as in ``_impl.masking``, float32 statistics, zeros
for a row without any unmasked key).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .masking import (blocked, check_and_prepare, check_block_size, group, grouped_head_max, key_side_blocks,
                      safe_shift, scores, Static, to_blocks)


def _flash_forward(cfg: Static, qg, kb, vb, q_side, kb_side):
  """Online softmax over key blocks; returns ``(out5, row_max, lse)``."""
  b, tq, hkv, g, _ = qg.shape
  nb, dv = kb.shape[0], vb.shape[-1]
  out_dtype = jnp.result_type(qg.dtype, kb.dtype, vb.dtype)

  def body(carry, xs):
    m, l, acc = carry
    j, k_blk, v_blk, side = xs
    s = scores(cfg, qg, k_blk, q_side, side, j * cfg.block)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    shift = safe_shift(m_new)
    alpha = jnp.exp(m - shift)  # rescales the old statistics; 0 while m is -inf
    p = jnp.exp(s - shift[..., None])
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum(
        "bhgqk,bkhd->bhgqd", p.astype(vb.dtype), v_blk, preferred_element_type=jnp.float32
    )
    acc = alpha[..., None] * acc + pv
    return (m_new, l, acc), None

  stats = (b, hkv, g, tq)
  init = (
      jnp.full(stats, -jnp.inf, jnp.float32),
      jnp.zeros(stats, jnp.float32),
      jnp.zeros(stats + (dv,), jnp.float32),
  )
  xs = (jnp.arange(nb, dtype=jnp.int32), kb, vb, kb_side)
  (m, l, acc), _ = jax.lax.scan(body, init, xs)
  nonempty = l > 0.0
  l_safe = jnp.where(nonempty, l, jnp.float32(1.0))
  out = (acc / l_safe[..., None]).transpose(0, 3, 1, 2, 4).astype(out_dtype)  # (B, Tq, Hkv, G, Dv)
  lse = jnp.where(nonempty, safe_shift(m) + jnp.log(l_safe), jnp.float32(0.0))
  return out, m, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, qg, kb, vb, q_side, kb_side):
  out, m, _ = _flash_forward(cfg, qg, kb, vb, q_side, kb_side)
  return out, m


def _flash_fwd(cfg, qg, kb, vb, q_side, kb_side):
  out, m, lse = _flash_forward(cfg, qg, kb, vb, q_side, kb_side)
  return (out, m), (qg, kb, vb, q_side, kb_side, out, lse)


def _flash_bwd(cfg, res, cts):
  """Flash-attention backward (Dao et al., Alg. 2): recompute each block's logits.

  With ``P = exp(S - LSE)``, ``D_i = sum_d dO_id O_id``: ``dV = P^T dO``,
  ``dS = P * (dO V^T - D)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.
  The row-maximum output is a capture (used under ``stop_gradient``): its cotangent is
  ignored.
  """
  qg, kb, vb, q_side, kb_side, out, lse = res
  d_out, _ = cts
  do = d_out.astype(jnp.float32).transpose(0, 2, 3, 1, 4)  # (B, Hkv, G, Tq, Dv)
  delta = jnp.sum(do * out.astype(jnp.float32).transpose(0, 2, 3, 1, 4), axis=-1)
  scale = jnp.float32(cfg.softmax_scale)

  def body(dq, xs):
    j, k_blk, v_blk, side = xs
    s = scores(cfg, qg, k_blk, q_side, side, j * cfg.block)
    p = jnp.exp(s - lse[..., None])  # exact softmax probabilities of the block
    dv = jnp.einsum("bhgqk,bhgqd->bkhd", p, do)
    dp = jnp.einsum("bhgqd,bkhd->bhgqk", do, v_blk, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_blk, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=jnp.float32)
    return dq, (dk.astype(kb.dtype), dv.astype(vb.dtype))

  xs = (jnp.arange(kb.shape[0], dtype=jnp.int32), kb, vb, kb_side)
  dq, (dkb, dvb) = jax.lax.scan(body, jnp.zeros(qg.shape, jnp.float32), xs)
  return dq.astype(qg.dtype), dkb, dvb, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    is_causal: bool = False,
    mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_mask: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    return_max_logits: bool = False,
    block_size: int = 512,
) -> tuple[jax.Array, jax.Array | None]:
  """Online-softmax attention over key blocks, ``O(Tq * block_size)`` memory.

  Same arguments, outputs, gradients and maxima as ``dense_attention`` (to float
  tolerance). Keys are padded to a multiple of ``block_size`` (``min(block_size, Tk)``)
  and the padding is masked. For each block ``B_j`` (Dao et al., arXiv 2205.14135,
  Alg. 1): ``m' = max(m, rowmax(S_j))``, ``l' = e^{m - m'} l + rowsum(e^{S_j - m'})``,
  ``acc' = e^{m - m'} acc + e^{S_j - m'} V_j``; at the end ``out = acc / l`` and the
  final ``m`` is every row's max logit, reduced over batch and queries for the capture.
  The backward pass recomputes each block's logits from ``Q``, ``K`` and the saved
  log-sum-exp (custom VJP), so no ``Tq x Tk`` matrix is ever stored. Being a
  ``jax.custom_vjp``, it supports reverse-mode differentiation (``grad``, ``vjp``) but not
  forward mode (``jvp``); use ``"dense"`` for the latter.

  Args:
    block_size: static key block length (>= 1).
    (the others as in ``dense_attention``)

  Returns:
    ``(out, max_logits)`` as ``dense_attention``.

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = k = v = jnp.linspace(-1.0, 1.0, 2 * 6 * 2 * 4).reshape(2, 6, 2, 4)
    >>> out, m = attention(q, k, v, softmax_scale=0.5, impl="chunked", is_causal=True, block_size=4,
    ...                    return_max_logits=True)
    >>> ref, ref_m = attention(q, k, v, softmax_scale=0.5, impl="dense", is_causal=True, return_max_logits=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-6)), bool(jnp.allclose(m, ref_m))
    ((2, 6, 2, 4), True, True)
  """
  check_block_size(block_size, "attention(impl='chunked')")
  q_side, k_side = check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="attention(impl='chunked')",
      is_causal=is_causal, return_max_logits=return_max_logits,
  )
  b, tq, h, _ = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  cfg, nb = blocked(softmax_scale, is_causal, tq, tk, block_size)
  out, row_max = _flash(
      cfg, group(q, hkv), to_blocks(k, 1, nb, cfg.block), to_blocks(v, 1, nb, cfg.block), q_side,
      key_side_blocks(k_side, nb, cfg.block),
  )
  out = out.reshape(b, tq, h, dv)
  return out, (grouped_head_max(row_max) if return_max_logits else None)
