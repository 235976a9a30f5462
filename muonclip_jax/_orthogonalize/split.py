"""Newton–Schulz of one matrix split over a group of ``g`` devices (inside ``shard_map``).

Each device of the group holds a column slab ``X_j`` (``m x n/g``) of a wide ``m x n``
matrix (``m <= n``), and ends with the same slab of the result. Both iterations of
``newton_schulz`` are supported, on a stack ``(q, m, n/g)``:

* ``"standard"``: ``A = sum_j X_j X_j^T`` (one all-reduce of ``m x m`` a step, float32),
  ``B = c (A - alpha I)^2`` (``newton_schulz.step_matrix``: ``a I + b A + c A^2 = B + gamma I``)
  with its square from half its row blocks (``_sym_full``), then ``X_j <- gamma X_j + B X_j``
  locally.
* ``"gram"``: ``G = sum_j X_j X_j^T`` (one all-reduce; each slab's in chunks for a short side
  below 32, as ``symmetric.gram_in_chunks``), then the ``m x m`` iteration split
  by rows: device ``p`` holds rows ``p m/g ..`` of ``Q``. Every iterate is a polynomial in
  ``G``, so they commute: ``Q_{k+1} = Q_k H_k`` and ``R_{k+1} = R_k H_k H_k``. Each device
  keeps the whole ``R_k`` and ``H_k``: the symmetric ``R_k^2`` and ``R_k H_k H_k`` come from
  about half of their row blocks (``_sym_full``: computed, all-gathered, mirrored). About
  ``6 m^3 / g`` FLOPs a step; ``Q`` is all-gathered once for the final ``Q X_j``.

The input is first scaled by a power of two below its largest magnitude (one all-reduce of a
scalar per matrix, ``pmax``), as ``newton_schulz`` does, so that squares of entries up to
float32's largest do not overflow. The Frobenius norm is then ``sqrt(trace(X X^T))`` of the
first Gram matrix, the second power of two scales ``X`` and that matrix, and the norm (or the
Schatten-4 norm, from the same matrix) is folded into the first step as in ``newton_schulz``.
Restarts and a traced step count are not supported: such matrices stay whole (``resolve``
returns None). Megatron's ``--muon-tp-mode distributed`` likewise all-reduces ``X X^T`` over
tensor-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .newton_schulz import (NORM_CAP, apply_factor, apply_step, factor_parts, first_scale,
                            power_of_two_scale, square_form, step_matrix)
from .precision import (einsum, first_step_parts, matmul, products, restarts as policy_restarts,
                        uses_gram)
from .presets import GRAM_ASPECT, gram_restarts, resolve_coeffs, resolve_options, resolve_steps
from .symmetric import SYMMETRIC_MIN, gram_in_chunks, gram_of


def resolve(ns_kwargs: dict, m: int, n: int) -> dict | None:
  """The static iteration of ``newton_schulz(**ns_kwargs)`` on ``m x n`` (``m <= n``), or
  None when it cannot be split (a traced step count, restarts)."""
  coeffs = ns_kwargs.get("coeffs", "muon")
  steps = ns_kwargs.get("steps")
  if isinstance(steps, jax.core.Tracer):
    return None
  steps = resolve_steps(steps, coeffs)
  table, norm_scale = resolve_coeffs(coeffs, steps)
  method = ns_kwargs.get("method", "standard")
  normalize, restarts = resolve_options(coeffs, steps, method, ns_kwargs.get("normalize"),
                                            ns_kwargs.get("restarts", ()))
  gram = uses_gram(method, m, n, ns_kwargs.get("precision"), GRAM_ASPECT)
  prec = products(ns_kwargs.get("precision"), gram, m, n)
  if restarts or (gram and policy_restarts((), gram_restarts(coeffs, steps, ()), steps, prec)):
    return None
  return dict(steps=steps, table=table, norm_scale=norm_scale, schatten4=normalize == "schatten4", gram=gram,
              eps=ns_kwargs.get("eps", 1e-7), compute_dtype=ns_kwargs.get("compute_dtype"),
              prec=prec)


def _half(g: int) -> int:
  """Blocks per block row that ``_sym_full`` computes: ``(p, p + i mod g)``, ``i <= g // 2``."""
  return g // 2 + 1


def cost(it: dict, m: int, n: int, g: int, itemsize: int) -> tuple[float, list[tuple[str, int, float]]]:
  """(FLOPs per device, [(collective, result bytes, group size)]) of one matrix split over ``g``.

  The collectives are those of ``iterate`` on one matrix; a stack of ``q`` has ``q`` times
  the bytes in the same collectives. They carry float32 whatever the compute dtype (the
  ``m x m`` matrices are formed and reduced in float32; XLA:CPU would widen a bf16
  reduction anyway). ``itemsize``, the iterate's, says whether a 16-bit iterate takes the
  standard first step's ``B`` or the Gram factor ``Q`` in two parts (one more ``m x m`` by
  ``m x n/g`` product, as ``ns_flops`` counts). The FLOPs count the matmuls and, unlike ``ns_flops``,
  the ``m x m`` elementwise work every device of the group repeats (``4 m^2`` a step: the
  polynomial ``a I + b R + c R^2``), which matters once ``g`` approaches ``m``.
  """
  w, r, h = n // g, m // g, _half(g)
  K = it["steps"]
  sym = 0.75 if m >= SYMMETRIC_MIN and m % 2 == 0 else 1.0
  half = 2 * h * r * r * m  # a symmetric m x m product from row blocks (``_sym_full``)
  half_bytes = g * h * r * r
  amax = [("all-reduce", 4, g)]  # the largest magnitude (pmax), one float32 per matrix
  width = jnp.dtype(f"float{8 * itemsize}")  # all first_step_parts and factor_parts read of the dtype
  if not it["gram"]:
    flops = K * (sym * 2 * m * m * w + half + 2 * m * m * w + 4 * m * m)
    flops += 2 * m * m * w if first_step_parts(it.get("prec"), width) is not None else 0
    return flops, amax + [("all-reduce", m * m * 4, g), ("all-gather", half_bytes * 4, g)] * K
  f = sym * 2 * m * m * w + (2 if factor_parts(it.get("prec"), width) else 1) * 2 * m * m * w
  f += K * (half + 4 * m * m) + (K - 1) * 2 * r * m * m + (K - 1) * (2 * r * m * m + half)
  wb = 4  # the m x m iteration runs in float32 (or wider)
  colls = [("all-reduce", m * m * wb, g)] + [("all-gather", half_bytes * wb, g)] * (2 * K - 1)
  return f, amax + colls + [("all-gather", m * m * wb, g)]


def _rows(x: jax.Array, p: jax.Array, r: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, p * r, r, axis=-2)


def _sym_full(rows: jax.Array, right: jax.Array, p: jax.Array, g: int, axes: tuple[str, ...],
              prec: Any = None) -> jax.Array:
  """The whole ``L @ right`` (``(q, m, m)``), known to be symmetric, from ``rows = L``'s row
  block ``p`` on device ``p``: each device computes the blocks ``(p, p + i mod g)``,
  ``i <= g // 2`` (every block or its mirror once, about half), all-gathers them, and
  mirrors the rest."""
  q, r, m = rows.shape
  h = _half(g)
  cols = jnp.take(right.reshape(q, m, g, r), (p + jnp.arange(h)) % g, axis=2)  # (q, m, h, r)
  mine = einsum("qrm,qmjc->qjrc", rows, cols, prec)  # (q, h, r, r): blocks (p, p + j)
  every = jax.lax.all_gather(mine, axes, axis=1).reshape(q, g * h, r, r)
  pool = jnp.concatenate([every, jnp.swapaxes(every, -1, -2)], axis=1)
  idx = np.full((g, g), -1)
  for a in range(g):
    for i in range(h):
      idx[a, (a + i) % g] = a * h + i
  for a in range(g):
    for i in range(h):
      if idx[(a + i) % g, a] < 0:
        idx[(a + i) % g, a] = g * h + a * h + i
  blocks = jnp.take(pool, jnp.asarray(idx.reshape(-1)), axis=1).reshape(q, g, g, r, r)
  return jnp.swapaxes(blocks, 2, 3).reshape(q, m, m)


def iterate(x: jax.Array, it: dict, axes: tuple[str, ...], g: int) -> jax.Array:
  """The polar factor's slabs of a stack of split matrices; ``x``: ``(q, m, n/g)`` slabs."""
  dtype = jnp.dtype(it["compute_dtype"]) if it["compute_dtype"] is not None else x.dtype
  wdtype = jnp.promote_types(dtype, jnp.float32)
  table = square_form(it["table"])
  last = table.shape[0] - 1
  eps, K = it["eps"], it["steps"]
  m = x.shape[-2]
  r = m // g
  p = jax.lax.axis_index(axes)
  xf = x.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)  # float64: its range; A stays float32
  # x scaled by powers of two (exact before the cast), as newton_schulz scales it: first below its
  # largest magnitude (|x e| < 4: no square overflows), then below the Frobenius norm, read from
  # the trace of the first Gram matrix (the Gram iteration's G: in chunks), scaled alike. The
  # first step's scale is folded in (first_scale).
  e = power_of_two_scale(jax.lax.pmax(jnp.max(jnp.abs(xf), axis=(-2, -1), keepdims=True), axes))
  X = (xf * e).astype(dtype)
  prec = it.get("prec")
  gram_f = lambda X, t=None, of=gram_of: jax.lax.psum(of(X, False, t, prec), axes)
  A = gram_f(X, jnp.float32, gram_in_chunks if it["gram"] else gram_of)
  f = power_of_two_scale(jnp.sqrt(jnp.trace(A, axis1=-2, axis2=-1))[..., None, None], NORM_CAP)
  X = (xf * e * f).astype(dtype)  # one rounding, as newton_schulz's
  A = A * (f * f)
  inv = 1.0 / first_scale(A, it["schatten4"], it["norm_scale"], eps * e * f)
  A = A * (inv * inv)

  def square(D):  # the product of newton_schulz.step_matrix, from half its row blocks
    return _sym_full(_rows(D, p, r), D, p, g, axes, prec)

  if not it["gram"]:
    for k in range(K):
      row = tuple(float(v) for v in table[min(k, last)])
      if k:
        A = gram_f(X, jnp.float32)
      B, gamma = step_matrix(A, row, prec, row[2] != 0, square)
      if k == 0:
        B, gamma = B * inv, gamma * inv
      X = apply_step(B, gamma, X, False, prec, first_step_parts(prec, X.dtype) if k == 0 else None)
    return X.astype(x.dtype)
  R = A.astype(wdtype)
  eye = jnp.broadcast_to(jnp.eye(m, dtype=wdtype), R.shape)
  Q_rows = None
  for k in range(K):
    row = tuple(float(v) for v in table[min(k, last)])
    R_rows = _rows(R, p, r)
    B, gamma = step_matrix(R, row, prec, row[2] != 0, square)
    H = B + gamma * eye
    Q_rows = _rows(H, p, r) if Q_rows is None else matmul(Q_rows, H, prec)
    if k + 1 < K:
      R = _sym_full(matmul(R_rows, H, prec), H, p, g, axes, prec)  # R H H = H R H
  Q = jax.lax.all_gather(Q_rows, axes, axis=1, tiled=True)
  return apply_factor(Q * inv.astype(wdtype), X, False, prec).astype(x.dtype)
