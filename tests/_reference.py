"""NumPy references for the tests: plain float64 math, written for clarity, not speed.

Each function is self-contained (no imports from ``muonclip_jax``).
"""

from __future__ import annotations

import numpy as np


def np_rope(x: np.ndarray, theta: float = 10000.0) -> np.ndarray:
  """Rotary embedding, "rotate half" (GPT-NeoX) form, positions 0..T-1.

  x: (B, T, ..., D) with D even; pair (x_i, x_{i + D/2}) is rotated by angle
  t * theta^(-2i/D) at position t. A linear, norm-preserving map per position.
  """
  x = np.asarray(x, np.float64)
  t, d = x.shape[1], x.shape[-1]
  if d % 2:
    raise ValueError(f"np_rope: last dim must be even, got {d}")
  freqs = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (D/2,)
  angles = np.arange(t, dtype=np.float64)[:, None] * freqs[None, :]  # (T, D/2)
  shape = (1, t) + (1,) * (x.ndim - 3) + (d // 2,)
  cos, sin = np.cos(angles).reshape(shape), np.sin(angles).reshape(shape)
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_scores(q: np.ndarray, k: np.ndarray, scale: float, causal: bool) -> np.ndarray:
  """q (B, T, H, D), k (B, S, H, D) -> scale * q.k of shape (B, H, T, S); masked = -inf."""
  logits = np.einsum("bthd,bshd->bhts", q, k) * scale
  if causal:
    t, s = logits.shape[-2:]
    mask = np.tril(np.ones((t, s), bool), k=s - t)
    logits = np.where(mask, logits, -np.inf)
  return logits


def np_mla_logits(
    q_in: np.ndarray,
    kv_latent: np.ndarray,
    k_rope: np.ndarray,
    *,
    wq: np.ndarray,
    wkv_b: np.ndarray,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    wq_bias: np.ndarray | None = None,
    wkv_b_bias: np.ndarray | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    rope_theta: float | None = 10000.0,
) -> np.ndarray:
  """Pre-softmax MLA logits (DeepSeek-V2/V3 layout), per head, times the softmax scale.

  q_in (B, T, q_in) is the input of the query projection ``wq_b`` (or ``wq``),
  kv_latent (B, T, kv_lora_rank) the (normalized) latent input of ``wkv_b``, and k_rope
  (B, T, qk_rope_head_dim) the un-rotated rotary key from ``wkv_a``, shared by all heads.
  Per head h: q = [q^C_h, q^R_h] are its nope then rope columns of ``q_in @ wq (+ bias)``;
  [k^C_h, v_h] its columns of ``kv_latent @ wkv_b (+ bias)``;
  logit_ij = scale * (q^C_i . k^C_j + rope(q^R)_i . rope(k^R)_j), scale = 1/sqrt(nope + rope)
  by default. Returns (B, H, T, T) float64 with masked pairs at -inf.
  """
  nope, rope_d, v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
  q = np.asarray(q_in, np.float64) @ np.asarray(wq, np.float64)
  if wq_bias is not None:
    q = q + np.asarray(wq_bias, np.float64)
  kv = np.asarray(kv_latent, np.float64) @ np.asarray(wkv_b, np.float64)
  if wkv_b_bias is not None:
    kv = kv + np.asarray(wkv_b_bias, np.float64)
  b, t = q.shape[:2]
  q = q.reshape(b, t, num_heads, nope + rope_d)
  kv = kv.reshape(b, t, num_heads, nope + v)
  q_nope, q_rope = q[..., :nope], q[..., nope:]
  k_nope = kv[..., :nope]
  k_rope = np.broadcast_to(
      np.asarray(k_rope, np.float64)[:, :, None, :], (b, t, num_heads, rope_d)
  )
  if rope_theta is not None and rope_d:
    q_rope, k_rope = np_rope(q_rope, rope_theta), np_rope(k_rope, rope_theta)
  scale = (nope + rope_d) ** -0.5 if softmax_scale is None else softmax_scale
  q_full = np.concatenate([q_nope, q_rope], axis=-1)
  k_full = np.concatenate([k_nope, k_rope], axis=-1)
  return _np_scores(q_full, k_full, scale, causal)


def np_gqa_logits(
    x: np.ndarray,
    *,
    wq: np.ndarray,
    wk: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    wq_bias: np.ndarray | None = None,
    wk_bias: np.ndarray | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    rope_theta: float | None = None,
) -> np.ndarray:
  """Pre-softmax GQA/MHA logits per query head, times the softmax scale.

  x (B, T, d); q = x @ wq (+ bias) as (B, T, H, D), k = x @ wk (+ bias) as (B, T, KV, D),
  head-major columns; query head h reads key head h // (H // KV).
  logit_ij = scale * rope(q)_i . rope(k)_j with scale = 1/sqrt(D) by default (no rotary
  embedding when rope_theta is None). Returns (B, H, T, T) float64, masked pairs at -inf.
  """
  x = np.asarray(x, np.float64)
  q = x @ np.asarray(wq, np.float64)
  k = x @ np.asarray(wk, np.float64)
  if wq_bias is not None:
    q = q + np.asarray(wq_bias, np.float64)
  if wk_bias is not None:
    k = k + np.asarray(wk_bias, np.float64)
  b, t = x.shape[:2]
  q = q.reshape(b, t, num_heads, head_dim)
  k = k.reshape(b, t, num_kv_heads, head_dim)
  k = np.repeat(k, num_heads // num_kv_heads, axis=2)
  if rope_theta is not None:
    q, k = np_rope(q, rope_theta), np_rope(k, rope_theta)
  scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
  return _np_scores(q, k, scale, causal)


def np_max_logits(logits: np.ndarray) -> np.ndarray:
  """Per-head maximum of (B, H, T, S) logits over batch and unmasked pairs -> (H,)."""
  return np.max(logits, axis=(0, 2, 3))
