"""The collectives of a compiled HLO module's text: op, result shapes, replica groups.

``compiled.as_text()`` writes an instruction as ``%name = RESULT op(OPERANDS), ...,
replica_groups=GROUPS, ...``. ``GROUPS`` has had three spellings across XLA versions, all
read here:

* explicit lists ``{{0,1,2,3},{4,5,6,7}}`` (``{}``: one group of every device);
* the iota form ``[G,S]<=[N]`` (``G`` groups of ``S`` devices, ``0..N-1`` in order), with an
  optional transpose ``[G,S]<=[A,B]T(1,0)`` (the iota reshaped to ``[A,B]``, transposed,
  flattened, cut into ``G`` rows);
* the mesh form of JAX 0.12 (``mesh['data'=2,'model'=4] {'model'}``: the devices that
  differ only along the named axes form a group; devices numbered in mesh order, or as
  ``device_ids=([2,2,2]T(1,0,2))`` lists them: an iota reshaped and transposed, the device
  of each mesh position).

Asynchronous pairs (``all-gather-start``/``-done``) are read at their start, whose last
result shape is the gathered one. Used by ``bench_sharding.py`` and the tests.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1, "u8": 1,
         "pred": 1}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]  # result (dtype, dims), one per tuple element
  groups: tuple[tuple[int, ...], ...]  # the replica groups, device ids

  @property
  def group_size(self) -> int:
    return len(self.groups[0])

  @property
  def nbytes(self) -> int:
    return sum(BYTES.get(t, 4) * math.prod(d) for t, d in self.shapes)

  @property
  def elements(self) -> int:
    return sum(math.prod(d) for _, d in self.shapes)


def _brace_groups(text: str) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", text))


def parse_groups(line: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """The replica groups of one instruction line (every device in one group if none given)."""
  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
  if m:
    return _brace_groups(m.group(1))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    out = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape([int(x) for x in m.group(2).split(",")])
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(out[0], -1)
    return tuple(tuple(int(x) for x in row) for row in ids)
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                r"\s*\{([^}]*)\}", line)
  if m:
    axes = [(a, int(s)) for a, s in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    within = set(re.findall(r"'([^']+)'", m.group(4)))
    names = [a for a, _ in axes]
    ids = np.arange(math.prod(s for _, s in axes))
    if m.group(2):  # the device at each mesh position: an iota, reshaped and transposed
      ids = ids.reshape([int(x) for x in m.group(2).split(",")])
      if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape([s for _, s in axes])
    inner = [i for i, a in enumerate(names) if a in within]
    outer = [i for i, a in enumerate(names) if a not in within]
    ids = ids.transpose(outer + inner).reshape(-1, math.prod(axes[i][1] for i in inner) if inner else 1)
    return tuple(tuple(int(x) for x in row) for row in ids)
  if re.search(r"replica_groups=\{\}", line) or "replica_groups" not in line:
    return (tuple(range(devices)),)
  raise ValueError(f"unrecognized replica_groups in: {line[:300]}")


def collectives(hlo: str, devices: int) -> list[Collective]:
  """Every collective instruction of ``hlo`` (``-done`` halves skipped)."""
  out = []
  for line in hlo.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    shapes = tuple((t, tuple(int(x) for x in d.split(",") if x)) for t, d in _SHAPE.findall(m.group(1)))
    if m.group(3):  # async start: (operands..., result); the result is the last
      shapes = shapes[-1:]
    out.append(Collective(m.group(2), shapes, parse_groups(line, devices)))
  return out


def received_bytes(c: Collective) -> float:
  """Bytes one device receives: ``(g-1)/g`` of an all-gather's or all-to-all's result,
  ``2 (g-1)/g`` of an all-reduce's (ring), ``g-1`` times a reduce-scatter's result, a
  collective-permute's result."""
  g = c.group_size
  factor = {"all-gather": (g - 1) / g, "all-to-all": (g - 1) / g, "all-reduce": 2 * (g - 1) / g,
            "reduce-scatter": g - 1, "collective-permute": 1.0}[c.op]
  return c.nbytes * factor


def communication(hlo: str, devices: int) -> tuple[float, dict[str, int]]:
  """(estimated bytes received per device, {collective: count}) of a compiled HLO text."""
  found = collectives(hlo, devices)
  counts: dict[str, int] = {}
  for c in found:
    counts[c.op] = counts.get(c.op, 0) + 1
  return sum(received_bytes(c) for c in found), counts

