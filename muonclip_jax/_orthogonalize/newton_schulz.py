"""Newton–Schulz orthogonalization: the polar factor U V^T of a matrix, approximately.

For ``X = U S V^T`` the iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` applies
the odd polynomial ``p(s) = a s + b s^3 + c s^5`` to every singular value, leaving U and V
alone. Starting from ``X / ||X||`` (all singular values in (0, 1]), a few steps drive the
singular values towards 1 (Keller Jordan, "Muon", 2024; Amsel et al., "The Polar Express",
arXiv 2505.16932).

Two ways to run the same polynomial iteration (``method``):

* ``"standard"``: the iteration above on the ``m x n`` matrix (``m <= n``; a tall matrix
  runs it on its transpose, without copying), ``4 m^2 n + 2 m^3`` FLOPs a step.
* ``"gram"`` (Gram Newton–Schulz, after the Dao AI lab's write-up): every iterate is
  ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``G = X_0 X_0^T``, so the steps can run
  on ``m x m`` matrices alone. With ``R_k = X_k X_k^T`` and ``H_k = a I + b R_k + c R_k^2``:
  ``Q_{k+1} = H_k Q_k`` and ``R_{k+1} = H_k R_k H_k``; one product ``Q_K X_0`` at the end.
  That costs ``2 m^2 n`` for ``G``, ``2 m^2 n`` for ``Q_K X_0`` and at most ``8 m^3`` a
  step, instead of ``4 m^2 n + 2 m^3`` a step: fewer FLOPs once ``n >~ 1.5 m``. A
  *restart* before step ``k`` re-forms ``X_0 <- Q_k X_0`` and ``G`` from it, bounding how
  much rounding in ``Q`` can grow (``4 m^2 n`` FLOPs each, less three ``m x m`` products).
  ``G`` is never re-formed otherwise, so a few-row ``X_0``'s is summed in chunks
  (``symmetric.gram_in_chunks``).

Both form each step's ``m x m`` matrix ``a I + b A + c A^2 = B + gamma I`` in float32 (float64
for float64), with ``B = c (A - alpha I)^2`` (``step_matrix``; ``square_form`` says why). The
standard iteration takes ``X <- gamma X + B X``, accumulated in float32 and rounded once to the
compute dtype; its first step's ``B`` goes in as two parts wherever the products round their
operands below float32 (``apply_step``, ``precision.first_step_parts``).

Both compute products whose result is symmetric (``X X^T``, ``(A - alpha I)^2``, ``H (R H)``) as
their top half rows and bottom-right block, mirrored (``symmetric``): 3/4 of their FLOPs.
``ns_flops`` counts what is computed.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._util import check_number, power_of_two_below
from .precision import (FLOAT16, first_step_parts, iterate_scale, matmul, products, restarts as policy_restarts,
                        uses_gram)
from .presets import GRAM_ASPECT, gram_restarts, resolve_coeffs, resolve_options, resolve_steps
from .symmetric import SYMMETRIC_MIN, gram_in_chunks, gram_of, sym_product


def newton_schulz(
    x: jax.Array,
    *,
    steps: int | None = 5,
    coeffs: Any = "muon",
    eps: float = 1e-7,
    compute_dtype: Any = None,
    method: str = "standard",
    normalize: str | None = None,
    restarts: Any = (),
    precision: str | None = None,
) -> jax.Array:
  """Approximate polar factor ``U V^T`` of the last two axes of ``x``.

  ``X_0 = x / (s ||x|| + eps)`` (s = 1 for ``"muon"``, 1.02 for the Polar Express tables;
  computed as ``x`` scaled by powers of two, exactly, with the division folded into the first
  step: ``first_scale``), then for ``k = 1..steps``: ``A = X X^T``, ``X <- a_k X + (b_k A +
  c_k A A) X``. A tall matrix (rows > cols) uses ``A = X^T X`` and ``X <- a X + X B``, the same iteration on
  the transpose, so that ``A`` is the smaller Gram matrix (and nothing is copied). The
  loop is rolled (``lax.fori_loop``) or runs on ``m x m`` matrices (``"gram"``), so
  temporaries stay a few times the size of ``x``. ``ns_flops`` counts the FLOPs.

  Args:
    x: array of rank >= 2; leading axes are a batch.
    steps: number of iterations (>= 1; static, or traced under ``inject_hyperparams``);
      ``None`` for the number the coefficients were designed for.
    coeffs: ``"muon"`` (Keller Jordan's quintic (3.4445, -4.7750, 2.0315), 5 steps),
      ``"polar_express"`` (Amsel et al. 2025's per-step coefficients, 5 steps),
      ``"polar_express_4"`` (the same construction for 4 steps, see
      ``POLAR_EXPRESS_4_COEFFS``; Schatten-4 normalization), ``"deepseek_v4"``
      (DeepSeek-V4's hybrid iteration as MaxText runs it: 8 steps of ``"muon"``'s quintic,
      then 2 of (2, -1.5, 0.5); 10 steps, Frobenius normalization), or an array of shape
      ``(3,)`` (the same every step) or ``(steps, 3)``. Steps past a preset's table use the
      converged quintic (15/8, -10/8, 3/8); past ``"deepseek_v4"``'s, its finishing
      (2, -1.5, 0.5).
    eps: added to the norm, so that a zero matrix maps to zero. It is a floor: the input is
      divided by ``s ||x|| + eps``, so a matrix whose Frobenius norm is not well above
      ``eps`` (entries of 1e-30, say) is divided by about ``eps`` instead of its norm and
      comes out near zero, not near orthogonal. Large inputs have no such limit: the norm is
      taken of ``x`` scaled by a power of two below its largest magnitude
      (``power_of_two_scale``), so every finite input, entries up to its dtype's largest
      included, gives the output of the input scaled down (orthogonalization is
      scale-invariant), without overflow or NaN.
    compute_dtype: dtype of the iteration (e.g. ``jnp.bfloat16`` on accelerators);
      defaults to ``x.dtype``. Norms are always taken in float32 (float64 for a float64
      ``x``, whose scales and norm keep its range and precision; the split path of
      ``shard_split`` forms its ``m x m`` matrices in float32 whatever the dtype). With
      ``"gram"`` only the ``m x n`` products run in ``compute_dtype`` (accumulating in
      float32); the ``m x m`` iteration runs in float32 (or wider), and in a low-precision
      dtype the final
      ``Q X_0`` splits ``Q`` into a high and a low part (two products) so that ``Q``'s
      growth does not amplify its rounding. (The ``"float16"`` policy, ``precision``, rounds
      every operand to float16 whatever the dtype.)
    method: ``"standard"``, ``"gram"`` (see the module docstring; same polynomial,
      different rounding) or ``"auto"`` (``"gram"`` when the longer side is at least
      ``GRAM_ASPECT`` = 2 times the shorter, where ``ns_flops`` counts fewer FLOPs for it
      than for ``"standard"``; the ratios are in ``benchmarks/RESULTS.md``).
    normalize: ``"frobenius"`` (``||x||_F``), ``"schatten4"`` (``||x||_S4 = ||x x^T||_F^(1/2)``,
      computed from the first Gram matrix at no extra matmul; it is never larger than
      ``||x||_F`` and never smaller than the top singular value, so every singular value
      starts at least as close to 1: Grishina et al. 2025, arXiv 2506.10935), or ``None``
      for the preset's choice (``"schatten4"`` for ``"polar_express_4"``, else Frobenius).
    restarts: Gram iteration only (``"gram"``, or ``"auto"`` where it picks it; refused with
      ``"standard"``): step indices (in ``[1, steps - 1]``) before which the Gram matrix is
      re-formed from the current iterate, in addition to those it always makes: the preset's
      own (``"deepseek_v4"`` restarts before step 5) and one every 5 steps, before steps 5,
      10, ... (every 2 under the ``"float16"`` policy): none at the presets' own step counts,
      where float32 holds the band (tested up to condition number 1e6), as bfloat16 compute
      does (see ``compute_dtype``); more steps without them leave it
      (``_orthogonalize/precision.py``).
    precision: the precision policy of the products (``_orthogonalize.precision``): None (the
      default) for the backend's, read from ``jax.default_backend()`` when traced: on the CPU
      ``"highest"`` (every product exact float32, ``"auto"`` as above); on GPUs
      ``"float16"`` (``"auto"`` as above; every product on float16 operands, the iterate
      scaled by a power of two into float16's range, accumulated in float32; a Gram iteration
      restarts every 2 steps, whatever ``restarts`` adds); on TPUs ``"default"``
      (``"auto"`` runs ``"standard"``, whose products run at the one-pass bfloat16 rate and
      hold the band there, but on matrices of at most ``SMALL_ENTRIES`` (64 x 64) entries at
      ``HIGHEST``; a ``"gram"`` iteration keeps exact float32 products, since 8-bit
      mantissas leave its band). No product depends on ``jax_default_matmul_precision``.

  Returns:
    An array of the shape and dtype of ``x`` (empty for a zero-size ``x``, such as a
    ``(0, n)`` matrix or an empty batch). Its singular values are ``p(s)`` of the
    normalized input's, ``p`` the composition of the steps' polynomials, and its singular
    vectors are ``x``'s. With each preset's own step count, input singular values down to
    3e-3 of the norm land in a band around 1 (smaller ones need more steps to grow): roughly
    [0.7, 1.2] for ``"muon"`` (Keller Jordan), and [0.779, 1.200] for ``"polar_express_4"``
    in exact arithmetic, by construction (``POLAR_EXPRESS_4_COEFFS``). The bands measured
    per preset and dtype are in ``benchmarks/RESULTS.md``; ``tests/test_newton_schulz.py``
    and ``tests/test_fast_orthogonalization.py`` check them, with a small margin, on
    Gaussian and condition-1e6 matrices, and that no output singular value exceeds the
    band's top. ``"gram"`` runs its ``m x m`` iteration in float32 whatever the dtype; it
    differs from ``"standard"`` by float32 rounding amplified by the conditioning of
    ``X X^T`` (which, for a short side below 32, is summed over chunks of 256 columns:
    ``symmetric.gram_in_chunks``). The Polar Express table is optimized for all five steps: fewer steps leave a
    wider band; more steps converge to 1 (steps past the table use the converged quintic).

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> x = jax.random.normal(jax.random.key(0), (4, 8))
    >>> o = mc.newton_schulz(x)  # Keller Jordan's quintic, 5 steps
    >>> o.shape, o.dtype
    ((4, 8), dtype('float32'))
    >>> s = jnp.linalg.svd(o, compute_uv=False)
    >>> bool(s.min() > 0.6 and s.max() < 1.25)  # near 1, not exactly 1
    True
    >>> o = mc.newton_schulz(x, steps=8, coeffs="polar_express")  # more steps converge
    >>> jnp.round(jnp.linalg.svd(o, compute_uv=False), 2)
    Array([1., 1., 1., 1.], dtype=float32)
    >>> u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    >>> round(float(jnp.abs(o - u @ vt).max()), 3)  # to the polar factor U V^T
    0.0
  """
  table, norm_scale = resolve_coeffs(coeffs, steps)
  normalize, restarts = resolve_options(coeffs, steps, method, normalize, restarts)
  steps = resolve_steps(steps, coeffs)
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array of rank >= 2, got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):  # the result has x's dtype: an integer one would truncate it to 0
    raise ValueError(f"newton_schulz needs a floating x, got x of {x.dtype}")
  dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else x.dtype
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits < 16:  # 8 bits: no promotion with float32
    raise ValueError(f"compute_dtype must be a floating dtype of 16 bits or more, got {dtype}" if compute_dtype
                     is not None else f"newton_schulz needs x of a floating dtype of 16 bits or more, got {dtype}; "
                     "pass compute_dtype=")
  check_number("eps", eps, low=0.0, high=math.inf, low_open=True, high_open=True)  # 0: a zero x is 0 / 0
  if x.size == 0:  # a (0, n) or (m, 0) matrix, or an empty batch: nothing to orthogonalize
    return jnp.zeros(x.shape, x.dtype)
  tall = x.shape[-2] > x.shape[-1]  # then A = X^T X and X <- a X + X B^T, no transposes
  m, n = min(x.shape[-2:]), max(x.shape[-2:])
  gram = uses_gram(method, m, n, precision, GRAM_ASPECT)
  prec = products(precision, gram, m, n)
  xf = x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)
  # x 2^-e 2^-k, exact before the cast (power_of_two_scale), with ||X||_F in [1/2, 1): the norm's
  # scale, norm_scale * ||X|| + eps 2^-e 2^-k, is folded into the first step (first_scale).
  e = power_of_two_scale(jnp.max(jnp.abs(xf), axis=(-2, -1), keepdims=True))
  y = xf * e  # |y| < 4: no square overflows
  norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=(-2, -1), keepdims=True))
  k = power_of_two_scale(norm, NORM_CAP)
  X = (y * k).astype(dtype)
  first = (normalize == "schatten4", norm_scale, eps * e * k, norm * k)  # first_scale's arguments after A
  if gram:
    X = _gram_iterate(X, table, steps, first,
                      policy_restarts(restarts, gram_restarts(coeffs, steps, ()), steps, prec), tall, prec)
  else:
    X = _iterate(X, table, steps, first, tall, prec)
  return X.astype(x.dtype)


# power_of_two_scale's cap (its hi) below the norm; below the largest magnitude it is the dtype's
# bias - 1 (126 for float32, 1022 for float64)
NORM_CAP = 1


def power_of_two_scale(v: jax.Array, hi: int | None = None) -> jax.Array:
  """``2^-e`` for the power of two with ``v < 2^e <= 2 v``, for a float32 or float64 ``v >= 0``
  (sign bit clear: not ``-0.0``), with ``-e`` kept within [-126, hi] (float64: [-1022, hi];
  ``_util.powers_of_two``): a normal number of ``v``'s dtype, so multiplying by it is exact (but
  where the product underflows). The figures below are float32's; float64's are alike, with
  1022 for 126. ``hi=None``: 126 (float64: 1022).

  ``newton_schulz`` scales its input by two of these instead of dividing it by its norm, so that
  an input of ``compute_dtype`` values (bfloat16 gradients, say) reaches the iteration unrounded
  (dividing rounds it a second time, which on small matrices, 4 x 4 or 8 x 8, can move a singular
  value near the band's low end below it: ``benchmarks/RESULTS.md``):

  * ``e`` from its largest magnitude, ``hi = None`` (126): ``|x 2^-e|`` in [1/2, 1), so
    no square overflows (those of entries above ~1.8e19 would); in [1, 4) for a largest
    magnitude at or above 2^126 (``2^-127`` would be subnormal, flushed to zero by XLA:CPU);
    ``2^126`` for a zero or subnormal largest magnitude (read from the exponent bits, which are
    0 for both), which brings a matrix of subnormals (where a backend keeps them) to entries of
    at least 2^-23, whose squares are normal: its norm is not 0.
  * ``k`` from the Frobenius norm of the result, ``hi = NORM_CAP = 1``: ``||X||_F`` in [1/2, 1).
    That norm is at least 1/2 unless the first scale was capped at ``2^126``, so ``2^1`` caps only
    the scale of a zero or subnormal matrix, whose ``eps`` floor dominates its norm. A zero
    input's two scales make ``2^127``, finite: no ``inf * 0`` where they are multiplied together
    or squared (the split iteration's ``A f^2``).
  """
  if jnp.dtype(v.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
    raise ValueError(f"power_of_two_scale needs float32 or float64, got {v.dtype}")
  bias = int(jnp.finfo(v.dtype).maxexp) - 1
  return power_of_two_below(v, 0, 1 - bias, bias - 1 if hi is None else hi)


def ns_flops(shape: tuple[int, ...], *, steps: int | None = 5, coeffs: Any = "muon",
             method: str = "standard", restarts: Any = (), precision: str | None = None,
             compute_dtype: Any = None) -> int:
  """FLOPs (2 per multiply-add) of ``newton_schulz`` on ``shape``, matmuls only.

  For ``m = min``, ``n = max`` of the last two sizes and ``K`` steps: ``"standard"``
  ``K (4 m^2 n + 2 m^3)``, plus ``2 m^2 n`` where its first step's ``B`` goes in as two parts
  (products narrower than float32 under ``precision`` and ``compute_dtype``, None counted as
  float32: ``precision.first_step_parts``); ``"gram"`` ``4 m^2 n`` (``G`` and ``Q X_0``) plus, per run of
  steps between restarts, ``2 m^3`` for ``R^2`` each step, ``2 m^3`` for ``H Q`` each step
  but the run's first and ``4 m^3`` for ``H R H`` each step but the last, plus ``4 m^2 n``
  per restart, and ``2 m^2 n`` more for each ``Q X_0`` that takes ``Q`` in two parts (a 16-bit
  compute dtype, unless ``"float16"``: ``factor_parts``). Products known to be symmetric (``X X^T``, ``(A - alpha I)^2``, ``R^2``, ``H (R H)``)
  count 3/4 when ``m >= SYMMETRIC_MIN`` is even, as computed. Elementwise work (``O(m n)``
  a step) is left out. ``"auto"`` is resolved as ``newton_schulz`` resolves it under ``precision``.
  """
  steps = resolve_steps(steps, coeffs)
  _, restarts = resolve_options(coeffs, steps, method, None, restarts)
  *batch, r, c = shape
  m, n = min(r, c), max(r, c)
  count = int(np.prod(batch)) if batch else 1
  gram = uses_gram(method, m, n, precision, GRAM_ASPECT)
  sym = 0.75 if m >= SYMMETRIC_MIN and m % 2 == 0 else 1.0
  mmn, mmm = 2 * m * m * n, 2 * m**3
  if not gram:
    total = steps * (sym * mmn + sym * mmm + mmn)
    if first_step_parts(products(precision, False, m, n), compute_dtype or jnp.float32) is not None:
      total += mmn
  else:
    prec = products(precision, gram, m, n)
    restarts = policy_restarts(restarts, gram_restarts(coeffs, steps, ()), steps, prec)
    factor = 2 * mmn if factor_parts(prec, compute_dtype or jnp.float32) else mmn  # Q X_0: apply_factor
    total = sym * mmn + factor + len(restarts) * (factor + sym * mmn)
    bounds = (0,) + restarts + (steps,)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
      k = hi - lo
      total += sym * mmm * k + mmm * (k - 1)  # R^2 every step, H Q all but the run's first
      total += (mmm + sym * mmm) * (k - 1)  # H R H all but the run's last step
  return int(round(count * total))


def _left(P: jax.Array, X: jax.Array, tall: bool, dtype: Any = None, prec: Any = None) -> jax.Array:
  """``P`` applied on the short side: ``P X`` (wide), ``X P^T`` (tall; the transpose of ``P X^T``)."""
  c = iterate_scale(X, prec)
  if tall:
    return matmul(X, jnp.matrix_transpose(P), prec, dtype, (c, 1.0))
  return matmul(P, X, prec, dtype, (1.0, c))


def first_scale(A: jax.Array, schatten4: bool, norm_scale: float, floor: jax.Array,
                fro: jax.Array | None = None) -> jax.Array:
  """The first step's scale ``s = norm_scale * ||X|| + floor`` from ``A = X X^T`` (float32,
  keepdims): ``||X||_S4 = ||A||_F^(1/2)`` if ``schatten4``, else ``||X||_F``: ``fro`` if given
  (``newton_schulz``'s, summed in float32 from the float32 input), else ``trace(A)^(1/2)``;
  1 for ``X = 0`` (``power_of_two_scale``: the norm is 0 only then).

  The first step runs on ``X / s``, folded in: with ``A' = A / s^2`` it is ``(gamma / s) X +
  (B(A') / s) X``, and a Gram iteration's ``Q`` is divided by ``s``. ``X`` is its input scaled
  by powers of two (``power_of_two_scale``: ``||X||_F`` in [1/2, 1) and ``||X||_S4 >=
  rank^(-1/4) ||X||_F``), so ``1 / s`` is at most ``2 rank^(1/4)``, in float16's range. A zero
  ``X`` stays zero at any scale; 1 keeps the step's factors finite whatever the floor (``1 / eps``
  would overflow a float16 operand, and ``inf * 0`` is NaN).
  """
  af = A.astype(jnp.promote_types(A.dtype, jnp.float32))
  if schatten4:
    norm = jnp.sqrt(jnp.sqrt(jnp.sum(af * af, axis=(-2, -1), keepdims=True)))
  elif fro is not None:
    norm = fro
  else:
    norm = jnp.sqrt(jnp.trace(af, axis1=-2, axis2=-1))[..., None, None]
  return jnp.where(norm > 0, norm_scale * norm + floor, 1.0)


def square_form(table: np.ndarray) -> np.ndarray:
  """Each step's ``(a, b, c)`` as ``(c, alpha, b', gamma)`` with ``a I + b A + c A^2 = c (A -
  alpha I)^2 + b' A + gamma I``: ``alpha = -b / 2c``, ``b' = 0``, ``gamma = a - c alpha^2`` for
  ``c != 0``; ``(0, 0, b, a)`` for ``c = 0``.

  Why: a step's ``p(s) / s = a + b s^2 + c s^4`` nearly cancels where the step maps singular
  values low. Polar Express's first step has ``a + b y + c y^2 ~ 0.03`` at ``y = s^2 ~ 0.67``,
  from terms of 8 to 17, so ``a X + (b A + c A^2) X`` with ``A^2`` or the product's operands
  rounded to 8 (bfloat16) or 11 (float16) bits is wrong by about the step's whole value there.
  With ``c > 0`` and ``gamma > 0`` (every preset's step: ``p(s) / s > 0`` has no real root)
  ``c (A - alpha I)^2`` and ``gamma I`` are positive semi-definite and add without cancelling,
  and ``A - alpha I`` is small where the step's value is.
  """
  a, b, c = (np.asarray(table, np.float64)[:, j] for j in range(3))
  quad = c != 0
  alpha = np.where(quad, -b / np.where(quad, 2 * c, 1.0), 0.0)
  return np.stack([c, alpha, np.where(quad, 0.0, b), a - c * alpha * alpha], axis=1)


def square_table(table: np.ndarray, dtype: Any) -> tuple[jax.Array, bool]:
  """``square_form(table)`` as an array of ``dtype``, and whether some row has ``c = 0`` (its
  ``b' A`` term: ``step_matrix``'s ``linear``)."""
  square = square_form(table)
  return jnp.asarray(square, dtype), bool(np.any(square[:, 2]))


def step_matrix(A: jax.Array, row: Any, prec: Any = None, linear: bool = True,
                square: Any = None) -> tuple[jax.Array, Any]:
  """``(B, gamma)`` with ``a I + b A + c A^2 = B + gamma I`` for a symmetric float ``A`` and its
  ``square_form`` row: ``B = c (A - alpha I)^2 + b' A`` (the ``b' A`` term only if ``linear``:
  some row has ``c = 0``), in ``A``'s dtype, its one product at ``prec`` (``square``: the
  function that squares ``A - alpha I`` instead, as the split iteration's row blocks do)."""
  c, alpha, b, gamma = (row[j] for j in range(4))
  D = A - alpha * jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
  B = c * (sym_product(D, D, None, prec) if square is None else square(D))
  return (B + b * A if linear else B), gamma


def _iterate(X: jax.Array, table: np.ndarray, steps: Any, first: tuple, tall: bool, prec: Any = None) -> jax.Array:
  wdtype = jnp.promote_types(X.dtype, jnp.float32)
  table_arr, linear = square_table(table, wdtype)
  last = table.shape[0] - 1
  row = (lambda i: table_arr[0]) if last == 0 else (lambda i: table_arr[jnp.minimum(i, last)])

  def body(i, X, narrow=None):
    # X <- gamma X + B X (step_matrix: B formed from A = X X^T in float32; apply_step).
    A = gram_of(X, tall, wdtype, prec)
    # Step 0 runs on X / s (first_scale), folded in; later steps use s = 1 (exact): the loop stays rolled.
    inv = 1.0 / jnp.where(i == 0, first_scale(A, *first), 1.0).astype(wdtype)
    A = A * (inv * inv)
    B, gamma = step_matrix(A, row(i), prec, linear)
    return apply_step(B * inv, gamma * inv, X, tall, prec, narrow)

  narrow = first_step_parts(prec, X.dtype)
  if narrow is None:
    return jax.lax.fori_loop(0, steps, body, X)
  return jax.lax.fori_loop(1, steps, body, body(0, X, narrow))


def apply_step(B: jax.Array, gamma: Any, X: jax.Array, tall: bool, prec: Any, narrow: Any = None) -> jax.Array:
  """One step ``gamma X + B X`` (``B`` on the short side, ``step_matrix``), accumulated in ``B``'s
  float dtype and rounded once to ``X``'s. ``B`` is multiplied in ``X``'s dtype (float16 under
  ``FLOAT16``, unless float64); with ``narrow`` (``precision.first_step_parts``) as two parts,
  ``hi`` rounded to ``narrow`` and ``B - hi``: about twice its bits."""
  w = B.dtype
  op = jnp.float16 if prec == FLOAT16 and jnp.dtype(X.dtype).itemsize < 8 else X.dtype
  if narrow is None:
    BX = _left(B.astype(op), X, tall, w, prec)
  else:
    hi = B.astype(narrow)
    BX = _left(hi, X, tall, w, prec) + _left((B - hi.astype(w)).astype(narrow), X, tall, w, prec)
  return (gamma * X.astype(w) + BX).astype(X.dtype)


def factor_parts(prec: Any, dtype: Any) -> bool:
  """Whether ``apply_factor`` multiplies a float32 ``Q`` in two parts for an ``X0`` of ``dtype``."""
  return prec != FLOAT16 and jnp.dtype(dtype).itemsize < 4


def apply_factor(Q: jax.Array, X0: jax.Array, tall: bool, prec: Any = None) -> jax.Array:
  """``Q X0`` (or ``X0 Q^T``) for a float32 ``Q``: in X0's dtype, split in two if narrower
  (one product under the ``"float16"`` policy, whose ``matmul`` rounds the float32 ``Q`` to
  float16 once: ``precision``)."""
  if not factor_parts(prec, X0.dtype):
    return _left(Q if prec == FLOAT16 else Q.astype(X0.dtype), X0, tall, None, prec)
  hi = Q.astype(X0.dtype)
  lo = (Q - hi.astype(Q.dtype)).astype(X0.dtype)
  return _left(hi, X0, tall, Q.dtype, prec) + _left(lo, X0, tall, Q.dtype, prec)


def _gram_iterate(X0: jax.Array, table: np.ndarray, steps: Any, first: tuple, restarts: tuple[int, ...],
                  tall: bool, prec: Any = None) -> jax.Array:
  """Gram Newton–Schulz (module docstring): ``Q_K X_0`` from ``m x m`` iterations."""
  wdtype = jnp.promote_types(X0.dtype, jnp.float32)
  G = gram_in_chunks(X0, tall, wdtype, prec)
  eye = jnp.broadcast_to(jnp.eye(G.shape[-1], dtype=wdtype), G.shape)
  s = first_scale(G, *first).astype(wdtype)  # the iteration runs on X0 / s: 1 / s folded into Q
  G = G / (s * s)
  inv = 1.0 / s
  table_w, linear = square_table(table, wdtype)
  last = table.shape[0] - 1

  if isinstance(steps, int):
    Q, R = None, G  # Q None is the identity
    for k in range(steps):
      if k in restarts:
        X0 = apply_factor(Q if inv is None else Q * inv, X0, tall, prec).astype(X0.dtype)
        inv, Q = None, None
        R = gram_in_chunks(X0, tall, wdtype, prec)
      B, gamma = step_matrix(R, table_w[min(k, last)], prec, linear)
      H = B + gamma * eye
      Q = H if Q is None else matmul(H, Q, prec)
      if k + 1 < steps and k + 1 not in restarts:
        R = sym_product(H, matmul(R, H, prec), None, prec)
    return apply_factor(Q if inv is None else Q * inv, X0, tall, prec).astype(X0.dtype)

  # Traced step count (inject_hyperparams): a generic loop from Q = I.
  Q0 = eye * inv
  restart_arr = jnp.asarray(restarts, jnp.int32)

  def body(i, carry):
    X, Q, R = carry
    if restarts:
      def restart(c):
        X, Q, _ = c
        X = apply_factor(Q, X, tall, prec).astype(X.dtype)
        return X, eye, gram_in_chunks(X, tall, wdtype, prec)
      X, Q, R = jax.lax.cond(jnp.any(i == restart_arr), restart, lambda c: c, (X, Q, R))
    B, gamma = step_matrix(R, table_w[jnp.minimum(i, last)], prec, linear)
    H = B + gamma * eye
    return X, matmul(H, Q, prec), sym_product(H, matmul(R, H, prec), None, prec)

  X, Q, _ = jax.lax.fori_loop(0, steps, body, (X0, Q0, G))
  return apply_factor(Q, X, tall, prec).astype(X0.dtype)
