"""Equality of the results of two separately compiled programs, under this run's XLA flags.

A ``muonclip`` update and a ``muon_adamw`` update compute every leaf the clip leaves alone
with the same operations. Under XLA:CPU's default fusion emitters (JAX 0.12, and JAX 0.10
with its default flags) the two programs give those leaves the same bits, and the tests
check exactly that. The legacy fusion emitters, which ``conftest.py`` selects on JAX 0.10
for compile speed, fuse the two programs' shared part differently and round a few elements
(measured: under 2% of a leaf) by an ulp or two. Under them the check is to ``ULPS`` ulps of
the leaf's largest magnitude, which is still far below what any clip factor would change.
"""

import os

import jax.numpy as jnp
import numpy as np

LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"  # conftest.py sets it where XLA has it
ULPS = 4


def legacy_emitters() -> bool:
  """Whether this run compiles with the legacy fusion emitters (read when asked: conftest.py
  imports this module before it sets ``XLA_FLAGS``)."""
  return LEGACY_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "").split()


def assert_same_computation(actual, desired, err_msg: str = "") -> None:
  """``actual == desired`` bit for bit; to ``ULPS`` ulps under the legacy emitters."""
  if not legacy_emitters():
    np.testing.assert_array_equal(actual, desired, err_msg=err_msg)
    return
  eps = float(jnp.finfo(np.asarray(desired).dtype).eps)
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  atol = ULPS * eps * (np.abs(desired).max() if desired.size else 0.0)
  np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=err_msg)
