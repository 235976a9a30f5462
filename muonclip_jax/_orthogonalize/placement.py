"""Placement of the distributed Newton–Schulz's matrices on devices (``_orthogonalize.planner``).

Two heuristics over ``{class key: [(flops, (leaf, index), (m, n))]}``, returning
``{class key: [device per matrix]}``:

* ``lpt``: longest processing time first by FLOPs (each matrix on the least-loaded device;
  max load <= ideal + largest matrix, within 4/3 of the optimum), with a byte cap per device
  and class;
* ``grouped``: the shape-by-shape grouping, at most ``ceil(c / D)`` of a shape's ``c``
  matrices per device and class.

A *pinned* class (a stack sharded on its stack axes ``B``: expert parallelism) is placed on
the *home* devices, the slice ``B = 0`` of the mesh; every other slice repeats the placement
(the home's *images*), so a pinned matrix loads all the images of its home.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def home(axes: Sequence[str], sizes: Sequence[int], stack: Sequence[str], d: int) -> int:
  """Device ``d`` with its coordinates over ``stack`` set to 0 (devices raveled over ``axes``)."""
  out, step = 0, 1
  for a, size in zip(reversed(axes), reversed(sizes)):
    if a not in stack:
      out += (d % size) * step
    d //= size
    step *= size
  return out


def images(axes: Sequence[str], sizes: Sequence[int], stack: Sequence[str]) -> dict[int, list[int]]:
  """``{home device: every device that repeats its placement}`` over the slices of ``stack``."""
  out: dict[int, list[int]] = {}
  for d in range(math.prod(sizes)):
    out.setdefault(home(axes, sizes, stack, d), []).append(d)
  return out


Homes = dict  # per class key: None (any device) or {home device in the slice B = 0: its repeating devices}


def lpt(mats: dict, caps: dict, devices: int, blocks: dict, homes: Homes, pinned_first: bool) -> dict | None:
  """LPT by FLOPs with a byte cap per device and class; None if a matrix fits nowhere.

  A pinned matrix goes to the home device whose repeating devices are the least loaded (the
  most loaded of them counts), any other to the least-loaded device. ``pinned_first``: the
  pinned matrices are placed first, as fixed load, then the others around it; else all in
  one order, largest first. Free matrices that tie go to the images of one home after
  another (home-major order), so that the images of a home carry alike loads, which the
  pinned matrices, placed alike on every image, can then level.
  """
  order = sorted(((f, key, idx, shape) for key, ms in mats.items() for idx, (f, _, shape) in enumerate(ms)),
                 key=lambda t: ((homes[t[1]] is None) if pinned_first else False, -t[0]))
  load = [0.0] * devices
  used = {key: [0] * devices for key in mats}
  where = {key: [0] * len(ms) for key, ms in mats.items()}
  heaps: dict[tuple, list] = {}  # per stack axes (() for the free matrices): (level, rank, device), lazily updated
  pinned = next((h for h in homes.values() if h), None)
  rank = list(range(devices))
  if pinned is not None:
    for r, d in enumerate(d for h in sorted(pinned) for d in pinned[h]):
      rank[d] = r

  for f, key, idx, shape in order:
    images = (lambda d: (d,)) if homes[key] is None else homes[key].__getitem__
    level = lambda d: max(load[e] for e in images(d))  # noqa: E731
    heap = heaps.get(key[3])
    if heap is None:
      heap = heaps[key[3]] = [(level(d), rank[d], d)
                              for d in (range(devices) if homes[key] is None else sorted(homes[key]))]
      heapq.heapify(heap)
    b = blocks[key][shape]
    skipped = []
    while heap:
      ld, rk, d = heapq.heappop(heap)
      if ld != level(d):  # loads only grow: a stale entry goes back with its current level
        heapq.heappush(heap, (level(d), rk, d))
        continue
      if used[key][d] + b <= caps[key]:
        break
      skipped.append((ld, rk, d))
    else:
      return None
    for item in skipped:
      heapq.heappush(heap, item)
    where[key][idx] = d
    used[key][d] += b
    for e in images(d):
      load[e] += f
    heapq.heappush(heap, (level(d), rank[d], d))
  return where


def grouped(mats: dict, devices: int, homes: Homes) -> dict:
  """The shape-by-shape placement: per shape, at most ``ceil(c / D)`` matrices per device and
  class (pinned classes: ``c`` local matrices over the ``D / |B|`` devices of a slice)."""
  where = {key: [0] * len(ms) for key, ms in mats.items()}
  by_shape: dict[tuple, dict[tuple, list]] = {}
  for key, ms in mats.items():
    for idx, (_, _, shape) in enumerate(ms):
      by_shape.setdefault((shape, key[2]), {}).setdefault(key, []).append(idx)
  for per_class in by_shape.values():
    load = [0] * devices  # matrices of this shape per device, over its classes
    for key, idxs in per_class.items():
      images = (lambda d: (d,)) if homes[key] is None else homes[key].__getitem__
      candidates = range(devices) if homes[key] is None else sorted(homes[key])
      q = -(-len(idxs) // len(candidates))
      used = [0] * devices
      heap = [(max(load[e] for e in images(d)), d) for d in candidates]
      heapq.heapify(heap)
      for idx in idxs:
        _, d = heapq.heappop(heap)
        where[key][idx] = d
        used[d] += 1
        for e in images(d):
          load[e] += 1
        if used[d] < q:
          heapq.heappush(heap, (max(load[e] for e in images(d)), d))
  return where
