"""``with_numpy``: a third party's function run with its global ``jnp`` rebound.

The adapters of unmodified third-party attention (``capture_gemma``, ``capture_tunix``) run the
package's own function with one name of its globals, ``jnp``, bound to a ``jax.numpy`` stand-in
that sees the masking of the logits; the function and its module stay as they are.
"""

from __future__ import annotations

import types
from typing import Any


def with_numpy(fn: types.FunctionType, numpy: Any) -> types.FunctionType:
  """``fn`` whose global ``jnp`` is ``numpy``; ``fn`` and its module stay as they are."""
  bound = types.FunctionType(fn.__code__, {**fn.__globals__, "jnp": numpy}, fn.__name__, fn.__defaults__,
                             fn.__closure__)
  bound.__kwdefaults__ = fn.__kwdefaults__
  return bound
