"""The precision of Newton–Schulz's products, per backend: chosen when the update is traced.

A float32 matmul that names no precision runs at the backend's default: exact float32 on the
CPU, TF32 operands (10 mantissa bits) on NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs
(JAX's "Matmul precision" page), and whatever ``jax_default_matmul_precision`` says when the
user sets it. The two iterations react differently to narrow operands:

* ``"standard"`` multiplies the iterate ``X`` itself, whose singular values stay in (0, 1.2];
  rounding its operands perturbs each step by about the operands' unit roundoff, and the
  iteration's contraction towards 1 absorbs it: the band holds at one bfloat16 pass.
* ``"gram"`` iterates on ``G = X X^T``, which squares the input's condition number, and
  multiplies ``Q_k`` whose entries grow as ``1 / s_min``: 8-bit mantissas there leave the band
  (emulated TPU default: largest singular value up to 23 on condition-1e6 inputs). With 11-bit
  float16 operands it holds if the iteration restarts every two steps, before steps 2, 4, ...
  (``X_0 <- Q_k X_0`` and ``G`` from it), which resets the factor before its rounding has
  grown: the Dao AI Lab's Gram Newton–Schulz restarts its float16 ``m x m`` iteration on GPUs.
  (Four steps, ``polar_express_4``: one restart. DeepSeek-V4's ten, whose eight Keller steps
  grow small singular values ~2e4-fold, leave the band with restarts before steps 2 and 5
  only: largest singular value 2.2 on a condition-1e6 input.) Exact float32 products hold
  the band for the presets' own step counts (4 or 5; DeepSeek-V4 restarts before step 5), but
  not for more: without a restart, ``polar_express_4`` at 10 steps reached a largest singular
  value of 70 and 16 steps were not finite. So a float32 Gram iteration restarts every 5
  steps, before steps 5, 10, ... (none at the presets' own counts).

So the policy names a precision for every product (none depends on the global flag):

=========  =======================================  ===================  =====================
policy     ``method="auto"``                         standard's products  Gram's products
=========  =======================================  ===================  =====================
highest    Gram where it saves FLOPs (aspect >= 2)   ``HIGHEST``          ``HIGHEST``,
                                                                          restarts every 5 steps
float16    Gram where it saves FLOPs (aspect >= 2)   float16 operands     float16 operands,
                                                                          restarts every 2 steps
default    standard                                  ``DEFAULT``          ``HIGHEST``,
                                                     (``HIGHEST`` up to   restarts every 5 steps
                                                     ``SMALL_ENTRIES``)
=========  =======================================  ===================  =====================

float16 operands: every operand is rounded to float16 and the products accumulate in float32
(``preferred_element_type``), the iterate and its elementwise work stay in the compute dtype.
NVIDIA tensor cores multiply float16 at the bfloat16 rate, twice TF32's, with TF32's 10
mantissa bits. The iterate ``X`` (``m x n``, entries ``~ 1 / sqrt(m n)`` at the first step) is
multiplied by ``iterate_scale``, a power of two, before it is rounded, so that it lies in
float16's normal range; the product is divided by it again (exact). The other operands (``X
X^T``, the polynomial, ``Q``) are not scaled: their largest entries are of order 1 to a few
hundred, but at the first step ``X X^T`` (trace 1, or Frobenius norm 1 after a Schatten-4
normalization) has off-diagonal entries of about ``1 / (m sqrt(n))`` that float16 holds as
subnormals, with an absolute error of at most 2^-25 each: far below the rounding of its large
entries (measured: the band on 2048x8192 Gaussian and condition-1e6 inputs as in float32,
``benchmarks/emulated_band.py --large``). A float64 product stays float64 at ``HIGHEST``.

``precision=None`` takes ``"highest"`` on the CPU (where every float32 product is exact float32
anyway, so this is today's arithmetic, bit for bit), ``"float16"`` on GPUs and ``"default"`` on
TPUs (whose matrix units take bfloat16, not float16: the standard iteration at the one-pass
rate, in band; a Gram iteration asked for by name keeps exact float32 products). Under
``"default"`` a matrix of at most ``SMALL_ENTRIES`` (64 x 64) entries multiplies at ``HIGHEST``:
rounded to 8 bits, a small matrix's singular values just above the band's cutoff fall below it,
and its products cost nothing beside a model's large ones.
``jax.default_backend()`` is called on the ``jax`` module when the update is traced.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

POLICIES = ("highest", "float16", "default")
FLOAT16 = "float16"  # the products of the "float16" policy (else a ``jax.lax.Precision``)
_BACKEND_POLICY = {"cpu": "highest", "gpu": "float16"}  # any other backend: "default"
# float16 operands: every precision multiplies them alike; named, so that the global flag is not read
_F16 = jax.lax.Precision.DEFAULT


def policy(precision: str | None) -> str:
  """The policy ``precision`` names, or the backend's for None (module docstring)."""
  if precision is None:
    return _BACKEND_POLICY.get(jax.default_backend(), "default")
  if precision not in POLICIES:
    raise ValueError(f"ns_precision (newton_schulz's precision) must be None (the backend's policy) or one of "
                     f"{POLICIES}, got {precision!r}")
  return precision


def uses_gram(method: str, m: int, n: int, precision: str | None, aspect: int) -> bool:
  """Whether ``method`` runs the Gram iteration on an ``m x n`` matrix (``m <= n``)."""
  chosen = policy(precision)  # validates it
  if method == "gram":
    return True
  return method == "auto" and chosen != "default" and n >= aspect * m


# Matrices of at most this many entries (64 x 64) multiply at HIGHEST under "default": one pass rounds
# their input to 8 bits, moving each entry by up to 2^-9 of itself, which on a small matrix moves
# singular values just above polar_express_4's cutoff below it (`benchmarks/emulated_band.py
# --clusters`, benchmarks/RESULTS.md). Their products cost nothing beside a model's large matrices.
SMALL_ENTRIES = 4096


def products(precision: str | None, gram: bool, m: int, n: int) -> Any:
  """The products of one iteration on ``m x n`` matrices: a ``jax.lax.Precision``, or ``FLOAT16``
  (module docstring; ``SMALL_ENTRIES``)."""
  chosen = policy(precision)
  if chosen == "float16":
    return FLOAT16
  if chosen == "highest" or gram or m * n <= SMALL_ENTRIES:
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def first_step_parts(prec: Any, dtype: Any) -> Any:
  """The dtype the first step's ``B`` is split into (``hi`` in it and ``B - hi``), or None.

  A step multiplies ``X`` by ``gamma + c (s^2 - alpha)^2`` along each singular value ``s``
  (``newton_schulz.square_form``). The first step spans the widest range: ``polar_express_4``'s
  runs from 0.03 (around ``s = 0.82``) to 8.4 (small ``s``), a ratio of 280, and a ``B`` rounded
  entrywise to 8 bits (up to 2^-8 of its largest entries, 8.4) is wrong by up to the small
  end's whole value; 11 bits (float16) by up to 14% of it. So the first step's ``B`` reaches
  its product as two parts wherever the product's operands are narrower than float32: float16
  under ``FLOAT16``, bfloat16 at ``DEFAULT`` (a TPU's one pass) or for a bfloat16 iterate;
  float16 for a float16 one; None for float64 (its products are exact: ``matmul``). One more
  ``m x m`` by ``m x n`` product. (Ratios over the singular values a step sees: 280 for
  polar_express_4's first, 44 for Polar Express's; 2.2 to 5.4 for every later step and Keller's
  quintic.)
  """
  d = jnp.dtype(dtype)
  if d.itemsize >= 8:
    return None
  if prec == FLOAT16:
    return jnp.float16
  if d.itemsize < 4:
    return d
  if prec == jax.lax.Precision.DEFAULT:
    return jnp.bfloat16
  return None


TRACED_STEPS = 64  # the restarts of a traced step count (inject_hyperparams) are those below this
# Steps between a Gram iteration's restarts (module docstring): 2 for float16 products; 5 for float32
# ones, as DeepSeek-V4's preset restarts, since Q_k's rounding, unchecked, leaves the band past
# about 5 steps (polar_express_4 at 10 steps: largest singular value 70; 16 steps: not finite).
RESTART_EVERY, RESTART_EVERY_FLOAT16 = 5, 2


def restarts(given: tuple[int, ...], own: tuple[int, ...], steps: Any, prec: Any) -> tuple[int, ...]:
  """A Gram iteration's restarts: ``given`` (the caller's), the preset's ``own`` and one every
  ``RESTART_EVERY`` steps (``RESTART_EVERY_FLOAT16`` for float16 products) below ``steps``:
  before steps 5, 10, ... (2, 4, ...). The presets' own step counts need none in float32.
  The caller's restarts add to the others, never replace them: those are what the products'
  precision needs to hold the band (``benchmarks/RESULTS.md``)."""
  every = RESTART_EVERY_FLOAT16 if prec == FLOAT16 else RESTART_EVERY
  top = steps if isinstance(steps, int) else TRACED_STEPS
  return tuple(sorted({*given, *range(every, top, every), *own}))


def iterate_scale(x: Any, prec: Any) -> float:
  """The power of two an ``m x n`` iterate is multiplied by before it is rounded to float16
  (``prec`` is ``FLOAT16``; else 1): ``2^floor(log2 sqrt(m))``, ``m`` the shorter side, at
  most ``2^8`` (``|X| <= 1.2`` stays far below float16's largest, 65504)."""
  if prec != FLOAT16:
    return 1.0
  m = min(x.shape[-2:])
  return 2.0 ** min(8, int(math.log2(max(m, 1))) // 2)


def matmul(p: jax.Array, q: jax.Array, prec: Any, dtype: Any = None, scales: tuple[float, float] = (1.0, 1.0)
           ) -> jax.Array:
  """``p @ q`` at ``prec``, the result in ``dtype`` (None: the operands' promoted dtype).

  For ``FLOAT16``, ``p * scales[0]`` and ``q * scales[1]`` (powers of two) are rounded to
  float16, multiplied with float32 accumulation and divided by the scales again; float64
  operands are multiplied at ``HIGHEST`` instead."""
  out = dtype if dtype is not None else jnp.result_type(p, q)
  if prec != FLOAT16:
    return jnp.matmul(p, q, preferred_element_type=dtype, precision=prec)
  if jnp.dtype(out) == jnp.float64 or jnp.result_type(p, q) == jnp.float64:
    return jnp.matmul(p, q, preferred_element_type=dtype, precision=jax.lax.Precision.HIGHEST)
  p16, q16 = (_to_float16(v, s) for v, s in zip((p, q), scales))
  r = jnp.matmul(p16, q16, preferred_element_type=jnp.float32, precision=_F16)
  s = scales[0] * scales[1]
  return (r if s == 1.0 else r * (1.0 / s)).astype(out)


def einsum(spec: str, p: jax.Array, q: jax.Array, prec: Any) -> jax.Array:
  """``jnp.einsum(spec, p, q)`` at ``prec`` (``matmul``'s rules, without scales)."""
  if prec != FLOAT16 or jnp.result_type(p, q) == jnp.float64:
    return jnp.einsum(spec, p, q, precision=jax.lax.Precision.HIGHEST if prec == FLOAT16 else prec)
  r = jnp.einsum(spec, p.astype(jnp.float16), q.astype(jnp.float16), preferred_element_type=jnp.float32,
                 precision=_F16)
  return r.astype(jnp.result_type(p, q))


def _to_float16(v: jax.Array, scale: float) -> jax.Array:
  return (v if scale == 1.0 else v * jnp.asarray(scale, v.dtype)).astype(jnp.float16)
