"""Grouping matrices into Newton–Schulz calls (``scale_by_muon``'s default, ``ns_batch=None``):
which matrices share a loop, and that the grouped update equals the ungrouped one
(``ns_batch=1``, one matrix per call) as two separately compiled programs do (``_exactness``), on a
tree of mixed shapes, tall and wide leaves, a scanned stack, Gram-shaped leaves, per-head
blocks and sharded leaves.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax._orthogonalize import batching, ns_flops
from _exactness import assert_same_math

# The same products run inside a loop, but XLA compiles the elementwise direction (G + beta M,
# and the momentum when no output keeps it) into other fusions in a loop's body than in a
# single call, where XLA:CPU may contract a multiply-add into an FMA or not, and Newton–Schulz
# amplifies that rounding (35 ulps were measured with the optimizer built and run inside one
# outer jit): the suite's rule for separately compiled programs, ``assert_same_math``.
F32 = jnp.dtype(jnp.float32)


def _plan(counts, key=(4, 8, F32), batch=None):
  return batching.plan_calls([key] * len(counts), counts, batch)


def test_few_matrices_of_a_shape_are_not_stacked():
  assert _plan([1] * (batching.MIN_STACK - 1)) == [[i] for i in range(batching.MIN_STACK - 1)]


def test_stacks_are_at_most_half_of_a_shape_at_least_eight_and_at_most_96():
  assert [len(c) for c in _plan([1] * 12)] == [8, 4]  # max(8, 12 / 2)
  assert [len(c) for c in _plan([1] * 48)] == [24] * 2  # 48 / 2: the number of loops stops growing
  assert [len(c) for c in _plan([1] * 101)] == [51, 50]
  # thousands of separate expert leaves: loops of MAX_STACK, not two stacks of thousands of matrices
  assert [len(c) for c in _plan([1] * 300)] == [96, 96, 96, 12]


def test_a_leaf_is_never_cut_and_stacks_follow_the_leaves():
  chunks = _plan([1, 1, 20, 1, 1, 1, 1, 1, 1, 1])  # 29 matrices: stacks of 8; the 20-stack alone
  assert chunks == [[0, 1], [2], [3, 4, 5, 6, 7, 8, 9]]
  a, b = (4, 8, F32), (8, 8, F32)
  keys = [a, b] * 8
  chunks = batching.plan_calls(keys, [1] * 16, None)
  assert chunks == [list(range(0, 16, 2)), list(range(1, 16, 2))]  # by shape, ordered by first leaf
  assert batching.plan_calls([a, a, b, a], [1] * 4, 2) == [[0, 1], [2], [3]]  # ns_batch: calls of at most 2


def test_per_call_is_one_on_cpu_and_a_flop_budget_on_accelerators(monkeypatch):
  kw = dict(steps=None, coeffs="polar_express_4", method="auto")
  assert batching.per_call(256, 256, 48, F32, kw) == 1
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  flops = ns_flops((256, 1024), **kw)
  assert batching.per_call(256, 1024, 10**6, F32, kw) == int(batching.CALL_FLOPS // flops)
  assert batching.per_call(256, 1024, 3, F32, kw) == 3  # never more than the stack
  assert batching.per_call(8192, 8192, 16, F32, kw) == 1
  # The FLOPs counted are those of the iteration's dtype: on a TPU a bfloat16 Gram iteration
  # takes its factor Q in two parts (ns_flops), so fewer matrices make a call.
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  gram = dict(kw, method="gram")
  counts = {}
  for dtype, given in ((F32, None), (jnp.bfloat16, None), (F32, jnp.bfloat16)):
    flops = ns_flops((256, 1024), **gram, compute_dtype=given or dtype)
    counts[dtype, given] = batching.per_call(256, 1024, 10**6, dtype, dict(gram, compute_dtype=given))
    assert counts[dtype, given] == int(batching.CALL_FLOPS // flops)
  assert counts[F32, None] > counts[jnp.bfloat16, None] == counts[F32, jnp.bfloat16]


def _tree(key=0):
  """Mixed shapes: 12 leaves 16 x 24 / 24 x 16 (tall ones join the wide ones' loops), 9 Gram-shaped
  8 x 40, a scanned stack of 10, and two 20 x 20 (too few to stack)."""
  shapes = {**{f"a{i}": (16, 24) if i % 3 else (24, 16) for i in range(12)},
            **{f"g{i}": (8, 40) for i in range(9)}, "scan": (10, 16, 24), "s0": (20, 20), "s1": (20, 20)}
  keys = iter(jax.random.split(jax.random.key(key), len(shapes)))
  return {k: jax.random.normal(next(keys), s) for k, s in shapes.items()}


AXES = {"scan": mc.MatrixAxes((-2,), (-1,))}


@functools.cache
def _optimizer(**kw):
  """The optimizer and its jitted update, built once per options (so compiled once per input)."""
  opt = mc.scale_by_muon(matrix_axes=lambda p: {k: AXES.get(k) for k in p}, **kw)
  return opt, jax.jit(opt.update)


def _update(grads, **kw):
  opt, step = _optimizer(**kw)
  state = opt.init(grads)
  _, state = step(grads, state)  # a second step, so the momentum enters
  return step(jax.tree.map(jnp.cos, grads), state)[0]


def test_grouped_update_equals_the_ungrouped_one():
  g = _tree()
  grouped, single = _update(g), _update(g, ns_batch=1)
  assert_same_math(grouped, single)


def test_grouped_update_inside_an_outer_jit():
  """Built and run inside one ``jax.jit`` (the momentum fused into the direction,
  no state returned), without Nesterov; nine same-shaped leaves make one loop."""
  g = {f"w{i}": jax.random.normal(jax.random.key(i), (16, 24)) for i in range(9)}

  def run(grads, **kw):
    opt = mc.scale_by_muon(nesterov=False, **kw)
    _, state = opt.update(grads, opt.init(grads))
    return opt.update(jax.tree.map(jnp.cos, grads), state)[0]

  grouped = jax.jit(run)(g)
  single = jax.jit(functools.partial(run, ns_batch=1))(g)
  assert_same_math(grouped, single)


def test_sharded_leaves_give_the_single_device_update():
  g = _tree(2)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "model"))

  def place(x):
    spec = (None,) * (x.ndim - 2) + (("fsdp", None) if x.shape[-2] % 4 == 0 else (None, "model"))
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  sharded = _update(jax.tree.map(place, g))
  assert_same_math(sharded, _update(g))  # sharded products sum in another order (measured: 57 ulps)
  assert sharded["a1"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)


def test_per_head_blocks_under_the_default():
  """Nine unscanned attention layers, per head: the heads' blocks and the stacked output
  projections (nine of a shape: one loop) equal the one-matrix-per-call update."""
  layout = mc.GQALayout(num_heads=2, num_kv_heads=1, head_dim=8)
  keys = iter(jax.random.split(jax.random.key(3), 36))
  g = {f"layer_{i}": {"attn": {n: {"kernel": jax.random.normal(next(keys), s)} for n, s in
                               (("wq", (12, 16)), ("wk", (12, 8)), ("value", (12, 8)), ("out", (16, 12)))}}
       for i in range(9)}
  kw = dict(layout=layout, muon_blocks="head")
  assert_same_math(_update(g, **kw), _update(g, ns_batch=1, **kw))


def test_temporaries():
  """The default's temporaries: each loop's stacks (copies of its matrices and their
  momentum, which the results overwrite), at most two consecutive loops' at a time (a loop's
  stacks are made when it runs), not every loop's, not the Newton–Schulz temporaries of more
  than one call; ``ns_batch=1`` keeps one matrix's."""
  def temp(g, **kw):
    tx = mc.scale_by_muon(**kw)
    return jax.jit(tx.update).lower(g, tx.init(g)).compile().memory_analysis().temp_size_in_bytes

  matrix = 128 * 512 * 4
  shapes = [(128, 512), (512, 128), (256, 256), (64, 1024)]  # one loop of 8 matrices each
  g = {f"w{i}": jnp.ones(shapes[i % 4]) for i in range(32)}
  assert temp(g) <= (2 * 16 + 3) * matrix  # every loop's results at once: 64 matrices
  g = {f"w{i}": jnp.ones((128, 512)) if i % 2 else jnp.ones((512, 128)) for i in range(16)}
  assert temp(g, ns_batch=1) <= 3 * matrix


def test_a_loop_writes_its_results_into_its_stacks_in_place():
  """An iteration writes its results over its own entries of the loop's stacks, and no stack
  is copied, in an iteration or before the loop: with each entry read in the iteration that
  overwrites it (by the momentum, its scale and the direction, three readers XLA does not
  order before the write), XLA copied every stack in every iteration, which made a 24-layer
  update 2.4 times slower; a stack of 1-matrix entries reshaped to ``(8, 1, rows, cols)`` was
  copied to another layout before the loop (74 MiB more temporaries on GPT-2 small)."""
  for g, kw, stack in [({f"w{i}": jnp.ones((64, 96)) for i in range(8)}, {}, "8,64,96"),  # 8 matrices
                       ({f"w{i}": jnp.ones((2, 64, 96)) for i in range(8)},  # 8 whole stacks of 2
                        dict(matrix_axes=mc.MatrixAxes((-2,), (-1,))), "8,2,64,96")]:
    tx = mc.scale_by_muon(**kw)
    hlo = jax.jit(tx.update).lower(g, tx.init(g)).compile().as_text()
    computations = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^%([\w.\-]+) .*?^}", hlo)}
    bodies = [computations[b] for b in re.findall(r" while\(.*?body=%([\w.\-]+)", hlo)]
    assert any(f"f32[{stack}]" in body for body in bodies)  # one loop holds the stacks
    copies = [line for line in hlo.splitlines() if re.search(rf"= f32\[{stack}\][^=]* (copy\(|fusion\(.*calls=%wrapped_copy)", line)]
    assert not copies, copies
