"""Head layouts of attention projections, shared by QK-Clip and the attention modules.

A layout says how the columns of the query/key projection kernels split into heads.
It follows DeepSeek-V3's names and head-major column order (see ``qk_clip``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal


def _check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
  ok = isinstance(value, int) and not isinstance(value, bool)
  if not ok or value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else ">= 1"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MLALayout:
  """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

  Query kernel (``wq_b`` or ``wq``): ``(q_in, num_heads * (qk_nope_head_dim + qk_rope_head_dim))``,
  each head's columns its nope part (q^C) then its rope part (q^R).
  Key/value kernel ``wkv_b``: ``(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))``,
  each head's columns k_nope (k^C) then v. The rotary key k^R comes from ``wkv_a`` and is
  shared by all heads.

  Attributes:
    num_heads: number of attention heads.
    qk_nope_head_dim: per-head width of the non-rotary query/key part.
    qk_rope_head_dim: per-head width of the rotary query part (and of the shared rotary key).
    v_head_dim: per-head value width.
  """

  num_heads: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int

  def __post_init__(self):
    _check_positive_int("num_heads", self.num_heads)
    _check_positive_int("qk_nope_head_dim", self.qk_nope_head_dim, allow_zero=True)
    _check_positive_int("qk_rope_head_dim", self.qk_rope_head_dim, allow_zero=True)
    _check_positive_int("v_head_dim", self.v_head_dim)
    if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
      raise ValueError("MLALayout: qk_nope_head_dim + qk_rope_head_dim must be >= 1, got 0")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class GQALayout:
  """Grouped-query attention; multi-head attention is ``num_kv_heads == num_heads``.

  Kernels ``wq (d, num_heads * head_dim)`` and ``wk (d, num_kv_heads * head_dim)``,
  head-major columns. Query head ``h`` reads key head ``h // (num_heads // num_kv_heads)``.

  Attributes:
    num_heads: number of query heads.
    num_kv_heads: number of key/value heads; divides ``num_heads``.
    head_dim: per-head width of queries, keys and values.
    clip_mode: how QK-Clip treats a key head shared by several query heads.
      ``"split"`` (default, as Motif's and Megatron's PyTorch references): query head h by
      sqrt(gamma_h), shared key head g by sqrt(min of gamma over its group).
      ``"query"``: query head h by gamma_h and the key untouched (the principle of MLA's
      shared k^R), so every logit of head h is scaled by exactly gamma_h and no other head
      changes. For MHA both modes bound the logits; ``"split"`` gives the symmetric
      sqrt(gamma) on query and key.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  clip_mode: Literal["split", "query"] = "split"

  def __post_init__(self):
    _check_positive_int("num_heads", self.num_heads)
    _check_positive_int("num_kv_heads", self.num_kv_heads)
    _check_positive_int("head_dim", self.head_dim)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"GQALayout: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    if self.clip_mode not in ("split", "query"):
      raise ValueError(f"GQALayout: clip_mode must be 'split' or 'query', got {self.clip_mode!r}")

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads


Layout = MLALayout | GQALayout
