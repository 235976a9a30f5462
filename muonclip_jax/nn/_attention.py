"""Scaled dot-product attention that can report each head's largest logit.

QK-Clip (Kimi K2, arXiv 2507.20534, Sec. 2.1) needs, for every head ``h``,

  S_max^h = max over batch b, query i, key j with (i, j) unmasked of  s_{b,h,i,j},
  s_{b,h,i,j} = softmax_scale * <q_{b,i,h}, k_{b,j,g(h)}>,

the exact number that enters the softmax. Two implementations share one contract:

* ``dense_attention`` materializes ``s`` (``O(Tq * Tk)`` memory); it is the reference.
* ``chunked_attention`` is an online-softmax ("flash", Dao et al. arXiv 2205.14135,
  Alg. 1; Rabe & Staats arXiv 2112.05682) pass over key blocks of ``block_size``:
  ``O(Tq * block_size)`` logits at a time, forward and backward (a custom VJP that
  recomputes each block's logits, Alg. 2 of Dao et al.). Its running row maximum
  ``m_i = max_j s_{ij}`` is exactly the row's max logit, so the capture is one extra
  reduction of ``m`` over batch and queries; no second pass over ``Q K^T``. (The
  log-sum-exp is not the max: ``max <= LSE <= max + log Tk``.)

Accelerator implementations with the same contract live in their own modules:
``_flash_pallas`` (a fused Pallas kernel) and ``_max_pass`` (``jax.nn.dot_product_attention``
plus a max-only pass); ``attention(impl=...)`` chooses among all four.

Grouped-query attention: ``q`` has ``H`` heads, ``k``/``v`` have ``Hkv`` heads with
``H % Hkv == 0``; query head ``h`` reads key/value head ``g(h) = h // (H // Hkv)``.
Multi-head latent attention passes its per-head keys with ``Hkv == H``.

Masking: a pair ``(i, j)`` of batch row ``b`` is attended iff all given conditions hold:
``causal``: ``j <= i + Tk - Tq`` (bottom-right aligned; ``j <= i`` for self-attention);
segments: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``; padding: ``q_mask[b, i]`` and
``kv_mask[b, j]``; an explicit boolean ``mask[b, h, i, j]`` (broadcastable to
``(B, H, Tq, Tk)``, True = attend, Flax's convention). Masked pairs never count toward
the maximum; a head without any unmasked pair reports ``-inf``. A query row without any
unmasked key returns zeros (no NaN) and gets zero gradient.

Numerics: logits, softmax statistics and accumulation are float32 whatever the input
dtype (bf16 inputs feed the matmuls directly with float32 accumulation); the output has
the inputs' result dtype and the maxima are always float32 under ``stop_gradient``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from ._soft_cap import check_soft_cap, soft_cap

AttentionImpl = Literal["auto", "dense", "chunked", "pallas", "dpa_max", "splash", "tokamax_gpu"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "dense", "chunked", "pallas", "dpa_max", "splash", "tokamax_gpu")


class _QuerySide(NamedTuple):
  segment_ids: jax.Array | None  # (B, Tq) int
  mask: jax.Array | None  # (B, Tq) bool


class _KeySide(NamedTuple):
  segment_ids: jax.Array | None  # (B, Tk) int, or (nb, B, bk) when blocked
  mask: jax.Array | None  # (B, Tk) bool, or (nb, B, bk) when blocked
  pair_mask: jax.Array | None  # (Bm, Hkv|1, G|1, Tq, Tk) bool, or (nb, ..., bk) when blocked


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable, trace-time configuration of one attention call."""

  softmax_scale: float
  causal: bool
  tq: int
  tk: int  # true key length (before padding to a multiple of the block)
  block: int  # key block length (== tk for dense)
  padded: bool  # whether key positions >= tk exist and must be masked


def _check_and_prepare(q, k, v, *, mask, q_segment_ids, kv_segment_ids, q_mask, kv_mask, name):
  """Validates shapes and returns ``(_QuerySide, _KeySide)`` with a 5-D pair mask."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"{name}: expected q (B, Tq, H, D), k (B, Tk, Hkv, D), v (B, Tk, Hkv, Dv), "
        f"got {q.shape}, {k.shape}, {v.shape}"
    )
  b, tq, h, d = q.shape
  _, tk, hkv, _ = k.shape
  if k.shape[0] != b or v.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
    raise ValueError(
        f"{name}: inconsistent shapes q {q.shape}, k {k.shape}, v {v.shape}: need "
        "equal batch, equal q/k head width, equal k/v batch, length and heads"
    )
  if h % hkv:
    raise ValueError(f"{name}: key/value heads {hkv} must divide query heads {h}")
  if tq == 0 or tk == 0:
    raise ValueError(f"{name}: empty sequence: q {q.shape}, k {k.shape}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError(f"{name}: give both q_segment_ids and kv_segment_ids, or neither")
  for arg, shape, label in (
      (q_segment_ids, (b, tq), "q_segment_ids"),
      (kv_segment_ids, (b, tk), "kv_segment_ids"),
      (q_mask, (b, tq), "q_mask"),
      (kv_mask, (b, tk), "kv_mask"),
  ):
    if arg is not None and tuple(arg.shape) != shape:
      raise ValueError(f"{name}: {label} must have shape {shape}, got {tuple(arg.shape)}")
  pair_mask = None
  if mask is not None:
    full = (b, h, tq, tk)
    if mask.ndim != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full, strict=True)):
      raise ValueError(
          f"{name}: mask must be broadcastable to {full} (B, H, Tq, Tk), got {mask.shape}"
      )
    mb, mh = mask.shape[:2]
    mask = jnp.broadcast_to(mask.astype(bool), (mb, mh, tq, tk))
    g = h // hkv
    pair_mask = mask.reshape(mb, hkv, g, tq, tk) if mh == h else mask.reshape(mb, 1, 1, tq, tk)
  q_side = _QuerySide(q_segment_ids, None if q_mask is None else q_mask.astype(bool))
  k_side = _KeySide(kv_segment_ids, None if kv_mask is None else kv_mask.astype(bool), pair_mask)
  return q_side, k_side


def _allowed(cfg: _Static, q_side: _QuerySide, k_side: _KeySide, k_start) -> jax.Array | None:
  """Boolean ``(B|1, Hkv|1, G|1, Tq, bk)`` mask of one key block starting at ``k_start``."""
  parts = []
  k_idx = k_start + jnp.arange(cfg.block, dtype=jnp.int32)
  if cfg.causal:
    q_idx = jnp.arange(cfg.tq, dtype=jnp.int32) + (cfg.tk - cfg.tq)
    parts.append((k_idx[None, :] <= q_idx[:, None])[None, None, None])
  if cfg.padded:
    parts.append((k_idx < cfg.tk)[None, None, None, None, :])
  if q_side.segment_ids is not None:
    same = q_side.segment_ids[:, :, None] == k_side.segment_ids[:, None, :]
    parts.append(same[:, None, None])
  if q_side.mask is not None:
    parts.append(q_side.mask[:, None, None, :, None])
  if k_side.mask is not None:
    parts.append(k_side.mask[:, None, None, None, :])
  if k_side.pair_mask is not None:
    parts.append(k_side.pair_mask)
  if not parts:
    return None
  out = parts[0]
  for p in parts[1:]:
    out = out & p
  return out


def _scores(cfg: _Static, qg, k_blk, q_side, k_side_blk, k_start) -> jax.Array:
  """Masked scaled logits ``(B, Hkv, G, Tq, bk)`` in float32; masked pairs are ``-inf``."""
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk, preferred_element_type=jnp.float32)
  s = s * jnp.float32(cfg.softmax_scale)
  allowed = _allowed(cfg, q_side, k_side_blk, k_start)
  if allowed is not None:
    s = jnp.where(allowed, s, -jnp.inf)
  return s


def _safe_shift(m: jax.Array) -> jax.Array:
  """Row maxima with ``-inf`` (no unmasked key yet) replaced by 0, for ``exp(s - shift)``."""
  return jnp.where(jnp.isneginf(m), jnp.float32(0.0), m)


def _head_max(row_max: jax.Array) -> jax.Array:
  """``(B, Hkv, G, Tq)`` row maxima -> ``(H,)`` float32 per-head maxima, no gradient."""
  _, hkv, g, _ = row_max.shape
  return jax.lax.stop_gradient(jnp.max(row_max, axis=(0, 3)).reshape(hkv * g).astype(jnp.float32))


def _group(q: jax.Array, hkv: int) -> jax.Array:
  b, t, h, d = q.shape
  return q.reshape(b, t, hkv, h // hkv, d)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    causal: bool = False,
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
    causal: mask keys after the query (bottom-right aligned).
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
  """
  check_soft_cap(logits_soft_cap, "dense", "dense_attention")
  q_side, k_side = _check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="dense_attention",
  )
  b, tq, h, _ = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  cfg = _Static(float(softmax_scale), bool(causal), tq, tk, tk, False)
  out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  s = _scores(cfg, _group(q, hkv), k, q_side, k_side, 0)
  row_max = jnp.max(s, axis=-1)  # (B, Hkv, G, Tq)
  if return_max_logits:
    # Materialize the row maxima once, so that XLA does not fuse a second full
    # reduction over the logits into the capture (it would read Tq x Tk again).
    row_max = jax.lax.optimization_barrier(row_max)
  captured = row_max  # before the cap (see logits_soft_cap)
  if logits_soft_cap is not None:  # tanh is increasing: the capped row maximum is the cap of the maximum
    s, row_max = soft_cap(s, logits_soft_cap), soft_cap(row_max, logits_soft_cap)
  p = jnp.exp(s - jax.lax.stop_gradient(_safe_shift(row_max))[..., None])
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, jnp.float32(1.0), denom)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out.reshape(b, tq, h, dv).astype(out_dtype)
  return out, (_head_max(captured) if return_max_logits else None)


def _flash_forward(cfg: _Static, qg, kb, vb, q_side, kb_side):
  """Online softmax over key blocks; returns ``(out5, row_max, lse)``."""
  b, tq, hkv, g, _ = qg.shape
  nb, dv = kb.shape[0], vb.shape[-1]
  out_dtype = jnp.result_type(qg.dtype, kb.dtype, vb.dtype)

  def body(carry, xs):
    m, l, acc = carry
    j, k_blk, v_blk, side = xs
    s = _scores(cfg, qg, k_blk, q_side, side, j * cfg.block)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    shift = _safe_shift(m_new)
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
  lse = jnp.where(nonempty, _safe_shift(m) + jnp.log(l_safe), jnp.float32(0.0))
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
    s = _scores(cfg, qg, k_blk, q_side, side, j * cfg.block)
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


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads (``False`` for booleans) ``axis`` of ``x`` at the end to length ``size``."""
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _to_blocks(x: jax.Array | None, axis: int, nb: int, block: int) -> jax.Array | None:
  """Pads ``axis`` of ``x`` to ``nb * block`` and moves the block index to the front."""
  if x is None:
    return None
  x = _pad_axis(x, axis, nb * block)  # padded keys are masked by position
  axis = axis % x.ndim
  x = x.reshape(x.shape[:axis] + (nb, block) + x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    causal: bool = False,
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
  """
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"chunked_attention: block_size must be an int >= 1, got {block_size!r}")
  q_side, k_side = _check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="chunked_attention",
  )
  b, tq, h, _ = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  block = min(block_size, tk)
  nb = -(-tk // block)
  cfg = _Static(float(softmax_scale), bool(causal), tq, tk, block, nb * block != tk)
  kb_side = _KeySide(
      _to_blocks(k_side.segment_ids, 1, nb, block),
      _to_blocks(k_side.mask, 1, nb, block),
      _to_blocks(k_side.pair_mask, -1, nb, block),
  )
  out, row_max = _flash(
      cfg, _group(q, hkv), _to_blocks(k, 1, nb, block), _to_blocks(v, 1, nb, block), q_side, kb_side
  )
  out = out.reshape(b, tq, h, dv)
  return out, (_head_max(row_max) if return_max_logits else None)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    impl: AttentionImpl = "auto",
    block_size: int = 512,
    causal: bool = False,
    mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_mask: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    return_max_logits: bool = False,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Dispatches on ``impl``, the one place that chooses an implementation.

  * ``"dense"``: ``dense_attention``, the materialized reference.
  * ``"chunked"``: ``chunked_attention``, online softmax in ``lax.scan`` (key blocks of
    ``block_size``).
  * ``"pallas"``: ``pallas_attention``, the fused Pallas flash kernel (Triton on GPU,
    interpret mode on the CPU, an error on TPU); tiles of ``min(block_size, 64)`` rounded down to a power of
    two. Does not take the explicit ``mask`` (``ValueError``).
  * ``"dpa_max"``: ``dpa_max_attention``, ``jax.nn.dot_product_attention`` (cuDNN where
    it applies) plus a max-only pass over key blocks of ``block_size``.

  * ``"splash"``: ``splash_attention``, tokamax's TPU splash kernel (interpret mode on the
    CPU); no explicit ``mask``. Needs the ``tokamax`` extra.
  * ``"tokamax_gpu"``: ``tokamax_gpu_attention``, tokamax's maintained GPU flash kernels
    (Mosaic GPU on SM90/SM100, else Triton; its XLA op on the CPU). Needs ``tokamax``.
  * ``"auto"`` (default): ``resolve_impl`` picks one of the above from the backend and
    the masks (splash on TPU, ``tokamax_gpu`` on GPU, ``dense`` on CPU), logging any
    fallback.

  See ``dense_attention`` for the arguments and outputs, which all share.
  ``logits_soft_cap`` (``cap * tanh(s / cap)`` before the softmax; the maxima stay those of
  the logits before the cap) is supported by ``"dense"``, and by ``"splash"`` without
  ``return_max_logits`` (splash keeps only the capped maximum); any other ``impl`` with a
  cap raises ValueError, and ``"auto"`` then falls back to ``"dense"`` with a log line.
  """
  if impl == "auto":
    from ._auto import resolve_impl

    impl = resolve_impl(q, k, v, mask=mask, causal=causal, logits_soft_cap=logits_soft_cap,
                        return_max_logits=return_max_logits)
  check_soft_cap(logits_soft_cap, impl if impl in ATTENTION_IMPLS else "dense", "attention")
  kwargs = dict(
      softmax_scale=softmax_scale, causal=causal, mask=mask, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_mask=q_mask, kv_mask=kv_mask,
      return_max_logits=return_max_logits,
  )
  if impl == "dense":
    return dense_attention(q, k, v, logits_soft_cap=logits_soft_cap, **kwargs)
  if impl == "chunked":
    return chunked_attention(q, k, v, block_size=block_size, **kwargs)
  # Imported here: both modules build on this one's helpers.
  if impl == "pallas":
    from ._flash_pallas import pallas_attention

    return pallas_attention(q, k, v, block_size=block_size, **kwargs)
  if impl == "dpa_max":
    from ._max_pass import dpa_max_attention

    return dpa_max_attention(q, k, v, block_size=block_size, **kwargs)
  if impl == "splash":
    from ._splash import splash_attention

    return splash_attention(q, k, v, block_size=block_size, logits_soft_cap=logits_soft_cap, **kwargs)
  if impl == "tokamax_gpu":
    from ._tokamax_gpu import tokamax_gpu_attention

    return tokamax_gpu_attention(q, k, v, **kwargs)
  raise ValueError(f"attention: impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
