"""The exact clip: QK-Clip repeated on the updated weights' own maxima until every layer holds.

Kimi K2 (arXiv 2507.20534, Algorithm 1) clips with the maxima of the step's forward pass,
which saw the weights before the update; ``make_train_step(exact_clip=True)`` measures
the updated weights on the same batch and clips again, layer by layer (see
``exact_qk_clip``), and reports the product of the factors each head received.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .max_logits import nest_max_logits
from .qk_clip import clip_decisions, no_clip_decisions, qk_clip


def exact_qk_clip(params: Any, measure: Callable[[Any], dict[str, jax.Array]], *, qk_clip_threshold: Any,
                  layout: Any, rtol: float = 1e-4) -> tuple[Any, jax.Array]:
  """QK-Clip until the params' own maxima are at most tau (1 + rtol), for any depth.

  Clipping attention layer l changes the input of the layers after it, so one clip with the
  maxima of one forward pass bounds only the first layer. This repeats: measure the maxima
  of ``params`` (``measure(params) -> {module: (*stack, H)}``, a gradient-free forward pass
  on the step's batch), and clip every head above ``tau (1 + rtol)`` to tau, then measure
  again, until no head is above it, or at most ``L`` times, ``L`` the number of attention
  layers (rows of the maxima: modules times stacked layers). After clip ``k`` the first
  ``k`` attention layers (in the order of the forward pass) are at most tau and are never
  touched again, so the inputs of layer ``k + 1`` are fixed: ``L`` clips bound every layer.
  This holds when each attention layer's logits depend only on its own and earlier layers'
  query/key weights; it fails for an attention module whose weights are applied more than
  once in the forward pass (weight sharing across depth) or whose logits do not follow its
  query/key kernels (a QK-norm the layout does not declare). Every clip is followed by a
  measurement, so the last one says whether every head holds.

  Inside jit, no host sync (``lax.while_loop``). Returns ``(params, passes)``: ``passes``
  (int32, 1 to L + 1) is the number of forward passes taken, one more than the clips.
  ``make_train_step(exact_clip=True)`` also reports the product of the factors each head
  received over the passes and the largest max logit of the last measurement.

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> from muonclip_jax import training
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> k = jax.random.split(jax.random.key(0), 3)
    >>> params = {"attn": {"wq": {"kernel": 3 * jax.random.normal(k[0], (8, 8))},
    ...                    "wk": {"kernel": 3 * jax.random.normal(k[1], (8, 8))}}}
    >>> x = jax.random.normal(k[2], (2, 5, 8))
    >>> def measure(p):  # each head's largest scaled logit on the batch x
    ...   q = (x @ p["attn"]["wq"]["kernel"]).reshape(2, 5, 2, 4)
    ...   kk = (x @ p["attn"]["wk"]["kernel"]).reshape(2, 5, 2, 4)
    ...   return {"attn": jnp.einsum("bqhd,bkhd->bhqk", q, kk).max(axis=(0, 2, 3)) / 2}
    >>> bool(jnp.max(measure(params)["attn"]) > 10.0)
    True
    >>> clipped, passes = training.exact_qk_clip(params, measure, qk_clip_threshold=10.0, layout=layout)
    >>> bool(jnp.max(measure(clipped)["attn"]) <= 10.0 * (1 + 1e-4)), int(passes)  # one clip, measured
    (True, 2)
  """
  return exact_clip_with_factors(params, measure, qk_clip_threshold=qk_clip_threshold, layout=layout, rtol=rtol)[:2]


def exact_clip_with_factors(params: Any, measure: Callable[[Any], dict[str, jax.Array]], *, qk_clip_threshold: Any,
                            layout: Any, rtol: float) -> tuple[Any, jax.Array, dict, dict, dict]:
  """``exact_qk_clip``, plus per head whether it was scaled, the product of its factors and the
  maxima of the returned params (the last measurement)."""
  maxima = measure(params)
  num_layers = sum(math.prod(s.shape[:-1]) for s in maxima.values())
  limit = jnp.asarray(qk_clip_threshold, jnp.float32) * (1 + rtol)

  def over(maxima):  # heads within the tolerance keep their weights
    return {m: jnp.where(s > limit, s, -jnp.inf) for m, s in maxima.items()}

  def clip(params, maxima, scaled, total):
    above = over(maxima)
    params = qk_clip(params, nest_max_logits(above), qk_clip_threshold=qk_clip_threshold, layout=layout)
    for m, s in above.items():
      hit, gamma = clip_decisions(s, qk_clip_threshold)
      scaled, total = {**scaled, m: scaled[m] | hit}, {**total, m: total[m] * gamma}
    return params, scaled, total

  def cond(carry):  # passes - 1 clips so far
    _, maxima, passes, _, _ = carry
    return (passes <= num_layers) & jnp.any(jnp.stack([jnp.any(s > limit) for s in maxima.values()]))

  def body(carry):
    params, maxima, passes, scaled, total = carry
    params, scaled, total = clip(params, maxima, scaled, total)
    return params, measure(params), passes + 1, scaled, total

  scaled, total = no_clip_decisions(maxima)
  params, maxima, passes, scaled, total = jax.lax.while_loop(
      cond, body, (params, maxima, jnp.ones((), jnp.int32), scaled, total))
  return params, passes, scaled, total, maxima


def exact_clip_step(params: Any, measure: Callable[[Any], dict[str, jax.Array]], *, qk_clip_threshold: Any,
                    layout: Any, rtol: float, updated: jax.Array | None,
                    like: dict[str, jax.Array]) -> tuple[Any, jax.Array, dict, dict, dict]:
  """The exact clip of one train step: ``exact_clip_with_factors``, where the weights changed.

  ``updated`` is None when every call updates the weights; under ``optax.MultiSteps`` /
  ``multi_steps`` it is whether this call made the real update, and the other micro-steps
  leave ``params`` as they are (0 passes, nothing scaled; ``like``, the step's maxima, are
  theirs).
  """

  def clip_now(p):
    return exact_clip_with_factors(p, measure, qk_clip_threshold=qk_clip_threshold, layout=layout, rtol=rtol)

  if updated is None:
    return clip_now(params)

  def skip(p):
    return (p, jnp.zeros((), jnp.int32), *no_clip_decisions(like), like)

  return jax.lax.cond(updated, clip_now, skip, params)


def exact_rtol(params: Any, compute_dtype: Any) -> float:
  """1e-4, or the machine epsilon of the forward's lowest-precision float dtype if larger."""
  dtypes = [jnp.dtype(compute_dtype)] if compute_dtype is not None else [
      jnp.result_type(x) for x in jax.tree.leaves(params) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  return max([1e-4] + [float(jnp.finfo(d).eps) for d in dtypes])
