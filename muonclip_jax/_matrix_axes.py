"""``MatrixAxes``: which axes of a parameter are the rows and columns of Muon's matrix."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


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

  Attributes:
    fan_in: axes that form the rows.
    fan_out: axes that form the columns.
  """

  fan_in: tuple[int, ...]
  fan_out: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "fan_in", tuple(int(a) for a in self.fan_in))
    object.__setattr__(self, "fan_out", tuple(int(a) for a in self.fan_out))
    if not self.fan_in or not self.fan_out:
      raise ValueError(f"MatrixAxes needs at least one fan_in and one fan_out axis, got {self}")

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


MatrixAxesSpec = MatrixAxes | Any | Callable[[Any], Any] | None
