"""Naive NumPy (float64) references for MLA/GQA forward passes and their per-head max logits.

Written from the formulas (DeepSeek-V2 arXiv 2405.04434 Sec. 2.1, DeepSeek-V3 arXiv
2412.19437 Sec. 2.1.1; GQA arXiv 2305.13245; RoPE arXiv 2104.09864; YaRN arXiv 2309.00071),
with explicit loops over heads, independent of the JAX implementation. Self-contained.

``params`` are plain nested dicts of NumPy arrays with Flax's names (``wq_a/kernel``, ...).
Kernels map inputs to outputs as ``x @ kernel``.
"""

from __future__ import annotations

import math

import numpy as np


def f64(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
  x = f64(x)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(scale)


def rope_frequencies(dim: int, base: float, yarn: dict | None = None) -> np.ndarray:
  """theta_i = base^(-2i/dim); with YaRN, blend theta_i/s (slow dims) and theta_i (fast dims)."""
  freqs = np.array([base ** (-2.0 * i / dim) for i in range(dim // 2)])
  if yarn is None or yarn["factor"] == 1.0:
    return freqs
  s, orig = yarn["factor"], yarn["original_max_position"]

  def index(rotations):  # i with orig * theta_i = 2 pi * rotations
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = max(math.floor(index(yarn.get("beta_fast", 32.0))), 0)
  high = min(math.ceil(index(yarn.get("beta_slow", 1.0))), dim - 1)  # DeepSeek-V3: dim - 1
  if high == low:
    high += 1e-3
  out = np.empty_like(freqs)
  for i, theta in enumerate(freqs):
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0 fast .. 1 slow
    out[i] = ramp * theta / s + (1.0 - ramp) * theta
  return out


def yarn_softmax_scale(qk_head_dim: int, yarn: dict | None = None) -> float:
  scale = 1.0 / math.sqrt(qk_head_dim)
  if yarn is not None and yarn["factor"] > 1.0:
    mscale = 0.1 * yarn.get("mscale", 1.0) * math.log(yarn["factor"]) + 1.0
    scale *= mscale * mscale
  return scale


def rope(x: np.ndarray, positions: np.ndarray, base: float, yarn: dict | None = None) -> np.ndarray:
  """x (B, T, H, D): pairs (i, i + D/2) rotated by positions * theta_i."""
  x = f64(x)
  d = x.shape[-1]
  freqs = rope_frequencies(d, base, yarn)
  out = np.empty_like(x)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      ang = positions[b, t] * freqs
      c, s = np.cos(ang), np.sin(ang)
      x1, x2 = x[b, t, :, : d // 2], x[b, t, :, d // 2 :]
      out[b, t, :, : d // 2] = x1 * c - x2 * s
      out[b, t, :, d // 2 :] = x2 * c + x1 * s
  return out


def allowed_pairs(
    batch: int,
    heads: int,
    tq: int,
    tk: int,
    *,
    is_causal: bool = False,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_mask=None,
    kv_mask=None,
    mask=None,
) -> np.ndarray:
  """(B, H, Tq, Tk) bool: which (query, key) pairs attend, by explicit loops."""
  out = np.ones((batch, heads, tq, tk), bool)
  for b in range(batch):
    for h in range(heads):
      for i in range(tq):
        for j in range(tk):
          ok = True
          if is_causal and j > i + (tk - tq):
            ok = False
          if q_segment_ids is not None and q_segment_ids[b, i] != kv_segment_ids[b, j]:
            ok = False
          if q_mask is not None and not q_mask[b, i]:
            ok = False
          if kv_mask is not None and not kv_mask[b, j]:
            ok = False
          if mask is not None:
            mb = 0 if mask.shape[0] == 1 else b
            mh = 0 if mask.shape[1] == 1 else h
            mi = 0 if mask.shape[2] == 1 else i
            mj = 0 if mask.shape[3] == 1 else j
            if not mask[mb, mh, mi, mj]:
              ok = False
          out[b, h, i, j] = ok
  return out


def attention(q, k, v, scale: float, allowed: np.ndarray):
  """q (B, Tq, H, D), k (B, Tk, Hkv, D), v (B, Tk, Hkv, Dv) -> (out (B, Tq, H, Dv), max (H,)).

  Query head h reads key head h // (H // Hkv). Fully masked rows give zeros; a head
  without any allowed pair reports -inf.
  """
  q, k, v = f64(q), f64(k), f64(v)
  b_, tq, h_, _ = q.shape
  hkv = k.shape[2]
  group = h_ // hkv
  out = np.zeros((b_, tq, h_, v.shape[-1]))
  max_logits = np.full((h_,), -np.inf)
  for h in range(h_):
    g = h // group
    for b in range(b_):
      logits = scale * q[b, :, h, :] @ k[b, :, g, :].T  # (Tq, Tk)
      ok = allowed[b, h]
      if ok.any():
        max_logits[h] = max(max_logits[h], logits[ok].max())
      for i in range(tq):
        if not ok[i].any():
          continue
        row = logits[i][ok[i]]
        p = np.exp(row - row.max())
        p /= p.sum()
        out[b, i, h] = p @ v[b, ok[i], g, :]
  return out, max_logits


def mla_qkv(params: dict, x: np.ndarray, cfg: dict, positions: np.ndarray):
  """Per-head q, k, v of DeepSeek-V3 MLA (the shared rotary key broadcast over heads)."""
  x = f64(x)
  h, dv = cfg["num_heads"], cfg["v_head_dim"]
  dn, dr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
  r, eps = cfg["kv_lora_rank"], cfg.get("norm_epsilon", 1e-6)
  base, yarn = cfg.get("rope_theta", 10000.0), cfg.get("yarn")
  b, t, _ = x.shape
  if cfg["q_lora_rank"]:
    c_q = rms_norm(x @ f64(params["wq_a"]["kernel"]), params["q_norm"]["scale"], eps)
    q = c_q @ f64(params["wq_b"]["kernel"])
  else:
    q = x @ f64(params["wq"]["kernel"])
  q = q.reshape(b, t, h, dn + dr)
  kv_a = x @ f64(params["wkv_a"]["kernel"])
  c_kv, k_rope = kv_a[..., :r], kv_a[..., r:]
  kv = rms_norm(c_kv, params["kv_norm"]["scale"], eps) @ f64(params["wkv_b"]["kernel"])
  kv = kv.reshape(b, t, h, dn + dv)
  q_rope = rope(q[..., dn:], positions, base, yarn) if dr else q[..., dn:]
  k_rope = rope(k_rope[:, :, None, :], positions, base, yarn) if dr else k_rope[:, :, None, :]
  qh = np.concatenate([q[..., :dn], q_rope], axis=-1)
  kh = np.concatenate([kv[..., :dn], np.repeat(k_rope, h, axis=2)], axis=-1)
  return qh, kh, kv[..., dn:]


def mla_forward(params: dict, x: np.ndarray, cfg: dict, positions: np.ndarray, allowed: np.ndarray):
  """(y (B, T, dim), max_logits (H,)) of MLA with the given (B, H, T, T) allowed pairs."""
  q, k, v = mla_qkv(params, x, cfg, positions)
  scale = yarn_softmax_scale(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg.get("yarn"))
  out, max_logits = attention(q, k, v, scale, allowed)
  b, t = x.shape[:2]
  return out.reshape(b, t, -1) @ f64(params["wo"]["kernel"]), max_logits


def gqa_forward(params: dict, x: np.ndarray, cfg: dict, positions: np.ndarray, allowed: np.ndarray):
  """(y (B, T, dim), max_logits (H,)) of GQA/MHA with optional q/k/v biases and RoPE."""
  x = f64(x)
  h, hkv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
  b, t, _ = x.shape

  def proj(name, heads):
    y = x @ f64(params[name]["kernel"])
    if "bias" in params[name]:
      y = y + f64(params[name]["bias"])
    return y.reshape(b, t, heads, d)

  q, k, v = proj("wq", h), proj("wk", hkv), proj("wv", hkv)
  if cfg.get("use_rope", True):
    q = rope(q, positions, cfg.get("rope_theta", 10000.0), cfg.get("yarn"))
    k = rope(k, positions, cfg.get("rope_theta", 10000.0), cfg.get("yarn"))
  out, max_logits = attention(q, k, v, yarn_softmax_scale(d, cfg.get("yarn")), allowed)
  return out.reshape(b, t, -1) @ f64(params["wo"]["kernel"]), max_logits
