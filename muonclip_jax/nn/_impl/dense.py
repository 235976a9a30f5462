"""``impl="dense"``: attention over the materialized logit matrix, the reference.

``out_i = sum_j softmax_j(s_ij) v_j`` over the unmasked keys ``j`` of query ``i``, with

  s_{b,h,i,j} = softmax_scale * <q_{b,i,h}, k_{b,j,g(h)}>,   g(h) = h // (H // Hkv),

the number that enters the softmax; QK-Clip (Kimi K2, arXiv 2507.20534, Sec. 2.1) needs its
maximum per head over batch, queries and unmasked keys. The row maximum that stabilizes
the softmax is that maximum per row, so the capture is one more reduction. Memory is
``O(Tq * Tk)``; ``chunked_attention`` computes the same without materializing ``s``.
Masks as in ``_impl.masking``.

Numerics: logits, softmax statistics and accumulation are float32 whatever the input
dtype (bf16 inputs feed the matmuls directly with float32 accumulation); the output has
the inputs' result dtype and the maxima are always float32 under ``stop_gradient``. A
query row without any unmasked key returns zeros (no NaN) and gets zero gradient; a head
without any unmasked pair reports ``-inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .masking import check_and_prepare, group, grouped_head_max, safe_shift, scores, Static
from .soft_cap import check_soft_cap, soft_cap


def dense_attention(
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
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Reference attention over the materialized logit matrix.

  ``out_i = sum_j softmax_j(s_ij) v_j`` over unmasked ``j`` with ``s`` as in the module
  docstring. The row maximum used to stabilize the softmax is reused for the capture.

  Args:
    q: queries ``(B, Tq, H, Dqk)``.
    k: keys ``(B, Tk, Hkv, Dqk)``, ``H % Hkv == 0``.
    v: values ``(B, Tk, Hkv, Dv)``.
    softmax_scale: the factor applied to ``q . k`` (static Python float).
    is_causal: mask keys after the query (bottom-right aligned); a bool, as
      ``return_max_logits`` (TypeError otherwise: ``"False"`` is truthy).
    mask: optional boolean mask broadcastable to ``(B, H, Tq, Tk)``, True = attend.
    q_segment_ids: optional ``(B, Tq)`` ints; with ``kv_segment_ids`` ``(B, Tk)``,
      only equal segments attend (packed sequences).
    kv_segment_ids: see ``q_segment_ids``.
    q_mask: optional ``(B, Tq)`` bool, False for padded queries (their rows are masked).
    kv_mask: optional ``(B, Tk)`` bool, False for padded keys.
    return_max_logits: static; also return the per-head maxima (else ``None``).
    logits_soft_cap: static None or positive number ``cap``: the softmax reads
      ``cap * tanh(s / cap)`` (Gemma 2). ``max_logits`` is still the maximum of ``s``
      before the cap: the cap hides the growth of ``q . k`` but does not stop it, and a
      maximum taken after it would never exceed ``cap``, so QK-Clip could not see it.

  Returns:
    ``(out, max_logits)``: ``out`` of shape ``(B, Tq, H, Dv)``; ``max_logits`` float32
    ``(H,)`` under ``stop_gradient`` or ``None``.

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = jnp.ones((1, 3, 4, 8))      # 4 query heads
    >>> k = v = jnp.ones((1, 5, 2, 8))  # 2 key/value heads: grouped-query attention
    >>> kv_mask = jnp.array([[True, True, True, False, False]])  # the last two keys are padding
    >>> out, max_logits = attention(q, k, v, softmax_scale=0.5, impl="dense", kv_mask=kv_mask,
    ...                             return_max_logits=True)
    >>> out.shape, max_logits.tolist()  # 0.5 * (q . k) = 0.5 * 8
    ((1, 3, 4, 8), [4.0, 4.0, 4.0, 4.0])
  """
  check_soft_cap(logits_soft_cap, "dense", "attention(impl='dense')")
  q_side, k_side = check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="attention(impl='dense')",
      is_causal=is_causal, return_max_logits=return_max_logits,
  )
  b, tq, h, _ = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  cfg = Static(float(softmax_scale), bool(is_causal), tq, tk, tk, False)
  out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  s = scores(cfg, group(q, hkv), k, q_side, k_side, 0)
  row_max = jnp.max(s, axis=-1)  # (B, Hkv, G, Tq)
  if return_max_logits:
    # Materialize the row maxima once, so that XLA does not fuse a second full
    # reduction over the logits into the capture (it would read Tq x Tk again).
    row_max = jax.lax.optimization_barrier(row_max)
  captured = row_max  # before the cap (see logits_soft_cap)
  if logits_soft_cap is not None:  # tanh is increasing: the capped row maximum is the cap of the maximum
    s, row_max = soft_cap(s, logits_soft_cap), soft_cap(row_max, logits_soft_cap)
  p = jnp.exp(s - jax.lax.stop_gradient(safe_shift(row_max))[..., None])
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, jnp.float32(1.0), denom)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out.reshape(b, tq, h, dv).astype(out_dtype)
  return out, (grouped_head_max(captured) if return_max_logits else None)
