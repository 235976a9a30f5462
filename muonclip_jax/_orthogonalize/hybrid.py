"""Hybrid plan: whole matrices by LPT, the largest ones split over device groups.

Whole-matrix placement cannot bring the most loaded device below its largest matrix
(``_orthogonalize.planner``: LPT's bound is ``ideal + largest``). Here every matrix of a ``(class, m,
n)`` group whose FLOPs exceed a share of the ideal ``total / D`` may instead be split
(``_orthogonalize.split``) over a *device group*: the ``s`` devices that shard its layout (rows axes
``Sr``, columns axes ``Sc``), times ``g_r`` devices of a subset ``G`` of the axes ``R`` that
replicate it; ``g = s g_r``. Each device of a group holds a column slab ``m x n/g``. The
other replicating axes ``O = R - G`` index ``n_out`` groups that run side by side, each on
``q = ceil(c / n_out)`` of the group's ``c`` matrices (zero-padded: every group runs ``q``).

Per device and group, the data movement (all exactly as executed by ``_orthogonalize.distributed``):

1. select the group's ``q`` matrices (local: the data is replicated over ``R``);
2. ``all_to_all`` over ``Sr``: blocks ``(bm, bn)`` -> slabs ``(m, bn / n_row)``; a slice
   over ``G`` (local);
3. the split iteration (its all-reduces and all-gathers, ``_orthogonalize.split.cost``);
4. ``all_gather`` over ``G``, the inverse ``all_to_all`` over ``Sr``, and an ``all_gather``
   over ``O``: every device gets its block of every result, in the parameter's sharding.

The plan tries no split and splitting every group above ``t`` times the ideal, for a few
``t``; for each split group the subset ``G`` with the least estimated time (FLOPs and bytes
on the device model). It keeps the
option with the least estimated step time on a device model (``_orthogonalize.cost``; ``split="auto"``),
so whole matrices stay whole where splitting would not pay, or the fewest FLOPs on the most
loaded device (``split="always"``; an option splitting more groups must save 2%), or never
splits (``split="never"``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from . import planner
from .cost import H100_NVLINK, Device

SPLIT_CHOICES = ("auto", "always", "never")
THRESHOLDS = (2.0, 1.0, 0.5, 0.25, 0.1)  # split groups whose matrices exceed t * ideal
# (m, n, g, leaf itemsize) -> (FLOPs per device, [(collective, result bytes, group size)]), or None
SplitCost = Callable[[int, int, int], tuple | None]


def received(op: str, nbytes: float, g: int) -> float:
  """Bytes one device receives (ring all-reduce; as ``benchmarks/hlo_collectives.py``)."""
  if g <= 1:
    return 0.0
  return nbytes * {"all-gather": (g - 1) / g, "all-to-all": (g - 1) / g, "all-reduce": 2 * (g - 1) / g}[op]


@dataclasses.dataclass(frozen=True)
class Split:
  """One ``(class, m, n)`` group orthogonalized by device groups."""

  key: tuple  # the class: (rows, cols, dtype)
  rows: tuple[str, ...]
  cols: tuple[str, ...]
  group_rep: tuple[str, ...]  # G: replicating axes that join the group
  outer: tuple[str, ...]  # O: replicating axes indexing the groups
  n_row: int
  n_col: int
  g_r: int
  n_out: int
  m: int
  n: int
  itemsize: int
  matrices: tuple[tuple[int, int], ...]  # (leaf, index in its stack)
  table: tuple[tuple[int, ...], ...]  # per group: q positions in ``matrices`` (len: padding)
  flops: float  # per device
  collectives: tuple[tuple[str, float, int], ...]  # per device: (op, result bytes, group size)

  @property
  def g(self) -> int:
    return self.n_row * self.n_col * self.g_r

  @property
  def q(self) -> int:
    return len(self.table[0])

  @property
  def comm(self) -> float:
    return sum(received(op, b, g) for op, b, g in self.collectives)


@dataclasses.dataclass(frozen=True)
class HybridPlan:
  whole: planner.Plan
  splits: tuple[Split, ...]

  @property
  def devices(self) -> int:
    return self.whole.devices

  @property
  def device_flops(self) -> tuple[float, ...]:
    extra = sum(s.flops for s in self.splits)
    return tuple(f + extra for f in self.whole.device_flops)

  @property
  def max_flops(self) -> float:
    return max(self.device_flops)

  @property
  def comm(self) -> float:
    return self.whole.comm + sum(s.comm for s in self.splits)

  @property
  def collectives(self) -> int:
    """Number of collectives one device takes part in."""
    n = sum(2 * (c.s > 1) + (c.n_rep > 1) for c in self.whole.classes)
    return n + sum(len(s.collectives) for s in self.splits)

  def step_s(self, device: Device) -> float:
    return device.step_s(self.max_flops, self.comm)


def _subsets(axes: Sequence[str]):
  for r in range(len(axes) + 1):
    yield from itertools.combinations(axes, r)


def _split(key: tuple, m: int, n: int, mats: list, mesh: Mapping[str, int], itemsize: int, cost: SplitCost,
           device: Device) -> Split | None:
  """The group's split with the least estimated time, or None if it cannot be split."""
  rows, cols = key[0], key[1]
  rep = tuple(a for a in mesh if mesh[a] > 1 and a not in rows + cols)
  n_row, n_col = math.prod(mesh[a] for a in rows), math.prod(mesh[a] for a in cols)
  best = None
  for grp in _subsets(rep):
    g_r = math.prod(mesh[a] for a in grp)
    g = n_row * n_col * g_r
    if g == 1 or m % g or n % g:
      continue
    got = cost(m, n, g, itemsize)
    if got is None:
      return None
    f, colls = got
    outer = tuple(a for a in rep if a not in grp)
    n_out = math.prod(mesh[a] for a in outer)
    q = -(-len(mats) // n_out)
    slab = q * m * n // (n_row * n_col) * itemsize
    moves = [("all-to-all", slab, n_row)] * 2 + [("all-gather", slab, g_r), ("all-gather", n_out * slab, n_out)]
    allc = tuple((op, q * b, gs) for op, b, gs in colls) + tuple(c for c in moves if c[2] > 1)
    table = tuple(tuple(o * q + i if o * q + i < len(mats) else len(mats) for i in range(q)) for o in range(n_out))
    s = Split(key=key, rows=rows, cols=cols, group_rep=grp, outer=outer, n_row=n_row, n_col=n_col, g_r=g_r, n_out=n_out,
              m=m, n=n, itemsize=itemsize, matrices=tuple(mats), table=table, flops=q * f, collectives=allc)
    score = device.step_s(s.flops, s.comm)
    if best is None or score < best[0]:
      best = (score, s)
  return None if best is None else best[1]


def plan(leaves: Sequence[planner.Leaf], mesh: Mapping[str, int], flops: planner.Flops, *,
         split_cost: SplitCost | None = None, split: str = "auto",
         device: Device = H100_NVLINK) -> HybridPlan:
  """The hybrid plan (module docstring); ``split_cost`` None: whole matrices only."""
  if split not in SPLIT_CHOICES:
    raise ValueError(f"split must be one of {SPLIT_CHOICES}, got {split!r}")
  whole = HybridPlan(planner.plan(leaves, mesh, flops), ())
  if split_cost is None or split == "never":
    return whole
  groups: dict[tuple, list] = {}  # pinned stacks (sharded stack axes) stay whole: never split
  for i, lf in enumerate(leaves):
    if lf.count and not lf.stack:
      groups.setdefault((lf.key, *lf.mn), []).extend((i, k) for k in range(lf.count))
  total = sum(float(flops(*lf.mn)) * lf.count for lf in leaves)
  devices = whole.devices
  ideal = total / devices
  options, seen = [whole], set()
  for t in THRESHOLDS:
    chosen = frozenset(g for g in groups if float(flops(g[1], g[2])) > t * ideal)
    if not chosen or chosen in seen:
      continue
    seen.add(chosen)
    splits = []
    for key, m, n in sorted(chosen, key=lambda g: -float(flops(g[1], g[2]))):
      s = _split(key, m, n, groups[(key, m, n)], mesh, leaves[groups[(key, m, n)][0][0]].itemsize, split_cost,
                 device)
      if s is not None:
        splits.append(s)
    if splits:
      skip = frozenset((s.key, s.m, s.n) for s in splits)
      options.append(HybridPlan(planner.plan(leaves, mesh, flops, skip=skip), tuple(splits)))
  if split == "always":  # more splits only for 2% fewer FLOPs (their small overheads are not modelled)
    best = options[0]
    for p in sorted(options[1:], key=lambda p: len(p.splits)):
      if p.max_flops < 0.98 * best.max_flops:
        best = p
    return best
  return min(options, key=lambda p: (p.step_s(device), len(p.splits)))
