"""``dot_product_attention_weights``: Flax's attention weights, plus the per-head max logit.

A drop-in for ``flax.linen.dot_product_attention_weights``: same arguments, and the same
weights (it calls Flax's own function; the logits are read through its ``einsum`` hook, so
``q . k`` is computed once). It also sows, like ``muonclip_jax.nn.dot_product_attention``,
the float32 ``(num_heads,)`` leaf ``max_logits`` on the calling module: for every head h,

  S_max^h = max over batch, query i, key j with mask[..., h, i, j] of  q_i . k_j / sqrt(D) + bias[..., h, i, j],

the scaled logit plus bias that enters the softmax (QK-Clip, Kimi K2, arXiv 2507.20534).
Code that calls ``dot_product_attention_weights`` by hand (Hugging Face's Flax GPT-2 and
Llama, which import it into their modules and have no ``attention_fn`` hook) needs one line::

  import transformers.models.llama.modeling_flax_llama as hf_llama
  hf_llama.dot_product_attention_weights = muonclip_jax.nn.dot_product_attention_weights

Such code passes no ``module=``: the calling Linen module is found on Flax's module stack
(``_capture.flax_private``), so the maximum lands next to the module's ``q_proj``/``k_proj`` (or
``c_attn``), where ``qk_clip`` looks. With ``module=`` it sows there (Linen or NNX) instead
of Flax's ``attention_weights``. Nothing is computed unless ``intermediates`` is captured.

A bias of ``finfo.min`` (how Hugging Face masks) counts like any other bias: it never wins
the maximum while a head has any pair left unmasked. A query row whose every key is masked
by ``mask`` is skipped; by such a bias it would count its ``finfo.min`` logits.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as flax_nn
import jax
import jax.numpy as jnp

from ..._util import check_bool
from .flax_private import check_module, linen_calling_module
from .._impl import head_max
from .sow import capturing, sow_head_max


def dot_product_attention_weights(
    query: jax.Array,
    key: jax.Array,
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
    einsum: Any = None,
) -> jax.Array:
  """``flax.linen.dot_product_attention_weights`` that also sows each head's max logit.

  Args: those of ``flax.linen.dot_product_attention_weights``: ``query``
  ``(*batch, q_length, heads, head_dim)``, ``key`` ``(*batch, kv_length, heads, head_dim)``,
  ``bias`` and ``mask`` broadcastable to ``(*batch, heads, q_length, kv_length)``, dropout,
  ``dtype``, ``precision``, ``module`` (where to sow; default: the calling Linen module),
  ``force_fp32_for_softmax``, and the ``einsum`` hook. ``einsum_dot_general`` is not
  supported (ValueError unless None).

  Returns:
    Flax's attention weights ``(*batch, heads, q_length, kv_length)``, computed by Flax's own
    function.

  Example:
    >>> import flax.linen as nn
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import dot_product_attention_weights
    >>> class Weights(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, q, k):
    ...     return dot_product_attention_weights(q, k)  # no module= needed
    >>> q = k = jnp.ones((2, 8, 4, 16))  # (batch, length, heads, head_dim)
    >>> w, state = Weights().apply({}, q, k, mutable=["intermediates"])
    >>> w.shape, state["intermediates"]["max_logits"].tolist()  # (q . k) / sqrt(16)
    ((2, 4, 8, 8), [4.0, 4.0, 4.0, 4.0])
  """
  for name, flag in (("broadcast_dropout", broadcast_dropout), ("deterministic", deterministic),
                     ("force_fp32_for_softmax", force_fp32_for_softmax)):
    check_bool(f"dot_product_attention_weights: {name}", flag)
  if einsum_dot_general is not None:
    raise ValueError(f"dot_product_attention_weights: einsum_dot_general is not supported (got {einsum_dot_general!r}); "
                     "use flax.linen.dot_product_attention_weights for quantized einsums")
  target = check_module(module, "dot_product_attention_weights") if module is not None else linen_calling_module()
  kwargs = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
                force_fp32_for_softmax=force_fp32_for_softmax)
  if not capturing(target):
    return flax_nn.dot_product_attention_weights(query, key, precision=precision, einsum=einsum, **kwargs)
  if einsum is not None and precision is not None:  # Flax's own error
    return flax_nn.dot_product_attention_weights(query, key, precision=precision, einsum=einsum, **kwargs)
  inner = einsum if einsum is not None else functools.partial(jnp.einsum, precision=precision)
  seen = []

  def recording_einsum(*args, **kw):
    logits = inner(*args, **kw)  # q / sqrt(D) . k, as Flax scales it
    seen.append(logits)
    return logits

  weights = flax_nn.dot_product_attention_weights(query, key, einsum=recording_einsum, **kwargs)
  if len(seen) != 1:
    raise RuntimeError(f"dot_product_attention_weights: flax.linen.dot_product_attention_weights called its einsum "
                       f"hook {len(seen)} times, expected once; this Flax version is not supported")
  logits = seen[0] if bias is None else seen[0] + bias
  sow_head_max(target, head_max(logits, mask, head_axis=-3, where="dot_product_attention_weights"))
  return weights
