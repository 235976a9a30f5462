"""The precision of Newton–Schulz's products, per backend: chosen when the update is traced.

A float32 matmul that names no precision runs at the backend's default: exact float32 on the
CPU, TF32 operands (10 mantissa bits) on NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs
(JAX's "Matmul precision" page), and whatever ``jax_default_matmul_precision`` says when the
user sets it. The two iterations react differently to narrow operands:

* ``"standard"`` multiplies the iterate ``X`` itself, whose singular values stay in (0, 1.2];
  rounding its operands perturbs each step by about the operands' unit roundoff, and the
  iteration's contraction towards 1 absorbs it: the band holds at one bfloat16 pass.
* ``"gram"`` iterates on ``G = X X^T``, which squares the input's condition number, and
  multiplies ``Q_k`` whose entries grow as ``1 / s_min``: narrow operands there leave the band
  (emulated TPU default: largest singular value up to 23 on condition-1e6 inputs).

So the policy names a precision for every product (none depends on the global flag):

=========  ======================================  =====================  ==========
policy     ``method="auto"``                        standard's products    Gram's
=========  ======================================  =====================  ==========
highest    Gram where it saves FLOPs (aspect >= 2)  ``HIGHEST``            ``HIGHEST``
default    standard                                 ``DEFAULT``            ``HIGHEST``
=========  ======================================  =====================  ==========

``precision=None`` takes ``"highest"`` on the CPU (where every float32 product is exact
float32 anyway, so this is today's arithmetic, bit for bit) and ``"default"`` on GPUs and TPUs
(the backend's fast one-pass rate for the standard iteration, in band; a Gram iteration asked
for by name keeps exact float32 products). ``jax.default_backend()`` is called on the ``jax``
module when the update is traced.
"""

from __future__ import annotations

import jax

POLICIES = ("highest", "default")


def policy(precision: str | None) -> str:
  """The policy ``precision`` names, or the backend's for None (module docstring)."""
  if precision is None:
    return "highest" if jax.default_backend() == "cpu" else "default"
  if precision not in POLICIES:
    raise ValueError(f"ns_precision (newton_schulz's precision) must be None (the backend's policy) or one of "
                     f"{POLICIES}, got {precision!r}")
  return precision


def uses_gram(method: str, m: int, n: int, precision: str | None, aspect: int) -> bool:
  """Whether ``method`` runs the Gram iteration on an ``m x n`` matrix (``m <= n``)."""
  chosen = policy(precision)  # validates it
  if method == "gram":
    return True
  return method == "auto" and chosen == "highest" and n >= aspect * m


def products(precision: str | None, gram: bool) -> jax.lax.Precision:
  """The ``jax.lax.Precision`` of every product of one iteration (module docstring)."""
  if policy(precision) == "highest" or gram:
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT
