"""Any-backend fast path (``impl="dpa_max"``): the backend's attention plus a max-only pass.

The output (and its gradient) comes from ``jax.nn.dot_product_attention``: cuDNN flash
attention on a GPU where it applies (bf16/fp16 inputs, no mask other than causal with
``Tq == Tk``, and shapes that JAX's cuDNN checks accept at trace time), XLA everywhere
else (which materializes the ``Tq x Tk`` logits). The per-head maxima of QK-Clip (Kimi K2, arXiv
2507.20534, Sec. 2.1) come from a separate pass that computes only
``max_{b, i, j unmasked} s_{b,h,i,j}`` over key blocks: one ``Q K_j^T`` product and a max
per block, no softmax, no ``P V``, no gradient (``stop_gradient``), and
``O(B * H * Tq * block_size)`` memory.

Cost: one extra ``Q K^T`` over every key block (masked blocks are not skipped): a flash
forward and backward do about seven ``Q K^T``-sized matmuls (two forward, five backward),
so the pass adds about 1/7 of their matmul FLOPs, about 2/7 under a causal mask (which
the fused kernels halve). When to prefer it over a fused kernel (``"tokamax_gpu"``,
``"splash"``): when the backend's attention (cuDNN) is faster than the
fused kernel by more than that; when no fused kernel applies (tokamax not installed, the
CPU); for the explicit boolean ``mask``, which splash does not take;
or when the maxima are needed only on some steps (with ``return_max_logits=False`` it is
plain ``jax.nn.dot_product_attention``). A fused kernel's capture costs a store of the row
maxima, not a second ``Q K^T``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .masking import (blocked, check_and_prepare, check_block_size, dense_mask, group, grouped_head_max,
                      key_side_blocks, pad_axis, scores, Static, to_blocks)


def _max_only(cfg: Static, q, k, q_side, k_side, nb: int) -> jax.Array:
  """Per-head maxima ``(H,)`` from a scan over key blocks that keeps only a running max."""
  hkv = k.shape[2]
  qg = group(jax.lax.stop_gradient(q), hkv)
  kb = to_blocks(jax.lax.stop_gradient(k), 1, nb, cfg.block)
  kb_side = key_side_blocks(k_side, nb, cfg.block)

  def body(m, xs):
    j, k_blk, side = xs
    s = scores(cfg, qg, k_blk, q_side, side, j * cfg.block)  # (B, Hkv, G, Tq, bk)
    return jnp.maximum(m, jnp.max(s, axis=-1)), None

  init = jnp.full(qg.shape[:1] + (hkv, qg.shape[3], qg.shape[1]), -jnp.inf, jnp.float32)
  m, _ = jax.lax.scan(body, init, (jnp.arange(nb, dtype=jnp.int32), kb, kb_side))
  return grouped_head_max(m)


def _backend_attention(cfg: Static, q, k, v, q_side, k_side) -> jax.Array:
  """``jax.nn.dot_product_attention`` under this library's masking contract.

  It needs equal q/k/v dtypes and equal key/value widths: inputs are cast to their
  result dtype and the narrower width is zero-padded (zero query/key columns change no
  logit, zero value columns are cut off). Its ``is_causal`` is top-left aligned, so it
  is used only for ``Tq == Tk``; every other mask becomes one boolean ``(B, H|1, Tq, Tk)``
  mask. Rows without any unmasked key come back as zeros (the XLA implementation would
  average them).
  """
  b, tq, h, d = q.shape
  tk, dv = k.shape[1], v.shape[3]
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  width = max(d, dv)
  q, k, v = (pad_axis(x.astype(dtype), -1, width) for x in (q, k, v))
  only_causal = cfg.is_causal and all(
      x is None for x in (*q_side, *k_side)
  )
  mask = None if only_causal and tq == tk else dense_mask(cfg, q_side, k_side)
  run = functools.partial(
      jax.nn.dot_product_attention, q, k, v, mask=mask, scale=cfg.softmax_scale,
      is_causal=mask is None and cfg.is_causal,
  )
  out = None
  if jax.default_backend() == "gpu" and mask is None and dtype in (jnp.bfloat16, jnp.float16):
    try:  # jax checks cuDNN's support (version, widths, lengths) at trace time
      out = run(implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError):
      out = None  # not supported for these shapes here: XLA below
  if out is None:
    out = run(implementation=None)  # XLA
  out = out[..., :dv]
  if mask is not None:
    row_any = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # (B|1, Tq, H|1, 1)
    out = jnp.where(row_any, out, jnp.zeros((), out.dtype))
  return out


def dpa_max_attention(
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
  """``jax.nn.dot_product_attention`` output plus max-only per-head maxima.

  Same arguments, outputs, gradients and maxima as ``dense_attention`` (to float
  tolerance; the maxima are the same float32 products as ``"chunked"``'s).

  Args:
    block_size: key block length of the max-only pass (``O(B H Tq block_size)`` memory).
    (the others as in ``dense_attention``)

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = jnp.linspace(-1.0, 1.0, 1 * 5 * 4 * 8).reshape(1, 5, 4, 8)  # 4 query heads
    >>> k = v = jnp.cos(jnp.arange(1 * 7 * 2 * 8.0)).reshape(1, 7, 2, 8)  # 2 key/value heads
    >>> pad = jnp.arange(7)[None, :] < 6  # the last key is padding
    >>> out, m = attention(q, k, v, softmax_scale=0.35, impl="dpa_max", kv_mask=pad, block_size=4,
    ...                    return_max_logits=True)
    >>> ref, ref_m = attention(q, k, v, softmax_scale=0.35, impl="dense", kv_mask=pad, return_max_logits=True)
    >>> m.shape, bool(jnp.allclose(out, ref, atol=1e-6)), bool(jnp.allclose(m, ref_m))
    ((4,), True, True)
    >>> attention(q, k, v, softmax_scale=0.35, impl="dpa_max")[1] is None  # no capture: no extra pass
    True
  """
  check_block_size(block_size, "attention(impl='dpa_max')")
  q_side, k_side = check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="attention(impl='dpa_max')",
      is_causal=is_causal, return_max_logits=return_max_logits,
  )
  tq, tk = q.shape[1], k.shape[1]
  whole = Static(float(softmax_scale), bool(is_causal), tq, tk, tk, False)
  out = _backend_attention(whole, q, k, v, q_side, k_side)
  if not return_max_logits:
    return out, None
  cfg, nb = blocked(softmax_scale, is_causal, tq, tk, block_size)
  return out, _max_only(cfg, q, k, q_side, k_side, nb)
