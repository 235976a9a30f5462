"""Which parameters Muon updates, and which axes of a parameter form its matrix.

Muon (Keller Jordan 2024; Moonlight, arXiv 2502.16982, section 2) is for the hidden weight
matrices of a network. Embedding tables, the output head, norm scales, biases and other
vectors go to AdamW. Decisions depend on paths and shapes only, never on values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from ._paths import path_str

MUON = "muon"
ADAM = "adam"

# Path components (lower-cased) that mark an embedding table or an output head.
_EMBEDDING_WORDS = ("embed", "wte", "wpe")
_HEAD_NAMES = frozenset({"lm_head", "head", "unembed", "output", "output_head", "logits", "classifier"})
_VECTOR_LEAF_NAMES = frozenset({"bias", "scale", "embedding"})


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


def matrix_axes_lookup(spec: MatrixAxesSpec, tree: Any) -> Callable[[str, tuple[int, ...]], MatrixAxes]:
  """Turns a ``matrix_axes`` argument into ``(path, shape) -> MatrixAxes``.

  ``spec`` is ``None`` (2-D leaves are ``(in, out)`` matrices; any other rank is ambiguous
  and raises), one ``MatrixAxes`` for every leaf, a pytree of ``MatrixAxes``/``None`` with
  the structure of the parameters, or a callable from the parameters to such a pytree.
  Trees are matched by path, so a sub-tree (as ``optax.partition`` passes) works too.
  """
  if callable(spec) and not isinstance(spec, MatrixAxes):
    spec = spec(tree)
  if spec is None or isinstance(spec, MatrixAxes):
    table = None
  else:
    leaves = jax.tree_util.tree_flatten_with_path(
        spec, is_leaf=lambda x: x is None or isinstance(x, MatrixAxes)
    )[0]
    table = {}
    for p, leaf in leaves:
      if leaf is not None and not isinstance(leaf, MatrixAxes):
        raise ValueError(f"matrix_axes: leaf at {path_str(p)} must be a MatrixAxes or None, got {leaf!r}")
      table[path_str(p)] = leaf

  def lookup(path: str, shape: tuple[int, ...]) -> MatrixAxes:
    axes = spec if table is None else table.get(path)
    if axes is not None:
      return axes
    if len(shape) == 2:
      return MatrixAxes((0,), (1,))
    raise ValueError(
        f"{path}: Muon needs to know which axes of a parameter of shape {shape} form its matrix; "
        "pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) (for layers stacked by nn.scan: "
        "MatrixAxes((-2,), (-1,))), a pytree of them, or route this parameter to AdamW"
    )

  return lookup


def matrix_dims(axes: MatrixAxes, path: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """``(fan_in, fan_out)`` sizes of the matrix of a leaf."""
  _, fi, fo = axes.resolve(path, shape)
  return math.prod(shape[a] for a in fi), math.prod(shape[a] for a in fo)


def default_label(path: str, shape: tuple[int, ...]) -> str:
  """``"muon"`` for a hidden weight matrix, ``"adam"`` for everything else.

  AdamW gets: arrays of rank < 2; leaves named ``bias``, ``scale`` or ``embedding``
  (Flax's norm scales, stacked or not, and ``nn.Embed`` tables); anything under a path
  component containing ``embed``, ``wte`` or ``wpe``; and output heads (a path component
  named ``lm_head``, ``head``, ``unembed``, ``output``, ``output_head``, ``logits`` or
  ``classifier``). Everything else of rank >= 2 goes to Muon.
  """
  parts = [p.lower() for p in path.split("/") if p]
  if len(shape) < 2 or (parts and parts[-1] in _VECTOR_LEAF_NAMES):
    return ADAM
  if any(w in p for p in parts for w in _EMBEDDING_WORDS) or any(p in _HEAD_NAMES for p in parts):
    return ADAM
  return MUON


def muon_labels(params: Any) -> Any:
  """The default routing: a tree of ``"muon"``/``"adam"`` labels (see ``default_label``)."""
  return jax.tree_util.tree_map_with_path(lambda p, x: default_label(path_str(p), tuple(x.shape)), params)
