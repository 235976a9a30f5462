"""Distributed Newton–Schulz: each matrix orthogonalized whole on one device of a mesh,
or the largest ones split over a group of devices.

Under plain SPMD each matrix is orthogonalized in its parameter's layout, and every device
that does not shard it repeats the work (the products ``X X^T`` and ``A A`` are replicated
over every mesh axis not sharding the matrix). Here, inside one ``shard_map`` over the mesh,
with the placement of ``_orthogonalize.planner.plan`` (LPT by FLOPs over every matrix, whatever its
shape; an expert stack ``(E, in, out)`` is ``E`` matrices), for each class of matrices (one
layout: the mesh axes ``S`` sharding its rows and columns, the others ``R`` replicating it;
one dtype):

1. each device packs the local blocks of the matrices placed in its ``R``-slice into a
   flat buffer, one row per destination of its ``S``-group (``lax.switch`` on its index
   over ``R``: the packing differs per slice; no communication, the data is replicated
   along ``R``);
2. an ``all_to_all`` over ``S`` hands each device every block of its matrices;
3. ``lax.switch`` on the device index runs the device's own program: reassemble its
   matrices, run ``ns`` on each same-shaped stack, cut the results into blocks. Each device
   runs a different set of shapes; XLA's cost analysis counts a conditional as its most
   expensive branch, i.e. the most loaded device;
4. the inverse ``all_to_all`` and an ``all_gather`` over ``R`` give every device its block of
   every result, in the parameter's own sharding.

Zero padding only fills each buffer row up to the fullest device's; the planner keeps the
total traffic within that of the shape-by-shape grouping (``_orthogonalize.planner``: each device takes
at most ``ceil(c / D)`` of the ``c`` matrices of a shape). Moonlight's distributed Muon
(arXiv 2502.16982) instead gathers every matrix on every data-parallel rank and repeats the
iteration there. Leaves whose sharding is unknown (a bare ``Mesh``) or not a block layout
are gathered first and come back replicated.

With ``ns_kwargs`` the plan is ``_orthogonalize.hybrid``'s: matrices too large for whole placement to
balance may be split over device groups (``_run_split``, ``_orthogonalize.split``) in the same
``shard_map``, after the whole ones.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import hybrid, planner
from .newton_schulz import newton_schulz, ns_flops
from .split import cost, iterate, resolve
from .._util import from_matrices, path_str, to_matrices


def mesh_of(shardings: Any) -> Mesh:
  """The one mesh of a pytree of ``NamedSharding``."""
  leaves = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
  if not leaves:
    raise ValueError("expected a pytree of NamedSharding (e.g. from param_shardings), found none")
  mesh = leaves[0].mesh
  for s in leaves[1:]:
    if s.mesh != mesh:
      raise ValueError(f"all shardings must share one mesh, got {mesh} and {s.mesh}")
  return mesh


def check_target(target: Any) -> None:
  """Validates ``scale_by_muon``'s ``shard_orthogonalization`` (a Mesh or NamedShardings)."""
  if target is None or isinstance(target, Mesh):
    return
  if callable(target):
    raise TypeError("shard_orthogonalization must be a Mesh or a pytree of NamedSharding, got a callable")
  leaves = jax.tree.leaves(target)
  bad = [x for x in leaves if not isinstance(x, NamedSharding)]
  if not leaves or bad:
    raise TypeError(
        "shard_orthogonalization must be None, a jax.sharding.Mesh or a pytree of NamedSharding "
        f"(muonclip_jax.sharding.param_shardings), got {type(bad[0] if bad else target).__name__}"
    )
  mesh_of(target)


def describe(xs: Sequence[Any], axes: Sequence[tuple], mesh: Mesh,
             shardings: Sequence[NamedSharding | None]) -> list[planner.Leaf]:
  """The planner's view of the leaves (arrays or ``ShapeDtypeStruct``s)."""
  return [planner.describe(x.shape, ax, None if s is None else tuple(s.spec), dict(mesh.shape),
                           jnp.dtype(x.dtype).name, jnp.dtype(x.dtype).itemsize)
          for x, ax, s in zip(xs, axes, shardings)]


def _to_wide(lf: planner.Leaf, x: jax.Array) -> jax.Array:
  """Local block -> ``(count, bm, bn)``: the local blocks of its wide matrices."""
  return to_matrices(x, lf.batch, lf.fan_in, lf.fan_out, transpose=lf.tall)


def _from_wide(lf: planner.Leaf, w: jax.Array, local_shape: tuple[int, ...]) -> jax.Array:
  """Inverse of ``_to_wide``."""
  return from_matrices(w, local_shape, lf.batch, lf.fan_in, lf.fan_out, transpose=lf.tall)


def _pack(pieces: list[jax.Array], width: int, dtype: Any, lead: int) -> jax.Array:
  """``(lead, width)``: the ``(lead, k)`` pieces side by side, zero-padded."""
  used = sum(p.shape[1] for p in pieces)
  if used < width:
    pieces = pieces + [jnp.zeros((lead, width - used), dtype)]
  return jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]


def _run_split(sp: hybrid.Split, wides: list, it: dict, mesh: Mesh) -> dict:
  """``{(leaf, k): local result block}`` of a split group (``_orthogonalize.hybrid``'s steps 1-4)."""
  blocks = [wides[i][k] for i, k in sp.matrices]
  blk = jnp.stack(blocks + [jnp.zeros_like(blocks[0])])  # the last one: padding
  o = jax.lax.axis_index(sp.outer) if sp.outer else 0
  x = jnp.take(blk, jnp.asarray(sp.table, jnp.int32)[o], axis=0)  # (q, bm, bn)
  if sp.n_row > 1:
    x = jax.lax.all_to_all(x, sp.rows, 2, 1, tiled=True)  # (q, m, bn / n_row)
  w = sp.n // sp.g
  if sp.g_r > 1:
    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(sp.group_rep) * w, w, axis=2)
  group = tuple(a for a in mesh.axis_names if a in sp.rows + sp.cols + sp.group_rep)
  y = iterate(x, it, group, sp.g)
  if sp.g_r > 1:
    y = jax.lax.all_gather(y, sp.group_rep, axis=2, tiled=True)
  if sp.n_row > 1:
    y = jax.lax.all_to_all(y, sp.rows, 1, 2, tiled=True)  # (q, bm, bn)
  every = jax.lax.all_gather(y, sp.outer, axis=0) if sp.n_out > 1 else y[None]
  return {ik: every[t // sp.q, t % sp.q] for t, ik in enumerate(sp.matrices)}


def _executor(leaves: list[planner.Leaf], hplan: hybrid.HybridPlan, mesh: Mesh, ns: Callable,
              split_iter: Callable | None = None) -> Callable:
  """The ``shard_map`` body: local leaf blocks -> local result blocks."""
  plan = hplan.whole
  shape = dict(mesh.shape)
  where = []  # per class: {(r, j): [matrix positions on that device, by offset]}
  by_device = []  # per class: {device: [matrix positions]}
  for cls in plan.classes:
    on_rj, on_d = collections.defaultdict(list), collections.defaultdict(list)
    for t, d in enumerate(cls.device):
      on_rj[planner.device_coords(plan, cls, d, shape)].append(t)
      on_d[d].append(t)
    where.append(on_rj)
    by_device.append(on_d)

  def geometry(cls, t):
    lf = leaves[cls.matrices[t][0]]
    m, n = lf.mn
    return lf, m, n, m // cls.n_row, n // cls.n_col

  def send(ci, r, blocks):
    """Slice ``r``'s buffer for class ``ci``: row ``j`` holds the blocks for device ``(r, j)``."""
    cls = plan.classes[ci]
    rows = [_pack([blocks[t][None] for t in where[ci].get((r, j), [])], cls.width, blocks[0].dtype, 1)
            for j in range(cls.s)]
    return jnp.concatenate(rows) if len(rows) > 1 else rows[0]

  def compute(d, recvs):
    """Device ``d``'s program: its matrices of every class, orthogonalized."""
    stacks = collections.defaultdict(list)
    for ci, cls in enumerate(plan.classes):
      for t in by_device[ci].get(plan.home(cls, d), []):
        lf, m, n, bm, bn = geometry(cls, t)
        o = cls.offset[t]
        x = recvs[ci][:, o:o + bm * bn].reshape(cls.n_row, cls.n_col, bm, bn)
        stacks[(m, n, lf.dtype)].append((ci, t, x.transpose(0, 2, 1, 3).reshape(m, n)))
    results = {}
    for items in stacks.values():
      y = ns(jnp.stack([x for _, _, x in items]))
      for (ci, t, _), yi in zip(items, y):
        results[(ci, t)] = yi
    outs = []
    for ci, cls in enumerate(plan.classes):
      pieces = []
      for t in by_device[ci].get(plan.home(cls, d), []):
        _, _, _, bm, bn = geometry(cls, t)
        y = results[(ci, t)].astype(recvs[ci].dtype).reshape(cls.n_row, bm, cls.n_col, bn)
        pieces.append(y.transpose(0, 2, 1, 3).reshape(cls.s, bm * bn))
      outs.append(_pack(pieces, cls.width, recvs[ci].dtype, cls.s))
    return tuple(outs)

  def body(*local):
    wides = [_to_wide(lf, x) for lf, x in zip(leaves, local)]
    recvs = []
    for ci, cls in enumerate(plan.classes):
      blocks = [wides[i][k].reshape(-1) for i, k in cls.matrices]
      if cls.n_rep > 1:
        branches = [lambda b, r=r, ci=ci: send(ci, r, b) for r in range(cls.n_rep)]
        buf = jax.lax.switch(jax.lax.axis_index(cls.rep), branches, blocks)
      else:
        buf = send(ci, 0, blocks)
      recvs.append(jax.lax.all_to_all(buf, cls.sharded, 0, 0) if cls.s > 1 else buf)
    branches = [lambda rs, d=d: compute(d, rs) for d in range(plan.devices)]
    outs = jax.lax.switch(jax.lax.axis_index(plan.axes), branches, tuple(recvs)) if plan.classes else ()
    out = list(local)  # (a leaf of zero matrices stays as it is)
    for cls, y in zip(plan.classes, outs):
      back = jax.lax.all_to_all(y, cls.sharded, 0, 0) if cls.s > 1 else y
      every = jax.lax.all_gather(back, cls.rep, axis=0) if cls.n_rep > 1 else back[None]
      got = collections.defaultdict(dict)
      for t, ((i, k), d, o) in enumerate(zip(cls.matrices, cls.device, cls.offset)):
        _, _, _, bm, bn = geometry(cls, t)
        r, j = planner.device_coords(plan, cls, d, shape)
        got[i][k] = every[r, j, o:o + bm * bn].reshape(bm, bn)
      for i in cls.leaves:
        w = jnp.stack([got[i][k] for k in range(leaves[i].local_count)])
        out[i] = _from_wide(leaves[i], w, local[i].shape)
    for sp in hplan.splits:
      got = _run_split(sp, wides, split_iter(sp.m, sp.n), mesh)
      for i in sorted({i for i, _ in sp.matrices}):
        w = jnp.stack([got[(i, k)] for k in range(leaves[i].count)])
        out[i] = _from_wide(leaves[i], w.astype(local[i].dtype), local[i].shape)
    return tuple(out)

  return body


def default_flops(m: int, n: int) -> float:
  """Placement weight of an ``m x n`` matrix when none is given: 5 quintic steps."""
  return float(ns_flops((m, n)))


def orthogonalize_sharded(xs: Sequence[jax.Array], axes: Sequence[tuple], ns: Callable[[jax.Array], jax.Array],
                          *, mesh: Mesh, shardings: Sequence[NamedSharding | None] | None = None,
                          flops: Callable[[int, int], float] | None = None, ns_kwargs: dict | None = None,
                          shard_split: str = "auto") -> list:
  """``ns`` of every matrix of every leaf, each matrix orthogonalized on one device only.

  Args:
    xs: the leaves (global arrays, under ``jit``).
    axes: per leaf, its ``(batch, fan_in, fan_out)`` axes (``MatrixAxes.resolve``).
    ns: orthogonalizes a stack ``(q, m, n)`` with ``m <= n`` (e.g. ``newton_schulz``).
    mesh: the devices to spread the work over (all of them).
    shardings: per leaf its ``NamedSharding`` on ``mesh`` (the layout the leaf has and its
      result gets), or None: a leaf without one, or with a layout this scheme does not
      handle (a sharded stack axis, or a sharded minor axis of a multi-axis fan-in/out),
      is all-gathered first and comes back replicated (XLA then slices it as needed).
    flops: the FLOPs of ``ns`` on one ``m x n`` matrix, the placement's weights
      (``default_flops`` if None).
    ns_kwargs: when ``ns`` is ``newton_schulz(**ns_kwargs)``, those arguments: then a
      matrix too large for whole-matrix placement may be split over a device group
      (``_orthogonalize.hybrid``, ``_orthogonalize.split``). None: every matrix whole.
    shard_split: ``"auto"`` (split where the ``_orthogonalize.cost`` H100 model says it pays), ``"always"``
      (wherever it lowers the most loaded device's FLOPs) or ``"never"``.

  Returns:
    The orthogonalized leaves, same shapes and dtypes (``ns``'s output dtype).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, muonclip_jax as mc
    >>> from jax.sharding import Mesh
    >>> from muonclip_jax import sharding
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, 1, -1), ("data", "fsdp", "model"))
    >>> experts = jnp.eye(4, 8)[None] + 0.3 * jax.random.normal(jax.random.key(0), (3, 4, 8))  # 3 matrices 4 x 8
    >>> dense = jnp.eye(8) + 0.3 * jax.random.normal(jax.random.key(1), (8, 8))
    >>> axes = [((0,), (1,), (2,)), ((), (0,), (1,))]  # (batch, fan_in, fan_out) of each leaf
    >>> ns = lambda x: mc.newton_schulz(x, steps=8, coeffs="polar_express")
    >>> out = jax.jit(lambda xs: sharding.orthogonalize_sharded(xs, axes, ns, mesh=mesh))([experts, dense])
    >>> [o.shape for o in out]
    [(3, 4, 8), (8, 8)]
    >>> jnp.round(jnp.linalg.svd(out[0], compute_uv=False), 2)  # each expert's matrix orthogonalized
    Array([[1., 1., 1., 1.],
           [1., 1., 1., 1.],
           [1., 1., 1., 1.]], dtype=float32)
  """
  if not xs:
    return []
  shardings = [None] * len(xs) if shardings is None else list(shardings)
  leaves = describe(xs, axes, mesh, shardings)
  if mesh.size == 1:
    return [_from_wide(lf, ns(_to_wide(lf, x)), x.shape) for x, lf in zip(xs, leaves)]
  hplan = plan_of(leaves, mesh, flops, ns_kwargs, shard_split)
  split_iter = None if ns_kwargs is None else (lambda m, n: resolve(ns_kwargs, m, n))
  specs = tuple(P(*lf.spec) for lf in leaves)
  fn = jax.shard_map(_executor(leaves, hplan, mesh, ns, split_iter), mesh=mesh, in_specs=specs, out_specs=specs,
                     check_vma=False)
  return list(fn(*xs))


def split_cost_of(ns_kwargs: dict | None) -> hybrid.SplitCost | None:
  """``_orthogonalize.hybrid``'s split cost of ``newton_schulz(**ns_kwargs)`` (None: never split)."""
  if ns_kwargs is None:
    return None
  cd = ns_kwargs.get("compute_dtype")

  def group_cost(m: int, n: int, g: int, itemsize: int):
    it = resolve(ns_kwargs, m, n)
    size = jnp.dtype(cd).itemsize if cd is not None else itemsize
    return None if it is None else cost(it, m, n, g, size)

  return group_cost


def plan_of(leaves: list[planner.Leaf], mesh: Mesh, flops: Callable | None, ns_kwargs: dict | None,
            split: str = "auto") -> hybrid.HybridPlan:
  """The plan ``orthogonalize_sharded`` executes."""
  return hybrid.plan(leaves, dict(mesh.shape), flops or default_flops, split_cost=split_cost_of(ns_kwargs),
                     split=split)


def ns_flops_of(ns_kwargs: dict) -> Callable[[int, int], float]:
  """``ns_flops`` of ``newton_schulz(**ns_kwargs)`` on an ``m x n`` matrix (static steps)."""
  steps = ns_kwargs.get("steps")
  if isinstance(steps, jax.core.Tracer):  # traced (inject_hyperparams): the preset's count
    steps = None
  kw = dict(steps=steps, coeffs=ns_kwargs.get("coeffs", "muon"), method=ns_kwargs.get("method", "standard"),
            restarts=ns_kwargs.get("restarts", ()), precision=ns_kwargs.get("precision"),
            compute_dtype=ns_kwargs.get("compute_dtype"))
  return lambda m, n: float(ns_flops((m, n), **kw))


def orthogonalize_leaves_sharded(gs: list, ms: list, axes: list, direction: Callable, finish: Callable, *,
                                 paths: Sequence[str], target: Any, ns_kwargs: dict, split: str = "auto") -> list:
  """``finish(i, ns(direction(i, g_i, m_i)))`` for every leaf, distributed over ``target``'s mesh.

  ``target`` is a ``Mesh`` or a pytree of ``NamedSharding`` matched to the leaves by
  ``paths`` (``scale_by_muon(shard_orthogonalization=target)``).
  """
  if isinstance(target, Mesh):
    mesh, shardings = target, [None] * len(paths)
  else:
    mesh = mesh_of(target)
    table = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(target)[0]}
    shardings = [table.get(p) for p in paths]
  ds = [direction(i, g, m) for i, (g, m) in enumerate(zip(gs, ms))]
  out = orthogonalize_sharded(ds, axes, lambda x: newton_schulz(x, **ns_kwargs), mesh=mesh,
                              shardings=shardings, flops=ns_flops_of(ns_kwargs), ns_kwargs=ns_kwargs,
                              shard_split=split)
  return [finish(i, o) for i, o in enumerate(out)]
