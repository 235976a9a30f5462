"""Gradient accumulation for MuonClip: the clip of a step sees every microbatch's maxima.

With k microbatches per optimizer step, QK-Clip must use S_max^h over the whole step's
batch, i.e. the maximum over the k microbatches (Kimi K2, arXiv 2507.20534, section 2.1:
S_max is over the batch). ``optax.MultiSteps`` hands its inner optimizer only the extra
arguments of the last micro-step, so ``multi_steps`` keeps the running maximum in its state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._qk_clip import collect_max_logits, init_max_logits, nest_max_logits


class MultiStepsMaxLogitsState(NamedTuple):
  """State of ``multi_steps``."""

  inner: optax.MultiStepsState  # the wrapped optax.MultiSteps state
  max_logits: Any  # running max over this step's microbatches; {..: {"max_logits": (*stack, H) f32}}


def merge_max_logits(running: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Elementwise maximum of two ``{module: maxima}`` maps with the same modules.

  ``fmax`` ignores a NaN on one side, so one bad microbatch does not hide the others.
  """
  if set(running) != set(new):
    raise ValueError(
        f"max_logits modules differ between microbatches: {sorted(running)} vs {sorted(new)}; "
        "maxima written below the attention module (MaxText's attention_op, (..., batch, heads)) "
        "must be passed as muonclip_jax.reduce_max_logits(intermediates)"
    )
  for module in running:
    if running[module].shape != new[module].shape:
      raise ValueError(
          f"max_logits of {module!r}: shape {new[module].shape}, expected {running[module].shape}"
      )
  return {m: jnp.fmax(running[m], new[m]) for m in running}


def multi_steps(
    opt: optax.GradientTransformation,
    every_k_schedule: int | Any,
    *,
    layout: Any,
    **multi_steps_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps`` that also accumulates ``max_logits`` (maximum) over micro-steps.

  Every call ``update(grads, state, params, max_logits=intermediates)`` merges the
  microbatch's maxima into a running maximum and hands the running maximum to ``opt``; at
  the k-th call ``opt`` makes the real update (and, for ``muonclip``, the one clip of the
  step) and the running maximum starts again from -inf.

  Args:
    opt: the optimizer, e.g. ``muonclip(...)``.
    every_k_schedule: microbatches per step (an int or a schedule, as for MultiSteps).
    layout: the attention layout (as for ``muonclip``); it sizes the running maximum.
      Maxima written below the attention module as ``(..., batch, heads)`` (MaxText) are
      passed as ``max_logits=muonclip_jax.reduce_max_logits(intermediates)``.
    **multi_steps_kwargs: passed to ``optax.MultiSteps``.
  """
  inner = optax.MultiSteps(opt, every_k_schedule, **multi_steps_kwargs)

  def init_fn(params):
    from ._state_checks import check_opt_state  # noqa: PLC0415 (_state_checks imports this module)

    state = inner.init(params)
    check_opt_state(state.inner_opt_state, caller="multi_steps")  # the clip must come last in opt
    return MultiStepsMaxLogitsState(inner=state, max_logits=init_max_logits(params, layout))

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    if max_logits is None:
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, MultiStepsMaxLogitsState(inner_state, state.max_logits)
    running = merge_max_logits(
        collect_max_logits(state.max_logits, "multi_steps"), collect_max_logits(max_logits, "multi_steps")
    )
    updates, inner_state = inner.update(
        updates, state.inner, params, max_logits=nest_max_logits(running), **extra_args
    )
    done = inner_state.mini_step == 0
    reset = {m: jnp.where(done, -jnp.inf, v) for m, v in running.items()}
    return updates, MultiStepsMaxLogitsState(inner_state, nest_max_logits(reset))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
