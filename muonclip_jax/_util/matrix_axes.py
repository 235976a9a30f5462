"""``MatrixAxes``: which axes of a parameter are the rows and columns of Muon's matrix.

``to_matrices``/``from_matrices`` turn a leaf into the ``(count, rows, cols)`` stack of its
matrices and back; Muon (``_muon``) and the distributed Newton–Schulz (``_orthogonalize.distributed``)
both use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from .checks import is_int


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
  """Which axes of a parameter are the rows (fan-in) and columns (fan-out) of its matrix.

  Every other axis is a batch axis: the parameter is a stack of independent matrices, each
  orthogonalized on its own. The matrix of a leaf is ``prod(fan_in sizes) x prod(fan_out
  sizes)``. Negative axes count from the end.

  Examples: a Dense kernel ``(in, out)`` is ``MatrixAxes((0,), (1,))`` (the default for
  2-D leaves); a kernel stacked by ``nn.scan``, ``(layers, in, out)``, is
  ``MatrixAxes((-2,), (-1,))``; a DenseGeneral kernel ``(in, heads, head_dim)`` is
  ``MatrixAxes((0,), (1, 2))``; an output projection ``(heads, head_dim, out)`` is
  ``MatrixAxes((0, 1), (2,))``.

  A fused MLP projection stores two matrices in one leaf: ``fused=(axis, n)`` says that
  ``axis`` (one of the fan axes) holds ``n`` equal parts one after the other, each its own
  matrix with its own RMS factor, as if stored apart. Hugging Face transformers' (v5)
  ``gate_up_proj``, ``(experts, 2 * intermediate, hidden)`` with gate then up, is
  ``MatrixAxes(fan_in=(-1,), fan_out=(-2,), fused=(-2, 2))`` (Muon finds this one by its
  name, ``_muon.fused_mlp``); ``fused=(axis, 1)`` keeps it one matrix.

  Attributes:
    fan_in: axes that form the rows (a tuple of ints, or one int; a list or range is taken as
      its tuple).
    fan_out: axes that form the columns (likewise).
    fused: ``(axis, n)``: ``axis`` holds ``n`` equal parts, each a matrix; None: one matrix.

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> axes = mc.MatrixAxes(fan_in=(0,), fan_out=(1, 2))  # a DenseGeneral kernel (in, heads, head_dim)
    >>> axes.resolve("attn/query/kernel", (8, 2, 4))  # (batch, fan_in, fan_out) axes
    ((), (0,), (1, 2))
    >>> kernel = (jnp.eye(8) + 0.3 * jax.random.normal(jax.random.key(0), (8, 8))).reshape(8, 2, 4)
    >>> opt = mc.scale_by_muon(matrix_axes=axes, rms_match=None, ns_coeffs="polar_express", ns_steps=8)
    >>> updates, _ = opt.update({"k": kernel}, opt.init({"k": kernel}))
    >>> updates["k"].shape  # orthogonalized as one 8 x 8 matrix, returned in the kernel's shape
    (8, 2, 4)
    >>> jnp.round(jnp.linalg.svd(updates["k"].reshape(8, 8), compute_uv=False), 2)
    Array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
  """

  fan_in: tuple[int, ...]
  fan_out: tuple[int, ...]
  fused: tuple[int, int] | None = None

  def __post_init__(self):
    for name in ("fan_in", "fan_out"):
      object.__setattr__(self, name, _axes(name, getattr(self, name)))
    if not self.fan_in or not self.fan_out:
      raise ValueError(f"MatrixAxes needs at least one fan_in and one fan_out axis, got {self}")
    if self.fused is not None:
      fused = tuple(self.fused)
      if len(fused) != 2 or not all(is_int(v) for v in fused) or fused[1] < 1:
        raise ValueError(f"MatrixAxes: fused must be (axis, n), two ints, n >= 1 parts, got fused={self.fused!r}")
      object.__setattr__(self, "fused", (int(fused[0]), int(fused[1])))

  def __repr__(self) -> str:
    extra = "" if self.fused is None else f", fused={self.fused}"
    return f"MatrixAxes(fan_in={self.fan_in}, fan_out={self.fan_out}{extra})"

  def fused_part(self, path: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(axis, n)`` of ``fused`` with ``axis`` non-negative, None for one matrix (``n == 1`` too);
    ValueError naming ``path`` when ``n`` does not divide the axis."""
    if self.fused is None or self.fused[1] == 1:
      return None
    _, fan_in, fan_out = self.resolve(path, shape)
    axis, n = self.fused[0] % len(shape) if -len(shape) <= self.fused[0] < len(shape) else None, self.fused[1]
    if axis not in fan_in + fan_out:
      raise ValueError(f"{path}: {self} cuts axis {self.fused[0]} of the parameter of shape {tuple(shape)}, which is "
                       "not one of its fan_in or fan_out axes")
    if shape[axis] % n:
      raise ValueError(f"{path}: {self} cuts axis {axis} of the parameter of shape {tuple(shape)} into {n} equal "
                       f"parts, but {n} does not divide {shape[axis]}")
    return axis, n

  def resolve(self, path: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Returns ``(batch, fan_in, fan_out)`` axes of ``shape``, normalized to be non-negative."""
    nd = len(shape)
    for a in self.fan_in + self.fan_out:
      if not -nd <= a < nd:
        raise ValueError(f"{path}: {self} names axis {a}, but the parameter has shape {shape}")
    fi = tuple(a % nd for a in self.fan_in)
    fo = tuple(a % nd for a in self.fan_out)
    if len(set(fi + fo)) != len(fi + fo):
      raise ValueError(f"{path}: {self} repeats an axis of shape {shape}")
    batch = tuple(a for a in range(nd) if a not in fi + fo)
    return batch, fi, fo


def _axes(name: str, value: Any) -> tuple[int, ...]:
  """``value`` (an axis, or an iterable of them: a tuple, list, range or integer array; one int
  as ``optax.contrib.MuonDimensionNumbers`` takes it) as a tuple of ints; TypeError naming
  ``name`` for anything else."""
  iterable = isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
  axes = (value,) if is_int(value) else tuple(value) if iterable else None
  if axes is None or not all(is_int(a) for a in axes):
    raise TypeError(f"MatrixAxes: {name} must be an axis (an int) or a tuple of them, got {name}={value!r}")
  return tuple(int(a) for a in axes)


MatrixAxesSpec = MatrixAxes | Any | Callable[[Any], Any] | None


def to_matrices(x: jax.Array, batch: tuple[int, ...], fan_in: tuple[int, ...], fan_out: tuple[int, ...], *,
                transpose: bool = False) -> jax.Array:
  """``x`` as the ``(count, rows, cols)`` stack of its matrices (``(count, cols, rows)`` with ``transpose``).

  ``batch``, ``fan_in`` and ``fan_out`` are non-negative axes of ``x``
  (``MatrixAxes.resolve``): the batch axes are flattened into ``count``, the fan-in axes
  into ``rows`` and the fan-out axes into ``cols``, each in the order given. (In ``lax``:
  it is traced once per leaf.)
  """
  perm = batch + fan_in + fan_out
  moved = x if perm == tuple(range(x.ndim)) else lax.transpose(x, perm)
  rows = math.prod(x.shape[a] for a in fan_in)
  cols = math.prod(x.shape[a] for a in fan_out)
  w = _reshaped(moved, (math.prod(x.shape[a] for a in batch), rows, cols))
  return lax.transpose(w, (0, 2, 1)) if transpose else w


def from_matrices(w: jax.Array, shape: tuple[int, ...], batch: tuple[int, ...], fan_in: tuple[int, ...],
                  fan_out: tuple[int, ...], *, transpose: bool = False) -> jax.Array:
  """The inverse of ``to_matrices``: a stack of matrices back into a leaf of shape ``shape``."""
  perm = batch + fan_in + fan_out
  if transpose:
    w = lax.transpose(w, (0, 2, 1))
  out = _reshaped(w, tuple(shape[a] for a in perm))
  if perm != tuple(range(len(shape))):
    out = lax.transpose(out, tuple(perm.index(a) for a in range(len(shape))))
  return out


def _reshaped(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return x if x.shape == shape else lax.reshape(x, shape)
