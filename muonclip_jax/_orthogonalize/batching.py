"""Which matrices go into which Newton–Schulz call: ``orthogonalize_leaves`` and its grouping rule.

A program with one Newton–Schulz call per matrix compiles in time proportional to the number
of matrices: an unscanned 48-layer model has hundreds, and its update compiles ten times
slower than AdamW's. Under the default (``ns_batch=None``) same-shaped matrices (same
``rows x cols`` and dtype) are stacked and orthogonalized by one loop (``lax.fori_loop``) over the
stack, so the program holds one Newton–Schulz body per stack, not per matrix; what the caller
computes per matrix before Newton–Schulz (``step``: Muon's momentum and direction) runs
in that body too, compiled once per stack:

* **count:** a shape with fewer than ``MIN_STACK`` matrices is not stacked (the few calls it
  saves do not pay for the loop); otherwise its matrices are cut, in leaf order, into stacks
  of ``max(MIN_STACK, min(MAX_STACK, ceil(count / STACKS)))`` matrices (a leaf is never cut:
  a stacked leaf with more matrices is a stack of its own): ``STACKS`` stacks up to
  ``STACKS * MAX_STACK`` matrices of a shape, then more stacks of ``MAX_STACK``. Each loop
  adds a Newton–Schulz body, and a loop of ``n`` matrices compiles in time growing as
  ``n^2`` (its ``lax.switch`` has ``n`` branches): two per shape compiled fastest on a 48-
  and a 96-layer model (``benchmarks/RESULTS.md``), and the cap keeps thousands of separate
  expert leaves from making one loop of thousands of branches.
* **backend:** each iteration of a stack's loop orthogonalizes ``per_call`` matrices in one
  batched call. On a CPU ``per_call`` is 1: batching saves nothing there and each batched
  product's temporaries grow with it. On an accelerator every iteration of a loop costs a
  fixed overhead (measured on an H200: about 0.1 ms, ``benchmarks/RESULTS.md``), so a call
  takes as many matrices as make ``CALL_FLOPS`` (``ns_flops``), about a millisecond of an
  H100's dense bf16 peak (``_orthogonalize.cost.H100_NVLINK``): the overhead stays near a tenth.
* **stacks:** a leaf of several matrices (scanned layers, experts) is never sliced: it is one
  batched call over its whole stack, and stacks of one shape share a loop whose iteration is
  one whole stack. XLA then partitions a stack along its sharded stack axis (an expert axis):
  each device orthogonalizes the matrices it holds, and no stack is gathered. The price is
  the Newton–Schulz temporaries of a whole stack (per device, its shard), not one matrix's.
* **matrix size** enters only there. A loop reads its matrices in place (``lax.switch`` on
  the iteration picks them), so stacking copies nothing on the way in; on the way out the
  loop's stacked result is sliced into the leaves, one pass over each matrix against
  Newton–Schulz's ``O(steps min(m, n))`` operations per element. The slices' offsets reach
  XLA as operands, not constants (``_opaque``), so that every leaf of a shape shares one
  compiled kernel.

The loops run one after another, each waiting for the previous one's results
(``_util.sequence.after``). Their stacked results (Newton–Schulz's, and ``step``'s new arrays:
Muon's new momentum, a few numbers per matrix for its scale) are the default's extra
temporary memory. A loop's result buffers are made after the previous loop's results, so
XLA allocates them when the loop runs: XLA:CPU's scheduler then kept at most two consecutive
loops' results (it slices a loop's into the leaves while the next one runs; measured, not
forced), not every loop's (which a scan's own buffers, allocated where XLA likes, let it
do). A loop of whole stacks returns them indexed by iteration, never merged with the loop's
axis, so that a sharded stack's results stay sharded. Grouping
changes the results by rounding only: the same products run inside a loop, but XLA may fuse
the elementwise direction differently in a loop's body than in a single call, and XLA:CPU may
contract a multiply-add into an FMA in one and not the other, which Newton–Schulz amplifies
(measured on XLA:CPU: 0 ulps in a jitted update; a probe found 35 ulps of a leaf's largest
entry with the optimizer built inside an outer jit; ``tests/test_ns_batching.py`` bounds it).

``ns_batch=k`` keeps the rule it always had: same-shaped matrices (tall ones transposed to
join the wide ones of their size) in leaf order, in calls of
at most ``k``, no loops but for a stacked leaf with more than ``k`` matrices; ``ns_batch=1``
orthogonalizes one matrix at a time (the smallest temporaries).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .newton_schulz import newton_schulz, ns_flops
from .._util import after, from_matrices, to_matrices

STACKS = 2  # a shape's matrices go into this many stacks, unless they would be longer than MAX_STACK
MAX_STACK = 96  # matrices per stack, at most (a loop's compile time grows as the square of its length)
MIN_STACK = 8  # fewer matrices of a shape than this are not stacked
CALL_FLOPS = 2.0**40  # on accelerators, the Newton–Schulz FLOPs of one batched call (at least)


def plan_calls(keys: list, counts: list[int], batch: int | None) -> list[list[int]]:
  """The leaves of each call (``batch``: ``ns_batch``) or stack (``None``), in order of first leaf.

  ``keys[i]`` is leaf ``i``'s ``(min, max, dtype)``, ``counts[i]`` its number of matrices.
  """
  if batch is not None:
    chunks, open_chunk = [], {}
    for i, (key, count) in enumerate(zip(keys, counts)):
      cur = open_chunk.get(key)
      if cur is not None and sum(counts[j] for j in cur) + count > batch:
        cur = None
      if cur is None:
        cur = []
        chunks.append(cur)
        if count < batch:
          open_chunk[key] = cur
      cur.append(i)
    return chunks
  groups: dict = {}
  for i, key in enumerate(keys):
    groups.setdefault(key, []).append(i)
  chunks = []
  for members in groups.values():
    total = sum(counts[i] for i in members)
    if total < MIN_STACK:
      chunks.extend([i] for i in members)
      continue
    size, cur = max(MIN_STACK, min(MAX_STACK, -(-total // STACKS))), []
    for i in members:
      if cur and sum(counts[j] for j in cur) + counts[i] > size:
        chunks.append(cur)
        cur = []
      cur.append(i)
    chunks.append(cur)
  return sorted(chunks, key=lambda c: c[0])


def per_call(m: int, n: int, size: int, ns_kwargs: dict) -> int:
  """Matrices per batched call in a stack of ``size`` ``m x n`` matrices (see the module docstring)."""
  if jax.default_backend() == "cpu":
    return 1
  steps = ns_kwargs.get("steps")
  kw = dict(steps=None if isinstance(steps, jax.core.Tracer) else steps, coeffs=ns_kwargs.get("coeffs", "muon"),
            method=ns_kwargs.get("method", "standard"), restarts=ns_kwargs.get("restarts", ()),
            precision=ns_kwargs.get("precision"))
  return max(1, min(size, int(CALL_FLOPS // max(1, ns_flops((m, n), **kw)))))


def orthogonalize_leaves(gs: list, states: list, specs: list, step: Callable, finish: Callable, *,
                         batch: int | None, **ns_kwargs: Any) -> tuple[list, list]:
  """``finish(i, NewtonSchulz(d_i))`` for every leaf ``g_i``, ``(d_i, new_i) = step(g_i, *states[i])``.

  ``states[i]`` is a tuple of leaf ``i``'s arrays read by ``step`` (the momentum and its
  scale), each of the leaf's rank (size 1 on the matrix axes for a per-matrix scalar);
  ``step`` takes them as ``(count, rows, cols)`` matrices (``to_matrices``), ``(count, 1,
  1)`` for a per-matrix scalar, and returns the direction and a tuple of new arrays, each
  of one of those two shapes (or ``()``). ``step`` runs inside a stack's loop, once per
  loop, not once per leaf: what it computes per matrix (the momentum's scale) compiles
  once per stack.
  ``specs[i]`` is leaf ``i``'s ``(batch, fan_in, fan_out)`` axes; ``batch`` is ``ns_batch``
  (``None``: the default grouping of the module docstring). The calls (or stacks) run one
  after another, each waiting for the previous one's results. Returns the finished leaves
  and, per leaf, ``step``'s new arrays with the leaf's rank (the leaf's shape, or size 1 on
  its matrix axes).
  """
  # ns_batch > 1 groups tall matrices with the wide ones of their shape (transposed); the
  # default keeps each as stored (``newton_schulz`` takes a tall one as it is, with no copy)
  wide = batch is not None and batch > 1
  keys, counts, tall = [], [], []
  for g, st, (b, fi, fo) in zip(gs, states, specs):
    r = math.prod(g.shape[a] for a in fi)
    c = math.prod(g.shape[a] for a in fo)
    kinds = tuple((x.dtype, tuple(x.shape[a] for a in fi + fo)) for x in st)
    keys.append(((min(r, c), max(r, c)) if wide else (r, c)) + (jnp.result_type(g), kinds))
    counts.append(math.prod(g.shape[a] for a in b))
    tall.append(r > c)
  # The default never slices a stack: a leaf of several matrices is one unit (a batched call
  # over the whole stack), grouped only with leaves of its own stack shape.
  whole = [batch is None and len(specs[i][0]) > 0 and counts[i] > 1 for i in range(len(gs))]
  units = [1 if w else c for w, c in zip(whole, counts)]
  keys = [k + ((counts[i],) if whole[i] else ()) for i, k in enumerate(keys)]

  per_matrix = [tuple(1 if a in fi + fo else n for a, n in enumerate(g.shape)) for g, (_, fi, fo) in zip(gs, specs)]

  def ns(x):
    return newton_schulz(x, **ns_kwargs)

  def mats(i, x):
    return to_matrices(x, *specs[i], transpose=wide and tall[i])

  def leaf(i, w, shape):
    return from_matrices(w, shape, *specs[i], transpose=wide and tall[i])

  result, new_states = [None] * len(gs), [None] * len(gs)
  done: list = []  # the previous call's results: the next call waits for them
  for chunk in plan_calls(keys, units, batch):
    raw = [(gs[i], states[i]) for i in chunk]
    looped = batch is None and len(chunk) > 1
    if done and not looped:  # wait for the previous call (see the docstring)
      raw = after(raw, done)
    if not looped:
      stepped = [step(mats(i, g), *(mats(i, x) for x in st)) for i, (g, st) in zip(chunk, raw)]
      x = stepped[0][0] if len(chunk) == 1 else jnp.concatenate([d for d, _ in stepped], axis=0)
      k = batch if batch is not None else per_call(x.shape[1], x.shape[2], x.shape[0], ns_kwargs)
      out = ns(x) if x.shape[0] <= k or whole[chunk[0]] else jax.lax.map(ns, x, batch_size=k)
      news = [new for _, new in stepped]
    else:
      # the matrices are read in place, each in its own branch; per-matrix scalars (the
      # momentum's scales) are gathered into one small array per loop
      small = [a.shape[1:] == (1, 1) for a in jax.eval_shape(lambda: [mats(chunk[0], x) for x in raw[0][1]])]
      sources = [lambda i=i, g=g, st=st: (mats(i, g),) + tuple(mats(i, x) for x, t in zip(st, small) if not t)
                 for i, (g, st) in zip(chunk, raw)]
      gathered = [[mats(i, st[a]) for i, (_, st) in zip(chunk, raw)] for a, t in enumerate(small) if t]
      out, stacked = _loop(sources, gathered, small, ns, step, ns_kwargs, done, whole=whole[chunk[0]])
      if whole[chunk[0]]:  # leaf j is iteration j: indexed, its stack axis never merged with the loop's
        offsets = list(range(len(chunk)))  # (a sharded stack's results stay sharded)
      else:
        out, stacked = jax.tree.map(lambda y: lax.reshape(y, (y.shape[0] * y.shape[1],) + y.shape[2:]),
                                    (out, stacked))
        offsets = [sum(counts[i] for i in chunk[:j]) for j in range(len(chunk))]
      if jax.default_backend() == "cpu":  # see _opaque
        offsets = _opaque(out, offsets)
    start = 0
    for j, i in enumerate(chunk):
      c = counts[i]
      if len(chunk) == 1:
        cut = lambda y: y  # noqa: E731
      elif looped and whole[i]:
        cut = lambda y: lax.dynamic_index_in_dim(y, offsets[j], keepdims=False,  # noqa: E731
                                                 allow_negative_indices=False)
      elif looped:
        cut = lambda y: lax.dynamic_slice_in_dim(y, offsets[j], c, allow_negative_indices=False)  # noqa: E731
      else:
        cut = lambda y: lax.slice_in_dim(y, start, start + c)  # noqa: E731
      result[i] = finish(i, leaf(i, cut(out), gs[i].shape))
      new = news[j] if not looped else tuple(cut(y) for y in stacked)
      new_states[i] = tuple(leaf(i, y, gs[i].shape if y.shape[1:] != (1, 1) else per_matrix[i]) for y in new)
      start += c
    done = [out]
  return result, new_states


def _loop(sources: list[Callable], gathered: list[list], small: list[bool], ns: Callable, step: Callable,
          ns_kwargs: dict, done: list, *, whole: bool) -> tuple[jax.Array, tuple]:
  """``ns`` of the directions of several leaves, by one loop with one body, and ``step``'s new arrays.

  ``sources`` give each leaf's gradient and full-size state as matrices: one matrix each
  (``(1, rows, cols)``), or, with ``whole``, one stack each, all of one shape. ``gathered``
  holds, per state marked ``small``, every leaf's per-matrix scalars (``(count, 1, 1)``).
  Iteration ``j`` picks its leaves' matrices with ``lax.switch`` over branches that each
  read only their own leaves: no stacked copy of the inputs is made. The small states are
  concatenated (a few numbers per matrix) and sliced by ``j``. ``step`` and ``ns`` run in the
  loop's body, so each is compiled once per loop, not once per leaf. Returns the loop's
  results, iteration after iteration (``(iterations, k, rows, cols)``, ``k`` the matrices
  of an iteration), and ``step``'s new arrays the same way. The loop waits for ``done`` (the
  previous call's results) through its result buffers (see the module docstring): the inputs
  are read inside the loop only, so one tie per loop does what ``after`` does per leaf
  elsewhere. With ``whole`` each iteration takes
  one whole leaf, never a matrix sliced out of a stack, so that a stack's sharding stays.
  """
  first = jax.eval_shape(sources[0])[0]
  k = first.shape[0] if whole else per_call(first.shape[1], first.shape[2], len(sources), ns_kwargs)
  per = 1 if whole else k  # leaves per iteration
  steps = -(-len(sources) // per)
  pad = steps * per - len(sources)  # the last iteration's padding: copies of its first leaf, dropped after
  gathered = [lax.concatenate(xs + [xs[(steps - 1) * per]] * pad, 0) for xs in gathered]

  def branch(j):
    picks = sources[j * per:(j + 1) * per]

    def pick():
      xs = [f() for f in picks]
      xs += [xs[0]] * (per - len(xs))
      return xs[0] if per == 1 else tuple(lax.concatenate(col, 0) for col in zip(*xs))

    return pick

  branches = [branch(j) for j in range(steps)]

  def stepped(picked, scalars):  # step on one iteration's leaves (``picked``) and scalars
    picked, scalars = iter(picked), iter(scalars)
    g = next(picked)
    return step(g, *(next(scalars) if t else next(picked) for t in small))

  def body(j, bufs):
    d, new = stepped(lax.switch(j, branches),
                     [lax.dynamic_slice_in_dim(y, j * k, k, allow_negative_indices=False) for y in gathered])
    return jax.tree.map(lambda b, y: lax.dynamic_update_index_in_dim(b, y, j, 0), bufs, (ns(d), tuple(new)))

  # The results' buffers (``ns`` keeps its input's shape and dtype), made after the previous
  # call's results: XLA then allocates them when this loop runs. A scan's own buffers would
  # let it allocate every loop's at the start, a copy of all the stacked matrices' results.
  shaped = lambda xs: [jax.ShapeDtypeStruct((k,) + x.shape[1:], x.dtype) for x in xs]  # noqa: E731
  d, new = jax.eval_shape(stepped, shaped(jax.eval_shape(sources[0])), shaped(gathered))
  bufs = jax.tree.map(lambda a: jnp.zeros((steps,) + a.shape, a.dtype), (d, tuple(new)))
  return lax.fori_loop(0, steps, body, after(bufs, done) if done else bufs)


def _opaque(x: jax.Array, values: list[int]) -> tuple[jax.Array, ...]:
  """``values`` as int32 scalars that XLA cannot fold into constants: a stack's slice offsets.

  XLA:CPU compiles one kernel per distinct fused computation and reuses it for identical ones.
  A leaf's slice of its stack's results, fused into the leaf's finishing, holds its offset:
  a constant makes every leaf's kernel its own (one per offset and shape, compiled for tens
  of milliseconds each). Passed as operands, the offsets leave one kernel per shape. They
  come out of a ``lax.cond`` whose two branches both return them, on a predicate that is
  always true (a bit of ``x``'s first element OR 1) but that XLA does not evaluate. Used on
  the CPU only, where a conditional runs on the host anyway: on a GPU XLA reads a
  conditional's predicate back to the host, a wait in every step, so there the offsets stay
  constants (the same slices).
  """
  bits = lax.bitcast_convert_type(x[(0,) * x.ndim], jnp.dtype(f"int{8 * x.dtype.itemsize}"))
  known = lax.ne(lax.bitwise_or(bits, jnp.ones((), bits.dtype)), jnp.zeros((), bits.dtype))
  consts = lambda: tuple(jnp.int32(v) for v in values)  # noqa: E731
  return lax.cond(known, consts, consts)
