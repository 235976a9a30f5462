"""Which matrices go into which Newton–Schulz call: ``orthogonalize_leaves`` and its grouping rule.

A program with one Newton–Schulz call per matrix compiles in time proportional to the number
of matrices: an unscanned 48-layer model has hundreds, and its update compiles ten times
slower than AdamW's. Under the default (``ns_batch=None``) same-shaped matrices (same
``rows x cols`` and dtype) are stacked and orthogonalized by one
loop (``lax.map``) over the stack, so the program holds one Newton–Schulz body per stack, not
per matrix:

* **count:** a shape with fewer than ``MIN_STACK`` matrices is not stacked (the few calls it
  saves do not pay for the loop); otherwise its matrices are cut, in leaf order, into at most
  ``STACKS`` stacks of ``max(MIN_STACK, ceil(count / STACKS))`` matrices (a leaf is never
  cut: a stacked leaf with more matrices is a stack of its own). The number of loops
  therefore does not grow with depth (measured: eight per shape compile faster than fewer,
  longer ones, whose ``lax.switch`` has more branches).
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
  Newton–Schulz's ``O(steps min(m, n))`` operations per element.

The loops run one after another, each waiting for the previous one's results
(``_util.sequence.after``). Their stacked results are the default's extra temporary memory: at
most one copy of the stacked matrices' updates (XLA keeps them until the leaves are
finished). Grouping changes the results by rounding only: the same products run inside a loop,
but XLA may fuse the elementwise direction differently in a loop's branch than in a single call,
and XLA:CPU may contract a multiply-add into an FMA in one and not the other, which Newton–Schulz
amplifies (measured on XLA:CPU: 0 ulps in a jitted update; a probe found 35 ulps of a leaf's
largest entry with the optimizer built inside an outer jit; ``tests/test_ns_batching.py`` bounds it).

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

from .newton_schulz import newton_schulz, ns_flops
from .._util import after, from_matrices, to_matrices

STACKS = 8  # a shape's matrices go into at most this many stacks
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
    size, cur = max(MIN_STACK, -(-total // STACKS)), []
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


def orthogonalize_leaves(gs: list, ms: list, specs: list, direction: Callable, finish: Callable, *,
                         batch: int | None, **ns_kwargs: Any) -> list:
  """``finish(i, NewtonSchulz(direction(i, g_i, m_i)))`` for every leaf pair ``(g_i, m_i)``.

  ``specs[i]`` is leaf ``i``'s ``(batch, fan_in, fan_out)`` axes; ``batch`` is ``ns_batch``
  (``None``: the default grouping of the module docstring). The calls (or stacks) run one
  after another, each waiting for the previous one's finished leaves.
  """
  # ns_batch > 1 groups tall matrices with the wide ones of their shape (transposed); the
  # default keeps each as stored (``newton_schulz`` takes a tall one as it is, with no copy)
  wide = batch is not None and batch > 1
  keys, counts, tall = [], [], []
  for g, (b, fi, fo) in zip(gs, specs):
    r = math.prod(g.shape[a] for a in fi)
    c = math.prod(g.shape[a] for a in fo)
    keys.append((min(r, c), max(r, c), jnp.result_type(g)) if wide else (r, c, jnp.result_type(g)))
    counts.append(math.prod(g.shape[a] for a in b))
    tall.append(r > c)
  # The default never slices a stack: a leaf of several matrices is one unit (a batched call
  # over the whole stack), grouped only with leaves of its own stack shape.
  whole = [batch is None and len(specs[i][0]) > 0 and counts[i] > 1 for i in range(len(gs))]
  units = [1 if w else c for w, c in zip(whole, counts)]
  keys = [k + ((counts[i],) if whole[i] else ()) for i, k in enumerate(keys)]

  def ns(x):
    return newton_schulz(x, **ns_kwargs)

  result = [None] * len(gs)
  prev: list = []
  for chunk in plan_calls(keys, units, batch):
    raw = [(gs[i], ms[i]) for i in chunk]
    done = [result[i] for i in prev]
    looped = batch is None and len(chunk) > 1
    if done and not looped:  # wait for the previous call (see the docstring)
      raw = after(raw, done)
    sources = [lambda i=i, g=g, m=m: to_matrices(direction(i, g, m), *specs[i], transpose=wide and tall[i])
               for i, (g, m) in zip(chunk, raw)]
    if not looped:
      x = sources[0]() if len(chunk) == 1 else jnp.concatenate([f() for f in sources], axis=0)
      k = batch if batch is not None else per_call(x.shape[1], x.shape[2], x.shape[0], ns_kwargs)
      out = ns(x) if x.shape[0] <= k or whole[chunk[0]] else jax.lax.map(ns, x, batch_size=k)
    else:
      out = _loop(sources, [counts[i] for i in chunk], ns, ns_kwargs, done, whole=whole[chunk[0]])
    start = 0
    for i in chunk:
      result[i] = finish(i, from_matrices(out[start:start + counts[i]], gs[i].shape, *specs[i],
                                          transpose=wide and tall[i]))
      start += counts[i]
    prev = chunk
  return result


def _loop(sources: list[Callable], counts: list[int], ns: Callable, ns_kwargs: dict, done: list, *,
          whole: bool = False) -> jax.Array:
  """``ns`` of the matrices of several leaves, ``(total, m, n)``, by one loop with one body.

  Iteration ``j`` picks its matrices with ``lax.switch`` over branches that each compute
  their leaves' directions (``sources``, sliced before the arithmetic, so a branch reads
  only its own matrices): no stacked copy of the inputs is made. The results are the scan's
  stacked output. The loop waits for ``done`` (the previous call's results) through its
  indices: the inputs are read inside the loop only, so one tie per loop does what
  ``after`` does per leaf elsewhere. ``whole``: each iteration takes one whole leaf (stacks of
  one shape), never a matrix sliced out of a stack, so that a stack's sharding stays.
  """
  where = [(f, slice(None)) for f in sources] if whole else [(f, k) for f, c in zip(sources, counts) for k in range(c)]
  first = jax.eval_shape(sources[0])
  shape, dtype = (first.shape if whole else first.shape[1:]), first.dtype
  k = 1 if whole else per_call(shape[0], shape[1], len(where), ns_kwargs)
  steps = -(-len(where) // k)

  def branch(j):
    picks = where[j * k:(j + 1) * k]

    def pick():
      if whole:
        return picks[0][0]()
      xs = [f()[c] for f, c in picks]
      xs += [jnp.zeros(shape, dtype)] * (k - len(xs))  # the last iteration's padding (Newton–Schulz of 0 is 0)
      return jnp.stack(xs)

    return pick

  branches = [branch(j) for j in range(steps)]

  def body(carry, j):
    return carry, ns(jax.lax.switch(j, branches))

  index = jnp.arange(steps)
  _, out = jax.lax.scan(body, None, after(index, done) if done else index)
  if whole:
    return out.reshape((-1,) + shape[1:])
  return out.reshape((steps * k,) + shape)[:len(where)]
