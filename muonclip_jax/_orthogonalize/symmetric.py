"""Products known to be symmetric, among them the Gram matrix ``X X^T``, for Newton–Schulz.

``sym_product`` computes such a product of ``m >= SYMMETRIC_MIN`` rows as its top half and
bottom-right block, mirrored: 3/4 of its FLOPs. ``gram_of`` is the smaller Gram matrix of an
``m x n`` iterate; ``gram_in_chunks`` the same summed over chunks of columns, for the Gram
iteration's ``X_0 X_0^T``, which is formed once and whose float32 rounding nothing corrects.
Both iterations (``newton_schulz``, ``split``) take their products from here, at the precision
``precision.matmul`` names.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .precision import iterate_scale, matmul


# Products known to be symmetric (X X^T, A A, H (R H)) of size >= SYMMETRIC_MIN compute the
# top half of the rows and the bottom-right block only, and mirror the bottom-left block:
# 3/4 of the FLOPs, in two matmuls. (No symmetric-product routine is exposed by XLA.)
SYMMETRIC_MIN = 512


def sym_product(P: jax.Array, Q: jax.Array, dtype: Any = None, prec: Any = None,
                scales: tuple[float, float] = (1.0, 1.0)) -> jax.Array:
  """``P @ Q`` for a product known to be symmetric (square, ``m x m``), at precision ``prec``
  (``precision.matmul``; ``scales``: its float16 operand scales)."""
  m = P.shape[-2]
  if m < SYMMETRIC_MIN or m % 2:
    return matmul(P, Q, prec, dtype, scales)
  h = m // 2
  top = matmul(P[..., :h, :], Q, prec, dtype, scales)  # [C11 C12]
  c22 = matmul(P[..., h:, :], Q[..., :, h:], prec, dtype, scales)
  return jnp.concatenate([top, jnp.concatenate([jnp.matrix_transpose(top[..., :, h:]), c22], axis=-1)], axis=-2)


def gram_of(X: jax.Array, tall: bool, dtype: Any = None, prec: Any = None) -> jax.Array:
  """The smaller Gram matrix: ``X X^T`` of a wide ``X``, ``X^T X`` of a tall one."""
  c = iterate_scale(X, prec)
  if tall:
    return sym_product(jnp.matrix_transpose(X), X, dtype, prec, (c, c))
  return sym_product(X, jnp.matrix_transpose(X), dtype, prec, (c, c))


# The Gram iteration forms G = X_0 X_0^T once and iterates on it: G's float32 rounding is never
# corrected (the standard iteration re-forms X X^T from each step's X, which absorbs it). One dot
# sums n products per entry in float32, and where the terms repeat (a gradient of bfloat16 values,
# ones plus 1% noise) the rounding is biased: on 2 x 8192 such gradients it moved G's small
# eigenvalue (s^2 ~ 5e-5 at s = 7e-3, near the band's start, 3e-3) by 10-40%, and polar_express_4's
# largest singular value reached 1.28-1.42. With a short side of a few rows G's entries are of
# order 1 / m, large; measured, short sides of 2 to 16 left the band, 24 to 512 held (up to 32 x
# 131072). Below GRAM_CHUNK_BELOW rows G is summed in chunks of GRAM_CHUNK columns: ~GRAM_CHUNK +
# n / GRAM_CHUNK roundings per entry instead of n (2 x 8192: the small eigenvalue 0.1% off).
GRAM_CHUNK, GRAM_CHUNK_BELOW = 256, 32


def gram_in_chunks(X: jax.Array, tall: bool, dtype: Any = None, prec: Any = None) -> jax.Array:
  """``gram_of(X, tall, dtype, prec)`` as a sum over chunks of ``GRAM_CHUNK`` columns (rows of a tall
  ``X``) and the remainder where the short side is below ``GRAM_CHUNK_BELOW``: the same products,
  ``n / GRAM_CHUNK`` Gram matrices of ``m x m`` summed in ``dtype`` (comment above). The chunks
  are laid side by side first: one copy of ``X``, a few rows by ``n``."""
  *batch, r, c = X.shape
  m, n = (c, r) if tall else (r, c)
  k = n // GRAM_CHUNK
  if m >= GRAM_CHUNK_BELOW or k < 2:
    return gram_of(X, tall, dtype, prec)
  main = k * GRAM_CHUNK
  if tall:  # (..., n, m) -> (..., k, GRAM_CHUNK, m)
    chunks = X[..., :main, :].reshape(*batch, k, GRAM_CHUNK, m)
    rest = X[..., main:, :]
  else:  # (..., m, n) -> (..., k, m, GRAM_CHUNK)
    chunks = jnp.swapaxes(X[..., :main].reshape(*batch, m, k, GRAM_CHUNK), -3, -2)
    rest = X[..., main:]
  G = jnp.sum(gram_of(chunks, tall, dtype, prec), axis=-3)
  return G + gram_of(rest, tall, dtype, prec) if main < n else G
