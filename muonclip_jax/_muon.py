"""``scale_by_muon``: momentum, Newton–Schulz orthogonalization and update-RMS matching.

Muon (Keller Jordan 2024) as used by Moonlight (arXiv 2502.16982, Algorithm 1) and Kimi K2
(arXiv 2507.20534, Algorithm 1):

  M_t = mu M_{t-1} + G_t
  O_t = NewtonSchulz(G_t + mu M_t)        (Nesterov; NewtonSchulz(M_t) without it)
  O_t <- r(fan_in, fan_out) * O_t

with the RMS factor ``r`` of ``rms_match``: Moonlight's ``rms_scale * sqrt(max(fan_in,
fan_out))`` (rms_scale = 0.2 makes the update RMS match AdamW's, so AdamW hyperparameters
transfer), Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``, or 1.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from . import _newton_schulz
from ._routing import MatrixAxesSpec, matrix_axes_lookup, matrix_dims, path_str

RMS_MODES = ("moonlight", "keller", None)


class ScaleByMuonState(NamedTuple):
  """State of ``scale_by_muon``."""

  mu: optax.Updates  # momentum M_t; shapes of the params, dtype mu_dtype (default: the params')


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 high_open: bool = False) -> None:
  """Raises ValueError for a concrete number outside [low, high]; skips schedules and tracers."""
  if callable(value) or isinstance(value, jax.core.Tracer):
    return
  try:
    v = float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be a number, got {value!r}") from e
  bad = math.isnan(v) or (low is not None and v < low)
  if high is not None:
    bad = bad or v > high or (high_open and v == high)
  if bad:
    hi = "" if high is None else (f" and < {high}" if high_open else f" and <= {high}")
    raise ValueError(f"{name} must be >= {low}{hi}, got {value!r}")


def orthogonalize(g: jax.Array, batch: tuple[int, ...], fan_in: tuple[int, ...],
                  fan_out: tuple[int, ...], **ns_kwargs: Any) -> jax.Array:
  """Newton–Schulz of each matrix ``(fan_in, fan_out)`` in a stack laid out along ``batch``."""
  perm = batch + fan_in + fan_out
  moved = g if perm == tuple(range(g.ndim)) else jnp.transpose(g, perm)
  lead = moved.shape[: len(batch)]
  m = math.prod(g.shape[a] for a in fan_in)
  n = math.prod(g.shape[a] for a in fan_out)
  out = _newton_schulz.newton_schulz(moved.reshape(lead + (m, n)), **ns_kwargs).reshape(moved.shape)
  if perm != tuple(range(g.ndim)):
    out = jnp.transpose(out, tuple(perm.index(a) for a in range(g.ndim)))
  return out


def rms_factor(rms_match: str | None, rms_scale: Any, fan_in: int, fan_out: int) -> Any:
  """The update-RMS factor ``r(fan_in, fan_out)`` of ``scale_by_muon``."""
  if rms_match == "moonlight":
    return rms_scale * math.sqrt(max(fan_in, fan_out))
  if rms_match == "keller":
    return math.sqrt(max(1.0, fan_out / fan_in))
  return 1.0


def scale_by_muon(
    beta: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: Any = "muon",
    eps: float = 1e-7,
    compute_dtype: Any = None,
    mu_dtype: Any = None,
    rms_match: str | None = "moonlight",
    rms_scale: float = 0.2,
    matrix_axes: MatrixAxesSpec = None,
) -> optax.GradientTransformation:
  """Muon's direction: orthogonalized (Nesterov) momentum with update-RMS matching.

  Apply it to hidden weight matrices only (see ``muon_adamw`` for a whole model). Each leaf
  is a matrix, or a stack of matrices given by ``matrix_axes``; stacked matrices (e.g.
  layers under ``nn.scan``) are orthogonalized one by one, never as one big matrix.

  Args:
    beta: momentum ``mu`` (Moonlight/Kimi: 0.95). May be traced (``inject_hyperparams``).
    nesterov: use ``G_t + mu M_t`` instead of ``M_t``.
    ns_steps: Newton–Schulz iterations (static).
    ns_coeffs: ``"muon"``, ``"polar_express"`` or an array (see ``newton_schulz``).
    eps: Newton–Schulz norm epsilon; a zero gradient gives a zero update.
    compute_dtype: dtype of the Newton–Schulz iteration (default: the gradient's).
    mu_dtype: dtype of the momentum (default: the gradient's).
    rms_match: ``"moonlight"`` (``rms_scale * sqrt(max(fan_in, fan_out))``, the default),
      ``"keller"`` (``sqrt(max(1, fan_out / fan_in))``) or ``None`` (no scaling).
    rms_scale: the 0.2 of Moonlight's matching. May be traced.
    matrix_axes: which axes form each leaf's matrix: ``None`` (2-D leaves only; a leaf of
      another rank raises ValueError naming its path and shape), one ``MatrixAxes`` for all
      leaves, a pytree of ``MatrixAxes``/``None`` matched by path, or a callable from the
      params to such a pytree.

  Returns:
    An ``optax.GradientTransformation`` whose state holds only the momentum.
  """
  _newton_schulz.resolve_coeffs(ns_coeffs, ns_steps)  # validates both
  check_number("beta", beta, low=0.0, high=1.0, high_open=True)
  check_number("rms_scale", rms_scale, low=0.0)
  check_number("eps", eps, low=0.0)
  if rms_match not in RMS_MODES:
    raise ValueError(f"rms_match must be one of {RMS_MODES}, got {rms_match!r}")
  ns_kwargs = dict(steps=ns_steps, coeffs=ns_coeffs, eps=eps, compute_dtype=compute_dtype)

  def init_fn(params):
    lookup = matrix_axes_lookup(matrix_axes, params)
    # Resolve every leaf now, so that an ambiguous tensor fails at init with its path.
    jax.tree_util.tree_map_with_path(lambda p, x: matrix_dims(lookup(path_str(p), x.shape), path_str(p), x.shape), params)
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    return ScaleByMuonState(mu=mu)

  def update_fn(updates, state, params=None):
    del params
    lookup = matrix_axes_lookup(matrix_axes, updates)
    mu = jax.tree.map(lambda m, g: (beta * m + g).astype(m.dtype), state.mu, updates)
    if nesterov:
      direction = jax.tree.map(lambda m, g: g + beta * m.astype(g.dtype), mu, updates)
    else:
      direction = jax.tree.map(lambda m, g: m.astype(g.dtype), mu, updates)

    def one(path, d):
      p = path_str(path)
      axes = lookup(p, d.shape)
      batch, fi, fo = axes.resolve(p, d.shape)
      fan_in, fan_out = matrix_dims(axes, p, d.shape)
      o = orthogonalize(d, batch, fi, fo, **ns_kwargs)
      return (o * rms_factor(rms_match, rms_scale, fan_in, fan_out)).astype(d.dtype)

    return jax.tree_util.tree_map_with_path(one, direction), ScaleByMuonState(mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)
