"""Per-head Muon against whole-matrix Muon: update time, analytic FLOPs, per-device FLOPs.

  PYTHONPATH=. python benchmarks/bench_per_head.py            # the full run
  PYTHONPATH=. python benchmarks/bench_per_head.py --quick    # 1 layer, 3 repeats: a smoke run (about 3 minutes)

Two models' hidden matrices, float32, each attention module declared by its layout:

* GPT-2-small: 12 layers of separate 2-D ``wq``, ``wk``, ``wv``, ``wo`` (768 x 768, 12 heads
  of 64) and the MLP (768 x 3072, 3072 x 768);
* DeepSeek-style MLA (``model_shapes.MLA_1024``: width 1024, 8 heads, q_lora 384, kv_lora
  256, head dims 64 + 32 rope, values 64, SwiGLU 2816), 4 layers.

For ``muon_blocks`` in ``matrix``, ``part``, ``head``, ``head+out`` (``scale_by_muon``'s
defaults otherwise: ``polar_express_4``, ``ns_method="auto"``, the default grouping):

1. **Analytic FLOPs** of the Newton–Schulz matmuls (``newton_schulz.ns_flops`` of every
   block), the attention's and the whole update's.
2. **Time** of one jitted update, every mode compiled first, then timed alternating in one
   process (medians; the spread is min-max).
3. **Per-device FLOPs on 8 fake CPU devices** (XLA's cost analysis of the compiled update,
   Newton–Schulz loops unrolled and one matrix per call, ``ns_batch=1``: cost analysis counts
   a rolled loop's body once), on a
   ``2 x 4`` ``data x model`` mesh with the heads on ``model`` (the library's default rules),
   plain SPMD and with ``shard_orthogonalization`` (the distributed Newton–Schulz), over one
   device's compiled FLOPs of the same mode.

Timings on a shared machine mean little: run it on a quiet one (the figures in
``benchmarks/RESULTS.md`` say where they were taken).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("matrix", "part", "head", "head+out")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="1 layer, 3 repeats, one model for the device part")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--skip-devices", action="store_true", help="leave out the 8-device part")
  return p.parse_args(argv)


def models(quick: bool):
  """``{name: (params, logical specs, layout)}``."""
  import jax
  import jax.numpy as jnp

  import muonclip_jax as mc
  from model_shapes import MLA_1024, gqa_attention, mlp

  def build(layer, layers, seed):
    keys = iter(jax.random.split(jax.random.key(seed), len(layer) * layers))
    params = {f"l{i}": {n: {"kernel": jax.random.normal(next(keys), s, jnp.float32)} for n, (s, _) in layer.items()}
              for i in range(layers)}
    names = {f"l{i}": {n: {"kernel": jax.sharding.PartitionSpec(*a)} for n, (_, a) in layer.items()}
             for i in range(layers)}
    return params, names

  gpt2 = {**gqa_attention(768, 12, 12, 64), **mlp(768, 3072)}
  out = {"GPT-2-small": (*build(gpt2, 1 if quick else 12, 0), mc.GQALayout(12, 12, 64, value="wv", out="wo")),
         "DeepSeek-style MLA": (*build(MLA_1024, 1 if quick else 4, 1), mc.MLALayout(8, 64, 32, 64, out="wo"))}
  return out


def analytic_flops(params, layout, mode):
  """(attention FLOPs, all FLOPs) of the Newton–Schulz matmuls of one update."""
  import jax

  from muonclip_jax._muon import muon_blocks_lookup, piece_dims
  from muonclip_jax._orthogonalize import ns_flops
  from muonclip_jax._util import leaf_shape, path_str

  lookup = muon_blocks_lookup(None, layout, mode, params)
  attn = total = 0
  for p, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    path, shape = path_str(p), leaf_shape(x)
    blocks = lookup(path, shape)
    for piece, (batch, _, _, r, c) in zip(blocks.piece_shapes(shape), piece_dims(blocks, path, shape)):
      count = math.prod(piece[a] for a in batch)
      f = ns_flops((count, r, c), steps=None, coeffs="polar_express_4", method="auto")
      total += f
      if not any(k in path for k in ("w_gate", "w_up", "w_down", "fc", "proj")):
        attn += f
  return attn, total


def timing(params, layout, repeats):
  import jax
  import jax.numpy as jnp

  import muonclip_jax as mc

  grads = jax.tree.map(jnp.sin, params)
  runs = {}
  for mode in MODES:
    opt = mc.scale_by_muon(layout=layout, muon_blocks=mode)
    state = opt.init(params)
    compiled = jax.jit(opt.update).lower(grads, state).compile()
    jax.block_until_ready(compiled(grads, state))
    runs[mode] = functools.partial(compiled, grads, state)
  times = {m: [] for m in MODES}
  for _ in range(repeats):
    for mode, fn in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[mode].append(time.perf_counter() - t0)
  return {m: (statistics.median(t) * 1e3, min(t) * 1e3, max(t) * 1e3) for m, t in times.items()}


@contextlib.contextmanager
def unrolled_loops():
  """``jax.lax.fori_loop`` fully unrolled while tracing (cost analysis counts a rolled body once)."""
  import jax

  original = jax.lax.fori_loop
  jax.lax.fori_loop = functools.partial(original, unroll=True)
  try:
    yield
  finally:
    jax.lax.fori_loop = original


def device_flops(params, names, layout):
  """{mode: (single-device FLOPs, SPMD per-device / single, distributed per-device / single)}."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import muonclip_jax as mc
  from muonclip_jax import sharding

  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  grads = jax.tree.map(jnp.sin, params)
  sp, sg = jax.device_put(params, ps), jax.device_put(grads, ps)
  out = {}
  for mode in MODES:
    row = []
    with unrolled_loops():
      single = mc.scale_by_muon(layout=layout, muon_blocks=mode, ns_batch=1)  # no stacking loops (see above)
      ref = jax.jit(single.update).lower(grads, single.init(params)).compile().cost_analysis()["flops"]
      row.append(ref)
      for target in (None, ps):
        opt = mc.scale_by_muon(layout=layout, muon_blocks=mode, shard_orthogonalization=target, ns_batch=1)
        state = sharding.init_state(opt, sp, ps)
        compiled = jax.jit(opt.update, out_shardings=(ps, None)).lower(sg, state).compile()
        row.append(compiled.cost_analysis()["flops"] / ref)
    out[mode] = tuple(row)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax

  if not args.skip_devices:
    try:
      jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
      pass
  repeats = args.repeats or (3 if args.quick else 20)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} x {jax.device_count()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}; repeats {repeats}"
        + (" (--quick: 1 layer)" if args.quick else ""))
  built = models(args.quick)
  for name, (params, names, layout) in built.items():
    base_attn, base_all = analytic_flops(params, layout, "matrix")
    times = timing(params, layout, repeats)
    print(f"\n### {name}: {len(params)} layers\n")
    print("| muon_blocks | NS GFLOP, attention | vs matrix | NS GFLOP, all | vs matrix | update ms (median) | "
          "min-max | vs matrix |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
      attn, total = analytic_flops(params, layout, mode)
      med, lo, hi = times[mode]
      print(f"| {mode} | {attn / 1e9:.3f} | {attn / base_attn:.3f} | {total / 1e9:.3f} | {total / base_all:.3f} "
            f"| {med:.1f} | {lo:.1f}-{hi:.1f} | {med / times['matrix'][0]:.3f} |")
  if args.skip_devices or jax.device_count() < 8:
    print("\n(8-device part skipped)")
    return 0
  for name, (params, names, layout) in built.items():
    if args.quick and name != "GPT-2-small":
      continue
    rows = device_flops(params, names, layout)
    print(f"\n### {name}: per-device FLOPs on 2 x 4 (data x model), heads on model\n")
    print("| muon_blocks | one device, GFLOP (compiled) | SPMD, per device / one device | "
          "shard_orthogonalization, per device / one device |")
    print("|---|---|---|---|")
    for mode, (ref, spmd, dist) in rows.items():
      print(f"| {mode} | {ref / 1e9:.3f} | {spmd:.3f} | {dist:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
