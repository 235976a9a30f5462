"""Hidden matrices of DeepSeek-style MLA/MoE and dense GQA models: shapes and logical names.

Each builder returns ``{name: (shape, logical axis names)}`` for one layer's Muon-routed
matrices (kernels ``(in, out)``; an expert stack ``(experts, in, out)`` with the unsharded
logical name ``expert``). ``model`` repeats a layer, unscanned (``l0/...``, ``l1/...``) or
scanned (one leaf ``(layers, ...)`` per name, logical name ``layers``). Used by
``bench_sharding.py`` and ``tests/test_distributed_ns.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def mla_attention(d: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> dict:
  """DeepSeek-V2/V3 multi-head latent attention: wq_a, wq_b, wkv_a, wkv_b, wo."""
  return {
      "wq_a": ((d, q_lora), ("embed", "q_lora")),
      "wq_b": ((q_lora, heads * (nope + rope)), ("q_lora", "heads")),
      "wkv_a": ((d, kv_lora + rope), ("embed", "kv_lora")),
      "wkv_b": ((kv_lora, heads * (nope + v)), ("kv_lora", "heads")),
      "wo": ((heads * v, d), ("heads", "embed")),
  }


def mlp(d: int, hidden: int, prefix: str = "") -> dict:
  """SwiGLU MLP: w_gate, w_up ``(d, hidden)``, w_down ``(hidden, d)``."""
  return {f"{prefix}w_gate": ((d, hidden), ("embed", "mlp")), f"{prefix}w_up": ((d, hidden), ("embed", "mlp")),
          f"{prefix}w_down": ((hidden, d), ("mlp", "embed"))}


def experts(d: int, hidden: int, count: int) -> dict:
  """A stack of ``count`` SwiGLU experts: ``(count, d, hidden)`` and ``(count, hidden, d)``."""
  return {f"experts/{k}": ((count,) + shape, ("expert",) + names) for k, (shape, names) in mlp(d, hidden).items()}


def gqa_attention(d: int, heads: int, kv_heads: int, head_dim: int) -> dict:
  """Grouped-query attention: wq, wk, wv, wo."""
  return {"wq": ((d, heads * head_dim), ("embed", "heads")), "wk": ((d, kv_heads * head_dim), ("embed", "kv_heads")),
          "wv": ((d, kv_heads * head_dim), ("embed", "kv_heads")), "wo": ((heads * head_dim, d), ("heads", "embed"))}


def model(layer: dict, layers: int, *, scanned: bool = False, dtype=jnp.float32) -> tuple[dict, dict]:
  """(abstract params, logical ``PartitionSpec``s) of ``layers`` copies of ``layer``."""
  if scanned:
    params = {k: jax.ShapeDtypeStruct((layers,) + s, dtype) for k, (s, _) in layer.items()}
    return params, {k: P("layers", *n) for k, (_, n) in layer.items()}
  params = {f"l{i}": {k: jax.ShapeDtypeStruct(s, dtype) for k, (s, _) in layer.items()} for i in range(layers)}
  return params, {f"l{i}": {k: P(*n) for k, (_, n) in layer.items()} for i in range(layers)}


# The balanced placement's MLA test case: width 1024, 8 heads, q_lora 384, kv_lora 256, head dims 64 + 32
# (rope), values 64, SwiGLU 2816. With polar_express_4 it reproduces the figures of
# the shape-by-shape grouping (0.232, 0.174 of one device's FLOPs on 8 devices with 3 and 4 layers).
MLA_1024 = {**mla_attention(1024, 8, 384, 256, 64, 32, 64), **mlp(1024, 2816)}


def deepseek_v3(layers: int = 61, dense: int = 3) -> list[tuple[dict, int]]:
  """DeepSeek-V3's hidden matrices (arXiv 2412.19437): ``[(layer, count)]``.

  Width 7168, 128 heads, q_lora 1536, kv_lora 512, head dims 128 + 64 (rope), values 128;
  the first ``dense`` layers have an 18432 MLP, the others 256 routed experts of 2048 and
  one shared expert of 2048.
  """
  attn = mla_attention(7168, 128, 1536, 512, 128, 64, 128)
  return [({**attn, **mlp(7168, 18432)}, dense),
          ({**attn, **experts(7168, 2048, 256), **mlp(7168, 2048, "shared/")}, layers - dense)]


def dense_70b(layers: int = 80) -> list[tuple[dict, int]]:
  """A Llama-2/3-70B-like dense GQA model: width 8192, 64 heads, 8 KV heads of 128, MLP 28672."""
  return [({**gqa_attention(8192, 64, 8, 128), **mlp(8192, 28672)}, layers)]


def dense_405b(layers: int = 126) -> list[tuple[dict, int]]:
  """A Llama-3-405B-like dense GQA model (arXiv 2407.21783): width 16384, 128 heads, 8 KV
  heads of 128, MLP 53248."""
  return [({**gqa_attention(16384, 128, 8, 128), **mlp(16384, 53248)}, layers)]


def active_params(layers: list[tuple[dict, int]], experts_active: int = 8) -> int:
  """Hidden-matrix parameters one token passes through (``experts_active`` of each stack)."""
  total = 0
  for layer, count in layers:
    for shape, names in layer.values():
      size = 1
      for d in shape[1:] if names[0] == "expert" else shape:
        size *= d
      total += count * size * (experts_active if names[0] == "expert" else 1)
  return total
