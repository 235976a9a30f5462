"""The reference MuonClip train step: forward with max-logit capture, gradients, update, clip.

``make_train_step`` builds a pure ``step(params, opt_state, batch) -> (params, opt_state,
metrics)`` to be wrapped in ``jax.jit``. It works with any Optax optimizer (AdamW, Muon,
MuonClip): the per-head maxima of the forward pass are handed to the optimizer as the extra
argument ``max_logits`` (ignored by optimizers that do not take it), as in Kimi K2
(arXiv 2507.20534), Algorithm 1. Everything stays on device: no host synchronization.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._accumulation import merge_max_logits
from ._qk_clip import collect_max_logits, nest_max_logits, qk_clip, qk_clip_stats

LossFn = Callable[[Any, Any], tuple[jax.Array, Any]]


def clip_metrics(maxima: dict[str, jax.Array], threshold: Any) -> dict[str, Any]:
  """Logging metrics of one step's maxima ``{module: (*stack, H)}`` (all arrays, jit-safe).

  ``max_logits`` (the maxima themselves, per head), ``max_logit`` (largest over all heads),
  ``max_logit_per_layer`` (``{module: (*stack,)}``),
  ``num_clipped`` (heads with S_max > tau), ``clipped_fraction`` (of all heads; Kimi K2
  reports 12.7% of heads triggering in K2's first 70k steps) and ``min_gamma``.
  """
  stats = qk_clip_stats(nest_max_logits(maxima), threshold=threshold)
  num_clipped = sum(jnp.sum(s["num_clipped"]) for s in stats.values())
  num_heads = sum(jnp.sum(s["num_heads"]) for s in stats.values())
  return {
      "max_logits": dict(maxima),
      "max_logit": jnp.max(jnp.stack([jnp.max(s["max_logit"]) for s in stats.values()])),
      "max_logit_per_layer": {m: s["max_logit"] for m, s in stats.items()},
      "num_clipped": num_clipped,
      "clipped_fraction": num_clipped / num_heads,
      "min_gamma": jnp.min(jnp.stack([jnp.min(s["min_gamma"]) for s in stats.values()])),
  }


def _split_microbatches(batch: Any, k: int) -> Any:
  def split(x):
    if x.shape[0] % k:
      raise ValueError(f"make_train_step: batch leading size {x.shape[0]} is not divisible by num_microbatches={k}")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])

  return jax.tree.map(split, batch)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    qk_clip_threshold: Any = None,
    layout: Any = None,
    num_microbatches: int = 1,
    compute_dtype: Any = None,
    exact_clip: bool = False,
) -> Callable[[Any, Any, Any], tuple[Any, Any, dict[str, Any]]]:
  """Builds ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, intermediates)``, where ``intermediates``
      is the collection of ``model.apply({"params": params}, ..., mutable=["intermediates"])``
      (its ``max_logits`` leaves are what QK-Clip needs).
    optimizer: any Optax optimizer; ``muonclip`` clips inside its update.
    qk_clip_threshold: tau used for the metrics (and for ``exact_clip``); pass the
      optimizer's tau. ``None``: no clip is counted.
    layout: the attention layout; needed only with ``exact_clip``.
    num_microbatches: k > 1 splits the batch's leading axis into k microbatches and scans
      over them (``lax.scan``): gradients are averaged, maxima combined by maximum, and
      the optimizer (hence the clip) runs once, on the whole step's maxima.
    compute_dtype: e.g. ``jnp.bfloat16``: the forward/backward pass runs on a copy of the
      (float32 master) params cast to this dtype; gradients, the update and the clip act
      on the master params, and the next step's copy is cast from them again.
    exact_clip: Kimi K2 clips with the maxima of the step's forward pass, which saw the
      weights before the update, so on the step's batch the updated weights can overshoot
      tau a little. With ``exact_clip=True`` the step runs one more forward pass (no
      gradient) with the updated params on the same batch and applies ``qk_clip`` with
      those maxima, so every head's max logit on the step's batch is at most tau after the
      step. Costs one forward pass; use it with ``muon_adamw`` (or with ``muonclip``,
      which then clips twice).

  Returns:
    The step function. ``metrics`` holds ``loss``, the forward pass's ``max_logits`` (per
    head), ``max_logit``, ``max_logit_per_layer``, ``num_clipped``, ``clipped_fraction``, ``min_gamma`` (see
    ``clip_metrics``).
  """
  if not isinstance(num_microbatches, int) or num_microbatches < 1:
    raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
  if exact_clip and (qk_clip_threshold is None or layout is None):
    raise ValueError("make_train_step: exact_clip=True needs qk_clip_threshold and layout")
  opt = optax.with_extra_args_support(optimizer)

  def forward(params, batch):
    compute = params if compute_dtype is None else optax.tree.cast(params, compute_dtype)
    loss, intermediates = loss_fn(compute, batch)
    return loss.astype(jnp.float32), collect_max_logits(intermediates)

  grad_fn = jax.value_and_grad(forward, has_aux=True)

  def loss_grads_maxima(params, batch):
    if num_microbatches == 1:
      (loss, maxima), grads = grad_fn(params, batch)
      return loss, grads, maxima
    micro = _split_microbatches(batch, num_microbatches)
    first = jax.tree.map(lambda x: x[0], micro)
    _, maxima_shape = jax.eval_shape(forward, params, first)
    init = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(jnp.zeros_like, params),
        {m: jnp.full(s.shape, -jnp.inf, jnp.float32) for m, s in maxima_shape.items()},
    )

    def body(carry, mb):
      loss_sum, grad_sum, running = carry
      (loss, maxima), grads = grad_fn(params, mb)
      grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
      return (loss_sum + loss, grad_sum, merge_max_logits(running, maxima)), None

    (loss_sum, grad_sum, maxima), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g: (g / num_microbatches).astype(g.dtype), grad_sum)
    return loss_sum / num_microbatches, grads, maxima

  def step(params, opt_state, batch):
    loss, grads, maxima = loss_grads_maxima(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=nest_max_logits(maxima))
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, **clip_metrics(maxima, qk_clip_threshold)}
    if exact_clip:
      after = jax.lax.stop_gradient(_maxima_on(forward, params, batch, num_microbatches))
      params = qk_clip(params, nest_max_logits(after), threshold=qk_clip_threshold, layout=layout)
    return params, opt_state, metrics

  return step


def _maxima_on(forward, params, batch, num_microbatches):
  """The maxima of a gradient-free forward pass over the whole batch (microbatch by microbatch)."""
  if num_microbatches == 1:
    return forward(params, batch)[1]
  micro = _split_microbatches(batch, num_microbatches)
  maxima = jax.lax.map(lambda mb: forward(params, mb)[1], micro)
  return {m: jnp.max(v, axis=0) for m, v in maxima.items()}
