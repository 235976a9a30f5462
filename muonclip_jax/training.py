"""The reference MuonClip train step: forward with max-logit capture, gradients, update, clip.

``make_train_step`` builds a pure ``step(params, opt_state, batch) -> (params, opt_state,
metrics)`` to be wrapped in ``jax.jit``. It works with any Optax optimizer (AdamW, Muon,
MuonClip): the per-head maxima of the forward pass are handed to the optimizer as the extra
argument ``max_logits`` (ignored by optimizers that do not take it), as in Kimi K2
(arXiv 2507.20534), Algorithm 1. Everything stays on device: no host synchronization.
"""

from __future__ import annotations

import math
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
      tau. With ``exact_clip=True`` the step then measures the updated params' maxima on the
      same batch (a forward pass without gradient) and clips with them, repeating until no
      head is above tau (1 + rtol), at most once per attention layer (``exact_qk_clip``):
      after the step every head's max logit on the step's batch is at most tau (1 + rtol),
      for any depth (rtol = 1e-4, or the machine epsilon of a lower-precision
      ``compute_dtype``/param dtype). Costs one forward pass, more when clipping a layer
      pushes a later one above tau (metric ``exact_clip_passes``); use it with
      ``muon_adamw`` (or with ``muonclip``, which then clips twice).

  Returns:
    The step function. ``metrics`` holds ``loss``, the forward pass's ``max_logits`` (per
    head), ``max_logit``, ``max_logit_per_layer``, ``num_clipped``, ``clipped_fraction``,
    ``min_gamma`` (see ``clip_metrics``); with ``exact_clip``, ``exact_clip_passes`` (int32,
    the forward passes the exact clip took, 1 to the number of attention layers).
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
      measure = lambda p: _maxima_on(forward, p, batch, num_microbatches)
      params, metrics["exact_clip_passes"] = exact_qk_clip(
          params, measure, threshold=qk_clip_threshold, layout=layout, rtol=_exact_rtol(params, compute_dtype))
    return params, opt_state, metrics

  return step


def _maxima_on(forward, params, batch, num_microbatches):
  """The maxima of a gradient-free forward pass over the whole batch (microbatch by microbatch)."""
  params = jax.lax.stop_gradient(params)
  if num_microbatches == 1:
    return forward(params, batch)[1]
  micro = _split_microbatches(batch, num_microbatches)
  maxima = jax.lax.map(lambda mb: forward(params, mb)[1], micro)
  return {m: jnp.max(v, axis=0) for m, v in maxima.items()}


def _exact_rtol(params: Any, compute_dtype: Any) -> float:
  """1e-4, or the machine epsilon of the forward's lowest-precision float dtype if larger."""
  dtypes = [jnp.dtype(compute_dtype)] if compute_dtype is not None else [
      jnp.result_type(x) for x in jax.tree.leaves(params) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  return max([1e-4] + [float(jnp.finfo(d).eps) for d in dtypes])


def exact_qk_clip(params: Any, measure: Callable[[Any], dict[str, jax.Array]], *, threshold: Any,
                  layout: Any, rtol: float = 1e-4) -> tuple[Any, jax.Array]:
  """QK-Clip until the params' own maxima are at most tau (1 + rtol), for any depth.

  Clipping attention layer l changes the input of the layers after it, so one clip with the
  maxima of one forward pass bounds only the first layer. This repeats: measure the maxima
  of ``params`` (``measure(params) -> {module: (*stack, H)}``, a gradient-free forward pass
  on the step's batch), and clip every head above ``tau (1 + rtol)`` to tau, until no head
  is above it, or at most ``L`` times, ``L`` the number of attention layers (rows of the
  maxima: modules times stacked layers). After clip ``k`` the first ``k`` attention layers
  (in the order of the forward pass) are at most tau and are never touched again, so the
  inputs of layer ``k + 1`` are fixed: ``L`` clips bound every layer. This holds when each
  attention layer's logits depend only on its own and earlier layers' query/key weights;
  an attention module whose weights are applied more than once in the forward pass
  (weight sharing across depth) is not covered by the bound.

  Inside jit, no host sync (``lax.while_loop``). Returns ``(params, passes)``: ``passes``
  (int32, 1 to L) is the number of forward passes taken; the last clip needs no forward
  pass after it (it is the L-th clip, or clips nothing).
  """
  maxima = measure(params)
  num_layers = sum(math.prod(s.shape[:-1]) for s in maxima.values())
  limit = jnp.asarray(threshold, jnp.float32) * (1 + rtol)

  def over(maxima):  # heads within the tolerance keep their weights
    return nest_max_logits({m: jnp.where(s > limit, s, -jnp.inf) for m, s in maxima.items()})

  def clip(params, maxima):
    return qk_clip(params, over(maxima), threshold=threshold, layout=layout)

  def cond(carry):
    _, maxima, passes = carry
    return (passes < num_layers) & jnp.any(jnp.stack([jnp.any(s > limit) for s in maxima.values()]))

  def body(carry):
    params, maxima, passes = carry
    params = clip(params, maxima)
    return params, measure(params), passes + 1

  params, maxima, passes = jax.lax.while_loop(cond, body, (params, maxima, jnp.ones((), jnp.int32)))
  return clip(params, maxima), passes
