"""The Pallas kernels behind ``pallas_attention``: flash forward with capture, dQ, dK/dV.

One forward kernel computes the online softmax of Dao et al. (arXiv 2205.14135, Alg. 1;
FlashAttention-2, arXiv 2307.08691, Sec. 3.1) per ``(query tile, batch, head)`` program:
for each key tile ``j``, ``m' = max(m, rowmax(S_j))``, ``l' = e^{m - m'} l +
rowsum(e^{S_j - m'})``, ``acc' = e^{m - m'} acc + e^{S_j - m'} V_j``. Its final running
row maximum ``m`` is exactly the row's max logit (masked pairs are ``-inf`` and never
count). With capture on, the kernel also writes ``m`` ``(B, H, Tq)``.

The backward pass (``flash``'s custom VJP, Dao et al. Alg. 2) is two kernels that
recompute each tile's logits from ``Q``, ``K`` and the saved log-sum-exp: one accumulates
``dQ`` over key tiles, one accumulates ``dK``, ``dV`` over query tiles and, for GQA, over
the ``G`` query heads that share the key/value head.

The kernels are written for Pallas Triton (``jax.experimental.pallas.triton``): tiles are
powers of two of at least 16 and the inputs arrive padded to whole tiles
(``pallas_attention`` pads them); padded keys are masked by position. The tile caps are
not tuned.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._masking import safe_shift

MIN_TILE = 16  # Triton's smallest dot operand dimension
MAX_TILE = 64  # forward tile cap (not tuned)
MAX_BWD_TILE = 32  # backward tile cap: two float32 accumulators per program


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static configuration of one kernel call (hashable: a ``nondiff_argnums`` entry)."""

  scale: float
  is_causal: bool
  tq: int  # true query length
  tk: int  # true key length
  bq: int  # query tile
  bk: int  # key tile
  groups: int  # G = H // Hkv
  segments: bool
  q_valid: bool
  kv_valid: bool
  capture: bool
  interpret: bool

  @property
  def offset(self) -> int:  # causal: query i sees keys j <= i + offset
    return self.tk - self.tq


def pow2_at_least(n: int) -> int:
  return max(MIN_TILE, 1 << (max(n, 1) - 1).bit_length())


def tile(block_size: int, length: int) -> int:
  """Largest power of two <= ``min(block_size, 64)``, >= 16, no longer than needed."""
  cap = max(MIN_TILE, 1 << (min(block_size, MAX_TILE).bit_length() - 1))
  return min(cap, pow2_at_least(length))


def _dot(a, b, contract=(1, 1)):
  """``a b^T`` (``contract=(1, 1)``), ``a b`` (``(1, 0)``) or ``a^T b`` (``(0, 0)``) in float32.

  ``contract`` names the contracted dimension of ``a`` and of ``b``. Float32 inputs ask
  for IEEE products (Triton would use TF32 by default).
  """
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(
      a, b, (((contract[0],), (contract[1],)), ((), ())),
      precision=precision, preferred_element_type=jnp.float32,
  )


def _block_mask(cfg: KernelConfig, q_start, k_start, qseg, kseg, qval, kval):
  """``(bq, bk)`` bool mask of one tile (True = attend), or ``None`` if all attend."""
  mask = None

  def both(a, b):
    return b if a is None else a & b

  k_idx = k_start + jnp.arange(cfg.bk, dtype=jnp.int32)[None, :]
  if cfg.is_causal:
    q_idx = q_start + jnp.arange(cfg.bq, dtype=jnp.int32)[:, None]
    mask = k_idx <= q_idx + cfg.offset
  if cfg.tk % cfg.bk:
    mask = both(mask, jnp.broadcast_to(k_idx < cfg.tk, (cfg.bq, cfg.bk)))
  if cfg.segments:
    mask = both(mask, qseg[:, None] == kseg[None, :])
  if cfg.q_valid:
    mask = both(mask, jnp.broadcast_to(qval[:, None] != 0, (cfg.bq, cfg.bk)))
  if cfg.kv_valid:
    mask = both(mask, jnp.broadcast_to(kval[None, :] != 0, (cfg.bq, cfg.bk)))
  return mask


def _logits(cfg: KernelConfig, q, k, mask):
  s = _dot(q, k) * jnp.float32(cfg.scale)
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _split_aux(cfg: KernelConfig, refs):
  """Splits ``refs`` into (qseg, kseg, qval, kval) (``None`` where absent) and the rest."""
  refs = list(refs)
  qseg = kseg = qval = kval = None
  if cfg.segments:
    qseg, kseg = refs.pop(0), refs.pop(0)
  if cfg.q_valid:
    qval = refs.pop(0)
  if cfg.kv_valid:
    kval = refs.pop(0)
  return (qseg, kseg, qval, kval), refs


def _load(ref, sl=None):
  if ref is None:
    return None
  return ref[...] if sl is None else ref[sl]


def _key_blocks_end(cfg: KernelConfig, q_start, nk: int):
  """Number of key tiles a query tile can see (all of them unless causal)."""
  if not cfg.is_causal:
    return nk
  last = lax.div(q_start + cfg.bq + cfg.offset + cfg.bk - 1, cfg.bk)
  return jnp.clip(last, 0, nk)


def _query_blocks_start(cfg: KernelConfig, k_start):
  """First query tile that can see a key tile (0 unless causal)."""
  if not cfg.is_causal:
    return 0
  return jnp.maximum(lax.div(k_start - cfg.offset, cfg.bq), 0)


def _forward_kernel(cfg: KernelConfig, with_lse: bool, q_ref, k_ref, v_ref, *refs):
  (qseg_ref, kseg_ref, qval_ref, kval_ref), outs = _split_aux(cfg, refs)
  o_ref = outs.pop(0)
  lse_ref = outs.pop(0) if with_lse else None
  m_ref = outs.pop(0) if cfg.capture else None
  q_start = pl.program_id(0) * cfg.bq
  q = q_ref[...]
  qseg, qval = _load(qseg_ref), _load(qval_ref)

  def body(j, carry):
    acc, m, l = carry
    ks = pl.ds(j * cfg.bk, cfg.bk)
    mask = _block_mask(cfg, q_start, j * cfg.bk, qseg, _load(kseg_ref, ks), qval,
                       _load(kval_ref, ks))
    s = _logits(cfg, q, k_ref[ks, :], mask)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    shift = safe_shift(m_new)
    alpha = jnp.exp(m - shift)  # 0 while m is -inf
    p = jnp.exp(s - shift[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    v = v_ref[ks, :]
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, (1, 0))
    return acc, m_new, l

  init = (
      jnp.zeros((cfg.bq, v_ref.shape[-1]), jnp.float32),
      jnp.full((cfg.bq,), -jnp.inf, jnp.float32),
      jnp.zeros((cfg.bq,), jnp.float32),
  )
  nk = k_ref.shape[0] // cfg.bk
  acc, m, l = lax.fori_loop(0, _key_blocks_end(cfg, q_start, nk), body, init)
  nonempty = l > 0.0
  l_safe = jnp.where(nonempty, l, jnp.float32(1.0))
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)  # zeros for an empty row
  if lse_ref is not None:
    lse_ref[...] = jnp.where(nonempty, safe_shift(m) + jnp.log(l_safe), jnp.float32(0.0))
  if m_ref is not None:
    m_ref[...] = m


def _dq_kernel(cfg: KernelConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
  (qseg_ref, kseg_ref, qval_ref, kval_ref), (dq_ref,) = _split_aux(cfg, refs)
  q_start = pl.program_id(0) * cfg.bq
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qseg, qval = _load(qseg_ref), _load(qval_ref)

  def body(j, dq):
    ks = pl.ds(j * cfg.bk, cfg.bk)
    mask = _block_mask(cfg, q_start, j * cfg.bk, qseg, _load(kseg_ref, ks), qval,
                       _load(kval_ref, ks))
    k = k_ref[ks, :]
    p = jnp.exp(_logits(cfg, q, k, mask) - lse[:, None])  # exact probabilities
    ds = p * (_dot(do, v_ref[ks, :]) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  nk = k_ref.shape[0] // cfg.bk
  dq = lax.fori_loop(0, _key_blocks_end(cfg, q_start, nk), body,
                     jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * jnp.float32(cfg.scale)).astype(dq_ref.dtype)


def _dkv_kernel(cfg: KernelConfig, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
  """One key tile of one key/value head: sums over its ``G`` query heads and query tiles."""
  (qseg_ref, kseg_ref, qval_ref, kval_ref), (dk_ref, dv_ref) = _split_aux(cfg, refs)
  k_start = pl.program_id(0) * cfg.bk
  k, v = k_ref[...], v_ref[...]
  kseg, kval = _load(kseg_ref), _load(kval_ref)
  nq = q_ref.shape[0] // cfg.bq

  def head(g, carry):
    def body(i, carry):
      dk, dv = carry
      qs = pl.ds(i * cfg.bq, cfg.bq)
      mask = _block_mask(cfg, i * cfg.bq, k_start, _load(qseg_ref, qs), kseg,
                         _load(qval_ref, qs), kval)
      q, do = q_ref[qs, g, :], do_ref[qs, g, :]
      p = jnp.exp(_logits(cfg, q, k, mask) - lse_ref[g, qs][:, None])
      dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
      ds = p * (_dot(do, v) - delta_ref[g, qs][:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
      return dk, dv

    return lax.fori_loop(_query_blocks_start(cfg, k_start), nq, body, carry)

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(0, cfg.groups, head, init)
  dk_ref[...] = (dk * jnp.float32(cfg.scale)).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(cfg: KernelConfig, q, k, v, *, q_tiled: bool):
  """BlockSpecs of q, k, v and the aux vectors.

  ``q_tiled`` (forward, dQ): grid ``(query tiles, B, H)``, keys and values of head
  ``h // G`` read whole. Otherwise (dK, dV): grid ``(key tiles, B, Hkv)``, the queries of
  the ``G`` heads of key/value head ``h`` read whole.
  """
  g = cfg.groups
  dqk, dv = q.shape[-1], v.shape[-1]
  tq, tk = q.shape[1], k.shape[1]
  if q_tiled:
    q_spec = pl.BlockSpec((None, cfg.bq, None, dqk), lambda i, b, h: (b, i, h, 0))
    k_spec = pl.BlockSpec((None, tk, None, dqk), lambda i, b, h: (b, 0, h // g, 0))
    v_spec = pl.BlockSpec((None, tk, None, dv), lambda i, b, h: (b, 0, h // g, 0))
    qvec = pl.BlockSpec((None, cfg.bq), lambda i, b, h: (b, i))
    kvec = pl.BlockSpec((None, tk), lambda i, b, h: (b, 0))
  else:
    q_spec = pl.BlockSpec((None, tq, g, dqk), lambda i, b, h: (b, 0, h, 0))
    k_spec = pl.BlockSpec((None, cfg.bk, None, dqk), lambda i, b, h: (b, i, h, 0))
    v_spec = pl.BlockSpec((None, cfg.bk, None, dv), lambda i, b, h: (b, i, h, 0))
    qvec = pl.BlockSpec((None, tq), lambda i, b, h: (b, 0))
    kvec = pl.BlockSpec((None, cfg.bk), lambda i, b, h: (b, i))
  aux = []
  if cfg.segments:
    aux += [qvec, kvec]
  if cfg.q_valid:
    aux.append(qvec)
  if cfg.kv_valid:
    aux.append(kvec)
  return [q_spec, k_spec, v_spec], aux


def _call(kernel, cfg: KernelConfig, grid, in_specs, out_specs, out_shape, name):
  width = max(s.block_shape[-1] for s in in_specs[:3])
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4 if width <= 64 else 8, num_stages=2),
      interpret=cfg.interpret, name=name,
  )


def _forward(cfg: KernelConfig, q, k, v, aux, with_lse: bool):
  b, tq, h, _ = q.shape
  (qkv_specs, aux_specs) = _specs(cfg, q, k, v, q_tiled=True)
  row = pl.BlockSpec((None, None, cfg.bq), lambda i, b_, h_: (b_, h_, i))
  stats = jax.ShapeDtypeStruct((b, h, tq), jnp.float32)
  out_specs = [pl.BlockSpec((None, cfg.bq, None, v.shape[-1]), lambda i, b_, h_: (b_, i, h_, 0))]
  out_shape = [jax.ShapeDtypeStruct((b, tq, h, v.shape[-1]), jnp.result_type(q, k, v))]
  for wanted in (with_lse, cfg.capture):
    if wanted:
      out_specs.append(row)
      out_shape.append(stats)
  outs = _call(
      functools.partial(_forward_kernel, cfg, with_lse), cfg, (tq // cfg.bq, b, h),
      qkv_specs + aux_specs, out_specs, out_shape, "flash_max_forward",
  )(q, k, v, *aux)
  out = outs[0]
  lse = outs[1] if with_lse else None
  m = outs[-1] if cfg.capture else None
  return out, lse, m


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(cfg, q, k, v, aux):
  out, _, m = _forward(cfg, q, k, v, aux, with_lse=False)
  return out, m


def _flash_fwd(cfg, q, k, v, aux):
  out, lse, m = _forward(cfg, q, k, v, aux, with_lse=True)
  return (out, m), (q, k, v, aux, out, lse)


def _flash_bwd(cfg, res, cts):
  """``dV = P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ = c dS K``, ``dK = c dS^T Q``.

  ``D_i = sum_d dO_id O_id``. The row-maximum output is a capture: its cotangent is
  ignored (the modules use it under ``stop_gradient``). Tiles are at most 32 (they divide
  the forward's power-of-two tiles, so the padded lengths still split evenly); these
  sizes are not tuned.
  """
  cfg = dataclasses.replace(cfg, bq=min(cfg.bq, MAX_BWD_TILE), bk=min(cfg.bk, MAX_BWD_TILE))
  q, k, v, aux, out, lse = res
  d_out = cts[0]
  b, tq, h, _ = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  do = d_out.astype(out.dtype)
  delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), out.astype(jnp.float32))
  row = pl.BlockSpec((None, None, cfg.bq), lambda i, b_, h_: (b_, h_, i))

  (q_s, k_s, v_s), aux_s = _specs(cfg, q, k, v, q_tiled=True)
  do_s = pl.BlockSpec((None, cfg.bq, None, v.shape[-1]), lambda i, b_, h_: (b_, i, h_, 0))
  dq = _call(
      functools.partial(_dq_kernel, cfg), cfg, (tq // cfg.bq, b, h),
      [q_s, k_s, v_s, do_s, row, row] + aux_s, q_s, jax.ShapeDtypeStruct(q.shape, q.dtype),
      "flash_max_backward_dq",
  )(q, k, v, do, lse, delta, *aux)

  (q_s, k_s, v_s), aux_s = _specs(cfg, q, k, v, q_tiled=False)
  do_s = pl.BlockSpec((None, tq, cfg.groups, v.shape[-1]), lambda i, b_, h_: (b_, 0, h_, 0))
  group_rows = pl.BlockSpec((None, cfg.groups, tq), lambda i, b_, h_: (b_, h_, 0))
  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg), cfg, (tk // cfg.bk, b, hkv),
      [q_s, k_s, v_s, do_s, group_rows, group_rows] + aux_s, [k_s, v_s],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      "flash_max_backward_dkv",
  )(q, k, v, do, lse, delta, *aux)
  return dq, dk, dv, None


flash.defvjp(_flash_fwd, _flash_bwd)
