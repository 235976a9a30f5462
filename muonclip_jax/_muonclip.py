"""MuonClip as one Optax optimizer: Muon + AdamW, then QK-Clip on the updated weights.

Kimi K2 (arXiv 2507.20534), Algorithm 1: after the Muon/AdamW update, every attention head
whose max logit S_max^h on the step's batch exceeds tau has its query/key weights scaled by
gamma_h = tau / S_max^h (see ``qk_clip``). In Optax terms the clip is one more transform at
the end of the chain: it turns the updates ``u`` into ``u' = qk_clip(params + u) - params``,
so that ``optax.apply_updates(params, u')`` gives the clipped parameters.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._alias import forwards_options_of, muon_adamw
from ._muon import check_number
from ._qk_clip import _check_layout, qk_clip

_MISSING_MAX_LOGITS = (
    "{name}: max_logits is missing, but the clip threshold is {tau!r}; pass "
    "opt.update(grads, state, params, max_logits=intermediates) with the 'intermediates' "
    "collection of model.apply(..., mutable=['intermediates']), or set the threshold to None "
    "to turn the clip off"
)


def _clip_is_off(threshold: Any) -> bool:
  """True for None and a concrete +inf (a traced threshold is always on)."""
  if threshold is None:
    return True
  if isinstance(threshold, jax.core.Tracer):
    return False
  return math.isinf(float(threshold)) and float(threshold) > 0


def qk_clip_transform(threshold: Any, *, layout: Any) -> optax.GradientTransformationExtraArgs:
  """QK-Clip as the last transform of an Optax chain (Kimi K2, Algorithm 1, lines 10-15).

  ``update(updates, state, params, max_logits=intermediates)`` returns updates ``u'`` such
  that ``params + u'`` is ``qk_clip(params + updates, max_logits, threshold, layout)``.
  Only the query/key leaves that ``qk_clip`` changes get ``u' = clipped - params``; every
  other leaf, and every element of a head that is not clipped, keeps its update bit for bit.

  Rounding: for a clipped head, ``params + (clipped - params)`` equals ``clipped`` exactly
  when ``clipped / params`` lies in [1/2, 2] (Sterbenz's lemma: the subtraction is then
  exact), e.g. gamma >= 1/2 and an update small against the weight; otherwise the two
  roundings (of the subtraction and of the addition) leave it within one ulp of
  ``max(|params|, |clipped|)`` of ``clipped`` (measured in tests/test_muonclip.py).

  Args:
    threshold: tau > 0 (Kimi K2: 100). ``None`` or ``inf`` turns the clip off, and then
      ``max_logits`` is not needed. May be traced (``optax.inject_hyperparams``).
    layout: an ``MLALayout``/``GQALayout`` or a mapping from path patterns to them.
  """
  _check_layout(layout)
  if threshold is not None and not isinstance(threshold, jax.core.Tracer):
    check_number("qk_clip_threshold", threshold)
    value = float(threshold)
    if math.isnan(value) or value <= 0:
      raise ValueError(f"qk_clip_threshold must be > 0 (or None/inf for no clip), got {threshold!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if _clip_is_off(threshold):
      return updates, state
    if params is None:
      raise ValueError("qk_clip_transform: params are required (opt.update(grads, state, params, ...))")
    if max_logits is None:
      raise ValueError(_MISSING_MAX_LOGITS.format(name="qk_clip_transform", tau=threshold))
    stepped = optax.apply_updates(params, updates)
    clipped = qk_clip(stepped, max_logits, threshold=threshold, layout=layout)

    def adjust(u, p, s, c):
      if c is s:  # a leaf qk_clip did not touch
        return u
      return jnp.where(c == s, u, (c - p).astype(u.dtype))

    new_updates = jax.tree.map(adjust, updates, params, stepped, clipped)
    return new_updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@forwards_options_of(muon_adamw)
def muonclip(
    learning_rate: optax.ScalarOrSchedule,
    *,
    layout: Any,
    qk_clip_threshold: Any = 100.0,
    **muon_adamw_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1): ``muon_adamw`` then QK-Clip.

  ``updates, state = opt.update(grads, state, params, max_logits=intermediates)``, then
  ``optax.apply_updates(params, updates)`` gives the updated and clipped parameters. It
  composes like any Optax optimizer: ``optax.chain(optax.clip_by_global_norm(1.0),
  muonclip(...))`` (``chain`` hands ``max_logits`` on), schedules, and
  ``optax.inject_hyperparams`` (``qk_clip_threshold`` may be injected). For gradient
  accumulation wrap it with ``muonclip_jax.multi_steps`` (not plain ``optax.MultiSteps``,
  which would hand on only the last microbatch's maxima), or take the maximum over the
  microbatches yourself (``muonclip_jax.training.make_train_step(num_microbatches=k)``).

  Args:
    learning_rate: a scalar or schedule, shared by Muon and (by default) AdamW.
    layout: the attention head layout (``module.layout`` of the library's attention
      modules), or a mapping from module-path glob patterns to layouts.
    qk_clip_threshold: tau (Kimi K2: 100). ``None`` or ``inf`` turns the clip off, and
      ``max_logits`` is then optional; with a finite tau a missing ``max_logits`` is a
      ValueError at trace time, never a silent no-clip.
    **muon_adamw_kwargs: every keyword argument of ``muon_adamw`` (``weight_decay=0.1``,
      ``labels``, ``matrix_axes``, the AdamW and Newton–Schulz options), with its defaults;
      ``muonclip``'s signature lists them, so ``inject_hyperparams`` sees each one. Under
      ``optax.inject_hyperparams`` a callable ``labels``/``matrix_axes`` must be named in
      ``static_args`` (inject_hyperparams takes every callable for a schedule); a
      ``MatrixAxes`` or a pytree is static as it is.

  See ``qk_clip_transform`` for the (at most one-ulp) rounding difference between this and
  calling ``qk_clip`` on ``optax.apply_updates(params, updates)`` yourself.
  """
  return optax.chain(
      muon_adamw(learning_rate, **muon_adamw_kwargs),
      qk_clip_transform(qk_clip_threshold, layout=layout),
  )
