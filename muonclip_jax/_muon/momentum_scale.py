"""Muon's momentum kept as ``mu * mu_scale``: the power of two that keeps it in range.

Finite gradients never overflow the momentum or the direction: a constant gradient of 2e37
makes ``M_t`` pass float32's largest (it tends to ``G / (1 - mu)``), and ``G + mu M_t`` does
from ``G`` ~ 1.8e38. ``scale_by_muon`` stores ``M_t / s_t`` (``ScaleByMuonState``), ``s_t`` a
power of two >= 1 per matrix (one per leaf, one per layer or expert of a stack: ``scale_shape``)
chosen at each step by ``rescale``; ``in_units`` reads a gradient in those units.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._util import power_of_two_below
from .blocks import stack_axes


def scale_dtype(dtype: Any) -> Any:
  """The dtype of a leaf's ``mu_scale`` and of its rescaling: float32, or float64 for float64."""
  return jnp.promote_types(jnp.float32, dtype)


def in_units(g: jax.Array, s: jax.Array) -> jax.Array:
  """``g / s`` for a power of two ``s`` (exact), and ``g`` itself (selected) where ``s == 1``.

  Written in ``lax`` (as ``rescale``): it is traced once per leaf, and each ``jnp`` call is a
  nested ``jit`` that costs tracing time on a model of hundreds of leaves."""
  dt = s.dtype
  s = _spread(s, g.shape)
  return lax.select(_spread(lax.eq(s, np.ones((), dt)), g.shape), g, lax.div(g.astype(dt), s).astype(g.dtype))


def rounded(x: jax.Array) -> jax.Array:
  """``x`` rounded to its dtype, explicitly (``reduce_precision``; nothing for float32).

  Under ``xla_allow_excess_precision`` (XLA's default) a bfloat16 or float16 value computed
  inside a float32 fusion may reach its consumer unrounded: how the momentum and the
  direction fuse with Newton–Schulz (in a stack's loop, or not) would then decide their
  roundings. Rounded here, they are the values their dtype holds, wherever XLA fuses them.
  """
  info = jnp.finfo(x.dtype)
  if info.bits >= 32:  # XLA computes in float32 or wider: no excess precision to drop
    return x
  return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _spread(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A per-matrix ``x`` (the leaf's rank, size 1 on its matrix axes) broadcast to ``shape``; a
  per-leaf scalar as it is (``lax`` takes a scalar operand as it is)."""
  return x if x.ndim == 0 or x.shape == tuple(shape) else lax.broadcast_in_dim(x, tuple(shape), tuple(range(x.ndim)))


def rescale(ms: list, gs: list, ss: list) -> list[tuple[jax.Array, jax.Array]]:
  """``[(m_in, s_new)]``: each leaf's momentum in the units of its new ``mu_scale``, and that scale.

  ``s`` is a leaf's scalar, or one scale per matrix of a stack (``scale_shape``: the leaf's
  rank, size 1 on the matrix axes); everything below holds per matrix then, the maximum taken
  over the matrix axes only.

  The true momentum is ``m * s = m_in * s_new``; the gradient in those units is ``g_in =
  in_units(g, s_new)``. Both are exact: ``s`` and ``s_new`` are powers of two (only entries
  below ~2^-250 of the largest can underflow).

  Bound: let ``T = 2^(x - 3)``, ``x`` the ``maxexp`` of the narrower of ``m``'s and ``g``'s
  dtypes (float32, bfloat16: ``T = 2^125 ~ 4.3e37``; float16: ``2^13``); both dtypes' largest
  is at least ``2^(x - 1) = 4T``. ``s_new`` makes ``|m_in|, |g_in| <= T``. With ``u`` the unit
  roundoff, the new momentum is then ``|beta m_in + g_in| <= (1 + beta) T (1 + u)^2 < 2.01 T``
  and the Nesterov direction ``|g_in + beta M| <= (T + 2.01 T)(1 + u)^2 < 3.1 T``, both below
  ``4T``: neither overflows, in either dtype (nor does ``M`` cast to the gradient's dtype).

  ``s_new`` is the smallest power of two >= 1 that puts the largest entry ``a`` of ``m s /
  s_new`` and ``g / s_new`` below ``T`` (``a`` scaled by ``2^(x - 3 - k)`` for ``a = f 2^k``,
  ``f`` in [0.5, 1)), except that it never grows while ``a < T``: it goes back to 1 once the
  momentum decays. A non-finite ``a`` keeps ``s``. Where ``s_new == s == 1`` the inputs are
  returned as they are (selected, not multiplied by 1, so that ``beta * m + g`` downstream
  keeps its exact form and rounding: the plain formula's operations).

  This is one fused reduction (``a``), a few scalar integer operations on ``a``'s exponent
  bits (``_util.powers_of_two``) and a select. Under the default grouping it runs in each
  stack's loop (``_orthogonalize.batching``), compiled once per stack: traced once per leaf
  of a deep unscanned model (hundreds of leaves), such scalar code multiplied the update's
  compile time (``benchmarks/RESULTS.md``, "The scaled momentum's compile time" and "The
  scales in the loops"); the new momentum is computed there too, and returned sliced into
  the leaves.
  """
  out = []
  for m, g, s in zip(ms, gs, ss):
    x = min(jnp.finfo(m.dtype).maxexp, jnp.finfo(g.dtype).maxexp)
    dt = s.dtype
    bias = jnp.finfo(dt).maxexp - 1
    # max(max|m|, max|g| / s) in one reduction: s is a power of two, so dividing each entry
    # first gives the same maximum
    # a per-matrix s (shape: the leaf's, size 1 on the matrix axes) reduces over those axes only
    axes = tuple(range(m.ndim)) if s.ndim == 0 else tuple(i for i in range(m.ndim) if s.shape[i] == 1)
    a = lax.reduce_max(lax.max(lax.abs(m.astype(dt)), lax.div(lax.abs(g.astype(dt)), _spread(s, g.shape))), axes)
    a = a.reshape(s.shape)
    # c: the largest power of two with a c < T; below 1 (s grows) only where a >= T. Where
    # a < T, c >= 1 and s / c must stay >= 1: min(c, s) lets s fall back towards 1 but not past it
    # (a zero a gives 2^bias, the dtype's largest power of two: clipped to s all the same)
    ones = np.ones(s.shape, dt)
    c = lax.select(lax.is_finite(a), lax.min(power_of_two_below(a, x - 3, 1 - bias, bias), s), ones)
    grown = lax.mul(m.astype(dt), _spread(c, m.shape)).astype(m.dtype)
    out.append((lax.select(_spread(lax.eq(c, ones), m.shape), m, grown), lax.div(s, c)))
  return out


def scale_shape(blocks: Any, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """A leaf's ``mu_scale`` shape: ``()`` for one matrix; for a stack of matrices (layers,
  experts), the leaf's rank with the stacked axes' sizes and 1 elsewhere (one scale each)."""
  axes = stack_axes(blocks, path, tuple(shape))
  return tuple(n if a in axes else 1 for a, n in enumerate(shape)) if axes and math.prod(
      shape[a] for a in axes) > 1 else ()
