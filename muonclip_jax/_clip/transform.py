"""QK-Clip as an Optax transform: the clip of the updated weights as the last step of a chain.

Kimi K2 (arXiv 2507.20534), Algorithm 1: after the Muon/AdamW update, every attention head
whose max logit S_max^h on the step's batch exceeds tau has its query/key weights scaled by
gamma_h = tau / S_max^h (see ``qk_clip``). In Optax terms the clip is one more transform at
the end of the chain: it turns the updates ``u`` into ``u' = qk_clip(params + u) - params``,
so that ``optax.apply_updates(params, u')`` gives the clipped parameters.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._util import check_number, names_by_path, skip_frozen_leaves
from .max_logits import CAPTURE_HINT
from .qk_clip import qk_clip, qk_clip_stats, threshold_or_nan
from .layouts import check_layout, LayoutSpec, report_layout

_MISSING_MAX_LOGITS = (
    "{name}: max_logits is missing, but the clip threshold is {tau!r}; pass "
    "opt.update(grads, state, params, max_logits=intermediates), or set the threshold to None "
    "to turn the clip off (Flax's TrainState.apply_gradients passes no extra arguments to tx.update: "
    "docs/training.md shows a TrainState that does). " + CAPTURE_HINT
)


class QKClipState(NamedTuple):
  """State of ``qk_clip_transform``: what the last update did, for logging.

  ``muonclip_jax.training.make_train_step`` reads it (wherever it sits in a chain,
  ``inject_hyperparams`` or ``multi_steps`` state) to report the clip the optimizer made.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> opt = optax.chain(optax.sgd(0.0), mc.qk_clip_transform(100.0, layout=layout))
    >>> state = opt.init(params)
    >>> state[1]  # the clip's state, last in the chain
    QKClipState(count=Array(0, dtype=int32), threshold=Array(100., dtype=float32),
                num_clipped=Array(0, dtype=int32), min_gamma=Array(1., dtype=float32))
    >>> grads = jax.tree.map(jnp.zeros_like, params)
    >>> _, state = opt.update(grads, state, params, max_logits={"attn": {"max_logits": jnp.array([400.0, 50.0])}})
    >>> int(state[1].count), int(state[1].num_clipped), float(state[1].min_gamma)
    (1, 1, 0.25)
  """

  count: jax.Array  # shape=(), int32: updates so far (the step a tau schedule is evaluated at)
  # shape=(), float32: tau of the last update (+inf: clip off; NaN: the tau was NaN, zero or
  # negative, which only a traced tau can be, and nothing was clipped)
  threshold: jax.Array
  num_clipped: jax.Array  # shape=(), int32: heads the last update clipped, over all layers
  min_gamma: jax.Array  # shape=(), float32: smallest factor gamma_h of the last update (1: none)


def _clip_is_off(threshold: Any) -> bool:
  """True for None and a concrete +inf (a traced threshold or a schedule is always on)."""
  if threshold is None:
    return True
  if isinstance(threshold, jax.core.Tracer) or callable(threshold):
    return False
  return math.isinf(float(threshold)) and float(threshold) > 0


def _state(count, threshold, num_clipped=0, min_gamma=1.0) -> QKClipState:
  return QKClipState(count=jnp.asarray(count, jnp.int32), threshold=threshold_or_nan(threshold),
                     num_clipped=jnp.asarray(num_clipped, jnp.int32), min_gamma=jnp.asarray(min_gamma, jnp.float32))


def qk_clip_transform(qk_clip_threshold: optax.ScalarOrSchedule | None, *, layout: LayoutSpec) -> optax.GradientTransformationExtraArgs:
  """QK-Clip as the last transform of an Optax chain (Kimi K2, Algorithm 1, lines 10-15).

  ``update(updates, state, params, max_logits=intermediates)`` returns updates ``u'`` such
  that ``params + u'`` is ``qk_clip(params + updates, max_logits, qk_clip_threshold=...,
  layout=...)``.
  Only the query/key leaves that ``qk_clip`` changes get ``u' = clipped - params``; every
  other leaf, and every element of a head that is not clipped, keeps its update bit for bit.
  The state (``QKClipState``) records the tau, the number of clipped heads and the
  smallest gamma of the last update. Non-float and zero-size leaves get a zero update
  (see ``muon``); a head whose max logit is +inf is left unclipped (see ``qk_clip``).

  It must be the last transform: ``params + u'`` is the clipped weights only if nothing
  changes ``u'`` afterwards. ``optax.chain(qk_clip_transform(...), optax.scale(0.5))``
  would halve the clip's correction and ``clip_by_global_norm`` after it could undo it,
  while the state still reported the heads as clipped. A transform cannot see what follows
  it, so ``make_train_step``, ``sharding.init_state``, ``multi_steps`` and
  ``check_opt_state`` refuse such a chain (ValueError); put every other transform before
  it. Gradient accumulation around it must be ``multi_steps``, not ``optax.MultiSteps``.

  A traced tau (a schedule, ``optax.inject_hyperparams``) that is NaN, zero or negative
  cannot raise inside jit: it clips nothing, and the state's ``threshold`` is NaN (the
  train step's metrics: ``qk_clip_threshold`` NaN, ``qk_clip_threshold_valid`` False).
  A concrete one is a ValueError here.

  Rounding: for a clipped head, ``params + (clipped - params)`` equals ``clipped`` exactly
  when ``clipped / params`` lies in [1/2, 2] (Sterbenz's lemma: the subtraction is then
  exact), e.g. gamma >= 1/2 and an update small against the weight; otherwise the two
  roundings (of the subtraction and of the addition) leave it within one ulp of
  ``max(|params|, |clipped|)`` of ``clipped`` (checked in tests/test_muonclip.py).

  Args:
    qk_clip_threshold: tau > 0 (Kimi K2: 100), or a schedule: a callable of the update count
      (0, 1, ...) returning tau (an infinite tau clips nothing; a NaN or non-positive one
      clips nothing and is flagged, see above). ``None`` or ``inf`` turns the clip off, and
      then ``max_logits`` is not needed. May be traced (``optax.inject_hyperparams``).
    layout: an ``MLALayout``/``GQALayout`` or a mapping from path patterns to them.
      Projections without declared axes are read from the kernels' logical axis names;
      names seen by ``init`` are kept for updates that get bare arrays (``nnx.Optimizer``).

  ``max_logits`` written below the attention module as ``(..., batch, heads)`` (MaxText's
  ``attention_op``) are passed as ``muonclip_jax.reduce_max_logits(intermediates)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> opt = optax.chain(optax.sgd(1.0), mc.qk_clip_transform(100.0, layout=layout))
    >>> state = opt.init(params)
    >>> grads = jax.tree.map(lambda p: -jnp.ones_like(p), params)  # SGD alone would make every weight 2
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}  # head 0 above tau
    >>> updates, state = opt.update(grads, state, params, max_logits=max_logits)
    >>> optax.apply_updates(params, updates)["attn"]["wq"]["kernel"][0]  # head 0 of the updated weights clipped
    Array([1., 1., 1., 1., 2., 2., 2., 2.], dtype=float32)
  """
  check_layout(layout)
  threshold = qk_clip_threshold
  if threshold is not None and not isinstance(threshold, jax.core.Tracer) and not callable(threshold):
    check_number("qk_clip_threshold", threshold, low=0.0, low_open=True)  # inf: no clip
  off = _clip_is_off(threshold)

  def tau_at(count):
    if off:
      return jnp.inf
    return threshold(count) if callable(threshold) else threshold

  # Logical axis names seen at init (nnx.Optimizer hands boxed parameters to init and bare
  # arrays to update): a layout read from names must be the same at every update.
  recorded: dict[str, tuple] = {}

  def init_fn(params):
    recorded.update(names_by_path(params))
    return _state(0, tau_at(jnp.zeros((), jnp.int32)))

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    report_layout("qk_clip", layout)  # for make_train_step(exact_clip=True)
    count = optax.safe_increment(state.count)
    if off:
      return updates, _state(count, jnp.inf)
    if params is None:
      raise ValueError("qk_clip_transform: params are required (opt.update(grads, state, params, ...))")
    if max_logits is None:
      raise ValueError(_MISSING_MAX_LOGITS.format(name="qk_clip_transform", tau=threshold))
    tau = jnp.asarray(tau_at(state.count), jnp.float32)
    stepped = optax.apply_updates(params, updates)
    names = names_by_path(stepped) or recorded
    clipped = qk_clip(stepped, max_logits, qk_clip_threshold=tau, layout=layout, names=names)

    def adjust(u, p, s, c):
      if c is s:  # a leaf qk_clip did not touch
        return u
      return jnp.where(c == s, u, (c - p).astype(u.dtype))

    new_updates = jax.tree.map(adjust, updates, params, stepped, clipped)
    stats = qk_clip_stats(max_logits, qk_clip_threshold=tau).values()
    num_clipped = sum(jnp.sum(s["num_clipped"]) for s in stats)
    min_gamma = jnp.min(jnp.stack([jnp.min(s["min_gamma"]) for s in stats]))
    return new_updates, _state(count, tau, num_clipped, min_gamma)

  return skip_frozen_leaves(optax.GradientTransformationExtraArgs(init_fn, update_fn))
