"""The masking and key-blocking toolkit every attention implementation shares.

Inputs: ``q (B, Tq, H, D)``, ``k (B, Tk, Hkv, D)``, ``v (B, Tk, Hkv, Dv)`` with
``H % Hkv == 0``; query head ``h`` reads key/value head ``h // G``, ``G = H // Hkv``.
Queries are handled grouped, ``(B, Tq, Hkv, G, D)`` (``group``), so that no key or value
is repeated.

Masking: a pair ``(i, j)`` of batch row ``b`` is attended iff all given conditions hold:
``is_causal``: ``j <= i + Tk - Tq`` (bottom-right aligned; ``j <= i`` for self-attention);
segments: ``q_segment_ids[b, i] == kv_segment_ids[b, j]``; padding: ``q_mask[b, i]`` and
``kv_mask[b, j]``; an explicit boolean ``mask[b, h, i, j]`` (broadcastable to
``(B, H, Tq, Tk)``, True = attend, Flax's convention). ``check_and_prepare`` validates the
arguments and splits them into a query side and a key side; ``allowed`` combines them for
one key block, and ``scores`` returns that block's scaled logits with masked pairs at
``-inf``, so they never count toward a maximum.

Blocking: ``to_blocks`` pads the key axis to a whole number of blocks and moves the block
index to the front, for a ``lax.scan`` over key blocks; ``Static.padded`` masks the padded
keys by position.

The capture: ``head_max`` reduces any per-row (or per-pair) maxima to QK-Clip's per-head
maximum (Kimi K2, arXiv 2507.20534, Sec. 2.1), float32 under ``stop_gradient``; it is the
one such reduction in the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..._util import check_bool


class QuerySide(NamedTuple):
  segment_ids: jax.Array | None  # (B, Tq) int
  mask: jax.Array | None  # (B, Tq) bool


class KeySide(NamedTuple):
  segment_ids: jax.Array | None  # (B, Tk) int, or (nb, B, bk) when blocked
  mask: jax.Array | None  # (B, Tk) bool, or (nb, B, bk) when blocked
  pair_mask: jax.Array | None  # (Bm, Hkv|1, G|1, Tq, Tk) bool, or (nb, ..., bk) when blocked


@dataclasses.dataclass(frozen=True)
class Static:
  """Hashable, trace-time configuration of one attention call."""

  softmax_scale: float
  is_causal: bool
  tq: int
  tk: int  # true key length (before padding to a multiple of the block)
  block: int  # key block length (== tk for dense)
  padded: bool  # whether key positions >= tk exist and must be masked


def blocked(softmax_scale: float, is_causal: bool, tq: int, tk: int, block_size: int) -> tuple[Static, int]:
  """``(Static, nb)`` of a pass over ``nb`` key blocks of ``min(block_size, tk)`` keys."""
  block = min(block_size, tk)
  nb = -(-tk // block)
  return Static(float(softmax_scale), bool(is_causal), tq, tk, block, nb * block != tk), nb


def check_and_prepare(q, k, v, *, mask, q_segment_ids, kv_segment_ids, q_mask, kv_mask, name, is_causal,
                      return_max_logits):
  """Validates shapes and the boolean options; returns ``(QuerySide, KeySide)`` with a 5-D pair mask.

  ``is_causal`` and ``return_max_logits`` must be bools (TypeError otherwise: ``"False"``
  would be truthy).
  """
  check_bool(f"{name}: is_causal", is_causal)
  check_bool(f"{name}: return_max_logits", return_max_logits)
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
  q_side = QuerySide(q_segment_ids, None if q_mask is None else q_mask.astype(bool))
  k_side = KeySide(kv_segment_ids, None if kv_mask is None else kv_mask.astype(bool), pair_mask)
  return q_side, k_side


def check_block_size(block_size: Any, name: str) -> None:
  """ValueError unless ``block_size`` is a Python int >= 1."""
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"{name}: block_size must be an int >= 1, got {block_size!r}")


def allowed(cfg: Static, q_side: QuerySide, k_side: KeySide, k_start) -> jax.Array | None:
  """Boolean ``(B|1, Hkv|1, G|1, Tq, bk)`` mask of one key block starting at ``k_start``."""
  parts = []
  k_idx = k_start + jnp.arange(cfg.block, dtype=jnp.int32)
  if cfg.is_causal:
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


def dense_mask(cfg: Static, q_side: QuerySide, k_side: KeySide) -> jax.Array | None:
  """``allowed`` over every key at once as one boolean ``(B|1, H|1, Tq, Tk)`` mask, or None.

  For kernels that take a Flax-style mask (``cfg.block == cfg.tk``, no padding).
  """
  pairs = allowed(cfg, q_side, k_side, 0)
  if pairs is None:
    return None
  pairs = jnp.broadcast_to(pairs, pairs.shape[:3] + (cfg.tq, cfg.tk))  # (B|1, Hkv|1, G|1, Tq, Tk)
  return pairs.reshape(pairs.shape[0], pairs.shape[1] * pairs.shape[2], cfg.tq, cfg.tk)


def scores(cfg: Static, qg, k_blk, q_side, k_side_blk, k_start) -> jax.Array:
  """Masked scaled logits ``(B, Hkv, G, Tq, bk)`` in float32; masked pairs are ``-inf``."""
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_blk, preferred_element_type=jnp.float32)
  s = s * jnp.float32(cfg.softmax_scale)
  mask = allowed(cfg, q_side, k_side_blk, k_start)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  return s


def safe_shift(m: jax.Array) -> jax.Array:
  """Row maxima with ``-inf`` (no unmasked key yet) replaced by 0, for ``exp(s - shift)``."""
  return jnp.where(jnp.isneginf(m), jnp.float32(0.0), m)


def group(q: jax.Array, hkv: int) -> jax.Array:
  """``(B, T, H, D)`` -> ``(B, T, Hkv, G, D)``: the ``G`` query heads of each key/value head."""
  b, t, h, d = q.shape
  return q.reshape(b, t, hkv, h // hkv, d)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads (``False`` for booleans) ``axis`` of ``x`` at the end to length ``size``."""
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def to_blocks(x: jax.Array | None, axis: int, nb: int, block: int) -> jax.Array | None:
  """Pads ``axis`` of ``x`` to ``nb * block`` and moves the block index to the front."""
  if x is None:
    return None
  x = pad_axis(x, axis, nb * block)  # padded keys are masked by position
  axis = axis % x.ndim
  x = x.reshape(x.shape[:axis] + (nb, block) + x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def key_side_blocks(k_side: KeySide, nb: int, block: int) -> KeySide:
  """``k_side`` cut into ``nb`` key blocks of ``block`` (see ``to_blocks``)."""
  return KeySide(
      to_blocks(k_side.segment_ids, 1, nb, block),
      to_blocks(k_side.mask, 1, nb, block),
      to_blocks(k_side.pair_mask, -1, nb, block),
  )


def head_max(x: jax.Array, mask: Any = None, *, head_axis: int, where: str = "head_max") -> jax.Array:
  """``(num_heads,)`` float32: the maximum of ``x`` over every axis but ``head_axis``.

  Only entries where ``mask`` (broadcastable to ``x``) is True count; a head without any
  reports ``-inf``. Under ``stop_gradient``. ``where`` names the caller in errors.
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"{where}: logits must have a head axis and at least one other axis, got shape {x.shape}")
  if not isinstance(head_axis, int) or isinstance(head_axis, bool) or not -x.ndim <= head_axis < x.ndim:
    raise ValueError(f"{where}: head_axis must be an int in [{-x.ndim}, {x.ndim}) for logits of shape "
                     f"{x.shape}, got {head_axis!r}")
  s = jax.lax.stop_gradient(x).astype(jnp.float32)
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.ndim > s.ndim or any(m not in (1, t) for m, t in zip(mask.shape[::-1], s.shape[::-1])):
      raise ValueError(f"{where}: mask of shape {mask.shape} is not broadcastable to the logits' shape {s.shape}")
    s = jnp.where(mask.astype(bool), s, -jnp.inf)
  axis = head_axis % s.ndim
  return jnp.max(s, axis=tuple(a for a in range(s.ndim) if a != axis))


def grouped_head_max(row_max: jax.Array) -> jax.Array:
  """Grouped row maxima ``(B, Hkv, G, Tq)`` -> ``head_max`` ``(H,)``, head ``h = g_kv * G + g``."""
  b, hkv, g, tq = row_max.shape
  return head_max(row_max.reshape(b, hkv * g, tq), head_axis=1)
