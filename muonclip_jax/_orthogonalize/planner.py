"""Planner of the distributed Newton–Schulz: which device orthogonalizes which matrix.

Pure Python, from shapes, matrix axes, ``PartitionSpec`` entries and mesh axis sizes
alone (no JAX arrays, no compilation), so it simulates meshes far larger than the machine
it runs on. ``_orthogonalize.distributed`` executes its plans; ``benchmarks/bench_sharding.py`` uses it
to simulate large meshes.

The model. Every leaf is a stack of ``count`` matrices ``m x n`` (tall ones transposed,
``m <= n``); an expert stack ``(E, in, out)`` is ``E`` matrices. Its *layout* is the pair of
mesh-axis tuples sharding the wide matrix's rows and columns; ``S`` = rows + cols shard it
into ``s`` blocks, the other mesh axes ``R`` (``n_rep`` devices) replicate it. Matrices of one
layout and dtype form a *class*, exchanged in one flat buffer. A device ``d`` has coordinates
``(r, j)``: ``r`` over ``R``, ``j`` over ``S``. Any device can assemble any matrix of a class
from the ``s`` devices of its own ``R``-slice, so placement is free:

* placement: matrices by decreasing FLOPs, each on the least-loaded device (longest
  processing time first, LPT: max load <= ideal + largest matrix, within 4/3 of the optimum),
  optionally subject to a byte cap per device and class; of these and the shape-by-shape
  grouping (``grouped``: each device takes at most ``ceil(c / D)`` of the ``c`` matrices of
  a shape) the plan keeps the one with the fewest FLOPs on the most loaded device among
  those whose traffic does not exceed the grouping's;
* FLOPs per device: the sum of ``flops(m, n)`` over its matrices (``ns_flops``: matmuls only;
  XLA's cost analysis adds the elementwise work, ``O(m n)`` a step: see
  ``benchmarks/RESULTS.md``);
* communication per device and class, with ``C`` the largest number of block elements a
  device holds (the flat buffer, padded to the same size on every device): the exchange and
  its inverse ``all_to_all`` over ``S``, ``2 (s - 1) C``, plus the ``all_gather`` of the
  results over ``R``, ``(n_rep - 1) s C`` elements received.

Expert parallelism. A leaf whose stack (batch) axes are sharded, over mesh axes ``B`` (an
expert stack ``(E, in, out)`` on an ``expert`` axis), is never gathered: each ``B``-slice of
the mesh holds ``E / |B|`` whole experts (or their blocks, when ``S`` also shards them, e.g.
FSDP), and only the devices of that slice take part in their exchange (``R`` excludes
``B``). Its class is *pinned*: the ``c`` local matrices (the local stack's, by local index)
are placed once over the devices of the slice at ``B = 0`` and every other slice repeats that
placement on its own experts, so each device of a slice orthogonalizes the same local
positions, and the packing programs do not depend on ``B`` (``_orthogonalize.placement``).
The plan tries the pinned matrices first, as fixed load with the others placed around it,
and all matrices largest first, and keeps the better.

The grouping's traffic is that of the width ``C = sum_g ceil(c_g / D) m_g n_g / s`` per
class (``c_g`` matrices of shape ``g`` in it: each group zero-padded to a multiple of ``D``);
the grouping meets it by construction, so the plan's communication never exceeds it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import placement as placing

Entry = str | tuple[str, ...] | None
Flops = Callable[[int, int], float]


def entry_axes(entry: Entry) -> tuple[str, ...]:
  """The mesh axes of one ``PartitionSpec`` entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One leaf as the plan sees it (all static)."""

  shape: tuple[int, ...]
  batch: tuple[int, ...]
  fan_in: tuple[int, ...]
  fan_out: tuple[int, ...]
  dtype: str
  itemsize: int
  rows: tuple[str, ...]  # mesh axes sharding the wide matrix's rows
  cols: tuple[str, ...]  # ... and its columns
  spec: tuple[Entry, ...]  # the in/out spec of the exchange (() replicated: gathered first)
  gathered: int  # shards of the leaf gathered before the exchange (1: none)
  stack: tuple[str, ...] = ()  # mesh axes sharding the stack (batch) axes: pinned to their slice
  stack_shards: int = 1  # their product

  @property
  def count(self) -> int:
    return math.prod(self.shape[a] for a in self.batch)

  @property
  def local_count(self) -> int:
    """Matrices of one device's local stack (``count`` unless the stack axes are sharded)."""
    return self.count // self.stack_shards

  @property
  def tall(self) -> bool:
    return math.prod(self.shape[a] for a in self.fan_in) > math.prod(self.shape[a] for a in self.fan_out)

  @property
  def mn(self) -> tuple[int, int]:
    r = math.prod(self.shape[a] for a in self.fan_in)
    c = math.prod(self.shape[a] for a in self.fan_out)
    return min(r, c), max(r, c)

  @property
  def key(self) -> tuple:
    """The class: layout, dtype and the stack's mesh axes."""
    return self.rows, self.cols, self.dtype, self.stack


def _dim_axes(spec: Sequence[Entry], ndim: int, mesh: Mapping[str, int]) -> list[tuple[str, ...]]:
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return [tuple(a for a in entry_axes(e) if mesh[a] > 1) for e in entries]


def describe(shape: Sequence[int], axes: tuple, spec: Sequence[Entry] | None, mesh: Mapping[str, int],
             dtype: str, itemsize: int) -> Leaf:
  """A leaf of ``shape`` with ``(batch, fan_in, fan_out)`` axes and sharding ``spec``.

  ``spec`` None (unknown) or a layout the exchange cannot express (a sharded minor axis of a
  multi-axis fan-in/fan-out, a size not divisible by its shards) gives a replicated leaf:
  XLA gathers it before the exchange. Sharded stack axes pin the leaf's matrices to their
  mesh slice (module docstring).
  """
  shape = tuple(int(d) for d in shape)
  batch, fan_in, fan_out = (tuple(a) for a in axes)
  base = dict(shape=shape, batch=batch, fan_in=fan_in, fan_out=fan_out, dtype=dtype, itemsize=itemsize)
  fallback = Leaf(**base, rows=(), cols=(), spec=(), gathered=1)
  if spec is None or len(spec) > len(shape):
    return fallback
  dims = _dim_axes(spec, len(shape), mesh)
  shards = math.prod(mesh[a] for ax in dims for a in ax)
  fallback = dataclasses.replace(fallback, gathered=shards)
  if any(dims[a] for a in fan_in[1:] + fan_out[1:]):
    return fallback
  if any(d % math.prod(mesh[a] for a in ax) for d, ax in zip(shape, dims)):
    return fallback
  rows, cols = dims[fan_in[0]], dims[fan_out[0]]
  stack = tuple(a for a in mesh if any(a in dims[b] for b in batch))
  leaf = Leaf(**base, rows=rows, cols=cols, spec=tuple(spec), gathered=1, stack=stack,
              stack_shards=math.prod(mesh[a] for a in stack))
  return dataclasses.replace(leaf, rows=cols, cols=rows) if leaf.tall else leaf


@dataclasses.dataclass(frozen=True)
class Class:
  """One exchange: the matrices of one layout and dtype, and where each goes."""

  rows: tuple[str, ...]
  cols: tuple[str, ...]
  rep: tuple[str, ...]  # the replicating mesh axes R (never the stack's B)
  n_row: int
  n_col: int
  n_rep: int
  itemsize: int
  leaves: tuple[int, ...]  # leaf indices, in order; their matrices in order form the class
  matrices: tuple[tuple[int, int], ...]  # (leaf, index in its (local) stack)
  device: tuple[int, ...]  # per matrix: the device that orthogonalizes it (pinned: in the slice B = 0)
  offset: tuple[int, ...]  # per matrix: its first element in that device's buffer row
  width: int  # C: block elements per buffer row (the largest device's, padded)
  stack: tuple[str, ...] = ()  # B: the mesh axes sharding the stack (pinned class), or ()

  @property
  def sharded(self) -> tuple[str, ...]:
    return self.rows + self.cols

  @property
  def s(self) -> int:
    return self.n_row * self.n_col

  def comm(self) -> int:
    """Bytes one device receives: exchange, inverse exchange, gather over R."""
    return (2 * (self.s - 1) + (self.n_rep - 1) * self.s) * self.width * self.itemsize


@dataclasses.dataclass(frozen=True)
class Plan:
  """Placement of every matrix and its costs."""

  axes: tuple[str, ...]  # the active mesh axes (size > 1), in mesh order: device = ravel over them
  sizes: tuple[int, ...]
  classes: tuple[Class, ...]
  device_flops: tuple[float, ...]
  gather_bytes: int  # bytes one device receives when XLA gathers the fallback leaves first
  grouped_comm: int  # bytes one device receives under the shape-by-shape grouping (the bound on ``comm``)

  @property
  def devices(self) -> int:
    return math.prod(self.sizes)

  def coords(self, d: int) -> dict[str, int]:
    out, rest = {}, d
    for a, size in zip(reversed(self.axes), reversed(self.sizes)):
      out[a], rest = rest % size, rest // size
    return out

  def home(self, cls: Class, d: int) -> int:
    """The device of the slice ``B = 0`` whose placement device ``d`` repeats (``d`` if unpinned)."""
    return placing.home(self.axes, self.sizes, cls.stack, d)

  @property
  def comm(self) -> int:
    """Bytes one device receives (every device the same: buffers are padded alike)."""
    return self.gather_bytes + sum(c.comm() for c in self.classes)

  @property
  def max_flops(self) -> float:
    return max(self.device_flops)


def _ravel(coords: Mapping[str, int], axes: Sequence[str], mesh: Mapping[str, int]) -> int:
  out = 0
  for a in axes:
    out = out * mesh[a] + coords[a]
  return out


def _matrices(leaves: Sequence[Leaf], flops: Flops, skip: frozenset = frozenset()):
  """Per class key: ``[(flops, (leaf, index in its stack), (m, n))]``, leaves in order."""
  out: dict[tuple, list] = {}
  for i, lf in enumerate(leaves):
    if not lf.count or (lf.key, *lf.mn) in skip:  # an empty stack, or split: nothing to place
      continue
    m, n = lf.mn
    f = float(flops(m, n))
    out.setdefault(lf.key, []).extend((f, (i, k), (m, n)) for k in range(lf.local_count))
  return out


def _size(axes: Sequence[str], mesh: Mapping[str, int]) -> int:
  return math.prod(mesh[a] for a in axes)


def grouped_counts(leaves: Sequence[Leaf], skip: frozenset = frozenset()) -> dict[tuple, int]:
  """The shape-by-shape grouping's groups: ``{(class key, m, n): number of (local) matrices}``."""
  out: dict[tuple, int] = {}
  for lf in leaves:
    if not lf.count or (lf.key, *lf.mn) in skip:
      continue
    key = (lf.key, *lf.mn)
    out[key] = out.get(key, 0) + lf.local_count
  return out


def _slice_devices(key: tuple, mesh: Mapping[str, int]) -> int:
  """Devices a class's matrices may go to: the whole mesh, or one slice of a pinned class."""
  return math.prod(mesh.values()) // _size(key[3], mesh)


def plan(leaves: Sequence[Leaf], mesh: Mapping[str, int], flops: Flops, *, placement: str = "best",
         skip: frozenset = frozenset()) -> Plan:
  """The plan for ``leaves`` on a mesh of axis sizes ``mesh`` (ordered as the mesh's axes).

  Args:
    leaves: ``describe`` of every leaf.
    mesh: axis name -> size, in mesh order.
    flops: FLOPs of orthogonalizing one ``m x n`` matrix (``m <= n``).
    placement: ``"best"``: the fewest FLOPs on the most loaded device among ``"grouped"``
      and LPT with the byte cap per class at 1, 1.25 and infinitely many times the
      grouping's (with pinned matrices: each placed first, as fixed load, and all largest
      first), keeping only those whose total traffic does not exceed the grouping's;
      ``"lpt"``: LPT without any cap (the whole-matrix bound); ``"grouped"``: the
      shape-by-shape placement (at most ``ceil(c / D)`` matrices of a shape per device),
      without zero-matrix padding.
    skip: ``(class key, m, n)`` groups left out (split over device groups, ``_orthogonalize.hybrid``).
  """
  axes = tuple(a for a in mesh if mesh[a] > 1)
  sizes = tuple(mesh[a] for a in axes)
  devices = math.prod(sizes)
  mats = _matrices(leaves, flops, skip)
  rep_of = {key: tuple(a for a in axes if a not in key[0] + key[1] + key[3]) for key in mats}
  s_of = {key: _size(key[0] + key[1], mesh) for key in mats}
  homes = {key: placing.images(axes, sizes, key[3]) if key[3] else None for key in mats}
  blocks = {key: {shape: shape[0] * shape[1] // s_of[key] for _, _, shape in ms} for key, ms in mats.items()}
  caps: dict[tuple, int] = {key: 0 for key in mats}
  for (key, m, n), c in grouped_counts(leaves, skip).items():
    caps[key] += -(-c // _slice_devices(key, mesh)) * blocks[key][(m, n)]

  def loads(where):
    out = [0.0] * devices
    for key, ms in mats.items():
      for (f, _, _), d in zip(ms, where[key]):
        for e in (d,) if homes[key] is None else homes[key][d]:
          out[e] += f
    return out

  def classes(where, widths=None):
    out = []
    for key, ms in mats.items():
      rows, cols = key[0], key[1]
      filled = [0] * devices
      offset = []
      for (_, _, shape), d in zip(ms, where[key]):
        offset.append(filled[d])
        filled[d] += blocks[key][shape]
      members = tuple(sorted({i for _, (i, _), _ in ms}))
      out.append(Class(rows=rows, cols=cols, rep=rep_of[key], n_row=_size(rows, mesh), n_col=_size(cols, mesh),
                       n_rep=_size(rep_of[key], mesh), itemsize=leaves[members[0]].itemsize, leaves=members,
                       matrices=tuple(ij for _, ij, _ in ms), device=tuple(where[key]), offset=tuple(offset),
                       width=max(filled) if widths is None else widths[key], stack=key[3]))
    return tuple(out)

  gather = sum(int(math.prod(lf.shape) * lf.itemsize * (lf.gathered - 1) / lf.gathered) for lf in leaves)
  grouped = placing.grouped(mats, devices, homes)
  grouped_bytes = gather + sum(c.comm() for c in classes(grouped, caps))

  def build(where):
    return Plan(axes=axes, sizes=sizes, classes=classes(where), device_flops=tuple(loads(where)),
                gather_bytes=gather, grouped_comm=grouped_bytes)

  if placement == "grouped":
    return build(grouped)
  if placement == "lpt":
    orders = (True, False) if any(homes.values()) else (True,)
    return min((build(placing.lpt(mats, {k: math.inf for k in mats}, devices, blocks, homes, o)) for o in orders),
               key=lambda p: p.max_flops)
  if placement != "best":
    raise ValueError(f"placement must be 'best', 'lpt' or 'grouped', got {placement!r}")
  options = [build(grouped)]
  for scale in (1, 1.25, math.inf):  # the cap per class, then only the total traffic bounded
    for pinned_first in (True, False) if any(homes.values()) else (True,):
      where = placing.lpt(mats, {k: c * scale for k, c in caps.items()}, devices, blocks, homes, pinned_first)
      if where is not None:
        options.append(build(where))
  return min((p for p in options if p.comm <= grouped_bytes), key=lambda p: (p.max_flops, p.comm))


def device_coords(plan_: Plan, cls: Class, d: int, mesh: Mapping[str, int]) -> tuple[int, int]:
  """``(r, j)`` of device ``d`` for class ``cls``: its index over R and over S (rows, cols)."""
  at = plan_.coords(d)
  return _ravel(at, cls.rep, mesh), _ravel(at, cls.sharded, mesh)


@dataclasses.dataclass(frozen=True)
class Figures:
  """Per-device FLOPs and bytes of one scheme."""

  flops: float  # the most loaded device's FLOPs
  comm: float  # bytes one device receives
  total: float  # FLOPs on one device (every matrix once)

  def over_ideal(self, devices: int) -> float:
    return self.flops / (self.total / devices)


def figures(leaves: Sequence[Leaf], mesh: Mapping[str, int], flops: Flops) -> dict[str, Any]:
  """Per-device figures of this plan, the shape-by-shape grouping, Moonlight's repetition, the LPT bound.

  ``"grouped"``: the shape-by-shape scheme, every device orthogonalizing ``ceil(c / D)``
  matrices of each group (zero-padded) and exchanging at the cap. ``"repeated"``: Moonlight's
  (arXiv 2502.16982) distributed Muon, every device gathering every whole matrix and running
  every iteration. ``"lpt"``: LPT over whole matrices without the byte cap.
  """
  devices = math.prod(mesh.values())
  new = plan(leaves, mesh, flops)
  total = float(sum(new.device_flops))
  lpt = plan(leaves, mesh, flops, placement="lpt")
  group_flops = sum(-(-c // _slice_devices(key, mesh)) * float(flops(m, n))
                    for (key, m, n), c in grouped_counts(leaves).items())
  group_comm = new.grouped_comm
  # Moonlight's: every device gathers every matrix it holds a block of (pinned: its slice's)
  repeated = sum(int(math.prod(lf.shape) / lf.stack_shards * lf.itemsize
                     * (1 - 1 / max(lf.gathered, _size(lf.rows + lf.cols, mesh)))) for lf in leaves)
  repeated_flops = sum(float(flops(*lf.mn)) * lf.local_count for lf in leaves)
  return {
      "new": Figures(new.max_flops, new.comm, total),
      "lpt": Figures(lpt.max_flops, lpt.comm, total),
      "grouped": Figures(group_flops, group_comm, total),
      "repeated": Figures(repeated_flops, repeated, total),
  }
