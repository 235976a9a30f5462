"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) that reports per-head max logits.

MLA (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1; DeepSeek-V3, arXiv 2412.19437,
Sec. 2.1.1) with ``n_h`` heads, model width ``d``:

  c^Q = RMSNorm(x W^{DQ})                      (wq_a, q_norm; skipped when q_lora_rank == 0)
  [q^C_h ; q^R_h] = c^Q W^{UQ}                 (wq_b, or wq = x W^Q without query LoRA)
  [c^KV ; k^R] = x W^{DKV}                     (wkv_a: the latent, then the shared rotary key)
  [k^C_h ; v_h] = RMSNorm(c^KV) W^{UKV}        (kv_norm, wkv_b)
  q_h = [q^C_h ; RoPE(q^R_h)],  k_h = [k^C_h ; RoPE(k^R)]   (k^R shared by all heads)
  o_h = softmax(softmax_scale * q_h k_h^T + mask) v_h,  y = [o_1 .. o_{n_h}] W^O   (wo)

with ``softmax_scale = 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (times YaRN's
``mscale^2``). The RMSNorms on the two latents follow DeepSeek-V3's released model
code. Every kernel is a 2-D matrix with head-major columns in the order QK-Clip expects
(see ``muonclip_jax.MLALayout``). The per-head maximum of the scaled logits is sown as
``intermediates/.../max_logits`` (see ``MultiHeadLatentAttention``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._util import check_bool, check_positive_int
from .._clip import MLALayout
from ._capture import capturing, sow_head_max
from ._attention import AttentionImpl, attention
from ._module_args import Initializer, check_input, mask_kwargs, validate_common
from ._rope import YarnScaling, apply_rope
from . import _rope  # _rope.softmax_scale: the modules have a property of that name


def validate_mla(name: str, *, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                 qk_rope_head_dim, v_head_dim, rope_interleave=False, **common) -> MLALayout:
  """Checks MLA fields (``ValueError``; ``TypeError`` for a non-bool boolean) and returns the layout."""
  check_bool(f"{name}: rope_interleave", rope_interleave)
  check_positive_int(f"{name}: q_lora_rank", q_lora_rank, allow_zero=True)
  check_positive_int(f"{name}: kv_lora_rank", kv_lora_rank)
  try:
    layout = MLALayout(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, out="wo")
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from None
  if qk_rope_head_dim % 2:
    raise ValueError(f"{name}: qk_rope_head_dim must be even for RoPE, got {qk_rope_head_dim}")
  validate_common(name, **common)
  return layout


def mla_qkv(
    q: jax.Array,
    kv_a: jax.Array,
    kv_norm: Callable[[jax.Array], jax.Array],
    wkv_b: Callable[[jax.Array], jax.Array],
    positions: jax.Array,
    *,
    layout: MLALayout,
    kv_lora_rank: int,
    rope_theta: float,
    yarn: YarnScaling | None,
    rope_interleave: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-head ``q (B, T, H, dn+dr)``, ``k (B, T, H, dn+dr)``, ``v (B, T, H, dv)``.

  ``q`` is the query projection ``(B, T, H*(dn+dr))``, ``kv_a`` the output of ``wkv_a``
  ``(B, T, kv_lora_rank + dr)``; shared by the Linen and NNX modules.
  """
  b, t = q.shape[:2]
  h, dv = layout.num_heads, layout.v_head_dim
  dn, dr = layout.qk_nope_head_dim, layout.qk_rope_head_dim
  q = q.reshape(b, t, h, dn + dr)
  q_nope, q_rope = q[..., :dn], q[..., dn:]
  c_kv, k_rope = kv_a[..., :kv_lora_rank], kv_a[..., kv_lora_rank:]
  kv = wkv_b(kv_norm(c_kv)).reshape(b, t, h, dn + dv)
  k_nope, v = kv[..., :dn], kv[..., dn:]
  if dr:
    rope = dict(base=rope_theta, yarn=yarn, rope_interleave=rope_interleave)
    q_rope = apply_rope(q_rope, positions, **rope)
    k_rope = apply_rope(k_rope[:, :, None, :], positions, **rope)
    k_rope = jnp.broadcast_to(k_rope, (b, t, h, dr)).astype(k_nope.dtype)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
  else:
    q, k = q_nope, k_nope
  return q, k, v


class MultiHeadLatentAttention(nn.Module):
  """DeepSeek-V3 multi-head latent attention (Linen) with per-head max-logit capture.

  ``module.apply(variables, x)`` with ``x (batch, seq, dim)`` runs causal self-attention
  and returns ``(batch, seq, dim)``. Keyword arguments: ``positions (B, T)`` for RoPE
  (default ``0..T-1``), ``segment_ids (B, T)`` for packed sequences, ``padding_mask
  (B, T)`` (True = real token; masks both padded keys and padded queries) and ``mask``,
  a Flax-style boolean ``(B|1, H|1, T, T)`` mask combined with the others.

  Max logits: when the ``intermediates`` collection is mutable
  (``apply(..., mutable=["intermediates"])``), the module sows a float32 leaf
  ``intermediates/<module path>/max_logits`` of shape ``(num_heads,)``: the largest
  scaled logit ``softmax_scale * q_h . k_h`` over batch, queries and keys of unmasked
  pairs (``-inf`` for a head without any), under ``stop_gradient``. Repeated calls in
  one ``apply`` keep a running maximum; under ``nn.scan`` with
  ``variable_axes={"params": 0, "intermediates": 0}`` the leaf is
  ``(num_layers, num_heads)`` (boxed parameters also need
  ``metadata_params={nn.PARTITION_NAME: "layers"}``, or any name for the stacked axis).
  When the collection is not mutable nothing is computed and nothing is sown.

  Parameters (plain 2-D kernels, head-major columns, logical axis names):
    ``wq_a/kernel (dim, q_lora_rank)`` ("embed", "q_lora"),
    ``q_norm/scale (q_lora_rank,)`` ("norm",),
    ``wq_b/kernel (q_lora_rank, H*(dn+dr))`` ("q_lora", "heads"),
    or without query LoRA ``wq/kernel (dim, H*(dn+dr))`` ("embed", "heads"),
    ``wkv_a/kernel (dim, kv_lora_rank+dr)`` ("embed", "kv_lora"),
    ``kv_norm/scale (kv_lora_rank,)`` ("norm",),
    ``wkv_b/kernel (kv_lora_rank, H*(dn+dv))`` ("kv_lora", "heads"),
    ``wo/kernel (H*dv, dim)`` ("heads", "embed"),
  where ``H = num_heads``, ``dn = qk_nope_head_dim``, ``dr = qk_rope_head_dim``,
  ``dv = v_head_dim``. Query columns of head ``h`` are its nope then rope parts;
  ``wkv_b`` columns of head ``h`` are its k_nope then v parts.

  Attributes:
    num_heads: number of attention heads ``H``.
    q_lora_rank: rank of the query down-projection ``wq_a``; 0 = a single ``wq``.
    kv_lora_rank: rank of the key/value latent ``c^KV``.
    qk_nope_head_dim: per-head width of the non-rotary query/key part.
    qk_rope_head_dim: per-head width of the rotary query part and of the shared rotary key (even).
    v_head_dim: per-head value width.
    rope_theta: RoPE base.
    yarn: optional ``YarnScaling``: YaRN frequencies and the softmax scale times ``mscale^2``.
    rope_interleave: rotate the pairs ``(2i, 2i+1)`` of each rotary part (DeepSeek-V3's
      reference and Hugging Face's ``rope_interleave``) instead of ``(i, i + dr/2)``;
      checkpoints of DeepSeek-V3 / Kimi K2 then load without permuting columns.
    is_causal: causal self-attention (default True). ``rope_interleave`` and ``is_causal``
      are bools: anything else (``"False"`` is truthy) is a TypeError.
    impl: ``"auto"`` (default: splash on TPU, tokamax's GPU kernels on GPU, dense
      on CPU), ``"dense"`` (materialized logits), ``"chunked"`` (online softmax),
      ``"dpa_max"``, ``"splash"`` or ``"tokamax_gpu"`` (see ``attention``).
    block_size: key block length of ``"chunked"`` and ``"dpa_max"``.
    norm_epsilon: RMSNorm epsilon of ``q_norm`` and ``kv_norm``.
    dtype: computation dtype (``None``: inferred from inputs and params).
    param_dtype: parameter dtype.
    kernel_init: initializer of every kernel (wrapped with its logical axis names).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import MultiHeadLatentAttention
    >>> attn = MultiHeadLatentAttention(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
    ...                                 qk_rope_head_dim=4, v_head_dim=4, impl="dense")
    >>> x = jnp.ones((1, 5, 16))  # (batch, seq, dim)
    >>> params = attn.init(jax.random.key(0), x)
    >>> y, state = attn.apply(params, x, mutable=["intermediates"])
    >>> y.shape, state["intermediates"]["max_logits"].shape
    ((1, 5, 16), (2,))
    >>> params["params"]["wkv_b"]["kernel"].value.shape  # (kv_lora_rank, H * (dn + dv))
    (8, 16)
  """

  num_heads: int
  q_lora_rank: int = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope_theta: float = 10000.0
  yarn: YarnScaling | None = None
  rope_interleave: bool = False
  is_causal: bool = True
  impl: AttentionImpl = "auto"
  block_size: int = 512
  norm_epsilon: float = 1e-6
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()

  def __post_init__(self):
    validate_mla(
        type(self).__name__, num_heads=self.num_heads, q_lora_rank=self.q_lora_rank,
        kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
        qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
        impl=self.impl, block_size=self.block_size,
        rope_theta=self.rope_theta, yarn=self.yarn, rope_interleave=self.rope_interleave,
        is_causal=self.is_causal,
    )
    super().__post_init__()

  @property
  def layout(self) -> MLALayout:
    """The ``MLALayout`` to hand to ``muonclip_jax.qk_clip`` and ``muonclip`` (output projection ``wo``)."""
    return MLALayout(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, out="wo")

  @property
  def softmax_scale(self) -> float:
    """``1/sqrt(dn + dr)``, times YaRN's ``mscale^2`` when ``yarn`` is set."""
    return _rope.softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim, self.yarn)

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
    h, dqk, dv = layout.num_heads, layout.qk_head_dim, layout.v_head_dim
    dense = functools.partial(
        nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype
    )
    init = lambda *names: nn.with_logical_partitioning(self.kernel_init, names)
    norm = functools.partial(
        nn.RMSNorm, epsilon=self.norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
    )
    if self.q_lora_rank:
      wq_a = dense(self.q_lora_rank, kernel_init=init("embed", "q_lora"), name="wq_a")
      c_q = norm(name="q_norm")(wq_a(x))
      q = dense(h * dqk, kernel_init=init("q_lora", "heads"), name="wq_b")(c_q)
    else:
      q = dense(h * dqk, kernel_init=init("embed", "heads"), name="wq")(x)
    wkv_a = dense(
        self.kv_lora_rank + layout.qk_rope_head_dim, kernel_init=init("embed", "kv_lora"),
        name="wkv_a",
    )
    kv_norm = norm(name="kv_norm")
    wkv_b = dense(
        h * (layout.qk_nope_head_dim + dv), kernel_init=init("kv_lora", "heads"), name="wkv_b"
    )
    positions, kw = mask_kwargs(
        x, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask, mask=mask,
        is_causal=self.is_causal,
    )
    q, k, v = mla_qkv(
        q, wkv_a(x), kv_norm, wkv_b, positions, layout=layout, kv_lora_rank=self.kv_lora_rank,
        rope_theta=self.rope_theta, yarn=self.yarn, rope_interleave=self.rope_interleave,
    )
    capture = capturing(self)
    out, max_logits = attention(
        q, k, v, softmax_scale=self.softmax_scale, impl=self.impl,
        block_size=self.block_size, return_max_logits=capture, **kw,
    )
    if capture:
      sow_head_max(self, max_logits)
    return dense(dim, kernel_init=init("heads", "embed"), name="wo")(out.reshape(b, t, h * dv))
