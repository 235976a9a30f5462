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
  """State of ``multi_steps``: optax's ``MultiStepsState`` and the running maximum.

  Example:
    >>> import jax, jax.numpy as jnp, optax, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}}}
    >>> opt = mc.multi_steps(optax.sgd(0.1), 2, layout=layout)
    >>> state = opt.init(params)
    >>> state.max_logits  # nothing seen yet
    {'attn': {'max_logits': Array([-inf, -inf], dtype=float32)}}
    >>> grads = jax.tree.map(jnp.zeros_like, params)
    >>> _, state = opt.update(grads, state, params, max_logits={"attn": {"max_logits": jnp.array([3.0, 7.0])}})
    >>> state.max_logits["attn"]["max_logits"], int(state.inner.mini_step)  # after the first microbatch
    (Array([3., 7.], dtype=float32), 1)
  """

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
