"""Sharded MuonClip: logical-axis rules, shardings for a mesh, distributed Newton–Schulz.

MuonClip runs under ``jax.jit`` with ``NamedSharding``s on a ``Mesh`` (the pjit model):
parameters, optimizer state and batch carry shardings, XLA partitions the program. This
module gives

* ``DEFAULT_RULES``: logical axis names of the library's modules (and of
  ``examples/mla_lm.py``) -> mesh axes ``data``, ``fsdp``, ``model``; ``logical_to_spec``
  applies them to one array, ``param_shardings`` to a parameter tree, ``batch_shardings``
  to a batch, ``state_shardings``/``init_state`` give optimizer state the shardings of the
  parameters each leaf belongs to (never replicated), ``jit_train_step`` jits a train step
  with them;
* ``orthogonalize_sharded``: Newton–Schulz on a disjoint share of the matrices per device,
  used by ``scale_by_muon(shard_orthogonalization=...)`` (and ``muon``, ``muon_adamw``,
  ``muonclip``).

Why a distributed Newton–Schulz. Under plain SPMD each matrix is orthogonalized in its
parameter's layout: the products ``A = X X^T`` and ``A A`` are replicated over every mesh
axis that does not shard the matrix (all of ``data``, and ``model`` for the ``m x m``
products), so every device repeats most of the work (``optax.contrib.muon`` on GPT-2-like
matrices on a 2x4 mesh: 0.375 of the single-device FLOPs per device, 0.125 being ideal).
Here same-shaped matrices (tall ones transposed, ``m <= n``) of one dtype form a group of
``c`` matrices, and inside one ``shard_map``, for each layout in the group (which mesh axes
shard its rows and columns):

1. the mesh axes that do not shard the layout (``R``, where the data is replicated) pick,
   without communication, a disjoint share of its matrices;
2. an ``all_to_all`` over the axes that do shard it (``S``) hands each device all blocks of
   its share, which it reassembles into whole matrices;
3. each device runs the ordinary ``newton_schulz`` on its ``T = ceil(c / D)`` whole
   matrices of the group (``D`` devices; matrices are placed on the least-loaded device
   across the group's layouts, zero matrices pad the count). Moonlight's distributed Muon
   (arXiv 2502.16982) instead gathers every matrix on every data-parallel rank and repeats
   the iteration there;
4. the inverse ``all_to_all`` and an ``all_gather`` over ``R`` return every device its block
   of every result, in the parameter's own sharding.

A zero matrix orthogonalizes to zero, so padding changes nothing but costs FLOPs: per device
``ceil(c / D)`` matrices of each group, ``1/D`` of the work when each group holds a multiple
of ``D`` matrices. Communication per device: its share out and back (``(|S| - 1) / |S|`` of
each ``all_to_all``; each layout's count is padded to a multiple of ``D`` for the exchange)
plus the ``all_gather`` over ``R`` of the results. A leaf whose sharding is unknown (a bare
``Mesh``) or not a block layout of its matrices is all-gathered first (Moonlight's volume)
and only the compute is split.

Multi-host: nothing here is host-specific; ``jax.distributed.initialize`` before anything
else, a mesh over ``jax.devices()`` (all processes' devices) and the same program on every
process. See ``docs/sharding.md``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._paths import key_name, path_str, strip_value

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# Logical axis name -> mesh axes, tried in order (several rules may name the same logical
# axis: the first whose mesh axes exist, are unused by the array's other dimensions and
# divide the dimension wins; None replicates). See docs/sharding.md for the table.
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")),  # activations/batch: data parallel (FSDP shards data too)
    ("vocab", "model"),  # embedding rows, LM-head columns
    ("heads", "model"),  # attention heads (head-major columns of wq/wq_b/wkv_b, rows of wo)
    ("kv_heads", "model"),  # GQA key/value heads
    ("mlp", "model"),  # MLP hidden units
    ("embed", "fsdp"),  # the model width: FSDP shards every large matrix along it
    ("q_lora", "fsdp"),  # MLA query latent (wq_a columns, wq_b rows)
    ("kv_lora", "fsdp"),  # MLA key/value latent (wkv_a columns, wkv_b rows)
    ("layers", None),  # nn.scan's stacked-layer axis
    ("norm", None),  # norm scales: small, replicated
    ("length", None),  # sequence
)


# ----------------------------------------------------------------------------- rules


def _axes(entry: MeshAxes) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_entry(axes: tuple[str, ...]) -> MeshAxes:
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> P:
  """The ``PartitionSpec`` of an array of ``shape`` whose dimensions are named ``names``.

  For each dimension, in order, the rules for its logical name are tried in order; a rule
  applies when its mesh axes (those present in ``mesh`` with size > 1; a rule left with
  none is skipped) are not used by an earlier dimension and their sizes' product divides
  the dimension. A rule with mesh axes ``None`` replicates the dimension; a name without
  an applicable rule, and a ``None`` name, is replicated too. So a mesh without an
  ``fsdp`` axis simply leaves ``embed`` unsharded, and an MLA ``wkv_a`` kernel
  ``("embed", "kv_lora")`` shards ``embed`` over ``fsdp`` and leaves ``kv_lora`` whole.

  Args:
    names: one logical name (or None) per leading dimension (``len(names) <= len(shape)``;
      missing trailing names are None), e.g. a Flax logical ``PartitionSpec``.
    shape: the array's shape.
    mesh: the device mesh.
    rules: ``(logical name, mesh axes)`` pairs (``DEFAULT_RULES``).
  """
  names = tuple(names)
  shape = tuple(int(s) for s in shape)
  if len(names) > len(shape):
    raise ValueError(f"logical_to_spec: {len(names)} names {names} for an array of shape {shape}")
  used: set[str] = set()
  out: list[MeshAxes] = []
  for dim, name in zip(shape, names + (None,) * (len(shape) - len(names))):
    chosen: tuple[str, ...] = ()
    if name is not None:
      if not isinstance(name, str):
        raise TypeError(f"logical_to_spec: logical names must be strings or None, got {name!r} in {names}")
      for logical, target in rules:
        if logical != name:
          continue
        if target is None:
          break
        axes = tuple(a for a in _axes(target) if mesh.shape.get(a, 1) > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and not used.intersection(axes) and dim % size == 0:
          chosen = axes
          break
    used.update(chosen)
    out.append(_spec_entry(chosen))
  return P(*out)


def _is_names(x: Any) -> bool:
  return x is None or isinstance(x, P) or (
      isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def param_shardings(params: Any, mesh: Mesh, *, logical_axes: Any = None,
                    rules: Rules = DEFAULT_RULES) -> Any:
  """``NamedSharding``s of the parameters on ``mesh`` from their logical axis names.

  Args:
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``s), or Flax boxed parameters
      (``nn.with_logical_partitioning``), whose names are then read from the boxes.
    mesh: the device mesh, with axes among ``data``, ``fsdp``, ``model`` for the default
      rules (missing axes are simply not used).
    logical_axes: a pytree with the parameters' paths whose leaves are logical
      ``PartitionSpec``s or tuples of names (e.g. ``nn.get_partition_spec`` of the boxed
      abstract variables; ``examples/mla_lm.logical_axes``). Matched by path; a parameter
      without an entry is replicated.
    rules: see ``logical_to_spec``.

  Returns:
    A pytree of ``NamedSharding`` with the structure of the (unboxed) parameters.
  """
  if logical_axes is None:
    import flax.linen as nn  # noqa: PLC0415 (only boxed params need Flax)

    logical_axes = nn.get_partition_spec(params)
    params = nn.unbox(params)
  table = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_names)[0]}

  def one(path, x):
    names = table.get(path_str(path)) or ()
    return NamedSharding(mesh, logical_to_spec(tuple(names), np.shape(x), mesh, rules))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_shardings(batch: Any, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> Any:
  """Shardings of a batch pytree whose leaves' leading axis is the logical ``"batch"``.

  With the default rules the batch is split over ``data`` and ``fsdp`` (every device of a
  data x fsdp x model mesh sees ``B / (data * fsdp)`` examples; ``model`` replicas share
  theirs). A batch size not divisible by the product falls back to replication.
  """
  return jax.tree.map(lambda x: NamedSharding(mesh, logical_to_spec(("batch",), np.shape(x), mesh, rules)), batch)


def _names(path: Sequence[Any]) -> tuple[str, ...]:
  """The path's names as strings, without the trailing ``value`` of boxed leaves."""
  return tuple(str(key_name(k)) for k in strip_value(path))


def _mesh_of(shardings: Any) -> Mesh:
  leaves = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
  if not leaves:
    raise ValueError("expected a pytree of NamedSharding (e.g. from param_shardings), found none")
  mesh = leaves[0].mesh
  for s in leaves[1:]:
    if s.mesh != mesh:
      raise ValueError(f"all shardings must share one mesh, got {mesh} and {s.mesh}")
  return mesh


def state_shardings(state: Any, params: Any, shardings: Any) -> Any:
  """Shardings for an optimizer state: each leaf gets its parameter's sharding.

  A state leaf belongs to a parameter when the parameter's path is a suffix of the leaf's
  path and the shapes agree (the momentum at ``.../mu/layers/attn/wq_b/kernel`` belongs
  to ``layers/attn/wq_b/kernel``; optax's ``partition``, ``chain``, ``MultiSteps`` and
  ``inject_hyperparams`` only add prefixes). The longest such suffix wins. Every other leaf
  (step counts, hyperparameters, the running ``max_logits`` of ``multi_steps``) is small
  and replicated.

  Args:
    state: the state or its abstract version (``jax.eval_shape(opt.init, params)``).
    params: the parameters (or their ``ShapeDtypeStruct``s).
    shardings: the parameters' shardings (``param_shardings``).

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``state``.
  """
  mesh = _mesh_of(shardings)
  flat_p, treedef = jax.tree_util.tree_flatten_with_path(params)
  flat_s = treedef.flatten_up_to(shardings)
  table = {_names(p): (tuple(np.shape(x)), s) for (p, x), s in zip(flat_p, flat_s)}
  replicated = NamedSharding(mesh, P())

  def one(path, leaf):
    names, shape = _names(path), tuple(np.shape(leaf))
    for k in range(len(names)):
      hit = table.get(names[k:])
      if hit is not None and hit[0] == shape:
        return hit[1]
    return replicated

  return jax.tree_util.tree_map_with_path(one, state)


def init_state(optimizer: Any, params: Any, shardings: Any) -> Any:
  """``optimizer.init(params)`` under ``jit`` with ``state_shardings`` as output shardings.

  ``params`` should already carry ``shardings`` (``jax.device_put(params, shardings)``).
  """
  abstract = jax.eval_shape(optimizer.init, params)
  return jax.jit(optimizer.init, out_shardings=state_shardings(abstract, params, shardings))(params)


def jit_train_step(step: Callable, params_shardings: Any, state_shardings: Any, batch_shardings: Any, *,
                   donate: bool = False) -> Callable:
  """``jax.jit`` of ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` on a mesh.

  In and out shardings of params and state are the given ones, so that every step returns
  them in the layout they came in (without ``out_shardings`` XLA chooses output layouts by
  propagation, and may, e.g., shard a replicated norm scale); metrics are replicated.

  Args:
    step: e.g. ``muonclip_jax.training.make_train_step(...)``.
    params_shardings: ``param_shardings(params, mesh, ...)``.
    state_shardings: ``state_shardings(...)`` (or ``jax.tree.map(lambda x: x.sharding,
      init_state(...))``).
    batch_shardings: ``batch_shardings(batch, mesh)``.
    donate: donate params and state (their buffers are reused for the outputs).
  """
  mesh = _mesh_of(params_shardings)
  return jax.jit(step, in_shardings=(params_shardings, state_shardings, batch_shardings),
                 out_shardings=(params_shardings, state_shardings, NamedSharding(mesh, P())),
                 donate_argnums=(0, 1) if donate else ())


# ----------------------------------------------------------------------------- Newton–Schulz


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
  _mesh_of(target)


def _resolve_target(target: Any, paths: Sequence[str]) -> tuple[Mesh, list[NamedSharding | None]]:
  if isinstance(target, Mesh):
    return target, [None] * len(paths)
  mesh = _mesh_of(target)
  table = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(target)[0]}
  return mesh, [table.get(p) for p in paths]


class _Leaf:
  """How one leaf enters the distributed orthogonalization (all static)."""

  def __init__(self, shape, axes, sharding, mesh):
    self.shape = tuple(shape)
    self.batch, self.fan_in, self.fan_out = axes
    r = math.prod(self.shape[a] for a in self.fan_in)
    c = math.prod(self.shape[a] for a in self.fan_out)
    self.count = math.prod(self.shape[a] for a in self.batch)
    self.tall = r > c
    self.m, self.n = min(r, c), max(r, c)
    self.rows, self.cols, self.spec = (), (), P()
    layout = self._layout(sharding, mesh)
    if layout is not None:
      (self.rows, self.cols), self.spec = layout
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    self.local_shape = tuple(d // size(ax) for d, ax in zip(self.shape, self._dim_axes(self.spec, mesh)))

  def _dim_axes(self, spec, mesh):
    entries = tuple(spec) + (None,) * (len(self.shape) - len(spec))
    return [tuple(a for a in _axes(e) if mesh.shape[a] > 1) for e in entries]

  def _layout(self, sharding, mesh):
    """((rows axes, cols axes) of the wide matrix, in_spec), or None for "replicate first"."""
    if sharding is None:
      return None
    spec = sharding.spec
    if len(spec) > len(self.shape):
      return None
    dims = self._dim_axes(spec, mesh)
    if any(dims[a] for a in self.batch):
      return None  # a sharded stack axis: gathered first (rare; e.g. a pipeline axis)
    if any(dims[a] for a in self.fan_in[1:] + self.fan_out[1:]):
      return None  # merging a sharded minor axis is not a block layout
    for d, ax in zip(self.shape, dims):
      if d % math.prod(mesh.shape[a] for a in ax):
        return None
    rows, cols = dims[self.fan_in[0]], dims[self.fan_out[0]]
    return ((cols, rows) if self.tall else (rows, cols)), spec

  def to_wide(self, x):
    """Local block -> ``(count, bm, bn)``: the local blocks of its wide matrices."""
    perm = self.batch + self.fan_in + self.fan_out
    moved = jnp.transpose(x, perm) if perm != tuple(range(x.ndim)) else x
    r = math.prod(x.shape[a] for a in self.fan_in)
    w = moved.reshape((self.count, r, -1))
    return jnp.swapaxes(w, -1, -2) if self.tall else w

  def from_wide(self, w):
    """Inverse of ``to_wide``."""
    perm = self.batch + self.fan_in + self.fan_out
    if self.tall:
      w = jnp.swapaxes(w, -1, -2)
    out = w.reshape(tuple(self.local_shape[a] for a in perm))
    if perm != tuple(range(len(perm))):
      out = jnp.transpose(out, tuple(perm.index(a) for a in range(len(perm))))
    return out


class _Plan:
  """Static plan for one group: same ``(m, n)`` and dtype, one or more layouts.

  Layout ``k`` (``rows``/``cols`` mesh axes of its ``c_k`` matrices' blocks) is exchanged
  as ``P_k = q_k D`` slots (``q_k = ceil(c_k / D)``): slot ``s`` lands whole on the device
  with index ``s // (P_k / |R_k|)`` over its replicated axes ``R_k`` and
  ``(s mod (P_k / |R_k|)) // q_k`` over its sharded axes ``S_k`` (rows, then columns).
  Real matrices are placed in slots greedily on the least-loaded device, so that over all
  layouts every device holds at most ``T = ceil(c / D)`` real matrices (padding each layout
  to a multiple of ``D`` on its own would cost up to one matrix per device per layout).
  """

  def __init__(self, layouts: list[tuple[tuple[str, ...], tuple[str, ...]]], counts: list[int], mesh: Mesh):
    self.active = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    sizes = [mesh.shape[a] for a in self.active]
    devices = math.prod(sizes)
    coords = list(np.ndindex(*sizes)) if sizes else [()]
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    self.parts = []
    loads = [0] * devices
    positions = [[] for _ in range(devices)]  # per device: positions of its real matrices
    offset = 0
    for (rows, cols), c in zip(layouts, counts):
      sharded = rows + cols
      rep = tuple(a for a in self.active if a not in sharded)
      q = -(-c // devices)
      chunk = q * devices // size(rep)
      first = []  # first slot received by each device
      for coord in coords:
        at = dict(zip(self.active, coord))
        r = int(np.ravel_multi_index([at[a] for a in rep], [mesh.shape[a] for a in rep])) if rep else 0
        j = int(np.ravel_multi_index([at[a] for a in sharded], [mesh.shape[a] for a in sharded])) if sharded else 0
        first.append(r * chunk + j * q)
      perm = [c] * (q * devices)  # slot -> source matrix (c: the zero matrix)
      inverse = [0] * c
      used = [0] * devices
      heap = [(loads[d], d) for d in range(devices)]  # devices with a free slot, least loaded first
      heapq.heapify(heap)
      for i in range(c):
        _, d = heapq.heappop(heap)
        perm[first[d] + used[d]] = i
        inverse[i] = first[d] + used[d]
        positions[d].append(offset + used[d])
        used[d] += 1
        loads[d] += 1
        if used[d] < q:
          heapq.heappush(heap, (loads[d], d))
      self.parts.append(dict(rows=rows, cols=cols, rep=rep, sharded=sharded, q=q, count=c,
                             n_rep=size(rep), n_sh=size(sharded), n_row=size(rows), n_col=size(cols),
                             perm=np.asarray(perm, np.int32),
                             inverse=np.asarray(inverse, np.int32)))
      offset += q
    self.received = offset  # matrices each device receives, padding included
    self.per_device = max(loads)  # T: matrices each device orthogonalizes
    self.table = np.full((devices, self.per_device), offset, np.int32)  # offset: a zero matrix
    for d, pos in enumerate(positions):
      self.table[d, :len(pos)] = pos
    self.identity = all(list(self.table[d]) == list(range(self.per_device)) for d in range(devices))


def _exchange(x: jax.Array, part: dict, m: int, n: int) -> jax.Array:
  """``(c_k, bm, bn)`` local blocks -> ``(q_k, m, n)`` whole matrices of my slots."""
  c, bm, bn = x.shape
  x = jnp.concatenate([x, jnp.zeros((1, bm, bn), x.dtype)])[part["perm"]]
  if part["rep"]:  # replicated along rep: take a disjoint slice, no communication
    x = x.reshape(part["n_rep"], -1, bm, bn)
    x = jax.lax.dynamic_index_in_dim(x, jax.lax.axis_index(part["rep"]), 0, keepdims=False)
  q = part["q"]
  if part["sharded"]:  # all blocks of my q matrices, from every device of the group
    x = jax.lax.all_to_all(x.reshape(part["n_sh"], q, bm, bn), part["sharded"], 0, 0)
    x = x.reshape(part["n_row"], part["n_col"], q, bm, bn).transpose(2, 0, 3, 1, 4)
  return x.reshape(q, m, n)


def _return(y: jax.Array, part: dict, bm: int, bn: int) -> jax.Array:
  """Inverse of ``_exchange``: ``(q_k, m, n)`` results -> my ``(c_k, bm, bn)`` blocks."""
  q = part["q"]
  if part["sharded"]:
    y = y.reshape(q, part["n_row"], bm, part["n_col"], bn).transpose(1, 3, 0, 2, 4)
    y = jax.lax.all_to_all(y.reshape(part["n_sh"], q, bm, bn), part["sharded"], 0, 0)
  y = y.reshape(-1, bm, bn)
  if part["rep"]:
    y = jax.lax.all_gather(y, part["rep"], axis=0, tiled=True)
  return y[part["inverse"]]


def _orthogonalize_group(xs: list[jax.Array], plan: _Plan, m: int, n: int,
                         ns: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
  """Inside ``shard_map``: local blocks ``(c_k, bm_k, bn_k)`` per layout -> result blocks."""
  got = [_exchange(x, part, m, n) for x, part in zip(xs, plan.parts)]
  stack = jnp.concatenate(got + [jnp.zeros((1, m, n), got[0].dtype)])
  if plan.identity:
    mine = stack[: plan.per_device]
  else:
    index = jnp.asarray(plan.table)[jax.lax.axis_index(plan.active)]
    mine = jnp.take(stack, index, axis=0)
  y = ns(mine)
  if plan.identity:
    back = jnp.concatenate([y, jnp.zeros((stack.shape[0] - plan.per_device, m, n), y.dtype)])
  else:
    back = jnp.zeros(stack.shape, y.dtype).at[index].set(y)
  out, start = [], 0
  for x, part in zip(xs, plan.parts):
    out.append(_return(back[start:start + part["q"]], part, x.shape[1], x.shape[2]))
    start += part["q"]
  return out


def orthogonalize_sharded(xs: Sequence[jax.Array], axes: Sequence[tuple], ns: Callable[[jax.Array], jax.Array],
                          *, mesh: Mesh, shardings: Sequence[NamedSharding | None] | None = None) -> list:
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

  Returns:
    The orthogonalized leaves, same shapes and dtypes (``ns``'s output dtype).
  """
  if shardings is None:
    shardings = [None] * len(xs)
  if not xs:
    return []
  leaves = [_Leaf(x.shape, ax, s, mesh) for x, ax, s in zip(xs, axes, shardings)]
  if math.prod(mesh.shape.values()) == 1:
    return [lf.from_wide(ns(lf.to_wide(x))) for x, lf in zip(xs, leaves)]
  groups: dict[tuple, dict[tuple, list[int]]] = {}  # (m, n, dtype) -> layout -> leaves
  for i, (x, lf) in enumerate(zip(xs, leaves)):
    groups.setdefault((lf.m, lf.n, jnp.result_type(x)), {}).setdefault((lf.rows, lf.cols), []).append(i)
  plans = {key: _Plan(list(by_layout), [sum(leaves[i].count for i in ids) for ids in by_layout.values()], mesh)
           for key, by_layout in groups.items()}

  def body(*local):
    out = [None] * len(local)
    for (m, n, _), by_layout in groups.items():
      stacks = []
      for ids in by_layout.values():
        parts = [leaves[i].to_wide(local[i]) for i in ids]
        stacks.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
      results = _orthogonalize_group(stacks, plans[(m, n, _)], m, n, ns)
      for ids, y in zip(by_layout.values(), results):
        start = 0
        for i in ids:
          out[i] = leaves[i].from_wide(y[start:start + leaves[i].count])
          start += leaves[i].count
    return tuple(out)

  specs = tuple(lf.spec for lf in leaves)
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
  return list(fn(*xs))


def orthogonalize_leaves_sharded(gs: list, ms: list, axes: list, direction: Callable, finish: Callable, *,
                                 paths: Sequence[str], target: Any, ns: Callable) -> list:
  """``finish(i, ns(direction(g_i, m_i)))`` for every leaf, distributed over ``target``'s mesh.

  The hook of ``scale_by_muon(shard_orthogonalization=target)``: ``target`` is a ``Mesh``
  or a pytree of ``NamedSharding`` matched to the leaves by ``paths``.
  """
  mesh, shardings = _resolve_target(target, paths)
  ds = [direction(g, m) for g, m in zip(gs, ms)]
  out = orthogonalize_sharded(ds, axes, ns, mesh=mesh, shardings=shardings)
  return [finish(i, o) for i, o in enumerate(out)]
