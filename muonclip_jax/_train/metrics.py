"""What a train step reports: its tau, the forward pass's maxima, and what was clipped.

Every metric is an array (no host sync inside the step); ``metrics_to_floats`` turns a
step's metrics into a flat dict of floats outside it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._clip import (clip_decisions, merge_max_logits, nest_max_logits, no_clip_decisions, qk_clip_stats,
                     threshold_or_nan)
from .opt_state_view import OptStateView


def grad_norm(grads: Any) -> jax.Array:
  """The global L2 norm of ``grads`` (``optax.tree.norm``), finite whenever it is representable.

  ``optax.tree.norm`` sums squares, which overflow from entries near 1.8e19 in float32 and
  report inf for a finite norm. Where it does and every entry is finite, the norm is taken
  again of ``grads / m`` (``m`` the largest magnitude) and multiplied back by ``m``; elsewhere
  it is ``optax.tree.norm``'s, bit for bit.
  """
  plain = optax.tree.norm(grads)
  leaves = [g for g in jax.tree.leaves(grads) if jnp.size(g)]
  if not leaves:
    return plain

  def rescaled():  # run only where the plain norm overflowed (lax.cond): no extra passes otherwise
    xs = [jnp.asarray(g, plain.dtype) for g in leaves]
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in xs]))
    safe = jnp.where((m > 0) & jnp.isfinite(m), m, jnp.ones((), plain.dtype))
    return jnp.where(jnp.isfinite(m), safe * jnp.sqrt(sum(jnp.sum(jnp.square(x / safe)) for x in xs)), plain)

  return jax.lax.cond(jnp.isfinite(plain), lambda: plain, rescaled)


def step_threshold(given: Any, before: OptStateView, after: OptStateView,
                   caller: str = "make_train_step") -> jax.Array | None:
  """The step's one tau: the optimizer's clip's, else ``given``; None when there is none.

  An optimizer that clips (``muonclip``, ``qk_clip_transform``) carries its tau; that is the
  step's tau (as float32, NaN where a traced value was NaN, zero or negative: it clipped
  nothing). Otherwise ``given`` (``make_train_step(qk_clip_threshold=...)``): a number, or
  a schedule evaluated at the optimizer's step count before the update (``before.count``).
  Giving both is a ValueError: the step has one tau.
  """
  if after.clip is not None:
    if given is not None:
      raise ValueError(f"{caller}: qk_clip_threshold={given!r} was given, but the optimizer clips with its own "
                       "tau (muonclip(qk_clip_threshold=...)): the step has one tau; pass it to the optimizer only "
                       "and leave make_train_step's qk_clip_threshold None")
    return after.clip.threshold
  if given is None:
    return None
  if callable(given):
    if before.count is None:
      raise ValueError(f"{caller}: a qk_clip_threshold schedule needs a step count, but the optimizer state has no "
                       "'count' field; pass a number, or a schedule to muonclip(qk_clip_threshold=...)")
    given = given(before.count)
  return threshold_or_nan(given)


def clip_metrics(maxima: dict[str, jax.Array], qk_clip_threshold: Any) -> dict[str, Any]:
  """Logging metrics of one step's maxima ``{module: (*stack, H)}`` (all arrays, jit-safe).

  ``max_logits`` (the maxima themselves, per head), ``max_logit`` (largest over all heads;
  NaN when a head's is NaN, +inf when one is +inf), ``max_logit_per_layer`` (``{module:
  (*stack,)}``) and ``num_above_threshold`` (heads with S_max > tau, whether or not a clip
  scaled them: +inf counts, being above any tau, though ``qk_clip`` leaves such a head as
  it is, see its "Non-finite maxima"; NaN does not; 0 when tau is None). What was clipped
  is ``applied_clip_metrics``: ``num_above_threshold`` above ``num_clipped`` after a step
  of a clipping optimizer shows a head the clip could not scale. Read from
  ``qk_clip_stats``, the public report.
  """
  stats = qk_clip_stats(nest_max_logits(maxima), qk_clip_threshold=qk_clip_threshold)
  return {
      "max_logits": dict(maxima),
      "max_logit": jnp.max(jnp.stack([jnp.max(s["max_logit"]) for s in stats.values()])),
      "max_logit_per_layer": {m: s["max_logit"] for m, s in stats.items()},
      "num_above_threshold": sum(jnp.sum(s["num_above_threshold"]) for s in stats.values()),
  }


def threshold_metrics(tau: jax.Array) -> dict[str, jax.Array]:
  """``qk_clip_threshold`` (float32; NaN for an invalid traced tau) and ``qk_clip_threshold_valid``."""
  tau = jnp.asarray(tau, jnp.float32)
  return {"qk_clip_threshold": tau, "qk_clip_threshold_valid": ~jnp.isnan(tau)}


def optimizer_clip(before: OptStateView, after: OptStateView,
                   maxima: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """Per head ``(scaled, gamma)`` of what the optimizer's clip did in one update.

  The clip saw ``maxima`` (the step's), merged with ``multi_steps``' running maximum when
  there is one, at its tau; it acted only if its count moved (under ``multi_steps`` or
  ``optax.MultiSteps`` only the last micro-step updates). An optimizer without a clip
  clipped nothing.
  """
  scaled, gamma = no_clip_decisions(maxima)
  if after.clip is None:
    return scaled, gamma
  seen = maxima if before.running_max_logits is None else merge_max_logits(before.running_max_logits, maxima)
  acted = after.clip.count != before.clip.count
  for m, s in seen.items():
    hit, g = clip_decisions(s, after.clip.threshold)
    scaled[m], gamma[m] = hit & acted, jnp.where(acted, g, 1.0)
  return scaled, gamma


def applied_clip_metrics(scaled: dict[str, jax.Array], gamma: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """``num_clipped``, ``clipped_fraction`` and ``min_gamma`` of the scaling a step applied.

  ``scaled`` and ``gamma`` are ``{module: (*stack, H)}``: whether each head was scaled at
  least once in the step, and the product of the factors gamma_h applied to it (over the
  optimizer's clip and every pass of the exact clip). ``num_clipped`` counts the scaled
  heads, ``clipped_fraction`` divides by all heads (Kimi K2 reports 12.7% of heads
  triggering in K2's first 70k steps), ``min_gamma`` is the smallest product (1.0: none).
  """
  num_clipped = sum(jnp.sum(v, dtype=jnp.int32) for v in scaled.values())
  num_heads = sum(math.prod(v.shape) for v in scaled.values())
  return {
      "num_clipped": num_clipped,
      "clipped_fraction": num_clipped / num_heads,
      "min_gamma": jnp.min(jnp.stack([jnp.min(g) for g in gamma.values()])),
  }


def optimizer_clip_metrics(before: OptStateView, after: OptStateView, maxima: dict[str, jax.Array]) -> dict:
  """``applied_clip_metrics`` of the optimizer's clip, read from its ``QKClipState``.

  Exactly what the optimizer's state reports; 0 and 1.0 at a micro-step of ``multi_steps``
  or ``optax.MultiSteps`` that did not update (the clip acts only at the last one, on the
  running maximum over the micro-steps, whatever this microbatch's own maxima were).
  """
  acted = after.clip.count != before.clip.count
  num_clipped = jnp.where(acted, after.clip.num_clipped, 0)
  num_heads = sum(math.prod(s.shape) for s in maxima.values())
  return {
      "num_clipped": num_clipped,
      "clipped_fraction": num_clipped / num_heads,
      "min_gamma": jnp.where(acted, after.clip.min_gamma, 1.0),
  }


def metrics_to_floats(metrics: Any) -> dict[str, float]:
  """A flat ``{name: float}`` of a step's metrics, for logging (``json.dumps`` takes it).

  Nested keys are joined with ``/`` and every array element gets its index, e.g.
  ``max_logit_per_layer/layers/attn/0``. One host transfer (``jax.device_get``); call it
  outside the jitted step. NaN and infinities stay (``json`` writes them as ``NaN`` and
  ``Infinity``).

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax import training
    >>> training.metrics_to_floats({"loss": jnp.float32(2.5), "max_logit_per_layer": {"attn": jnp.array([3.0, 4.0])}})
    {'loss': 2.5, 'max_logit_per_layer/attn/0': 3.0, 'max_logit_per_layer/attn/1': 4.0}
  """
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(metrics))[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    values = np.asarray(leaf, np.float64)
    if values.ndim == 0:
      flat[name] = float(values)
    for index in np.ndindex(values.shape if values.ndim else ()):
      if values.ndim:
        flat[f"{name}/{'/'.join(map(str, index))}"] = float(values[index])
  return flat
