"""One jitted ``init`` per Flax module configuration, shared by the attention modules' tests."""

from __future__ import annotations

import functools

import jax


@functools.cache
def jitted_init(module):
  """``jax.jit(module.init)``, cached per module: equal modules hash equal, so each configuration
  compiles once per input shape across a test file."""
  return jax.jit(module.init)
