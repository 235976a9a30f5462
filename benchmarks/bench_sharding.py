"""Per-device FLOPs and communication of one Muon update on a device mesh.

The hidden matrices of a GPT-2-small-like model (``--layers`` layers of four 768x768
attention matrices, 768x3072 and 3072x768; sharded by ``muonclip_jax.sharding``'s default
rules: ``embed`` over ``fsdp``, ``heads``/``mlp`` over ``model``) on meshes of 8 fake CPU
devices. For each optimizer and mesh the update is compiled (never run) and XLA's cost
analysis gives the FLOPs of one device's program; the HLO's collectives give the
communication. Contenders, all with Nesterov momentum 0.95 and no weight decay:

* ``optax.contrib.muon``: 5 quintic steps (Keller Jordan's coefficients), plain SPMD;
* ``muonclip_jax.muon`` with the same iteration (``ns_coeffs="muon", ns_steps=5,
  ns_method="standard"``), plain SPMD and with ``shard_orthogonalization`` (each matrix
  orthogonalized on one device, see ``muonclip_jax.sharding``);
* ``muonclip_jax.muon`` with its default iteration, sharded.

XLA's cost analysis counts the body of a rolled loop once, so the Newton–Schulz loops are
unrolled while compiling (``jax.lax.fori_loop`` gets ``unroll=True``) and the FLOPs are
those of the whole update. The analytic count is ``5 (4 m^2 n + 2 m^3)`` per ``m x n``
matrix (``m <= n``) for the quintic iteration (``newton_schulz.ns_flops`` for others);
elementwise work is not in it.

"comm MB/dev" estimates the bytes one device receives: ``(g-1)/g`` of an all-gather's or
all-to-all's result, ``2 (g-1)/g`` of an all-reduce's (ring), ``g-1`` times a
reduce-scatter's result, a collective-permute's result (``g``: the replica group size).

  python benchmarks/bench_sharding.py [--layers 4] [--dim 768]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import functools
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from optax import contrib  # noqa: E402

import muonclip_jax as mc  # noqa: E402
from muonclip_jax import _newton_schulz, sharding  # noqa: E402

KELLER = dict(ns_coeffs="muon", ns_steps=5, ns_method="standard")
MESHES = {
    "data 8 x model 1": ((8, 1), ("data", "model")),
    "data 2 x model 4": ((2, 4), ("data", "model")),
    "data 1 x model 8": ((1, 8), ("data", "model")),
    "fsdp 2 x model 4": ((2, 4), ("fsdp", "model")),
}
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1, "u8": 1,
          "pred": 1}
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def gpt2_hidden_matrices(layers: int, d: int) -> tuple[dict, dict]:
  """Abstract params and their logical axis names."""
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "fc": (d, 4 * d), "proj": (4 * d, d)}
  names = {"wq": ("embed", "heads"), "wk": ("embed", "heads"), "wv": ("embed", "heads"), "wo": ("heads", "embed"),
           "fc": ("embed", "mlp"), "proj": ("mlp", "embed")}
  params = {f"h{i}": {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()} for i in range(layers)}
  return params, {f"h{i}": {k: P(*names[k]) for k in shapes} for i in range(layers)}


@contextlib.contextmanager
def unrolled_loops():
  """``jax.lax.fori_loop`` fully unrolled while tracing (static trip counts only)."""
  original = jax.lax.fori_loop
  jax.lax.fori_loop = functools.partial(original, unroll=True)
  try:
    yield
  finally:
    jax.lax.fori_loop = original


def _group_size(line: str, devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  return devices


def communication(hlo: str, devices: int) -> tuple[float, dict[str, int]]:
  """(estimated bytes received per device, {collective: count}) of a compiled HLO text."""
  total, counts = 0.0, {}
  for line in hlo.splitlines():
    for op in COLLECTIVES:
      m = re.search(rf"= (.*?) {op}(-start)?\(", line)
      if not m:
        continue
      shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
      if m.group(2):  # async start: (operands..., result); count the result
        shapes = shapes[-1:]
      size = sum(_BYTES.get(t, 4) * int(np.prod([int(x) for x in dims.split(",") if x] or [1])) for t, dims in shapes)
      g = _group_size(line, devices)
      factor = {"all-gather": (g - 1) / g, "all-to-all": (g - 1) / g, "all-reduce": 2 * (g - 1) / g,
                "reduce-scatter": g - 1, "collective-permute": 1.0}[op]
      total += size * factor
      counts[op] = counts.get(op, 0) + 1
  return total, counts


def analytic(params: dict, **ns) -> float | None:
  """``newton_schulz.ns_flops`` summed over the matrices (None if it does not take these options)."""
  total = 0
  for x in jax.tree.leaves(params):
    try:
      total += _newton_schulz.ns_flops(x.shape, steps=ns.get("ns_steps"), coeffs=ns.get("ns_coeffs", "muon"),
                                       method=ns.get("ns_method", "standard"), restarts=ns.get("ns_restarts", ()))
    except (TypeError, ValueError):
      return None
  return float(total)


def measure(opt: optax.GradientTransformation, params: dict, shardings: dict | None, devices: int
            ) -> tuple[float, float, float, dict]:
  """(unrolled FLOPs, rolled FLOPs, comm bytes, collective counts) of one device's update."""
  if shardings is not None:
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
  state = jax.eval_shape(opt.init, params)
  if shardings is not None:
    ss = sharding.state_shardings(state, params, shardings)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, ss)
  update = jax.jit(lambda g, s, p: opt.update(g, s, p))
  rolled = update.lower(params, state, params).compile()
  with unrolled_loops():
    compiled = jax.jit(lambda g, s, p: opt.update(g, s, p)).lower(params, state, params).compile()
  comm, counts = communication(compiled.as_text(), devices)
  return compiled.cost_analysis()["flops"], rolled.cost_analysis()["flops"], comm, counts


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--dim", type=int, default=768)
  args = parser.parse_args()
  params, names = gpt2_hidden_matrices(args.layers, args.dim)
  contenders = {
      "optax.contrib.muon": lambda ps: contrib.muon(1.0, ns_steps=5, beta=0.95, nesterov=True, consistent_rms=0.2,
                                                    weight_decay=0.0),
      "muonclip_jax.muon (quintic x5)": lambda ps: mc.muon(1.0, weight_decay=0.0, **KELLER),
      "muonclip_jax.muon (quintic x5), sharded NS": lambda ps: mc.muon(1.0, weight_decay=0.0,
                                                                       shard_orthogonalization=ps, **KELLER),
      "muonclip_jax.muon (default NS), sharded NS": lambda ps: mc.muon(1.0, weight_decay=0.0,
                                                                       shard_orthogonalization=ps),
  }
  quintic = analytic(params, **KELLER)
  defaults = {k: v.default for k, v in inspect.signature(mc.muon).parameters.items() if k.startswith("ns_")}
  default_ns = analytic(params, **defaults)
  print(f"jax {jax.__version__}, optax {optax.__version__}, {len(jax.devices())} CPU devices, "
        f"{args.layers} layers, d = {args.dim}")
  fmt = lambda f: "n/a" if f is None else f"{f / 1e9:.2f}"
  print(f"analytic Newton-Schulz GFLOP, one device: quintic x5 {fmt(quintic)} "
        f"(ideal per device on 8: {fmt(None if quintic is None else quintic / 8)}); default NS {fmt(default_ns)}")
  header = (f"{'optimizer':44s} {'mesh':18s} {'GFLOP/dev':>9s} {'ratio':>6s} {'rolled':>6s} {'comm MB/dev':>11s}"
            "  collectives")
  print(header)
  print("-" * len(header))
  single = {}
  for name, make in contenders.items():
    base = name.replace(", sharded NS", "")
    if base not in single:
      flops, rolled, _, _ = measure(make(None), params, None, 1)
      single[base] = (flops, rolled)
      print(f"{base:44s} {'1 device':18s} {flops / 1e9:9.2f} {1.0:6.3f} {1.0:6.3f} {0.0:11.1f}")
  for mesh_name, (shape, axes) in MESHES.items():
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    ps = sharding.param_shardings(params, mesh, logical_axes=names)
    for name, make in contenders.items():
      base = name.replace(", sharded NS", "")
      flops, rolled, comm, counts = measure(make(ps), params, ps, mesh.size)
      ratio, rolled_ratio = flops / single[base][0], rolled / single[base][1]
      print(f"{name:44s} {mesh_name:18s} {flops / 1e9:9.2f} {ratio:6.3f} {rolled_ratio:6.3f} {comm / 1e6:11.1f}  "
            + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
  main()
