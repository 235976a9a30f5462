"""The forward pass of a train step, with the max-logit capture it hands to QK-Clip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._clip import collect_max_logits

LossFn = Callable[..., tuple[jax.Array, Any]]


def split_loss_output(out: Any, caller: str = "make_train_step") -> tuple[jax.Array, Any, Any]:
  """``(loss, intermediates, aux)`` of ``loss_fn``'s ``(loss, intermediates)`` or ``(loss, (intermediates, aux))``."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(f"{caller}: loss_fn must return (loss, intermediates) or (loss, (intermediates, aux)), "
                    f"got {type(out).__name__}")
  loss, rest = out
  if isinstance(rest, (tuple, list)):
    if len(rest) != 2:
      raise TypeError(f"{caller}: loss_fn returned (loss, <{type(rest).__name__} of {len(rest)}>); "
                      "expected (loss, intermediates) or (loss, (intermediates, aux))")
    return loss, rest[0], rest[1]
  return loss, rest, None


def capturing_forward(loss_fn: LossFn, compute_dtype: Any = None) -> Callable[..., tuple[jax.Array, tuple]]:
  """``forward(params, batch, rng) -> (loss, (maxima, aux))``, ready for ``jax.value_and_grad(has_aux=True)``.

  ``loss_fn(params, batch)`` (``loss_fn(params, batch, rng)`` when ``rng`` is not None)
  returns ``(loss, intermediates)`` or ``(loss, (intermediates, aux))``; ``intermediates``
  holds the attention modules' ``max_logits`` leaves. ``forward`` returns the loss in
  float32 and the maxima flattened to ``{module path: (*stack, H)}``
  (``collect_max_logits``; ``{}`` when there is none: the train step decides whether it
  needs them). With ``compute_dtype`` the pass runs on a copy of the params whose
  floating-point leaves are cast to it (float32 master params, bfloat16 compute; integer
  and boolean leaves stay as they are), so gradients still have the params' dtypes.
  """

  def forward(params: Any, batch: Any, rng: Any = None) -> tuple[jax.Array, tuple]:
    compute = params if compute_dtype is None else jax.tree.map(
        lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    out = loss_fn(compute, batch) if rng is None else loss_fn(compute, batch, rng)
    loss, intermediates, aux = split_loss_output(out)
    return loss.astype(jnp.float32), (collect_max_logits(intermediates, required=False), aux)

  return forward
