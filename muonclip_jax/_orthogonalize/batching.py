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
  adds a Newton–Schulz body to the program (a tenth of a second or more of XLA:CPU's compile),
  and a loop's stacks are the update's temporary memory (see below): fewer, longer loops
  compile faster and hold more. Two per shape is the trade measured in
  ``benchmarks/RESULTS.md``; the cap keeps thousands of separate expert leaves from making
  one stack of thousands of matrices.
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
* **matrix size** enters only there. A loop's inputs (each matrix and its momentum, its
  scale) are copied into stacks, one entry per iteration, and each iteration writes its
  results over its own entries; after the loop the stacked results are sliced into the
  leaves: two passes over each matrix against Newton–Schulz's ``O(steps min(m, n))``
  operations per element. The slices' offsets reach XLA as operands, not constants
  (``_opaque``), so that every leaf of a shape shares one compiled kernel.

The loops run one after another, each waiting for the previous one's results
(``_util.sequence.after``). A loop's stacks (its inputs, overwritten by its results) are the
default's extra temporary memory. They are made after the previous loop's results, so XLA
allocates them when the loop runs: XLA:CPU's scheduler then kept at most two consecutive
loops' stacks (it slices a loop's results into the leaves while the next one runs; measured,
not forced). A loop of whole stacks returns them indexed by iteration, never merged with
the loop's axis, so that a sharded stack's results stay sharded. Grouping changes the
results by rounding only: the same products run inside a loop, but XLA may fuse
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


def per_call(m: int, n: int, size: int, dtype: Any, ns_kwargs: dict) -> int:
  """Matrices per batched call in a stack of ``size`` ``m x n`` matrices of ``dtype`` (the
  iteration's compute dtype unless ``ns_kwargs`` names one; see the module docstring)."""
  if jax.default_backend() == "cpu":
    return 1
  steps = ns_kwargs.get("steps")
  kw = dict(steps=None if isinstance(steps, jax.core.Tracer) else steps, coeffs=ns_kwargs.get("coeffs", "muon"),
            method=ns_kwargs.get("method", "standard"), restarts=ns_kwargs.get("restarts", ()),
            precision=ns_kwargs.get("precision"), compute_dtype=ns_kwargs.get("compute_dtype") or dtype)
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
      k = batch if batch is not None else per_call(x.shape[1], x.shape[2], x.shape[0], x.dtype, ns_kwargs)
      out = ns(x) if x.shape[0] <= k or whole[chunk[0]] else jax.lax.map(ns, x, batch_size=k)
      news = [new for _, new in stepped]
    else:
      out, stacked = _loop([(mats(i, g),) + tuple(mats(i, x) for x in st) for i, (g, st) in zip(chunk, raw)],
                           ns, step, ns_kwargs, done, whole=whole[chunk[0]])
      if whole[chunk[0]]:  # leaf j is iteration j: indexed, its stack axis never merged with the loop's
        offsets = list(range(len(chunk)))  # (a sharded stack's results stay sharded)
      else:
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


def _loop(inputs: list[tuple], ns: Callable, step: Callable, ns_kwargs: dict, done: list, *,
          whole: bool) -> tuple[jax.Array, tuple]:
  """``ns`` of the directions of several leaves, by one loop with one body, and ``step``'s new arrays.

  ``inputs`` holds each leaf's ``step`` arguments as matrices (its gradient and states: one
  matrix each, ``(1, rows, cols)`` or ``(1, 1, 1)`` for a per-matrix scalar; with ``whole``,
  one stack each, all of one shape). Each argument is stacked: the leaves' matrices
  concatenated, an entry of ``k`` of them per iteration, or with ``whole`` the leaves' stacks
  along a new leading axis, one per iteration. A stack is made after ``done`` (the previous
  call's results), so XLA builds a loop's stacks when the loop runs. Iteration
  ``j`` runs ``step`` and ``ns`` on entry ``j`` and writes the results into entry ``j`` of
  the stacks of the same shape and dtype (Newton–Schulz's into the gradients', each new state
  into its state's; a result without one gets a buffer of its own): the loop's results take
  no memory beyond its inputs' stacks. Entry ``j + 1`` is read at the end of iteration ``j``,
  from the stacks as written (where it is unchanged), and carried to the next iteration: no
  computation reads a stack that a later one writes, so XLA updates the stacks in place
  (reading entry ``j`` inside the iteration, where the momentum, its scale and the direction
  each read it, made XLA copy every stack each iteration). ``step`` and ``ns`` are compiled
  once per loop, not once per leaf. Returns the results, iteration after iteration
  (``(iterations * k, rows, cols)``; with ``whole``, ``(iterations, *stack)``), and ``step``'s
  new arrays the same way. With ``whole`` an iteration takes one whole leaf, never a matrix
  sliced out of a stack, so that a stack's sharding stays.
  """
  first = inputs[0][0]
  k = first.shape[0] if whole else per_call(first.shape[1], first.shape[2], len(inputs), first.dtype, ns_kwargs)
  per = 1 if whole else k  # leaves per iteration
  steps = -(-len(inputs) // per)
  pad = steps * per - len(inputs)  # the last iteration's padding: copies of the last leaf, dropped after

  def stack(col):
    # the first entry waits for ``done``, and the stack with it (one matrix's ``after``:
    # XLA keeps a concatenation's operands apart, so ``after`` on each would cost one
    # kernel per leaf)
    col = [after(col[0], done) if done else col[0], *col[1:]] + [col[-1]] * pad
    if whole:
      col = [lax.broadcast_in_dim(x, (1,) + x.shape, tuple(range(1, x.ndim + 1))) for x in col]
    return lax.concatenate(col, 0)

  stacks = [stack(col) for col in zip(*inputs)]
  n_in = len(stacks)

  def stepped(xs):
    d, new = step(*xs)
    return [ns(d), *new]

  # an entry: one whole stack (indexed), or ``per`` matrices (sliced; a stack of them is
  # never reshaped to (steps, per, ...), which made XLA:CPU copy it to another layout)
  if whole:
    entry = lambda y: jax.ShapeDtypeStruct(y.shape[1:], y.dtype)  # noqa: E731
    get = lambda y, j: lax.dynamic_index_in_dim(y, j, keepdims=False)  # noqa: E731
    put = lambda y, x, j: lax.dynamic_update_index_in_dim(y, x, j, 0)  # noqa: E731
  else:
    entry = lambda y: jax.ShapeDtypeStruct((per,) + y.shape[1:], y.dtype)  # noqa: E731
    get = lambda y, j: lax.dynamic_slice_in_dim(y, j * per, per)  # noqa: E731
    put = lambda y, x, j: lax.dynamic_update_slice_in_dim(y, x, j * per, 0)  # noqa: E731
  slots = []  # the stack each result is written into (``ns`` keeps its input's shape and
  # dtype, so ``step`` alone is traced for the shapes: Newton–Schulz is traced once, in the body)
  d, new = jax.eval_shape(step, *[entry(y) for y in stacks])
  for r in [d, *new]:
    free = [i for i in range(n_in) if i not in slots and entry(stacks[i]) == r]
    if not free:
      buf = jnp.zeros((steps,) + r.shape if whole else (steps * per,) + r.shape[1:], r.dtype)
      stacks.append(after(buf, done) if done else buf)
    slots.append(free[0] if free else len(stacks) - 1)

  def read(stacks, j):
    return [get(y, j) for y in stacks[:n_in]]

  def body(j, carry):
    stacks, xs = carry
    for slot, y in zip(slots, stepped(xs)):
      stacks[slot] = put(stacks[slot], y, j)
    return stacks, read(stacks, jnp.minimum(j + 1, steps - 1))

  stacks, _ = lax.fori_loop(0, steps, body, (stacks, read(stacks, 0)))
  return stacks[slots[0]], tuple(stacks[s] for s in slots[1:])


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
