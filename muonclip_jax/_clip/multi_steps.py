"""Gradient accumulation for MuonClip: the clip of a step sees every microbatch's maxima.

With k microbatches per optimizer step, QK-Clip must use S_max^h over the whole step's
batch, i.e. the maximum over the k microbatches (Kimi K2, arXiv 2507.20534, section 2.1:
S_max is over the batch). ``optax.MultiSteps`` hands its inner optimizer only the extra
arguments of the last micro-step, so ``multi_steps`` keeps the running maximum in its state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._util import check_bool, skip_frozen_leaves
from .accumulation import merge_max_logits, MultiStepsMaxLogitsState
from .max_logits import collect_max_logits, nest_max_logits
from .qk_clip import init_max_logits
from .state_checks import check_opt_state
from .layouts import LayoutSpec


def multi_steps(
    opt: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], jax.Array],
    *,
    layout: LayoutSpec,
    use_grad_mean: bool = True,
    should_skip_update_fn: Callable[..., Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps`` that also accumulates ``max_logits`` (maximum) over micro-steps.

  Every call ``update(grads, state, params, max_logits=intermediates)`` merges the
  microbatch's maxima into a running maximum and hands the running maximum to ``opt``; at
  the k-th call ``opt`` makes the real update (and, for ``muonclip``, the one clip of the
  step) and the running maximum starts again from -inf. A micro-step that
  ``should_skip_update_fn`` skips drops its maxima with its gradient.

  Args:
    opt: the optimizer, e.g. ``muonclip(...)``.
    every_k_schedule: microbatches per step (an int or a schedule, as for MultiSteps).
    layout: the attention layout (as for ``muonclip``); it sizes the running maximum.
      Maxima written below the attention module as ``(..., batch, heads)`` (MaxText) are
      passed as ``max_logits=muonclip_jax.reduce_max_logits(intermediates)``.
    use_grad_mean, should_skip_update_fn: as for ``optax.MultiSteps`` (``use_grad_mean`` a
      ``bool``: anything else is a TypeError).

  Non-float and zero-size leaves get a zero update, and no accumulator (see ``muon``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    ``MultiStepsMaxLogitsState``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> clip = optax.chain(optax.sgd(0.0), mc.qk_clip_transform(100.0, layout=layout))
    >>> opt = mc.multi_steps(clip, 2, layout=layout)
    >>> state = opt.init(params)
    >>> grads = jax.tree.map(jnp.zeros_like, params)
    >>> for maxima in ([400.0, 50.0], [50.0, 50.0]):  # two microbatches; head 0 hot in the first
    ...   updates, state = opt.update(grads, state, params, max_logits={"attn": {"max_logits": jnp.array(maxima)}})
    ...   params = optax.apply_updates(params, updates)
    >>> params["attn"]["wq"]["kernel"][0]  # clipped once, with the maximum over both
    Array([0.5, 0.5, 0.5, 0.5, 1. , 1. , 1. , 1. ], dtype=float32)
  """
  check_bool("multi_steps: use_grad_mean", use_grad_mean)
  inner = optax.MultiSteps(opt, every_k_schedule, use_grad_mean=use_grad_mean,
                           should_skip_update_fn=should_skip_update_fn)

  def init_fn(params):
    state = inner.init(params)
    check_opt_state(state.inner_opt_state, caller="multi_steps")  # the clip must come last in opt
    return MultiStepsMaxLogitsState(inner=state, max_logits=init_max_logits(params, layout))

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    if max_logits is None:
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, MultiStepsMaxLogitsState(inner_state, state.max_logits)
    before = collect_max_logits(state.max_logits, "multi_steps")
    running = merge_max_logits(before, collect_max_logits(max_logits, "multi_steps"))
    updates, inner_state = inner.update(
        updates, state.inner, params, max_logits=nest_max_logits(running), **extra_args
    )
    # A micro-step that should_skip_update_fn skipped leaves optax's counters as they were: its
    # maxima are dropped like its gradient, wherever it falls in the accumulation.
    skipped = ((inner_state.mini_step == state.inner.mini_step)
               & (inner_state.gradient_step == state.inner.gradient_step))
    done = inner_state.mini_step == 0
    kept = {m: jnp.where(skipped, before[m], jnp.where(done, -jnp.inf, v)) for m, v in running.items()}
    return updates, MultiStepsMaxLogitsState(inner_state, nest_max_logits(kept))

  return skip_frozen_leaves(optax.GradientTransformationExtraArgs(init_fn, update_fn))
