"""Maxima accumulated over micro-steps: the state of ``multi_steps`` and the running maximum.

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
