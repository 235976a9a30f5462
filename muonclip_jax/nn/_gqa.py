"""Grouped-query attention (and multi-head attention) that reports per-head max logits.

GQA (Ainslie et al., arXiv 2305.13245) with ``H`` query heads and ``Hkv`` key/value heads:

  q_h = RoPE(x W^Q_h + b^Q_h),  k_g = RoPE(x W^K_g + b^K_g),  v_g = x W^V_g + b^V_g
  o_h = softmax(softmax_scale * q_h k_{g(h)}^T + mask) v_{g(h)},  y = [o_1 .. o_H] W^O

with ``g(h) = h // (H // Hkv)`` and ``softmax_scale = 1/sqrt(head_dim)`` (times YaRN's
``mscale^2``). ``Hkv == H`` is multi-head attention. Kernels are 2-D with head-major
columns as ``muonclip_jax.GQALayout`` expects.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._util import check_bool
from .._clip import GQALayout
from ._capture import capturing, sow_head_max
from ._attention import AttentionImpl, attention
from ._module_args import Initializer, check_input, mask_kwargs, validate_common
from ._rope import YarnScaling, apply_rope
from . import _rope  # _rope.softmax_scale: the modules have a property of that name


def validate_gqa(
    name: str, *, num_heads, num_kv_heads, head_dim, clip_mode, use_rope, qkv_bias, **common
) -> GQALayout:
  """Checks GQA fields (``ValueError``; ``TypeError`` for a non-bool boolean) and returns the layout."""
  check_bool(f"{name}: use_rope", use_rope)
  check_bool(f"{name}: qkv_bias", qkv_bias)
  try:
    layout = GQALayout(num_heads, num_kv_heads, head_dim, clip_mode=clip_mode, value="wv", out="wo")
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from None
  if use_rope and head_dim % 2:
    raise ValueError(f"{name}: head_dim must be even for RoPE, got {head_dim}")
  validate_common(name, **common)
  return layout


def gqa_qkv(q, k, v, positions, *, layout: GQALayout, use_rope: bool, rope_theta: float, yarn):
  """Projections ``(B, T, H*D)``, ``(B, T, Hkv*D)`` x2 -> per-head q, k, v with RoPE."""
  b, t = q.shape[:2]
  h, hkv, d = layout.num_heads, layout.num_kv_heads, layout.head_dim
  q = q.reshape(b, t, h, d)
  k = k.reshape(b, t, hkv, d)
  v = v.reshape(b, t, hkv, d)
  if use_rope:
    q = apply_rope(q, positions, base=rope_theta, yarn=yarn)
    k = apply_rope(k, positions, base=rope_theta, yarn=yarn)
  return q, k, v


class GroupedQueryAttention(nn.Module):
  """Grouped-query / multi-head self-attention (Linen) with per-head max-logit capture.

  ``module.apply(variables, x)`` with ``x (batch, seq, dim)`` returns ``(batch, seq, dim)``;
  keyword arguments ``positions``, ``segment_ids``, ``padding_mask``, ``mask`` as in
  ``MultiHeadLatentAttention``. With ``intermediates`` mutable it sows the float32
  ``(num_heads,)`` leaf ``max_logits`` (running maximum, ``-inf`` for a head without an
  unmasked pair, nothing computed when not mutable).

  Parameters (logical axis names in parentheses):
    ``wq/kernel (dim, H*D)`` ("embed", "heads"), ``wq/bias (H*D,)`` ("heads",),
    ``wk/kernel``, ``wv/kernel (dim, Hkv*D)`` ("embed", "kv_heads"),
    ``wk/bias``, ``wv/bias (Hkv*D,)`` ("kv_heads",),
    ``wo/kernel (H*D, dim)`` ("heads", "embed"); biases only with ``qkv_bias``.

  Attributes:
    num_heads: query heads ``H``.
    num_kv_heads: key/value heads ``Hkv``, dividing ``H`` (``H`` for multi-head attention).
    head_dim: per-head width ``D`` (even with RoPE).
    qkv_bias: add biases to the q/k/v projections (Qwen-style).
    use_rope: apply RoPE to queries and keys.
    rope_theta: RoPE base.
    yarn: optional ``YarnScaling`` (frequencies and softmax scale times ``mscale^2``).
    is_causal: causal self-attention (default True). ``qkv_bias``, ``use_rope`` and
      ``is_causal`` are bools: anything else (``"False"`` is truthy) is a TypeError.
    impl: one of ``ATTENTION_IMPLS``: ``"auto"`` (default: splash on TPU, tokamax's
      GPU kernels on GPU, dense on CPU), ``"dense"``, ``"chunked"``, ``"dpa_max"``,
      ``"splash"``, ``"tokamax_gpu"`` (see ``attention``).
    block_size: key block length of ``"chunked"`` and ``"dpa_max"``.
    clip_mode: ``GQALayout.clip_mode`` reported by ``layout`` (``"split"`` or ``"query"``).
    dtype: computation dtype (``None``: inferred).
    param_dtype: parameter dtype.
    kernel_init: initializer of every kernel.
    bias_init: initializer of the biases.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import GroupedQueryAttention
    >>> attn = GroupedQueryAttention(num_heads=4, num_kv_heads=2, head_dim=8, impl="dense")
    >>> x = jnp.ones((1, 5, 16))  # (batch, seq, dim)
    >>> params = attn.init(jax.random.key(0), x)
    >>> y, state = attn.apply(params, x, mutable=["intermediates"])
    >>> y.shape, state["intermediates"]["max_logits"].shape  # one max logit per query head
    ((1, 5, 16), (4,))
    >>> attn.layout.num_kv_heads  # the layout qk_clip reads
    2
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  qkv_bias: bool = False
  use_rope: bool = True
  rope_theta: float = 10000.0
  yarn: YarnScaling | None = None
  is_causal: bool = True
  impl: AttentionImpl = "auto"
  block_size: int = 512
  clip_mode: Literal["split", "query"] = "split"
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()

  def __post_init__(self):
    validate_gqa(
        type(self).__name__, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim, clip_mode=self.clip_mode, use_rope=self.use_rope,
        qkv_bias=self.qkv_bias, is_causal=self.is_causal, impl=self.impl, block_size=self.block_size,
        rope_theta=self.rope_theta, yarn=self.yarn,
    )
    super().__post_init__()

  @property
  def layout(self) -> GQALayout:
    """The ``GQALayout`` to hand to ``muonclip_jax.qk_clip`` and ``muonclip`` (projections ``wq``, ``wk``,
    ``wv``, ``wo``)."""
    return GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, clip_mode=self.clip_mode, value="wv",
                     out="wo")

  @property
  def softmax_scale(self) -> float:
    """``1/sqrt(head_dim)``, times YaRN's ``mscale^2`` when ``yarn`` is set."""
    return _rope.softmax_scale(self.head_dim, self.yarn)

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      *,
      positions: jax.Array | None = None,
      segment_ids: jax.Array | None = None,
      padding_mask: jax.Array | None = None,
      mask: jax.Array | None = None,
  ) -> jax.Array:
    check_input(type(self).__name__, x)
    b, t, dim = x.shape
    layout = self.layout
    h, hkv, d = layout.num_heads, layout.num_kv_heads, layout.head_dim

    def proj(features, axis, name):
      return nn.Dense(
          features, use_bias=self.qkv_bias, dtype=self.dtype, param_dtype=self.param_dtype,
          kernel_init=nn.with_logical_partitioning(self.kernel_init, ("embed", axis)),
          bias_init=nn.with_logical_partitioning(self.bias_init, (axis,)), name=name,
      )(x)

    positions, kw = mask_kwargs(
        x, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask, mask=mask,
        is_causal=self.is_causal,
    )
    q, k, v = gqa_qkv(
        proj(h * d, "heads", "wq"),
        proj(hkv * d, "kv_heads", "wk"),
        proj(hkv * d, "kv_heads", "wv"),
        positions,
        layout=layout,
        use_rope=self.use_rope,
        rope_theta=self.rope_theta,
        yarn=self.yarn,
    )
    capture = capturing(self)
    out, max_logits = attention(
        q, k, v, softmax_scale=self.softmax_scale, impl=self.impl,
        block_size=self.block_size, return_max_logits=capture, **kw,
    )
    if capture:
      sow_head_max(self, max_logits)
    wo = functools.partial(
        nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=nn.with_logical_partitioning(self.kernel_init, ("heads", "embed")),
    )
    return wo(dim, name="wo")(out.reshape(b, t, h * d))
