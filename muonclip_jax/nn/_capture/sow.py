"""``sow_max_logits``: the per-head max logit from attention code you wrote yourself.

QK-Clip (Kimi K2, arXiv 2507.20534, section 2.1) bounds, for every head h,

  S_max^h = max over every other axis (batch, query, key) with mask True of  logits[..., h, ...],

where ``logits`` is the number that enters the softmax *before* any soft-capping: the
scaled ``q . k`` plus any additive bias. A model that computes its logits by hand (Gemma's
``einsum("BTNH,BSNH->BTNS", q, k)``, Hugging Face Flax models, your own) calls::

  logits = jnp.einsum("BTNH,BSNH->BTNS", q * scale, k)
  muonclip_jax.nn.sow_max_logits(self, logits, mask=mask[:, :, None, :], head_axis=2)
  logits = cap * jnp.tanh(logits / cap)          # soft-capping, if any: after the capture
  logits = jnp.where(mask[:, :, None, :], logits, -1e30)

Why before the cap: ``cap * tanh(s / cap)`` stays below ``cap`` however large ``s`` grows,
so a maximum taken after it hides the growth of ``q . k`` that QK-Clip exists to stop (a
threshold at or above the cap would never fire, one below it would fire on a saturated,
meaningless number). The cap hides growth; it does not stop it.

It sows, on ``module``, the float32 leaf ``max_logits`` of shape ``(num_heads,)`` as a
running maximum over repeated calls (``reduce_fn=jnp.maximum``), where ``qk_clip`` looks for
it (next to the module's query and key projections). Nothing is computed unless it is being
captured: a Linen module under ``apply(..., mutable=["intermediates"])``, an NNX module under
``nnx.capture(model, nnx.Intermediate)``. A head without any True mask entry reports ``-inf``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .flax_private import check_module, nnx_capturing
from .._impl import head_max


def capturing(module: Any) -> bool:
  """Whether a maximum sown on ``module`` (Linen, NNX or None) would be recorded."""
  if isinstance(module, nn.Module):
    return module.is_mutable_collection("intermediates")
  if isinstance(module, nnx.Module):
    return nnx_capturing(module)
  return False


def sow_head_max(module: Any, max_logits: jax.Array) -> None:
  """Sows the ``(num_heads,)`` float32 ``max_logits`` on ``module`` as a running maximum."""
  h = max_logits.shape[0]
  init = lambda: jnp.full((h,), -jnp.inf, jnp.float32)  # noqa: E731
  if isinstance(module, nn.Module):
    module.sow("intermediates", "max_logits", max_logits, init_fn=init, reduce_fn=jnp.maximum)
  else:
    module.sow(nnx.Intermediate, "max_logits", max_logits, init_fn=init, reduce_fn=jnp.maximum)


def sow_max_logits(module: Any, logits: jax.Array, *, mask: Any = None, head_axis: int = -3) -> None:
  """Sows each head's max logit on ``module`` for QK-Clip (see the module docstring).

  Args:
    module: the Linen or NNX attention module that owns the query and key projections
      (``self`` in its ``__call__``).
    logits: the attention logits that enter the softmax, before any soft-cap: scaled
      ``q . k`` plus any additive bias, any shape with one head axis, e.g. Flax's
      ``(batch, heads, q_length, kv_length)``.
    mask: optional boolean array broadcastable to ``logits``; only True entries count.
      Pass the attention mask rather than relying on a large negative bias, so that a
      masked pair never counts.
    head_axis: the axis of ``logits`` that indexes heads (default -3, Flax's
      ``(..., heads, q, k)``; Gemma's ``"BTNS"`` logits: 2).

  Example:
    >>> import flax.linen as nn
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import sow_max_logits
    >>> class Attention(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, q, k):  # q, k: (B, T, H, D)
    ...     logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    ...     mask = nn.make_causal_mask(q[..., 0, 0])  # (B, 1, T, T)
    ...     sow_max_logits(self, logits, mask=mask)   # before any soft-cap
    ...     return logits
    >>> q = k = jnp.ones((1, 3, 2, 4))
    >>> _, state = Attention().apply({}, q, k, mutable=["intermediates"])
    >>> state["intermediates"]["max_logits"].tolist()  # (q . k) / sqrt(4) per head
    [2.0, 2.0]
  """
  check_module(module, "sow_max_logits")
  if capturing(module):
    sow_head_max(module, head_max(logits, mask, head_axis=head_axis, where="sow_max_logits"))
