"""``impl="splash"``: tokamax's TPU splash-attention kernel with the max-logit capture.

Splash attention (Pallas Mosaic TPU, from tokamax; MaxText's TPU attention) is an
online-softmax kernel. Built with ``save_residuals=True`` it returns, per head and
query row, the running maximum ``m_hi`` of its softmax inputs (``stats["max_logits"]``,
in natural units). With queries pre-scaled by ``softmax_scale`` that is
``max_j s_hij`` over the row's visible keys, the quantity QK-Clip needs (Kimi K2,
arXiv 2507.20534, Sec. 2.1); the capture is a reduction of ``m`` over batch and rows
and costs no second ``Q K^T`` pass. Conversions (``_impl.residual_max``): a row with no
visible key reports splash's finite mask value, which becomes ``-inf``.

How our contract maps onto the kernel (read from tokamax 0.0.12 and 0.0.17, and
checked against ``dense_attention`` in interpret mode by tests/test_splash.py):

* layout: ``(B, T, H, D)`` -> splash's ``(H, T, D)``, ``jax.vmap`` over the batch;
  GQA/MQA and MLA widths (``Dv != Dqk``) are native (query head ``h`` reads kv head
  ``h // (H // Hkv)``, as ours).
* lengths are padded to the kernel's blocks (multiples of 128, the TPU lane width);
  padded keys are masked through segment ids, padded queries dropped.
* ``is_causal`` (bottom-right aligned) and ``window`` are splash's static ``CausalMask`` /
  ``LocalMask`` with ``offset = Tk - Tq``; ``q_segment_ids``/``kv_segment_ids`` are its
  segment ids; ``q_mask``/``kv_mask`` become segment ids below every real one.
  An explicit traced ``(B, H, Tq, Tk)`` ``mask`` is not expressible: ValueError.
* a row without a visible key returns zeros (splash returns a mean of masked values);
  a static mask (``is_causal`` with ``Tq > Tk``, a ``window`` with cross lengths) that leaves
  a row, padded rows included, without any key is refused (ValueError).
* ``logits_soft_cap``: splash applies ``c * tanh(s / c)`` before its running maximum, so
  its max logit is the capped one and the pre-cap maximum QK-Clip bounds cannot be
  recovered reliably (``tanh`` saturates); ``logits_soft_cap`` with
  ``return_max_logits=True`` raises ValueError. Without capture it is supported.

On a CPU backend the kernel runs in Pallas interpret mode (slow; for tests), on TPU as
Mosaic. Needs the optional extra ``pip install 'muonclip_jax[tokamax]'``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._util import check_bool
from .masking import check_and_prepare, head_max
from .residual_max import row_max_from_residual
from . import tokamax_adapter

LANES = 128  # splash's block sizes must be multiples of the TPU lane width


def _default_interpret(backend: str) -> bool:
  if backend == "tpu":
    return False
  if backend == "cpu":
    return True
  raise ValueError(
      f"attention(impl='splash'): splash is a TPU kernel (interpreted on the CPU for tests); on the "
      f"'{backend}' backend use impl='auto', 'tokamax_gpu', 'chunked' or 'dpa_max'"
  )


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _block(block_size: int, t: int) -> int:
  return min(_round_up(max(block_size, 1), LANES), _round_up(t, LANES))


def _static_mask(mask_lib, shape, *, is_causal: bool, window, offset: int):
  if window is not None:
    left, right = window
    if is_causal:
      right = 0 if right is None else min(right, 0)
    return mask_lib.LocalMask(shape, window_size=(left, right), offset=offset)
  if is_causal:
    return mask_lib.CausalMask(shape, offset=offset)
  return mask_lib.FullMask(shape)


def _first_static_empty_row(tq_p, tk_p, *, is_causal: bool, window, offset: int) -> int | None:
  """First (padded) query row the static mask leaves without keys, or None.

  Row ``i`` sees keys ``i + offset - left <= j <= i + offset + right`` within
  ``[0, tk_p)`` (``right <= 0`` under ``is_causal``). A row with none would leave splash's
  skipped blocks uninitialized (NaN in the backward pass), so such shapes are refused.
  """
  left, right = window if window is not None else (None, None)
  if is_causal:
    right = 0 if right is None else min(right, 0)
  i = np.arange(tq_p)
  lo = np.zeros(tq_p, np.int64) if left is None else np.maximum(i + offset - left, 0)
  hi = np.full(tq_p, tk_p - 1) if right is None else np.minimum(i + offset + right, tk_p - 1)
  bad = np.nonzero(lo > hi)[0]
  return int(bad[0]) if bad.size else None


def _segment_ids(b, tq, tk, tq_p, tk_p, q_segment_ids, kv_segment_ids, q_mask, kv_mask):
  """``(B, Tq_p)``, ``(B, Tk_p)`` int32 ids, or None when nothing needs them.

  Padding (``q_mask``/``kv_mask`` False, or a position past the true length) moves a
  query to id ``low`` and a key to ``low - 1``, with ``low`` below every real id: such a
  query sees no key and such a key is seen by no query.
  """
  if q_segment_ids is None and q_mask is None and kv_mask is None and tk_p == tk:
    return None
  sq = jnp.zeros((b, tq), jnp.int32) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
  sk = jnp.zeros((b, tk), jnp.int32) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
  low = jnp.minimum(jnp.min(sq), jnp.min(sk)) - 1
  if q_mask is not None:
    sq = jnp.where(q_mask, sq, low)
  if kv_mask is not None:
    sk = jnp.where(kv_mask, sk, low - 1)
  sq = jnp.pad(sq, ((0, 0), (0, tq_p - tq)), constant_values=0)
  sq = jnp.where(jnp.arange(tq_p) < tq, sq, low)
  sk = jnp.pad(sk, ((0, 0), (0, tk_p - tk)), constant_values=0)
  sk = jnp.where(jnp.arange(tk_p) < tk, sk, low - 1)
  return sq, sk


def splash_attention(
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
    window: tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    return_max_logits: bool = False,
    block_size: int = 512,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Attention through tokamax's splash kernel; same contract as ``dense_attention``.

  Args:
    window: static ``(left, right)``: query ``i`` sees key ``j`` only if
      ``i + Tk - Tq - left <= j <= i + Tk - Tq + right`` (None: unbounded on that side);
      combined with ``is_causal``.
    logits_soft_cap: static ``c``: logits become ``c * tanh(s / c)`` (Gemma 2). Not with
      ``return_max_logits=True`` (ValueError, see the module doc).
    block_size: static; query/key blocks are ``block_size`` rounded up to a multiple of
      128, at most the padded length.
    interpret: static; None = Mosaic on TPU, interpret mode on CPU, ValueError elsewhere.
    (the others as ``dense_attention``; ``mask`` must be None)

  Returns:
    ``(out (B, Tq, H, Dv), max_logits (H,) float32 or None)``.

  Reverse-mode differentiable (``grad``, ``vjp``: a custom VJP around tokamax's), not
  forward mode (``jvp``).

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = k = v = jnp.linspace(-1.0, 1.0, 1 * 8 * 2 * 8).reshape(1, 8, 2, 8)
    >>> out, m = attention(q, k, v, softmax_scale=0.35, impl="splash", is_causal=True,
    ...                    return_max_logits=True)  # on the CPU: Pallas interpret mode
    >>> ref, ref_m = attention(q, k, v, softmax_scale=0.35, impl="dense", is_causal=True, return_max_logits=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5)), bool(jnp.allclose(m, ref_m))
    ((1, 8, 2, 8), True, True)
  """
  if mask is not None:
    raise ValueError(
        "attention(impl='splash'): an explicit boolean `mask` (B, H, Tq, Tk) array is not supported "
        "(splash's masks are static); use is_causal / window / segment ids / q_mask / kv_mask, "
        "or impl='dense', 'chunked' or 'dpa_max'"
    )
  if logits_soft_cap is not None and return_max_logits:
    raise ValueError(
        "attention(impl='splash'): logits_soft_cap with return_max_logits=True: splash takes its "
        "running maximum after the cap, so it cannot report the pre-cap max logit QK-Clip "
        "bounds; use impl='dense' or 'chunked' for capped attention with capture"
    )
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"attention(impl='splash'): logits_soft_cap must be > 0, got {logits_soft_cap!r}")
  if window is not None and (len(window) != 2 or any(w is not None and w < 0 for w in window)):
    raise ValueError(f"attention(impl='splash'): window must be (left, right) of ints >= 0 or None, got {window!r}")
  q_side, k_side = check_and_prepare(
      q, k, v, mask=None, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="attention(impl='splash')",
      is_causal=is_causal, return_max_logits=return_max_logits,
  )
  b, tq, h, _ = q.shape
  tk = k.shape[1]
  check_bool("splash_attention: interpret", interpret, allow_none=True)
  if interpret is None:
    interpret = _default_interpret(jax.default_backend())
  kernel_lib, mask_lib, base = tokamax_adapter.splash_modules("impl='splash'")
  bq, bkv = _block(block_size, tq), _block(block_size, tk)
  tq_p, tk_p = _round_up(tq, bq), _round_up(tk, bkv)
  empty = _first_static_empty_row(tq_p, tk_p, is_causal=bool(is_causal), window=window, offset=tk - tq)
  if empty is not None:
    what = f"causal with Tq {tq} > Tk {tk}" if is_causal and tq > tk else f"window={window!r}"
    raise ValueError(
        f"attention(impl='splash'): {what} leaves query row {empty} (of {tq}, padded to {tq_p}) without "
        "any key in the static mask, which splash does not support; use impl='chunked'"
    )
  static_mask = _static_mask(mask_lib, (tq_p, tk_p), is_causal=bool(is_causal), window=window,
                             offset=tk - tq)
  config = kernel_lib.SplashConfig(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
      block_kv_dkv_compute=bkv, attn_logits_soft_cap=logits_soft_cap, interpret=bool(interpret),
  )
  kernel = kernel_lib.make_splash_mha_single_device(static_mask, config=config, save_residuals=True)
  ids = _segment_ids(b, tq, tk, tq_p, tk_p, q_side.segment_ids, k_side.segment_ids,
                     q_side.mask, k_side.mask)

  out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  qs = (q * jnp.asarray(softmax_scale, jnp.float32)).astype(q.dtype)
  pad = lambda x, t: jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0), (0, 0)))
  qh, kh, vh = (jnp.swapaxes(pad(x, t), 1, 2) for x, t in ((qs, tq_p), (k, tk_p), (v, tk_p)))

  if ids is None:
    fn = lambda q, k, v: jax.vmap(lambda q, k, v: kernel(q, k, v))(q, k, v)
    out, stats = tokamax_adapter.allowing_rank_promotion(fn)(qh, kh, vh)
  else:
    run = lambda q, k, v, sq, sk: kernel(q, k, v, segment_ids=base.SegmentIds(q=sq, kv=sk))
    fn = lambda q, k, v: jax.vmap(run)(q, k, v, *ids)
    out, stats = tokamax_adapter.allowing_rank_promotion(fn)(qh, kh, vh)
  row_max = row_max_from_residual(stats["max_logits"][:, :, :tq])  # (B, H, Tq)
  visible = ~jnp.isneginf(row_max)
  out = jnp.where(visible[..., None], out[:, :, :tq], 0)
  out = jnp.swapaxes(out, 1, 2).astype(out_dtype)
  return out, (head_max(row_max, head_axis=1) if return_max_logits else None)
