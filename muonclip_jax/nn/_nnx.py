"""NNX twins of the attention modules, over the same pure functions as the Linen ones.

``MultiHeadLatentAttentionNNX`` and ``GroupedQueryAttentionNNX`` take the model width
``in_features`` and the same fields as their Linen twins (keyword-only) plus ``rngs``.
Submodules carry the same names (``wq_a, q_norm, wq_b`` or ``wq``, ``wkv_a, kv_norm,
wkv_b, wo``; ``wq, wk, wv, wo``), so ``nnx.state(model, nnx.Param)`` has the same paths
and shapes as the Linen ``params`` and ``qk_clip`` matches them. Kernels carry their
logical axis names as ``out_sharding`` metadata (the NNX successor of ``sharding_names``);
``nnx.get_partition_spec(nnx.state(model))`` reads them, e.g. under
``nn.logical_axis_rules``. The extra argument ``eager_sharding`` (default False) is passed
to every ``nnx.Param``: False stores the names without sharding at creation, so a model
can be built without a mesh; True (or None: flax's global default) shards each parameter
when created, which needs an active mesh whose axes the names (or rules) resolve to.

Getting the max logits (flax >= 0.12 ``nnx.capture``; ``sow`` outside it is deprecated)::

  y, intermediates = nnx.capture(model, nnx.Intermediate)(x)   # also inside nnx.jit
  # intermediates: nnx.State, e.g. {"max_logits": Intermediate((H,) float32)} for a bare
  # attention module, {"layers": {0: {"attn": {"max_logits": ...}}}} inside a model.
  new_params = muonclip_jax.qk_clip(
      nnx.state(model, nnx.Param), intermediates, qk_clip_threshold=tau, layout=model.layout)
  nnx.update(model, new_params)

``nnx.to_pure_dict(intermediates)`` gives the plain ``{..., "max_logits": array}`` tree
(``qk_clip`` accepts either, and pure-dict params as well).

Outside ``nnx.capture(..., nnx.Intermediate)`` a call computes no maximum and sows
nothing. Inside, repeated calls keep a running maximum (``reduce_fn=jnp.maximum``).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from .._clip import GQALayout, MLALayout
from ._capture import capturing, sow_head_max
from ._attention import AttentionImpl, attention
from ._gqa import gqa_qkv, validate_gqa
from ._mla import mla_qkv, validate_mla
from ._module_args import Initializer, check_input, mask_kwargs
from ._rope import YarnScaling
from . import _rope  # _rope.softmax_scale: the modules have a property of that name

_default_kernel_init = nnx.initializers.lecun_normal()
_default_bias_init = nnx.initializers.zeros_init()


def _linear(in_features, out_features, names, *, use_bias=False, dtype, param_dtype, kernel_init,
            bias_init=_default_bias_init, eager_sharding, rngs):
  return nnx.Linear(
      in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
      kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
      kernel_metadata={"out_sharding": names, "eager_sharding": eager_sharding},
      bias_metadata={"out_sharding": names[1:], "eager_sharding": eager_sharding},
  )


class MultiHeadLatentAttentionNNX(nnx.Module):
  """NNX twin of ``MultiHeadLatentAttention`` (same math, parameter names and shapes).

  ``model(x, positions=None, segment_ids=None, padding_mask=None, mask=None)``; see the
  Linen docstring for the math, the parameter tree and the logical axis names, and this
  module's docstring for capturing ``max_logits`` with ``nnx.capture``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from muonclip_jax.nn import MultiHeadLatentAttentionNNX
    >>> model = MultiHeadLatentAttentionNNX(16, num_heads=2, q_lora_rank=8, kv_lora_rank=8,
    ...                                     qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
    ...                                     impl="dense", rngs=nnx.Rngs(0))
    >>> y, captured = nnx.capture(model, nnx.Intermediate)(jnp.ones((1, 5, 16)))
    >>> y.shape, nnx.to_pure_dict(captured)["max_logits"].shape
    ((1, 5, 16), (2,))
  """

  def __init__(
      self,
      in_features: int,
      *,
      num_heads: int,
      q_lora_rank: int = 1536,
      kv_lora_rank: int = 512,
      qk_nope_head_dim: int = 128,
      qk_rope_head_dim: int = 64,
      v_head_dim: int = 128,
      rope_theta: float = 10000.0,
      yarn: YarnScaling | None = None,
      rope_interleave: bool = False,
      is_causal: bool = True,
      impl: AttentionImpl = "auto",
      block_size: int = 512,
      norm_epsilon: float = 1e-6,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      eager_sharding: bool | None = False,
      rngs: nnx.Rngs,
  ):
    self._layout = validate_mla(
        type(self).__name__, num_heads=num_heads, q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, impl=impl,
        block_size=block_size, rope_theta=rope_theta, yarn=yarn, rope_interleave=rope_interleave,
        is_causal=is_causal, eager_sharding=eager_sharding,
    )
    self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
    self.rope_interleave = rope_interleave
    self.rope_theta, self.yarn, self.is_causal = rope_theta, yarn, is_causal
    self.impl, self.block_size = impl, block_size
    h, dn, dr, dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    kw = dict(
        dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        eager_sharding=eager_sharding, rngs=rngs,
    )
    norm_kw = dict(
        epsilon=norm_epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        scale_metadata={"out_sharding": ("norm",), "eager_sharding": eager_sharding},
    )
    if q_lora_rank:
      self.wq_a = _linear(in_features, q_lora_rank, ("embed", "q_lora"), **kw)
      self.q_norm = nnx.RMSNorm(q_lora_rank, **norm_kw)
      self.wq_b = _linear(q_lora_rank, h * (dn + dr), ("q_lora", "heads"), **kw)
    else:
      self.wq = _linear(in_features, h * (dn + dr), ("embed", "heads"), **kw)
    self.wkv_a = _linear(in_features, kv_lora_rank + dr, ("embed", "kv_lora"), **kw)
    self.kv_norm = nnx.RMSNorm(kv_lora_rank, **norm_kw)
    self.wkv_b = _linear(kv_lora_rank, h * (dn + dv), ("kv_lora", "heads"), **kw)
    self.wo = _linear(h * dv, in_features, ("heads", "embed"), **kw)

  @property
  def layout(self) -> MLALayout:
    """The ``MLALayout`` to hand to ``muonclip_jax.qk_clip``."""
    return self._layout

  @property
  def softmax_scale(self) -> float:
    return _rope.softmax_scale(self._layout.qk_head_dim, self.yarn)

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
    b, t, _ = x.shape
    layout = self._layout
    q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
    positions, kw = mask_kwargs(
        x, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask, mask=mask,
        is_causal=self.is_causal,
    )
    q, k, v = mla_qkv(
        q, self.wkv_a(x), self.kv_norm, self.wkv_b, positions, layout=layout,
        kv_lora_rank=self.kv_lora_rank, rope_theta=self.rope_theta, yarn=self.yarn,
        rope_interleave=self.rope_interleave,
    )
    capture = capturing(self)
    out, max_logits = attention(
        q, k, v, softmax_scale=self.softmax_scale, impl=self.impl,
        block_size=self.block_size, return_max_logits=capture, **kw,
    )
    if capture:
      sow_head_max(self, max_logits)
    return self.wo(out.reshape(b, t, layout.num_heads * layout.v_head_dim))


class GroupedQueryAttentionNNX(nnx.Module):
  """NNX twin of ``GroupedQueryAttention`` (same math, parameter names and shapes).

  ``model(x, positions=None, segment_ids=None, padding_mask=None, mask=None)``; see the
  Linen docstring and this module's docstring for capturing ``max_logits``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from muonclip_jax.nn import GroupedQueryAttentionNNX
    >>> model = GroupedQueryAttentionNNX(16, num_heads=4, num_kv_heads=2, head_dim=8, impl="dense",
    ...                                  rngs=nnx.Rngs(0))
    >>> y, captured = nnx.capture(model, nnx.Intermediate)(jnp.ones((1, 5, 16)))
    >>> y.shape, nnx.to_pure_dict(captured)["max_logits"].shape
    ((1, 5, 16), (4,))
  """

  def __init__(
      self,
      in_features: int,
      *,
      num_heads: int,
      num_kv_heads: int,
      head_dim: int,
      qkv_bias: bool = False,
      use_rope: bool = True,
      rope_theta: float = 10000.0,
      yarn: YarnScaling | None = None,
      is_causal: bool = True,
      impl: AttentionImpl = "auto",
      block_size: int = 512,
      clip_mode: Literal["split", "query"] = "split",
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      kernel_init: Initializer = _default_kernel_init,
      bias_init: Initializer = _default_bias_init,
      eager_sharding: bool | None = False,
      rngs: nnx.Rngs,
  ):
    self._layout = validate_gqa(
        type(self).__name__, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        clip_mode=clip_mode, use_rope=use_rope, qkv_bias=qkv_bias, impl=impl,
        block_size=block_size, rope_theta=rope_theta, yarn=yarn, is_causal=is_causal,
        eager_sharding=eager_sharding,
    )
    self.use_rope, self.rope_theta, self.yarn, self.is_causal = use_rope, rope_theta, yarn, is_causal
    self.impl, self.block_size = impl, block_size
    kw = dict(
        dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        eager_sharding=eager_sharding, rngs=rngs,
    )
    qkv = dict(use_bias=qkv_bias, bias_init=bias_init, **kw)
    d = head_dim
    self.wq = _linear(in_features, num_heads * d, ("embed", "heads"), **qkv)
    self.wk = _linear(in_features, num_kv_heads * d, ("embed", "kv_heads"), **qkv)
    self.wv = _linear(in_features, num_kv_heads * d, ("embed", "kv_heads"), **qkv)
    self.wo = _linear(num_heads * d, in_features, ("heads", "embed"), **kw)

  @property
  def layout(self) -> GQALayout:
    """The ``GQALayout`` to hand to ``muonclip_jax.qk_clip``."""
    return self._layout

  @property
  def softmax_scale(self) -> float:
    return _rope.softmax_scale(self._layout.head_dim, self.yarn)

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
    b, t, _ = x.shape
    layout = self._layout
    positions, kw = mask_kwargs(
        x, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask, mask=mask,
        is_causal=self.is_causal,
    )
    q, k, v = gqa_qkv(
        self.wq(x), self.wk(x), self.wv(x), positions, layout=layout, use_rope=self.use_rope,
        rope_theta=self.rope_theta, yarn=self.yarn,
    )
    capture = capturing(self)
    out, max_logits = attention(
        q, k, v, softmax_scale=self.softmax_scale, impl=self.impl,
        block_size=self.block_size, return_max_logits=capture, **kw,
    )
    if capture:
      sow_head_max(self, max_logits)
    return self.wo(out.reshape(b, t, layout.num_heads * layout.head_dim))
