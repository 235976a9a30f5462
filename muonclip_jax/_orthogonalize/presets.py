"""Newton–Schulz coefficient presets and the validation of ``coeffs``, ``steps``, ``method``, ``normalize`` and ``restarts``.

A preset is a coefficient table (row ``i`` is step ``i``'s ``(a, b, c)``; the last row
repeats), the scale of the input's norm, which norm, the number of steps it was designed
for and its default Gram restarts. ``newton_schulz`` and the split iteration resolve their
arguments here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .._util import is_int

# Keller Jordan's fixed quintic: fast at the start, output singular values ~[0.7, 1.2].
MUON_COEFFS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al. 2025, arXiv 2505.16932): per-step minimax coefficients, to be
# used on an input normalized by 1.02 times its Frobenius norm.
POLAR_EXPRESS_COEFFS = (
    (8.1566, -22.4833, 15.8788),
    (4.0429, -2.8089, 0.5000),
    (3.8917, -2.7725, 0.5061),
    (3.2858, -2.3681, 0.4645),
    (2.3465, -1.7098, 0.4232),
)
POLAR_EXPRESS_NORM_SCALE = 1.02

# Four steps built with the Polar Express recipe (Amsel et al. 2025, section 4: at each step
# the odd quintic minimizing max |1 - p(x)| over the current interval [l_k, u_k] of
# singular values, which maps it onto [l_{k+1}, u_{k+1}]), computed here as a linear
# program for l_0 = 3e-3 / 1.02, u_0 = 1, with every later interval widened by 1% at the top
# as a rounding cushion; the last polynomial is scaled so that its maximum is 1.2. The
# composition maps [3e-3, 1] (singular values over 1.02 times the norm) into
# [0.779, 1.200]; below 3e-3 it grows values by up to 1 / 1.02 * prod(a_k) ~ 290.
# Keller's five steps give [0.682, 1.202] on the same interval for 25% more FLOPs.
POLAR_EXPRESS_4_COEFFS = (
    (8.3862, -24.7759, 18.3650),
    (4.0097, -2.9279, 0.5427),
    (3.4952, -2.5694, 0.5032),
    (2.4784, -1.7995, 0.4180),
)

# DeepSeek-V4's Newton–Schulz as MaxText runs it (optimizers.py, get_optimizer): 8 steps of
# Keller's quintic, then 2 of 2s - 1.5s^3 + 0.5s^5 (p(1) = 1, p'(1) = 0), Frobenius-normalized.
DEEPSEEK_V4_FINISH = (2.0, -1.5, 0.5)

# Steps past the published ones use the quintic with p(1) = 1, p'(1) = 0, p''(1) = 0
# (the classical Newton–Schulz polynomial), which converges to exactly 1.
_CONVERGED_QUINTIC = (15 / 8, -10 / 8, 3 / 8)

PRESETS = ("muon", "polar_express", "polar_express_4", "deepseek_v4")
METHODS = ("standard", "gram", "auto")
NORMALIZATIONS = ("frobenius", "schatten4")
# method="auto" uses "gram" on matrices with max(rows, cols) >= GRAM_ASPECT * min(rows, cols).
GRAM_ASPECT = 2


@dataclasses.dataclass(frozen=True)
class _Preset:
  table: tuple[tuple[float, float, float], ...]  # row i is step i's (a, b, c); last row repeats
  norm_scale: float  # the input is divided by norm_scale * ||x||
  normalize: str  # which norm
  steps: int  # the number of steps the table was designed for
  restarts: tuple[int, ...] = ()  # Gram restarts used when none are given


_PRESETS = {
    "muon": _Preset((MUON_COEFFS,), 1.0, "frobenius", 5),
    "polar_express": _Preset(POLAR_EXPRESS_COEFFS + (_CONVERGED_QUINTIC,), POLAR_EXPRESS_NORM_SCALE,
                             "frobenius", 5),
    "polar_express_4": _Preset(POLAR_EXPRESS_4_COEFFS + (_CONVERGED_QUINTIC,), POLAR_EXPRESS_NORM_SCALE,
                               "schatten4", 4),
    # Ten Gram steps drift in float32 without a restart (1e20 at condition 1e6); one at step 5 holds.
    "deepseek_v4": _Preset((MUON_COEFFS,) * 8 + (DEEPSEEK_V4_FINISH,), 1.0, "frobenius", 10, (5,)),
}


def resolve_steps(steps: Any, coeffs: Any = "muon") -> Any:
  """Validates ``steps``: a Python int (or a concrete integer array) >= 1, or a tracer.

  ``None`` is the number of steps ``coeffs`` was designed for (5 for ``"muon"`` and
  ``"polar_express"``, 4 for ``"polar_express_4"``, 10 for ``"deepseek_v4"``, ``k`` for a
  ``(k, 3)`` table, 5 for a single ``(3,)`` row). ``optax.inject_hyperparams`` turns every numeric argument into an
  array, so ``steps`` may arrive traced inside a jitted update; the loop then runs with a
  traced trip count.
  """
  if steps is None:
    if isinstance(coeffs, str) and coeffs in _PRESETS:
      return _PRESETS[coeffs].steps
    shape = np.shape(coeffs) if not isinstance(coeffs, str) else ()
    return shape[0] if len(shape) == 2 else 5
  if isinstance(steps, jax.core.Tracer):
    return steps
  if not isinstance(steps, bool):
    try:
      value = np.asarray(steps)
    except (TypeError, ValueError):
      value = None
    if value is not None and value.shape == () and np.issubdtype(value.dtype, np.integer) and value >= 1:
      return int(value)
  raise ValueError(f"steps must be an int >= 1, got {steps!r} (or None: the coefficients' own count)")


def resolve_coeffs(coeffs: Any, steps: Any) -> tuple[np.ndarray, float]:
  """Validates ``coeffs``/``steps``; returns ``(coefficient table (k, 3), norm scale)``.

  Step ``i`` uses row ``min(i, k - 1)`` of the table.
  """
  steps = resolve_steps(steps, coeffs)
  if isinstance(coeffs, str):
    if coeffs in _PRESETS:
      p = _PRESETS[coeffs]
      return np.asarray(p.table, np.float64), p.norm_scale
    raise ValueError(f"coeffs must be one of {PRESETS} or an array of shape (3,) or (steps, 3), got {coeffs!r}")
  try:
    arr = np.asarray(coeffs, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"coeffs must be a preset name or a numeric array, got {coeffs!r}") from e
  if arr.shape == (3,):
    arr = arr[None]
  elif arr.ndim != 2 or arr.shape[1] != 3 or (isinstance(steps, int) and arr.shape[0] != steps):
    raise ValueError(
        f"coeffs must have shape (3,) or (steps, 3) = ({steps}, 3), got an array of shape {arr.shape}"
    )
  if not np.all(np.isfinite(arr)):
    raise ValueError(f"coeffs must be finite, got {arr.tolist()}")
  return arr, 1.0


def resolve_options(coeffs: Any, steps: Any, method: str, normalize: str | None,
                    restarts: Any) -> tuple[str, tuple[int, ...]]:
  """Validates ``method``, ``normalize`` and ``restarts``; returns ``(normalize, restarts)``."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if normalize is None:
    normalize = _PRESETS[coeffs].normalize if isinstance(coeffs, str) and coeffs in _PRESETS else "frobenius"
  elif normalize not in NORMALIZATIONS:
    raise ValueError(f"normalize must be one of {NORMALIZATIONS} or None, got {normalize!r}")
  try:
    given = () if restarts is None else tuple(restarts)
  except TypeError as e:
    raise ValueError(f"restarts must be a sequence of step indices, got {restarts!r}") from e
  if isinstance(restarts, (str, bytes)) or not all(
      is_int(r) for r in given):  # 1.5 is no step
    raise ValueError(f"restarts must be a sequence of step indices (ints), got {restarts!r}")
  restarts = tuple(sorted({int(r) for r in given}))
  if restarts and method == "standard":  # nothing to restart: not ignored in silence
    raise ValueError(f"restarts are the Gram iteration's (method 'gram' or 'auto'); method 'standard' "
                     f"runs none, got {restarts}")
  steps = resolve_steps(steps, coeffs)
  top = steps - 1 if isinstance(steps, int) else None
  if any(r < 1 or (top is not None and r > top) for r in restarts):
    raise ValueError(f"restarts must be step indices in [1, steps - 1] = [1, {top}], got {restarts}")
  return normalize, restarts


def gram_restarts(coeffs: Any, steps: Any, restarts: tuple[int, ...]) -> tuple[int, ...]:
  """The restarts Gram Newton–Schulz runs with: the given ones, else the preset's own (below ``steps``)."""
  if restarts or not (isinstance(coeffs, str) and coeffs in _PRESETS):
    return restarts
  own = _PRESETS[coeffs].restarts
  return tuple(r for r in own if r < steps) if isinstance(steps, int) else own
