"""``after``: make a computation wait for others, so that XLA keeps one call's temporaries alive at a time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def after(tree: Any, done: list) -> Any:
  """``tree``, made to depend on the arrays ``done``: XLA computes those first.

  The dependency is an exact ``+ 0``: ``z = min(|v|, 0)`` with ``v`` the first element of
  each of ``done`` (NaN replaced by 0) is 0 for every value, but the compiler cannot tell.
  The element is indexed, not read from a flattened copy, so a sharded array is not
  gathered for it (only that element travels).
  ``lax.optimization_barrier`` would say the same more directly, but XLA:CPU drops it
  before scheduling.
  """
  v = sum(d[(0,) * d.ndim].astype(jnp.float32) for d in done)  # one element: no reshape of a sharded array
  z = jnp.minimum(jnp.abs(jnp.where(jnp.isnan(v), 0.0, v)), 0.0)
  return jax.tree.map(lambda x: x + z.astype(x.dtype), tree)
