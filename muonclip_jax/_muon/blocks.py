"""Muon's blocks of one kernel: which matrices a leaf is cut into, from how its heads are stored.

``muon_blocks`` (``scale_by_muon``) chooses the granularity:

* ``"matrix"`` (Kimi K2, Moonlight): a projection is one matrix, ``"layers"`` axes batched;
* ``"part"``: a fused projection is its logical parts (xtuner #2030): q, k and v of a fused
  ``qkv``, k and v of Gemma's ``kv_einsum``, and MLA's ``wkv_b`` as its k_nope columns and its
  v columns of every head;
* ``"head"`` (Kimi K3, arXiv 2607.24653, section 2.5; GLM-5 "Muon Split", arXiv 2602.15763):
  every head's block on its own, ``in x head_dim`` (MLA: ``wq_b`` per head
  ``q_lora x (nope + rope)``, ``wkv_b`` per head ``kv_lora x (nope + v)``); ``"head+out"``
  also cuts the output projection into ``head_dim x out`` blocks;
* ``"group:<k>"`` (Group Muon, arXiv 2605.08933): every ``k`` consecutive heads of a projection
  one block, ``in x k*head_dim`` (``"group:1"`` is ``"head"``; ``k`` divides each projection's
  head count); ``"group:kv"``: GQA's groups, the query heads that share one key/value head one
  block, and each key/value head its own; either with ``"+out"`` for the output projection's
  heads, grouped the same way as the query heads.

A kernel is described by one name per axis (``_clip.projection.AXES``: ``layers``, ``in``,
``heads``, ``head_dim``, ``out``, ``parts``), in the reading of a projection from the model
dimension to heads; an output projection is read the same way, transposed (its model
dimension is ``"in"``, its heads ``"heads"``/``"head_dim"`` or the flattened ``"out"``), and
its matrix is transposed back so that its fan-in stays the heads side.

``Blocks`` cuts a leaf in three steps: an optional reshape that splits one flattened
head-major axis in two (``(in, H*D)`` -> ``(in, H, D)``, or ``(in, H/k, k*D)`` for groups of
``k`` heads; a view of the same memory, no copy of the parameters), optional slices of that
view along one axis (parts of unequal shape, MLA's k_nope | v columns; each slice may be
split in two in turn: GQA groups of a fused q|k|v kernel), and one ``MatrixAxes`` per piece
over the view, whose batch axes include the heads or parts axes (``inner``): every block of
a piece is orthogonalized in one batched call, never mapped one by one, so a heads-sharded
kernel stays where it lives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._util import MatrixAxes

MODES = ("matrix", "part", "head", "head+out", "group:<k>", "group:kv", "group:<k>+out", "group:kv+out")


def parse_mode(mode: Any) -> tuple[str, int | str, bool]:
  """``muon_blocks`` as ``(kind, group, out)``: kind ``"matrix"``, ``"part"`` or ``"head"``; group the
  heads per block (an int, or ``"kv"`` for GQA's groups); out whether the output projection is cut too.

  ``"head"`` is ``("head", 1, False)``, ``"group:4+out"`` ``("head", 4, True)``. Raises ValueError for
  any other spelling, listing the accepted ones.
  """
  if mode in ("matrix", "part"):
    return mode, 1, False
  if isinstance(mode, str):
    body, plus, tail = mode.partition("+")
    out = bool(plus)
    if not plus or tail == "out":
      if body == "head":
        return "head", 1, out
      kind, colon, group = body.partition(":")
      if kind == "group" and colon and group == "kv":
        return "head", "kv", out
      if kind == "group" and colon and group.isascii() and group.isdigit() and group == str(int(group)) \
          and int(group) >= 1:
        return "head", int(group), out
  raise ValueError(
      f"muon_blocks must be one of {MODES} (<k>: the number of consecutive heads per block, an integer "
      f">= 1; 'kv': GQA's groups of the query heads that share a key/value head), got {mode!r}")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """How Muon cuts one leaf into matrices.

  Attributes:
    axes: one ``MatrixAxes`` per piece, over the view (its batch axes include ``inner``).
    split: ``(axis, size)``: the view splits the leaf's ``axis`` into ``(size, rest)``; None:
      the view is the leaf as it is.
    cut: the view axis the pieces are sliced along, or None for one piece (the whole view).
    bounds: per piece, ``(start, stop)`` along ``cut``.
    inner: batch axes of the view that hold blocks of one matrix (heads, parts): always
      orthogonalized in one batched call; the other batch axes (stacked layers) follow
      ``ns_batch``.
    piece_split: per piece, the size its ``cut`` axis is split into (``(size, rest)``, a view
      of the slice) before its ``MatrixAxes`` apply; empty: the pieces are the slices.
  """

  axes: tuple[MatrixAxes, ...]
  split: tuple[int, int] | None = None
  cut: int | None = None
  bounds: tuple[tuple[int, int], ...] = ()
  inner: tuple[int, ...] = ()
  piece_split: tuple[int, ...] = ()

  @property
  def is_whole(self) -> bool:
    """One matrix (or stack of them) over the leaf as it is: what ``"matrix"`` gives."""
    return self.split is None and self.cut is None and not self.inner

  def view_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(shape)
    if self.split is None:
      return shape
    a, k = self.split
    return shape[:a] + (k, shape[a] // k) + shape[a + 1:]

  def _sliced(self, v: tuple[int, ...], a: int, b: int, k: int | None) -> tuple[int, ...]:
    c = self.cut
    return v[:c] + ((b - a,) if k is None else (k, (b - a) // k)) + v[c + 1:]

  def piece_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    v = self.view_shape(shape)
    if self.cut is None:
      return [v]
    splits = self.piece_split or (None,) * len(self.bounds)
    return [self._sliced(v, a, b, k) for (a, b), k in zip(self.bounds, splits)]

  def pieces(self, x: jax.Array) -> list[jax.Array]:
    """The view's pieces (slices of the reshaped leaf, each split where ``piece_split`` says)."""
    v = x if self.split is None else x.reshape(self.view_shape(x.shape))
    if self.cut is None:
      return [v]
    out = [jax.lax.slice_in_dim(v, a, b, axis=self.cut) for a, b in self.bounds]
    return [p.reshape(s) for p, s in zip(out, self.piece_shapes(x.shape))] if self.piece_split else out

  def assemble(self, ys: Sequence[jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """The inverse of ``pieces``: the pieces concatenated and the view undone."""
    if self.piece_split:
      v = self.view_shape(shape)
      ys = [y.reshape(self._sliced(v, a, b, None)) for y, (a, b) in zip(ys, self.bounds)]
    v = ys[0] if self.cut is None else jnp.concatenate(list(ys), axis=self.cut)
    return v if self.split is None else v.reshape(shape)


def stack_axes(blocks: Blocks, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The axes of the leaf that stack its separate matrices (layers, experts): one ``mu_scale`` each.

  Of a whole leaf, its ``MatrixAxes``' batch axes. Of a leaf cut into blocks (heads, parts:
  blocks of one projection, which keep one scale), the batch axes that every piece shares and
  that lie before the first axis the view reshapes or slices, i.e. its leading stacked layers.
  """
  dims = piece_dims(blocks, path, tuple(shape))
  if blocks.is_whole:
    return dims[0][0]
  touched = min([a for a in (None if blocks.split is None else blocks.split[0], blocks.cut) if a is not None]
                + list(blocks.inner) + [len(shape)])
  shared = set.intersection(*(set(d[0]) for d in dims))
  return tuple(sorted(a for a in shared if a < touched))


def whole(axes: MatrixAxes) -> Blocks:
  return Blocks((axes,))


def matrix_blocks(axes: MatrixAxes, path: str, shape: tuple[int, ...]) -> Blocks:
  """The ``Blocks`` of a leaf whose matrix ``axes`` says: one matrix (or a stack), or, with
  ``fused=(axis, n)``, its ``n`` parts along ``axis``, a view ``(n, size / n)`` of that axis whose
  first axis is batched with the blocks of one matrix (``inner``), as ``"part"`` cuts a fused q|k|v."""
  cut = axes.fused_part(path, tuple(shape))
  if cut is None:
    return whole(axes)
  axis, n = cut
  _, fan_in, fan_out = axes.resolve(path, tuple(shape))
  moved = lambda group: tuple(a if a < axis else a + 1 for a in group)  # noqa: E731
  return Blocks((MatrixAxes(moved(fan_in), moved(fan_out)),), (axis, n), inner=(axis,))


def _split(names: list[str], shape: list[int], axis: int, first: int, labels: tuple[str, str]):
  """``names``/``shape`` with ``axis`` split into ``(first, rest)`` sizes, labelled ``labels``."""
  n = shape[axis]
  return (names[:axis] + list(labels) + names[axis + 1:], shape[:axis] + [first, n // first] + shape[axis + 1:])


def blocks_for(names: Sequence[str], shape: Sequence[int], parts: Sequence[tuple[Any, int, int]], *,
               output: bool = False, mode: str = "matrix", split: int = 0,
               groups: Sequence[int] | None = None, kv_groups: int = 0) -> Blocks:
  """The ``Blocks`` of a kernel whose axes are ``names``, holding ``parts`` ((role, heads, width), ...).

  ``output``: an output projection read transposed (see the module docstring): its matrix's
  fan-in is the heads side. ``split``: for ``"part"``, the width at which each head's columns
  divide into two parts (MLA's ``wkv_b``: ``qk_nope_head_dim``), 0 for none. ``groups``: for
  ``"head"``, the heads per block of each part (default 1: one head per block), each dividing
  its part's head count. ``kv_groups``: the key/value heads that order a fused projection's
  flattened columns (``Projection.grouped``), 0 for the parts one after another. The shape must
  already have been checked against ``parts`` (``_clip.projection.fits_declared``).
  """
  names, shape = list(names), [int(n) for n in shape]
  split_at = None
  fused = len(parts) > 1
  groups = tuple(groups or (1,) * len(parts))

  def axes_of(names: list[str], head_side: list[int]) -> MatrixAxes:
    ins = tuple(i for i, n in enumerate(names) if n == "in")
    side = tuple(head_side)
    return MatrixAxes(side, ins) if output else MatrixAxes(ins, side)

  def rest(names: list[str], *skip: str) -> list[int]:
    return [i for i, n in enumerate(names) if n not in ("layers", "in") + skip]

  if kv_groups and mode != "matrix" and "out" in names:
    return _by_kv_group(names, shape, parts, kv_groups, mode, groups, axes_of, rest)
  if mode == "head" and "out" in names:  # flattened head-major columns -> (heads, head_dim), or (groups, k*head_dim)
    widths = {w for _, _, w in parts}
    if len(widths) != 1:
      raise ValueError(f"the parts {list(parts)} differ in head width; declare the axes")
    o = names.index("out")
    w = widths.pop()
    if len(set(groups)) > 1:  # fused parts grouped differently: each run of equal groups sliced, then split
      return _grouped_slices(names, o, w, parts, groups, axes_of, rest)
    split_at = (o, shape[o] // (w * groups[0]))
    names, shape = _split(names, shape, o, split_at[1], ("heads", "head_dim"))
  elif mode == "head" and groups[0] > 1:  # a heads axis -> (groups, k): the k heads join the fan-out
    if len(set(groups)) > 1:
      raise ValueError(f"the parts {list(parts)} of one heads axis need one group size, got {groups}")
    h = names.index("heads")
    split_at = (h, shape[h] // groups[0])
    names, shape = _split(names, shape, h, split_at[1], ("heads", "head_dim"))
  if mode == "head":
    inner = tuple(i for i, n in enumerate(names) if n in ("parts", "heads"))
    return Blocks((axes_of(names, rest(names, "parts", "heads")),), split_at, inner=inner)
  if mode == "part" and "parts" in names:
    return Blocks((axes_of(names, rest(names, "parts")),), inner=(names.index("parts"),))
  if mode == "part" and fused and "out" in names:
    o = names.index("out")
    if len({(h, w) for _, h, w in parts}) == 1:  # equal parts: (P, h * w), batched
      names, shape = _split(names, shape, o, len(parts), ("parts", "out"))
      return Blocks((axes_of(names, rest(names, "parts")),), (o, len(parts)), inner=(o,))
    edges = [0]
    for _, h, w in parts:
      edges.append(edges[-1] + h * w)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    return Blocks((axes_of(names, [o]),) * len(bounds), cut=o, bounds=bounds)
  if mode == "part" and not fused and 0 < split < parts[0][2]:  # MLA wkv_b: k_nope | v of every head
    _, h, w = parts[0]
    if "out" in names:
      split_at = (names.index("out"), h)
      names, shape = _split(names, shape, names.index("out"), h, ("heads", "head_dim"))
    cut, bounds = names.index("head_dim"), ((0, split), (split, w))
    return Blocks((axes_of(names, rest(names)),) * 2, split_at, cut, bounds)
  return whole(axes_of(names, rest(names)))


def _grouped_slices(names: list[str], o: int, w: int, parts, groups, axes_of, rest) -> Blocks:
  """Flattened fused columns whose parts have different group sizes (GQA groups of q | k | v):
  each run of parts with one group size is a slice, split into ``(blocks, k * w)``."""
  runs: list[list[int]] = []  # [start column, stop column, group]
  start = 0
  for (_, h, _), k in zip(parts, groups):
    if runs and runs[-1][2] == k:
      runs[-1][1] += h * w
    else:
      runs.append([start, start + h * w, k])
    start += h * w
  view = names[:o] + ["heads", "head_dim"] + names[o + 1:]
  axes = axes_of(view, rest(view, "heads"))
  return Blocks((axes,) * len(runs), cut=o, bounds=tuple((a, b) for a, b, _ in runs), inner=(o,),
                piece_split=tuple((b - a) // (k * w) for a, b, k in runs))


def _by_kv_group(names: list[str], shape: list[int], parts, kv: int, mode: str, groups, axes_of, rest) -> Blocks:
  """Fused columns ordered by key/value head (``Projection.grouped``): the view ``(kv, columns of one
  group)``, sliced into each part's columns of every group. ``"part"``: each slice is one matrix (all
  its groups' columns); ``"head"``: each slice split into its blocks of ``groups`` heads, batched."""
  o = names.index("out")
  edges = [0]
  for _, h, w in parts:
    edges.append(edges[-1] + h // kv * w)
  bounds = tuple(zip(edges[:-1], edges[1:]))
  view = names[:o] + ["heads", "out"] + names[o + 1:]
  if mode == "part":
    return Blocks((axes_of(view, rest(view)),) * len(parts), (o, kv), cut=o + 1, bounds=bounds)
  sizes = []
  for (role, h, _), k in zip(parts, groups):
    if (h // kv) % k:
      raise ValueError(
          f"a block of {k} {role or 'value'} heads would take columns of several key/value groups of a fused "
          f"projection grouped by key/value head ({h // kv} per group; one key and one value head each): "
          "such a kernel is cut by 'part', 'head' ('group:1') and 'group:kv' only")
    sizes.append(h // kv // k)
  piece = names[:o] + ["heads", "heads", "head_dim"] + names[o + 1:]
  return Blocks((axes_of(piece, rest(piece, "heads")),) * len(parts), (o, kv), cut=o + 1, bounds=bounds,
                inner=(o, o + 1), piece_split=tuple(sizes))


def piece_dims(blocks: Blocks, path: str, shape: tuple[int, ...]) -> list[tuple[tuple, tuple, tuple, int, int]]:
  """Per piece: its ``(batch, fan_in, fan_out)`` axes and its matrix's ``(rows, cols)``."""
  out = []
  for axes, s in zip(blocks.axes, blocks.piece_shapes(shape)):
    batch, fi, fo = axes.resolve(path, s)
    out.append((batch, fi, fo, math.prod(s[a] for a in fi), math.prod(s[a] for a in fo)))
  return out


def piece_spec(blocks: Blocks, spec: tuple | None, shape: tuple[int, ...], mesh_shape: dict[str, int]) -> tuple | None:
  """The ``PartitionSpec`` entries of the pieces, from the leaf's; None where they cannot be told.

  A split axis keeps its mesh axes on its first part (the heads) when they divide it; a
  sliced axis must be unsharded. Otherwise None: the distributed Newton–Schulz gathers such
  pieces first, as it gathers any leaf whose layout it cannot use.
  """
  if spec is None:
    return None
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if blocks.split is not None:
    axis, first = blocks.split
    e = entries[axis]
    shards = 1 if e is None else math.prod(mesh_shape[a] for a in ((e,) if isinstance(e, str) else e))
    if first % shards:
      return None
    entries = entries[:axis] + [e, None] + entries[axis + 1:]
  if blocks.cut is not None and entries[blocks.cut] is not None:
    return None
  if blocks.piece_split:  # every piece's (unsharded) cut axis split in two
    entries = entries[:blocks.cut] + [None] + entries[blocks.cut:]
  return tuple(entries)
