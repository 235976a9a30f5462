"""``dot_product_attention``: Flax's attention function, plus the per-head max logit.

A drop-in ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` and
``flax.nnx.MultiHeadAttention``::

  nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=muonclip_jax.nn.dot_product_attention)
  nnx.MultiHeadAttention(8, 256, attention_fn=muonclip_jax.nn.dot_product_attention, ...)

It takes ``flax.linen.dot_product_attention``'s arguments and returns its output
``softmax(q k^T / sqrt(D) + bias, masked) v`` (Vaswani et al., arXiv 1706.03762), and it
sows, on the attention module that calls it, the float32 leaf ``max_logits`` of shape
``(num_heads,)``: for every head h,

  S_max^h = max over batch, query i, key j with mask[..., h, i, j] of  q_i . k_j / sqrt(D) + bias[..., h, i, j],

the pre-softmax logit of QK-Clip (Kimi K2, arXiv 2507.20534, section 2.1). The additive
``bias`` is part of that logit, so it is included; masked pairs are not (a head without an
unmasked pair reports ``-inf``). The leaf is a running maximum over repeated calls, lives
next to the module's ``query``/``key`` kernels (where ``qk_clip`` looks for it) and is
only computed while it is being captured: Linen ``apply(..., mutable=["intermediates"])``,
NNX ``nnx.capture(model, nnx.Intermediate)``. No attention weights are recorded.

Soft-capping: ``logits_soft_cap=cap`` (keyword-only; ``functools.partial`` for Flax) feeds
``cap * tanh(s / cap)`` to the softmax, Gemma 2's cap, with ``impl="dense"`` only (ValueError
otherwise). The sown maximum is of ``s`` before the cap: the cap hides the growth of
``q . k`` but does not stop it, and a maximum after it could never exceed ``cap``.

Which module: Linen calls ``attention_fn`` from inside the module's ``__call__``, so the
function finds the calling module itself (through Flax's private module stack, see
``_capture.flax_private``: a Flax release that moves it makes this raise, never sow nothing);
``attention_fn=`` alone is enough.
``nnx.MultiHeadAttention`` hands its module over only when called with
``sow_weights=True`` (``module=self``), which with this function sows ``max_logits``
instead of the attention weights: call NNX attention modules with ``sow_weights=True``.

Implementation: without an additive ``bias`` and without active dropout the attention
is ``muonclip_jax.nn.attention`` (``impl=``/``block_size=`` select its kernel; pass them
with ``functools.partial(dot_product_attention, impl="chunked")``; an ``impl`` outside
``ATTENTION_IMPLS`` raises ValueError). A ``bias`` or dropout needs the attention weights,
so those calls take a dense path that materializes them (``impl="dense"`` only; any other
``impl`` raises ValueError) and draws dropout exactly as Flax does (same ``dropout_rng``,
same mask shapes), so outputs match Flax's.

Masks with ``impl="splash"``: the fused kernel takes no explicit ``(B, H, Tq, Tk)`` mask,
only causal masking and per-batch-row padding. Through ``attention_fn`` it therefore runs

* causal self-attention given as ``is_causal=True`` with no mask:
  ``functools.partial(dot_product_attention, impl="splash", is_causal=True)`` for Linen
  (which never passes ``is_causal``), or ``is_causal=True`` in the call of an
  ``nnx.MultiHeadAttention`` (which always passes its own ``is_causal``);
* a key padding mask, of a shape broadcastable as ``(B|1, 1, 1, Tk)`` (e.g.
  ``key_valid[:, None, None, :]`` for a boolean ``key_valid`` of shape ``(B, Tk)``), which
  becomes the kernel's ``kv_mask``; alone or with ``is_causal``.

Any other mask (per head, per query row, or a full ``(B, 1, Tq, Tk)`` mask such as
``nn.make_causal_mask``: the kernel cannot read mask values) raises ValueError; use
``impl="dense"``, ``"chunked"`` or ``"dpa_max"`` for arbitrary masks. NNX's ``is_causal``
with ``q_length != kv_length`` (a top-left aligned mask) is such a mask too.

Differences from Flax, all documented: the logits and the softmax are always float32 (as
``force_fp32_for_softmax=True``), so bf16 results can differ from Flax's bf16 softmax in
the last bits; the quantized-einsum hooks (``einsum_dot_general``,
``qk_attn_weights_einsum``, ``attn_weights_value_einsum``) are not supported and raise.
A query row whose keys are all masked gets, as in Flax, the mean of the values.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp

from ..._util import check_bool
from .._attention import attention, ATTENTION_IMPLS
from .flax_private import check_module, linen_calling_module
from .._impl import check_soft_cap, head_max, soft_cap
from .sow import capturing, sow_head_max


def _calling_module(module: Any) -> Any:
  """``module``, or the Linen module whose method is running (see ``_capture.flax_private``), or None."""
  if module is not None:
    return check_module(module, "dot_product_attention")
  return linen_calling_module()


def _precision(precision: Any) -> Any:
  """A context in which every matmul uses ``precision`` (None: the default)."""
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, jax.lax.Precision):
    return jax.default_matmul_precision(precision.name.lower())
  if isinstance(precision, str):
    return jax.default_matmul_precision(precision)
  raise ValueError(
      f"dot_product_attention: precision must be None, a jax.lax.Precision or its name, got {precision!r}"
  )


def _to_4d(x: Any, name: str, batch: tuple[int, ...], full: tuple[int, int, int]) -> jax.Array:
  """A mask/bias broadcastable to ``(*batch, H, Tq, Tk)`` as ``(B|1, H|1, Tq|1, Tk|1)``."""
  x = jnp.asarray(x)
  target = batch + full
  if x.ndim > len(target):
    raise ValueError(f"dot_product_attention: {name} of shape {x.shape} has more axes than "
                     f"(*batch, heads, q_length, kv_length) = {target}")
  x = x.reshape((1,) * (len(target) - x.ndim) + x.shape)
  if any(s not in (1, t) for s, t in zip(x.shape, target)):
    raise ValueError(f"dot_product_attention: {name} of shape {x.shape} is not broadcastable to "
                     f"(*batch, heads, q_length, kv_length) = {target}")
  nb = len(batch)
  if all(s == 1 for s in x.shape[:nb]):
    return x.reshape((1,) + x.shape[nb:])
  return jnp.broadcast_to(x, batch + x.shape[nb:]).reshape((math.prod(batch),) + x.shape[nb:])


def _key_padding(allowed: jax.Array, mask: Any, b: int, tk: int, *, is_causal: bool) -> jax.Array:
  """The ``(B, Tk)`` ``kv_mask`` equal to a ``(B|1, H|1, Tq|1, Tk|1)`` mask, for ``impl="splash"``.

  Only a mask without a head or query axis (a key padding mask, per batch row and shared
  by all heads and queries) is expressible; any other raises ValueError.
  """
  if allowed.shape[1] == 1 and allowed.shape[2] == 1:
    return jnp.broadcast_to(allowed[:, 0, 0, :], (b, tk))
  what = ("is_causal=True with q_length != kv_length (a top-left aligned causal mask)" if is_causal
          else f"a mask of shape {jnp.shape(mask)} (as (B, H, Tq, Tk): {allowed.shape})")
  raise ValueError(
      f"dot_product_attention: impl='splash' cannot apply {what}: the fused kernel takes no "
      "explicit (B, H, Tq, Tk) mask. Through attention_fn it supports causal self-attention as "
      "functools.partial(dot_product_attention, impl='splash', is_causal=True) with no mask "
      "(NNX: call the module with is_causal=True), and key padding masks of shape (B, 1, 1, Tk); "
      "for arbitrary masks use impl='dense', 'chunked' or 'dpa_max'"
  )


def _dense_with_weights(q, k, v, *, scale, bias, allowed, dropout, dtype, cap):
  """Attention through the materialized weights ``(B, H, Tq, Tk)``: for a bias or dropout.

  Returns ``(out (B, Tq, H, Dv), max_logits (H,))``. ``dropout`` is None or
  ``(rng, rate, broadcast, batch)``; the keep mask is drawn with Flax's shapes.
  """
  b, tq, h, _ = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  g = h // hkv
  s = jnp.einsum("bqngd,bknd->bngqk", q.reshape(b, tq, hkv, g, -1), k, preferred_element_type=jnp.float32)
  s = s.reshape(b, h, tq, tk) * jnp.float32(scale)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  if allowed is not None:
    s = jnp.where(allowed, s, -jnp.inf)
  max_logits = head_max(s, head_axis=1)  # before the cap (module doc)
  s = soft_cap(s, cap)
  row_max = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jax.lax.stop_gradient(jnp.where(jnp.isneginf(row_max), 0.0, row_max)))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)
  if allowed is not None:  # Flax: a row with every key masked attends uniformly
    p = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), p, jnp.float32(1.0 / tk))
  p = p.astype(dtype)
  if dropout is not None:
    rng, rate, broadcast, batch = dropout
    keep_prob = 1.0 - rate
    shape = (1,) * (len(batch) + 1) + (tq, tk) if broadcast else batch + (h, tq, tk)
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
    p = p * multiplier.reshape((-1,) + multiplier.shape[len(batch):])
  out = jnp.einsum("bngqk,bknd->bqngd", p.reshape(b, hkv, g, tq, tk), v, preferred_element_type=jnp.float32)
  return out.reshape(b, tq, h, dv).astype(dtype), max_logits


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Any = None,
    qk_attn_weights_einsum: Any = None,
    attn_weights_value_einsum: Any = None,
    is_causal: bool = False,
    *,
    impl: str = "auto",
    block_size: int = 512,
    logits_soft_cap: float | None = None,
) -> jax.Array:
  """Flax's ``dot_product_attention`` that also sows each head's max logit (see module doc).

  Args:
    query: ``(*batch, q_length, num_heads, head_dim)``.
    key: ``(*batch, kv_length, num_kv_heads, head_dim)``; ``num_kv_heads`` divides
      ``num_heads`` (grouped-query attention, as ``nnx.dot_product_attention``).
    value: ``(*batch, kv_length, num_kv_heads, v_head_dim)``.
    bias: additive logit bias broadcastable to ``(*batch, num_heads, q_length, kv_length)``;
      part of the logits and of their maximum.
    mask: boolean mask of the same broadcast shape; False pairs are masked.
    broadcast_dropout: one dropout mask for all batch entries and heads (as Flax).
    dropout_rng: PRNG key of the dropout.
    dropout_rate: attention-weight dropout rate (applied after the softmax, as Flax).
    deterministic: no dropout when True.
    dtype: computation and output dtype (default: the inputs' promoted dtype).
    precision: matmul precision (``jax.lax.Precision`` or its name).
    module: the module to sow on; Linen finds its calling module without it, NNX hands
      it over under ``sow_weights=True``.
    force_fp32_for_softmax: accepted; the softmax is always float32.
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: not supported
      (ValueError unless None).
    is_causal: NNX's causal mask (key ``j`` attends query ``i`` iff ``j <= i``).
    impl: ``muonclip_jax.nn.attention``'s kernel, one of ``ATTENTION_IMPLS`` (default
      ``"auto"``: by backend, see ``attention``; a bias or dropout takes the dense path) (keyword-only,
      never passed by Flax). ``"splash"`` takes only key padding masks (see module doc).
    block_size: key block of ``impl="chunked"``.
    logits_soft_cap: None, or a positive float ``cap``: the softmax reads
      ``cap * tanh(s / cap)`` of the scaled logit plus bias ``s`` (Gemma 2), keyword-only.
      The sown maximum is of ``s`` before the cap (see ``muonclip_jax.nn.attention``);
      ``impl="dense"`` only (ValueError otherwise).

  Returns:
    ``(*batch, q_length, num_heads, v_head_dim)`` in ``dtype``.

  Example:
    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import dot_product_attention
    >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16,
    ...                                         attention_fn=dot_product_attention)
    >>> x = jnp.ones((1, 4, 16))
    >>> params = layer.init(jax.random.key(0), x)
    >>> y, state = layer.apply(params, x, mutable=["intermediates"])
    >>> y.shape, state["intermediates"]["max_logits"].shape  # sown next to query/key
    ((1, 4, 16), (2,))
  """
  for name, flag in (("broadcast_dropout", broadcast_dropout), ("deterministic", deterministic),
                     ("force_fp32_for_softmax", force_fp32_for_softmax), ("is_causal", is_causal)):
    check_bool(f"dot_product_attention: {name}", flag)
  del force_fp32_for_softmax  # the softmax is float32 in every case
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"dot_product_attention: impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  check_soft_cap(logits_soft_cap, impl, "dot_product_attention")
  for name, hook in (("einsum_dot_general", einsum_dot_general), ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                     ("attn_weights_value_einsum", attn_weights_value_einsum)):
    if hook is not None:
      raise ValueError(f"dot_product_attention: {name} is not supported (got {hook!r}); use "
                       "flax.linen.dot_product_attention for quantized einsums")
  dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
  query, key, value = (jnp.asarray(x, dt) for x in (query, key, value))
  if not (query.ndim == key.ndim == value.ndim >= 3):
    raise ValueError("dot_product_attention: query, key, value must have the same rank >= 3 "
                     f"(*batch, length, heads, head_dim), got {query.shape}, {key.shape}, {value.shape}")
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch or key.shape[-3:-1] != value.shape[-3:-1]:
    raise ValueError("dot_product_attention: query, key, value must share batch axes and key/value "
                     f"their length and heads, got {query.shape}, {key.shape}, {value.shape}")
  tq, h, d = query.shape[-3:]
  tk = key.shape[-3]
  if key.shape[-1] != d or h % key.shape[-2]:
    raise ValueError(f"dot_product_attention: key {key.shape} must have query's head_dim {d} and a "
                     f"number of heads dividing query's {h} (query {query.shape})")
  dropout = None
  if not deterministic and dropout_rate > 0.0:
    if dropout_rng is None:
      raise ValueError("dot_product_attention: dropout_rate > 0 and not deterministic needs dropout_rng")
    dropout = (dropout_rng, dropout_rate, broadcast_dropout, batch)
  b = math.prod(batch)
  q4, k4, v4 = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
  full = (h, tq, tk)
  allowed = None if mask is None else _to_4d(mask, "mask", batch, full).astype(bool)
  square_causal = bool(is_causal) and tq == tk  # the kernels' causal mask (equal lengths)
  if is_causal and not square_causal:  # NNX's mask is jnp.tril(ones((Tq, Tk))): top-left aligned
    tril = jnp.tril(jnp.ones((tq, tk), bool))[None, None]
    allowed = tril if allowed is None else allowed & tril
  target = _calling_module(module)
  capture = capturing(target)
  scale = 1.0 / math.sqrt(d)
  with _precision(precision):
    if bias is not None or dropout is not None:
      if impl not in ("dense", "auto"):
        raise ValueError(f"dot_product_attention: impl={impl!r} supports neither an additive bias nor "
                         "dropout; these need the attention weights (impl='dense')")
      if square_causal:
        tril = jnp.tril(jnp.ones((tq, tk), bool))[None, None]
        allowed = tril if allowed is None else allowed & tril
      bias4 = None if bias is None else _to_4d(bias, "bias", batch, full)
      out, max_logits = _dense_with_weights(q4, k4, v4, scale=scale, bias=bias4, allowed=allowed,
                                            dropout=dropout, dtype=dt, cap=logits_soft_cap)
    else:
      pair_mask, kv_mask = allowed, None
      if impl == "splash" and allowed is not None:
        pair_mask, kv_mask = None, _key_padding(allowed, mask, b, tk, is_causal=bool(is_causal) and not square_causal)
      out, max_logits = attention(q4, k4, v4, softmax_scale=scale, impl=impl, block_size=block_size,
                                  is_causal=square_causal, mask=pair_mask, kv_mask=kv_mask, return_max_logits=capture,
                                  logits_soft_cap=logits_soft_cap)
      if allowed is not None:  # Flax: a row with every key masked gets the mean of the values
        rows = allowed if not square_causal else allowed & jnp.tril(jnp.ones((tq, tk), bool))[None, None]
        some = jnp.any(jnp.broadcast_to(rows, rows.shape[:2] + (tq, tk)), axis=-1)  # (B|1, H|1, Tq)
        mean_v = jnp.repeat(jnp.mean(v4.astype(jnp.float32), axis=1), h // k4.shape[2], axis=1)
        out = jnp.where(jnp.moveaxis(some, 1, 2)[..., None], out, mean_v[:, None].astype(dt))
  if capture:
    sow_head_max(target, max_logits)
  return out.reshape(batch + out.shape[1:])
