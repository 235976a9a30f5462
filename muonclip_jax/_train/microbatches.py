"""Gradient accumulation inside one train step: microbatches scanned, maxima combined by maximum.

QK-Clip needs S_max^h over the whole step's batch (Kimi K2, arXiv 2507.20534, section 2.1),
so the maxima of k microbatches are combined by maximum while gradients, the loss and any
auxiliary outputs are averaged; the optimizer (and its clip) then runs once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .._clip import merge_max_logits


def split_leading(x: jax.Array, k: int) -> jax.Array:
  """``(B, ...) -> (k, B // k, ...)``, microbatch i = rows ``[i B/k, (i+1) B/k)``.

  On a mesh with explicit axes a batch sharded over its leading axis cannot be reshaped
  without saying where the result lives: each microbatch is sharded like the batch was
  (or replicated when ``B / k`` does not divide over those devices), so a sharded step
  sees the same microbatches, in the same order, as a single-device step.
  """
  shape = (k, x.shape[0] // k, *x.shape[1:])
  sharding = jax.typeof(x).sharding
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
  if spec[0] is None:
    return x.reshape(shape)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  lead = spec[0] if shape[1] % math.prod(sharding.mesh.shape[a] for a in axes) == 0 else None
  out = NamedSharding(sharding.mesh, PartitionSpec(None, lead, *spec[1:x.ndim]))
  return jax.lax.reshape(x, shape, out_sharding=out)


def split_microbatches(batch: Any, k: int, caller: str = "make_train_step") -> Any:
  """Every leaf of ``batch`` split along its leading axis into ``k`` microbatches (``split_leading``)."""

  def split(path, x):
    if jnp.ndim(x) == 0 or x.shape[0] % k:
      what = f"batch leaf {jax.tree_util.keystr(path)}" if path else "the batch (one array)"
      raise ValueError(
          f"{caller}: {what} of shape {jnp.shape(x)} has no leading "
          f"axis divisible by num_microbatches={k} (pass a dropout key as step(..., rng=key), not in the batch)")
    return split_leading(x, k)

  return jax.tree_util.tree_map_with_path(split, batch)


def _microbatches(batch: Any, rng: Any, k: int) -> tuple[Any, Any]:
  return split_microbatches(batch, k), None if rng is None else jax.random.split(rng, k)


def loss_grads_maxima(forward: Callable, params: Any, batch: Any, rng: Any, k: int) -> tuple:
  """``(loss, grads, maxima, aux)`` of ``forward`` over ``k`` microbatches of ``batch``.

  ``forward(params, batch, rng) -> (loss, (maxima, aux))`` (``capturing_forward``). With
  ``k == 1`` one pass; with ``k > 1`` a ``lax.scan`` over the microbatches (``rng`` split
  into one key each): the loss, the gradients and ``aux`` are averaged (``aux`` in at
  least float32; each microbatch's share divided by ``k`` before it is added, so that ``k``
  finite gradients near the dtype's largest do not overflow their sum), the maxima
  ``{module: (*stack, H)}`` combined by maximum. The gradient of an integer or boolean leaf (a
  step counter kept in the params) is a zero of its dtype (``jax.grad``'s ``float0``, made
  addable), which the library's optimizers leave alone.
  """
  value_and_grad = jax.value_and_grad(forward, has_aux=True, allow_int=True)

  def grad_fn(params, *args):
    out, grads = value_and_grad(params, *args)
    return out, jax.tree.map(lambda g, p: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g, grads, params)

  if k == 1:
    (loss, (maxima, aux)), grads = grad_fn(params, batch, rng)
    return loss, grads, maxima, aux
  micro = _microbatches(batch, rng, k)
  _, (maxima_shape, aux_shape) = jax.eval_shape(forward, params, *jax.tree.map(lambda x: x[0], micro))
  init = (
      jnp.zeros((), jnp.float32),
      jax.tree.map(jnp.zeros_like, params),
      {m: jnp.full(s.shape, -jnp.inf, jnp.float32) for m, s in maxima_shape.items()},
      jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), aux_shape),
  )

  def mean_part(x):  # x / k before summing: a sum of k finite gradients near the dtype's largest overflows
    return (x / k).astype(x.dtype)

  def body(carry, mb):
    loss_mean, grad_mean, running, aux_mean = carry
    (loss, (maxima, aux)), grads = grad_fn(params, *mb)
    grad_mean = jax.tree.map(lambda a, g: a + mean_part(g), grad_mean, grads)
    aux_mean = jax.tree.map(lambda a, b: a + mean_part(b.astype(a.dtype)), aux_mean, aux)
    return (loss_mean + mean_part(loss), grad_mean, merge_max_logits(running, maxima), aux_mean), None

  (loss, grads, maxima, aux), _ = jax.lax.scan(body, init, micro)
  return loss, grads, maxima, aux


def maxima_on(forward: Callable, params: Any, batch: Any, rng: Any, k: int) -> dict[str, jax.Array]:
  """The maxima of a gradient-free forward pass over the whole batch (microbatch by microbatch)."""
  params = jax.lax.stop_gradient(params)
  if k == 1:
    return forward(params, batch, rng)[1][0]
  maxima = jax.lax.map(lambda mb: forward(params, *mb)[1][0], _microbatches(batch, rng, k))
  return {m: jnp.max(v, axis=0) for m, v in maxima.items()}
