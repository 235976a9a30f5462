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

Balanced placement parts (``--part``), with the library's default iteration (polar_express_4,
``ns_method="auto"``), float32:

* ``mla``: the hidden matrices of a DeepSeek-style MLA model (``model_shapes.MLA_1024``:
  wq_a, wq_b, wkv_a, wkv_b, wo, w_gate, w_up, w_down) on ``data x model`` meshes; the
  distributed Newton–Schulz alone (``orthogonalize_sharded``) compiled with the shape-by-shape grouping's code that came before
  (loaded from git, ``--baseline``) and with this one: per-device FLOPs (cost analysis, loops
  unrolled) over one device's, against the LPT bound and the ideal ``1/D``. Needs as many fake
  devices as the mesh has (``--devices 64`` for 8x8, in its own process);
* ``moe``: one MoE layer (MLA attention, a stack of routed experts, a shared expert);
* ``planner``: ``planner.figures`` (pure Python) for a DeepSeek-V3-like and a dense
  70B-like model on 8 to 1024 devices.

Expert parallelism (``--part experts``, pure Python): the DeepSeek-V3-like model with its
routed experts sharded on an ``expert`` mesh axis (``sharding.DEFAULT_RULES``: ``expert`` ->
``expert``), combined with FSDP (and data parallelism), on 64 to 1024 devices, against the
same devices without expert parallelism (the experts whole on every device, FSDP-sharded):
the most loaded device's FLOPs over the ideal, its own experts' share (the fixed load the
planner places first; what plain SPMD orthogonalizes on every device of an expert slice),
bytes received per device, the bytes of expert stacks each device would receive had they
been gathered (what the planner did before it pinned sharded stacks), and the estimated
optimizer step on the H100 model against a forward/backward estimate.

Compiled (``--part experts-compiled``, 8 fake CPU devices): one MoE layer (a small MLA
attention, 16 routed experts of 256 x 512, a shared expert), the experts sharded on
``expert``, ``embed`` on ``fsdp``, on expert 4 x data 2 and expert 2 x fsdp 2 x data 2:
``scale_by_muon`` under plain SPMD and with ``shard_orthogonalization``, per-device FLOPs
over one device's, bytes received, and every all-gather's result shape and group size (an
expert stack is ``(16, 256, 512)`` or ``(16, 512, 256)``). Runs against any revision of the
package on ``PYTHONPATH`` (the shardings are given explicitly), so before and after a
change; XLA's cost analysis counts a loop's body once, so the FLOPs of a revision whose
default loops over a stack's matrices (``lax.map``) are undercounted.

Split over device groups (``--part hybrid``, pure Python): whole-matrix against hybrid plans (the largest
matrices split over device groups, ``_orthogonalize.hybrid``) for dense 70B- and 405B-like and a
DeepSeek-V3-like model on 8 to 4096 devices: FLOPs of the most loaded device over the
ideal, bytes received, collectives, estimated optimizer-step time on the ``_orthogonalize.cost``
device models (H100 with NVLink, TPU v5p with ICI) against a forward/backward estimate
(``6 x active hidden-matrix parameters x tokens`` FLOPs at the same peak rate).

  python benchmarks/bench_sharding.py [--layers 4] [--dim 768]
  python benchmarks/bench_sharding.py --part mla [--devices 64]
  python benchmarks/bench_sharding.py --part moe
  python benchmarks/bench_sharding.py --part planner
  python benchmarks/bench_sharding.py --part hybrid [--models "dense 70B-like"]
  python benchmarks/bench_sharding.py --part experts
  python benchmarks/bench_sharding.py --part experts-compiled
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import functools
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from optax import contrib

import muonclip_jax as mc
from muonclip_jax import sharding
from muonclip_jax._orthogonalize import distributed, newton_schulz, ns_flops, planner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_collectives  # noqa: E402
import model_shapes  # noqa: E402

KELLER = dict(ns_coeffs="muon", ns_steps=5, ns_method="standard")
MESHES = {
    "data 8 x model 1": ((8, 1), ("data", "model")),
    "data 2 x model 4": ((2, 4), ("data", "model")),
    "data 1 x model 8": ((1, 8), ("data", "model")),
    "fsdp 2 x model 4": ((2, 4), ("fsdp", "model")),
}
COLLECTIVES = hlo_collectives.COLLECTIVES


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


def communication(hlo: str, devices: int) -> tuple[float, dict[str, int]]:
  """(estimated bytes received per device, {collective: count}) of a compiled HLO text."""
  return hlo_collectives.communication(hlo, devices)


def analytic(params: dict, **ns) -> float | None:
  """``newton_schulz.ns_flops`` summed over the matrices (None if it does not take these options)."""
  total = 0
  for x in jax.tree.leaves(params):
    try:
      total += ns_flops(x.shape, steps=ns.get("ns_steps"), coeffs=ns.get("ns_coeffs", "muon"),
                        method=ns.get("ns_method", "standard"), restarts=ns.get("ns_restarts", ()))
    except (TypeError, ValueError):
      return None
  return float(total)


def measure(opt: optax.GradientTransformation, params: dict, shardings: dict | None, devices: int, *,
            hlo: bool = False) -> tuple:
  """(unrolled FLOPs, rolled FLOPs, comm bytes, collective counts[, HLO text]) of one device's update."""
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
  out = (compiled.cost_analysis()["flops"], rolled.cost_analysis()["flops"], comm, counts)
  return out + (compiled.as_text(),) if hlo else out


DEFAULT_NS = dict(steps=None, coeffs="polar_express_4", method="auto")  # scale_by_muon's default
BASELINE = "aa1a07b"  # the first distributed Newton-Schulz, grouped shape by shape (muonclip_jax/sharding.py)


def grouped_module(rev: str) -> types.ModuleType:
  """The shape-by-shape grouping's ``muonclip_jax/sharding.py`` at git revision ``rev``, as a module of the package."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  src = subprocess.run(["git", "show", f"{rev}:muonclip_jax/sharding.py"], cwd=root, check=True,
                       capture_output=True, text=True).stdout
  src = src.replace("from ._paths import", "from ._util import")  # _paths.py is now _util/paths.py
  module = types.ModuleType("muonclip_jax._grouped_sharding")
  module.__package__ = "muonclip_jax"
  exec(compile(src, f"{rev}:muonclip_jax/sharding.py", "exec"), module.__dict__)  # noqa: S102
  return module


def _matrix_axes(x) -> tuple:
  nd = len(x.shape)
  return tuple(range(nd - 2)), (nd - 2,), (nd - 1,)


def planner_leaves(layers: list[tuple[dict, int]], mesh) -> list:
  """``planner.describe`` of every matrix of ``[(layer, count)]`` (float32) on ``mesh``."""
  out = []
  for layer, count in layers:
    for shape, names in layer.values():
      spec = sharding.logical_to_spec(names, shape, mesh)
      x = jax.ShapeDtypeStruct(shape, jnp.float32)
      out += [planner.describe(shape, _matrix_axes(x), tuple(spec), dict(mesh.shape), "float32", 4)] * count
  return out


def compiled_ns(orthogonalize, params: dict, shardings: dict | None, mesh: Mesh | None) -> tuple[float, float]:
  """(FLOPs, comm bytes) of one device's compiled distributed Newton–Schulz, loops unrolled."""
  xs = jax.tree.leaves(params)
  axes = [_matrix_axes(x) for x in xs]
  ns = functools.partial(newton_schulz, **DEFAULT_NS)
  if mesh is None:  # one device: every matrix
    fn = lambda *a: [ns(x) for x in a]
  else:
    ss = jax.tree.leaves(shardings)
    xs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(xs, ss)]
    fn = lambda *a: orthogonalize(list(a), axes, ns, mesh=mesh, shardings=ss)
  with unrolled_loops():
    compiled = jax.jit(fn).lower(*xs).compile()
  comm, _ = communication(compiled.as_text(), 1 if mesh is None else mesh.size)
  return compiled.cost_analysis()["flops"], comm


def compare(name: str, layers: list[tuple[dict, int]], mesh_shape: tuple, axes: tuple, baseline) -> None:
  """One row: the shape-by-shape grouping vs this scheme (compiled and planned), LPT bound, ideal."""
  mesh = Mesh(np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape), axes)
  params, names = {}, {}
  for li, (layer, count) in enumerate(layers):
    p, n = model_shapes.model(layer, count)
    params.update({f"{li}/{k}": v for k, v in p.items()})
    names.update({f"{li}/{k}": v for k, v in n.items()})
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  one, _ = compiled_ns(None, params, None, None)
  old, old_comm = compiled_ns(baseline.orthogonalize_sharded, params, ps, mesh)
  flops = distributed.ns_flops_of(DEFAULT_NS)
  new, new_comm = compiled_ns(functools.partial(distributed.orthogonalize_sharded, flops=flops), params, ps, mesh)
  fig = planner.figures(planner_leaves(layers, mesh), dict(mesh.shape), flops)
  total = fig["new"].total
  print(f"| {name} | {' x '.join(f'{a} {s}' for a, s in zip(axes, mesh_shape))} | {old / one:.3f} | {new / one:.3f} "
        f"| {fig['new'].flops / total:.3f} | {fig['lpt'].flops / total:.3f} | {1 / mesh.size:.3f} "
        f"| {new / one / (fig['lpt'].flops / total):.3f} | {old_comm / 1e6:.1f} | {new_comm / 1e6:.1f} "
        f"| {fig['new'].comm / 1e6:.1f} |", flush=True)


COMPARE_HEADER = ("| set | mesh | by shape | new | new (planner) | LPT bound | ideal | new / LPT | comm MB by shape "
                  "| comm MB new | comm MB planner |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def mla_part(devices: int, baseline) -> None:
  print(COMPARE_HEADER)
  if devices >= 64:
    compare("MLA, 6 layers", [(model_shapes.MLA_1024, 6)], (8, 8), ("data", "model"), baseline)
    return
  for layers in (3, 4):
    for shape, axes in (((2, 4), ("data", "model")), ((2, 4), ("fsdp", "model"))):
      compare(f"MLA, {layers} layers", [(model_shapes.MLA_1024, layers)], shape, axes, baseline)


# One MoE layer: the MLA attention of MLA_1024, 16 routed experts of 704 and a shared one.
MOE_LAYER = {**model_shapes.mla_attention(1024, 8, 384, 256, 64, 32, 64), **model_shapes.experts(1024, 704, 16),
             **model_shapes.mlp(1024, 704, "shared/")}


def moe_part(baseline) -> None:
  print(COMPARE_HEADER)
  for shape, axes in (((2, 4), ("data", "model")), ((2, 4), ("fsdp", "model")), ((1, 8), ("data", "model"))):
    compare("MoE layer (16 experts)", [(MOE_LAYER, 1)], shape, axes, baseline)


PLANNER_MESHES = {8: ((8,), ("model",)), 64: ((8, 8), ("fsdp", "model")), 256: ((32, 8), ("fsdp", "model")),
                  1024: ((8, 16, 8), ("data", "fsdp", "model"))}
HYBRID_MESHES = {**PLANNER_MESHES, 4096: ((32, 16, 8), ("data", "fsdp", "model"))}
# Tokens per optimizer step for the forward/backward estimate: 4M (2^22) for the dense
# models (Llama 3 405B's initial batch, arXiv 2407.21783); DeepSeek-V3's final batch, 15360
# sequences of 4096 tokens (arXiv 2412.19437).
HYBRID_MODELS = {"dense 70B-like": (model_shapes.dense_70b, 2**22), "dense 405B-like": (model_shapes.dense_405b, 2**22),
                 "DeepSeek-V3-like": (model_shapes.deepseek_v3, 15360 * 4096)}


def hybrid_part(models: list[str]) -> None:
  """Whole-matrix vs hybrid plans, their traffic, and step-time estimates on two device models."""
  from muonclip_jax._orthogonalize import cost, hybrid
  flops = distributed.ns_flops_of(DEFAULT_NS)
  split_cost = distributed.split_cost_of(dict(DEFAULT_NS))
  h100, v5p = cost.H100_NVLINK, cost.TPU_V5P
  print("| model | devices (mesh) | whole | hybrid | split (m x n over g, q each) | comm GB whole / hybrid "
        "| collectives/dev, largest MB (hybrid) | H100 ms whole / hybrid / auto | v5p ms whole / hybrid / auto "
        "| bound on H100 (auto) | fwd+bwd ms H100 | Muon share H100 (auto) |\n"
        "|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|")
  for model in models:
    make, tokens = HYBRID_MODELS[model]
    layers = make()
    active = model_shapes.active_params(layers)
    for devices, (shape, axes) in HYBRID_MESHES.items():
      mesh = AbstractMesh(shape, axes)
      leaves = planner_leaves(layers, mesh)
      total = sum(flops(*lf.mn) * lf.count for lf in leaves)
      ideal = total / devices
      plans = {"whole": hybrid.plan(leaves, dict(mesh.shape), flops),
               "hybrid": hybrid.plan(leaves, dict(mesh.shape), flops, split_cost=split_cost, split="always"),
               "h100": hybrid.plan(leaves, dict(mesh.shape), flops, split_cost=split_cost, device=h100),
               "v5p": hybrid.plan(leaves, dict(mesh.shape), flops, split_cost=split_cost, device=v5p)}
      hy = plans["hybrid"]
      largest = max([b for s in hy.splits for _, b, _ in s.collectives] +
                    [c.width * c.itemsize * c.s * c.n_rep for c in hy.whole.classes] + [0])
      ms = lambda p, d: 1e3 * p.step_s(d)
      auto = plans["h100"]
      bound = "comm" if h100.comm_s(auto.comm) > h100.compute_s(auto.max_flops) else "compute"
      fwd = 6 * active * tokens / devices
      share = ms(auto, h100) / (ms(auto, h100) + 1e3 * h100.compute_s(fwd))
      splits = ", ".join(f"{s.m}x{s.n}/{s.g} q{s.q}" for s in hy.splits) or "none"
      print(f"| {model} | {devices} ({' x '.join(f'{a} {s}' for a, s in zip(axes, shape))}) "
            f"| {plans['whole'].max_flops / ideal:.3f} | {hy.max_flops / ideal:.3f} | {splits} "
            f"| {plans['whole'].comm / 1e9:.2f} / {hy.comm / 1e9:.2f} | {hy.collectives}, {largest / 1e6:.0f} "
            f"| {ms(plans['whole'], h100):.1f} / {ms(hy, h100):.1f} / {ms(auto, h100):.1f} "
            f"| {ms(plans['whole'], v5p):.1f} / {ms(hy, v5p):.1f} / {ms(plans['v5p'], v5p):.1f} "
            f"| {bound} | {1e3 * h100.compute_s(fwd):.0f} | {100 * share:.1f}% |", flush=True)


# Expert parallelism x FSDP (x data) meshes, and the same device counts without an expert axis.
EXPERT_MESHES = [((8, 8), ("fsdp", "data")), ((8, 8), ("expert", "fsdp")), ((64, 1), ("expert", "fsdp")),
                 ((16, 16), ("fsdp", "data")), ((16, 16), ("expert", "fsdp")), ((32, 8), ("expert", "fsdp")),
                 ((16, 64), ("fsdp", "data")), ((8, 16, 8), ("expert", "fsdp", "data")),
                 ((32, 8, 4), ("expert", "fsdp", "data")), ((64, 16), ("expert", "fsdp"))]


def experts_part() -> None:
  """Expert-parallel plans of the DeepSeek-V3-like model (module docstring)."""
  from muonclip_jax._orthogonalize import cost, hybrid
  flops = distributed.ns_flops_of(DEFAULT_NS)
  split_cost = distributed.split_cost_of(dict(DEFAULT_NS))
  h100 = cost.H100_NVLINK
  layers = model_shapes.deepseek_v3()
  tokens = HYBRID_MODELS["DeepSeek-V3-like"][1]
  active = model_shapes.active_params(layers)
  print("| devices (mesh) | EP | matrices | new / ideal | LPT bound / ideal | own experts / ideal | comm GB new "
        "| experts gathered GB | H100 ms (auto) | bound | fwd+bwd ms H100 | Muon share H100 |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
  for shape, axes in EXPERT_MESHES:
    mesh = AbstractMesh(shape, axes)
    devices = mesh.size
    leaves = planner_leaves(layers, mesh)
    fig = planner.figures(leaves, dict(mesh.shape), flops)
    total = fig["new"].total
    ideal = total / devices
    own = sum(flops(*lf.mn) * lf.local_count for lf in leaves if lf.stack)
    gathered = sum(math.prod(lf.shape) * lf.itemsize * (1 - 1 / lf.stack_shards) for lf in leaves if lf.stack)
    auto = hybrid.plan(leaves, dict(mesh.shape), flops, split_cost=split_cost, device=h100)
    step = 1e3 * auto.step_s(h100)
    fwd = 1e3 * h100.compute_s(6 * active * tokens / devices)
    bound = "comm" if h100.comm_s(auto.comm) > h100.compute_s(auto.max_flops) else "compute"
    ep = dict(mesh.shape).get("expert", 1)
    print(f"| {devices} ({' x '.join(f'{a} {s}' for a, s in zip(axes, shape))}) | {ep} "
          f"| {sum(lf.count for lf in leaves)} | {fig['new'].flops / ideal:.3f} | {fig['lpt'].flops / ideal:.3f} "
          f"| {own / ideal:.3f} | {fig['new'].comm / 1e9:.2f} | {gathered / 1e9:.1f} | {step:.1f} | {bound} "
          f"| {fwd:.0f} | {100 * step / (step + fwd):.1f}% |", flush=True)


EP_LAYER = {**model_shapes.mla_attention(256, 4, 96, 64, 32, 16, 32), **model_shapes.experts(256, 512, 16),
            **model_shapes.mlp(256, 512, "shared/")}
EP_RULES = (("expert", "expert"), ("embed", "fsdp"), ("q_lora", "fsdp"), ("kv_lora", "fsdp"))


def experts_compiled_part() -> None:
  """Plain SPMD and ``shard_orthogonalization`` on expert-parallel meshes, compiled."""
  params, names = model_shapes.model(EP_LAYER, 1)
  axes = mc.MatrixAxes((-2,), (-1,))
  one, _, _, _ = measure(mc.scale_by_muon(matrix_axes=axes), params, None, 1)
  print(f"one device: {one / 1e9:.3f} GFLOP")
  print("| mesh | mode | GFLOP/dev | over one device | comm MB/dev | collectives | all-gathers: result / group "
        "|\n|---|---|---:|---:|---:|---|---|")
  for shape, names_ in (((4, 2), ("expert", "data")), ((2, 2, 2), ("expert", "fsdp", "data"))):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names_)
    ps = sharding.param_shardings(params, mesh, logical_axes=names, rules=EP_RULES)
    for mode in ("plain SPMD", "shard_orthogonalization"):
      kw = dict(shard_orthogonalization=ps) if mode != "plain SPMD" else {}
      opt = mc.scale_by_muon(matrix_axes=axes, **kw)
      flops, _, comm, counts, hlo = measure(opt, params, ps, 8, hlo=True)
      gathers = sorted({(c.shapes[0][1], c.group_size) for c in hlo_collectives.collectives(hlo, 8)
                        if c.op == "all-gather"}, key=lambda t: -math.prod(t[0]))
      shown = ", ".join(f"{'x'.join(map(str, d))}/{g}" for d, g in gathers) or "none"
      print(f"| {' x '.join(f'{a} {s}' for a, s in zip(names_, shape))} | {mode} | {flops / 1e9:.3f} "
            f"| {flops / one:.3f} | {comm / 1e6:.2f} | {', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))} "
            f"| {shown} |", flush=True)


def planner_part() -> None:
  flops = distributed.ns_flops_of(DEFAULT_NS)
  print("| model | devices (mesh) | matrices | new | LPT bound | by shape | Moonlight | comm GB new | by shape "
        "| Moonlight |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for model, layers in (("DeepSeek-V3-like", model_shapes.deepseek_v3()), ("dense 70B-like", model_shapes.dense_70b())):
    for devices, (shape, axes) in PLANNER_MESHES.items():
      mesh = AbstractMesh(shape, axes)
      leaves = planner_leaves(layers, mesh)
      fig = planner.figures(leaves, dict(mesh.shape), flops)
      over = {k: f.over_ideal(devices) for k, f in fig.items()}
      print(f"| {model} | {devices} ({' x '.join(f'{a} {s}' for a, s in zip(axes, shape))}) "
            f"| {sum(lf.count for lf in leaves)} | {over['new']:.3f} | {over['lpt']:.3f} | {over['grouped']:.3f} "
            f"| {over['repeated']:.0f} | {fig['new'].comm / 1e9:.2f} | {fig['grouped'].comm / 1e9:.2f} "
            f"| {fig['repeated'].comm / 1e9:.2f} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=("gpt2", "mla", "moe", "planner", "hybrid", "experts", "experts-compiled"),
                      default="gpt2")
  parser.add_argument("--models", default=",".join(HYBRID_MODELS), help="hybrid: comma-separated model names")
  parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (mla: 64 for the 8x8 mesh)")
  parser.add_argument("--baseline", default=BASELINE, help="git revision of the shape-by-shape grouping's sharding.py")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--dim", type=int, default=768)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.devices)
  print(f"jax {jax.__version__}, {args.devices} CPU devices, part {args.part}")
  if args.part == "planner":
    return planner_part()
  if args.part == "hybrid":
    return hybrid_part(args.models.split(","))
  if args.part == "experts":
    return experts_part()
  if args.part == "experts-compiled":
    return experts_compiled_part()
  if args.part == "mla":
    return mla_part(args.devices, grouped_module(args.baseline))
  if args.part == "moe":
    return moe_part(grouped_module(args.baseline))
  gpt2_part(args)


def gpt2_part(args) -> None:
  params, names = gpt2_hidden_matrices(args.layers, args.dim)
  contenders = {
      "optax.contrib.muon": lambda ps: contrib.muon(1.0, ns_steps=5, beta=0.95, nesterov=True, consistent_rms=0.2,
                                                    weight_decay=0.0),
      # one matrix per call: XLA's cost analysis counts a stacking loop's body once
      "muonclip_jax.muon (quintic x5)": lambda ps: mc.muon(1.0, weight_decay=0.0, ns_batch=1, **KELLER),
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
