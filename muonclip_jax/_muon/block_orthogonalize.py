"""Newton–Schulz of leaves cut into blocks (``_muon.blocks``): per head, per part.

Each leaf with blocks is cut into its pieces (a view of the leaf, sliced), every piece's
matrices orthogonalized, each piece scaled by the RMS factor of its own ``rows x cols``
(Moonlight's ``0.2 sqrt(max(rows, cols))`` gives every block the update RMS 0.2, whatever
its shape; DeepSpeed #8384 scales per head block the same way), and the pieces put back.

The blocks of one matrix (the ``inner`` batch axes: heads, parts) are orthogonalized in one
batched ``newton_schulz`` call, never mapped one by one: a heads-sharded kernel is then
orthogonalized where it lives, each device on its own heads, with no gather. Only stacked
layers (the other batch axes) are mapped, in slices of ``ns_batch`` (default 1). Leaves
without blocks go through ``orthogonalize_leaves`` (``_orthogonalize.batching``), after the block leaves.

With ``shard_orthogonalization`` the pieces are ordinary matrices of the distributed
Newton–Schulz (``_orthogonalize.distributed``), their shardings derived from the leaf's
(``piece_spec``), except pieces whose batch axes are sharded (heads on a model axis): those
already lie whole on their devices and are orthogonalized there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._orthogonalize import mesh_of, newton_schulz, ns_flops_of, orthogonalize_leaves, orthogonalize_sharded
from .blocks import Blocks, piece_dims, piece_spec
from .._util import after, path_str


def ns_in_place(x: jax.Array, batch: tuple[int, ...], fan_in: tuple[int, ...], fan_out: tuple[int, ...],
                inner: tuple[int, ...], ns: Callable[[jax.Array], jax.Array], limit: int) -> jax.Array:
  """``ns`` of every matrix of ``x``: the blocks of one matrix (its ``inner`` batch axes) in one
  call, the other batch axes (stacked layers) in slices of ``limit`` when there are more.

  The fan-in and fan-out axes keep their stored order when they are not interleaved (a
  torch-style ``(head_dim, in)`` block is orthogonalized as stored, its transpose's polar
  factor being the transpose of the polar factor). Each call gets a 3-D ``(blocks, rows,
  cols)`` stack whose leading axis is the inner axes
  first (major), then the sliced layers: a heads-sharded axis stays the major part of it,
  so its sharding carries through the reshape; and XLA:CPU computes every matrix of a 3-D
  batched product as it computes one matrix alone (a 4-D product rounds differently).
  """
  outer = tuple(a for a in batch if a not in inner)
  kept = tuple(a for a in batch if a in inner)
  rest = tuple(a for a in range(x.ndim) if a not in batch)
  if rest not in (fan_in + fan_out, fan_out + fan_in):  # else the matrix (or its transpose) as stored
    rest = fan_in + fan_out
  perm = outer + kept + rest
  moved = x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)
  count, k = math.prod(x.shape[a] for a in outer), math.prod(x.shape[a] for a in kept)
  # rows x cols as stored: the polar factor of a transpose is the transpose of the polar factor
  rows = math.prod(x.shape[a] for a in rest[:len(fan_in) if rest[0] in fan_in else len(fan_out)])
  cols = math.prod(x.shape[a] for a in rest) // rows
  y = moved.reshape(count, k, rows, cols)

  def run(chunk):  # (n, k, rows, cols) -> the same, through one (k * n, rows, cols) call
    n = chunk.shape[0]
    z = ns(jnp.swapaxes(chunk, 0, 1).reshape(k * n, rows, cols))
    return jnp.swapaxes(z.reshape(k, n, rows, cols), 0, 1)

  if count <= limit:
    z = run(y)
  else:
    full = count - count % limit
    z = jax.lax.map(run, y[:full].reshape(full // limit, limit, k, rows, cols)).reshape(full, k, rows, cols)
    if full < count:
      z = jnp.concatenate([z, run(y[full:])])
  z = z.reshape(tuple(x.shape[a] for a in perm))
  return z if perm == tuple(range(x.ndim)) else jnp.transpose(z, tuple(perm.index(a) for a in range(x.ndim)))


def orthogonalize_blocks(gs: list, ms: list, ss: list, blocks: Sequence[Blocks], direction: Callable, rms: Callable, *,
                         paths: Sequence[str], batch: int | None, target: Any, split: str,
                         ns_kwargs: dict) -> list:
  """``rms(rows, cols) * NewtonSchulz(direction(g_i, m_i, s_i))`` block by block, in each leaf's dtype.

  ``s_i`` is leaf ``i``'s momentum scale, of its rank (size 1 on the matrix axes).

  ``target`` is ``scale_by_muon``'s ``shard_orthogonalization``; ``batch`` its ``ns_batch``.
  """
  if target is not None:
    return _sharded(gs, ms, ss, blocks, direction, rms, paths=paths, target=target, split=split, ns_kwargs=ns_kwargs)

  def ns(x):
    return newton_schulz(x, **ns_kwargs)

  result: list = [None] * len(gs)
  prev: list = []
  for i, b in enumerate(blocks):
    if b.is_whole:
      continue
    g, m = (gs[i], ms[i]) if not prev else after((gs[i], ms[i]), prev)  # one leaf's temporaries at a time
    d = direction(g, m, ss[i])
    outs = [ns_in_place(x, bt, fi, fo, b.inner, ns, batch or 1) * rms(r, c)
            for x, (bt, fi, fo, r, c) in zip(b.pieces(d), piece_dims(b, paths[i], d.shape))]
    result[i] = b.assemble(outs, d.shape).astype(gs[i].dtype)
    prev = [result[i]]
  rest = [i for i, b in enumerate(blocks) if b.is_whole]
  if rest:
    sub = [(gs[i], ms[i]) for i in rest]
    if prev:
      sub = after(sub, prev)
    dims = [piece_dims(blocks[i], paths[i], gs[i].shape)[0] for i in rest]

    def finish(j, o):
      return (o * rms(dims[j][3], dims[j][4])).astype(gs[rest[j]].dtype)

    outs, _ = orthogonalize_leaves([g for g, _ in sub], [(m, ss[i]) for (_, m), i in zip(sub, rest)],
                                   [d[:3] for d in dims], lambda g, m, s: (direction(g, m, s), ()), finish,
                                   batch=batch, **ns_kwargs)
    for i, o in zip(rest, outs):
      result[i] = o
  return result


def _sharded(gs, ms, ss, blocks, direction, rms, *, paths, target, split, ns_kwargs) -> list:
  """The distributed path: every piece an ordinary matrix of one plan, except heads-sharded pieces."""
  if isinstance(target, Mesh):
    mesh, by_path = target, {}
  else:
    mesh = mesh_of(target)
    by_path = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(target)[0]}
  sizes = dict(mesh.shape)

  def ns(x):
    return newton_schulz(x, **ns_kwargs)

  xs, axes, shardings, where, pieces = [], [], [], [], {}
  for i, b in enumerate(blocks):
    d = direction(gs[i], ms[i], ss[i])
    sharding = by_path.get(paths[i])
    spec = None if sharding is None else (tuple(sharding.spec) if b.is_whole else
                                          piece_spec(b, tuple(sharding.spec), d.shape, sizes))
    for k, (x, (bt, fi, fo, r, c)) in enumerate(zip(b.pieces(d), piece_dims(b, paths[i], d.shape))):
      entries = () if spec is None else tuple(spec) + (None,) * (x.ndim - len(spec))
      local = not b.is_whole and any(_shards(entries[a], sizes) > 1 for a in bt) if entries else False
      if local:  # its blocks lie whole on their devices (heads sharded): orthogonalize them there
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))
        pieces[i, k] = ns_in_place(x, bt, fi, fo, b.inner, ns, math.prod(x.shape)) * rms(r, c)
        continue
      xs.append(x)
      axes.append((bt, fi, fo))
      shardings.append(None if spec is None else NamedSharding(mesh, P(*entries)))
      where.append((i, k, r, c))
  outs = orthogonalize_sharded(xs, axes, ns, mesh=mesh, shardings=shardings, flops=ns_flops_of(ns_kwargs),
                               ns_kwargs=ns_kwargs, shard_split=split)
  for (i, k, r, c), o in zip(where, outs):
    pieces[i, k] = o * rms(r, c)
  result = []
  for i, b in enumerate(blocks):
    ys = [pieces[i, k] for k in range(len(b.axes))]
    result.append(b.assemble(ys, gs[i].shape).astype(gs[i].dtype))
  return result


def _shards(entry: Any, sizes: dict[str, int]) -> int:
  if entry is None:
    return 1
  return math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))
