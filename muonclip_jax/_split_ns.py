"""Newton–Schulz of one matrix split over a group of ``g`` devices (inside ``shard_map``).

Each device of the group holds a column slab ``X_j`` (``m x n/g``) of a wide ``m x n``
matrix (``m <= n``), and ends with the same slab of the result. Both iterations of
``newton_schulz`` are supported, on a stack ``(q, m, n/g)``:

* ``"standard"``: ``A = sum_j X_j X_j^T`` (one all-reduce of ``m x m`` a step), then
  ``X_j <- a X_j + b (A X_j) + c (A (A X_j))``: the ``m x m`` product ``A^2`` is never
  formed, so every product is split (``6 m^2 n / g`` FLOPs a step, the Gram matrix at 3/4
  from ``SYMMETRIC_MIN`` up).
* ``"gram"``: ``G = sum_j X_j X_j^T`` (one all-reduce), then the ``m x m`` iteration split
  by rows: device ``p`` holds rows ``p m/g ..`` of ``R``, ``H`` and ``Q``. Every iterate is a
  polynomial in ``G``, so they commute: ``Q_{k+1} = Q_k H_k`` and ``R_{k+1} = R_k H_k H_k``
  need only the full ``H_k`` and ``R_k``, all-gathered (``R_k^2`` rows from the full
  ``R_k``). ``8 m^3 / g`` FLOPs a step (``2`` for ``R^2``, ``2`` for ``Q H`` but at the first,
  ``4`` for ``R H H`` but at the last); ``Q`` is all-gathered once for the final ``Q X_j``.

The Frobenius norm is ``sqrt(trace(X X^T))`` of the first Gram matrix (no extra
collective); the Schatten-4 norm follows from it as in ``newton_schulz``. Restarts and a
traced step count are not supported: such matrices stay whole (``splittable``).
Megatron's ``--muon-tp-mode distributed`` likewise all-reduces ``X X^T`` over
tensor-parallel ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _newton_schulz as nsm


def resolve(ns_kwargs: dict, m: int, n: int) -> dict | None:
  """The static iteration of ``newton_schulz(**ns_kwargs)`` on ``m x n`` (``m <= n``), or
  None when it cannot be split (a traced step count, restarts)."""
  coeffs = ns_kwargs.get("coeffs", "muon")
  steps = ns_kwargs.get("steps")
  if isinstance(steps, jax.core.Tracer):
    return None
  steps = nsm.resolve_steps(steps, coeffs)
  table, norm_scale = nsm.resolve_coeffs(coeffs, steps)
  method = ns_kwargs.get("method", "standard")
  normalize, restarts = nsm.resolve_options(coeffs, steps, method, ns_kwargs.get("normalize"),
                                            ns_kwargs.get("restarts", ()))
  if restarts:
    return None
  gram = method == "gram" or (method == "auto" and n >= nsm.GRAM_ASPECT * m)
  return dict(steps=steps, table=table, norm_scale=norm_scale, schatten4=normalize == "schatten4", gram=gram,
              eps=ns_kwargs.get("eps", 1e-7), compute_dtype=ns_kwargs.get("compute_dtype"))


def cost(it: dict, m: int, n: int, g: int, itemsize: int) -> tuple[float, list[tuple[str, int, float]]]:
  """(FLOPs per device, [(collective, result bytes, group size)]) of one matrix split over ``g``.

  The collectives are those of ``iterate`` on one matrix; a stack of ``q`` has ``q`` times
  the bytes in the same collectives.
  """
  w = n // g
  K = it["steps"]
  sym = 0.75 if m >= nsm.SYMMETRIC_MIN and m % 2 == 0 else 1.0
  if not it["gram"]:
    flops = K * (sym * 2 * m * m * w + 4 * m * m * w)
    return flops, [("all-reduce", m * m * 4, g)] + [("all-reduce", m * m * itemsize, g)] * (K - 1)
  rows = m // g
  f = sym * 2 * m * m * w + 2 * m * m * w
  f += K * 2 * rows * m * m + (K - 1) * 2 * rows * m * m + (K - 1) * 4 * rows * m * m
  wb = 4  # the m x m iteration runs in float32 (or wider)
  gathers = (K if K > 1 else 0) + (K - 1) + 1
  return f, [("all-reduce", m * m * wb, g)] + [("all-gather", m * m * wb, g)] * gathers


def _rows(x: jax.Array, p: jax.Array, r: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, p * r, r, axis=-2)


def iterate(x: jax.Array, it: dict, axes: tuple[str, ...], g: int) -> jax.Array:
  """The polar factor's slabs of a stack of split matrices; ``x``: ``(q, m, n/g)`` slabs."""
  dtype = jnp.dtype(it["compute_dtype"]) if it["compute_dtype"] is not None else x.dtype
  wdtype = jnp.promote_types(dtype, jnp.float32)
  table = np.asarray(it["table"])
  last = table.shape[0] - 1
  eps, K = it["eps"], it["steps"]
  X = x.astype(dtype)
  gram_f = lambda X, t=None: jax.lax.psum(nsm._gram_of(X, False, t), axes)
  A = gram_f(X, jnp.float32)  # X X^T of the input, float32: its trace is ||x||_F^2
  fro = jnp.sqrt(jnp.trace(A, axis1=-2, axis2=-1))[..., None, None]
  denom = fro * (1.0 if it["schatten4"] else it["norm_scale"]) + eps
  X = (x.astype(jnp.float32) / denom).astype(dtype)
  A = A / (denom * denom)
  if it["schatten4"]:
    s = nsm._schatten4_scale(A, it["norm_scale"], eps)
    A = A / (s * s)
    X = (X.astype(jnp.float32) / s).astype(dtype)
  if not it["gram"]:
    for k in range(K):
      a, b, c = (float(v) for v in table[min(k, last)])
      if k:
        A = gram_f(X)
      Ad = A.astype(dtype)
      AX = jnp.matmul(Ad, X)
      X = a * X + b * AX + c * jnp.matmul(Ad, AX)
    return X.astype(x.dtype)
  m = A.shape[-1]
  r = m // g
  p = jax.lax.axis_index(axes)
  R = A.astype(wdtype)
  eye_rows = _rows(jnp.broadcast_to(jnp.eye(m, dtype=wdtype), R.shape), p, r)
  gather = lambda rows: jax.lax.all_gather(rows, axes, axis=rows.ndim - 2, tiled=True)
  Q_rows = None
  for k in range(K):
    a, b, c = (float(v) for v in table[min(k, last)])
    R_rows = _rows(R, p, r)
    H_rows = a * eye_rows + b * R_rows + c * jnp.matmul(R_rows, R)
    H = gather(H_rows) if (K > 1) else None
    Q_rows = H_rows if Q_rows is None else jnp.matmul(Q_rows, H)
    if k + 1 < K:
      R = gather(jnp.matmul(jnp.matmul(R_rows, H), H))
  Q = gather(Q_rows)
  return nsm._apply(Q, X, False).astype(x.dtype)


def describe_collectives(it: dict, m: int, n: int, g: int, itemsize: int, q: int) -> list[tuple[str, int, int]]:
  """``cost``'s collectives for a stack of ``q`` matrices."""
  return [(op, q * b, gs) for op, b, gs in cost(it, m, n, g, itemsize)[1]]


def flops(it: dict, m: int, n: int, g: int) -> float:
  return cost(it, m, n, g, 4)[0]

