"""Compile time and step time of one optimizer update on deep unscanned models.

For each depth, each contender's ``update`` is jitted, lowered and compiled ``--compiles``
times (wall time of ``lower(...).compile()``, median; a fresh optimizer each time, so nothing
is cached; the contenders in turn, round after round), then run ``--repeats`` times,
contenders alternating (median step time). A second table gives each contender's compile
against the first contender's (``optax.adamw``) of the same round, median over the rounds:
on a small or shared machine whose speed drifts, a ratio within one round moves less than
either median. It is given in wall time and in the process's CPU time, which leaves out the
time the process waited for a core but adds up the threads XLA:CPU compiles on (so a compile
spread over more threads has a higher CPU ratio than wall ratio). Trees, unscanned (one leaf
per matrix and layer, as Hugging Face Flax models and layer-by-layer NNX models hold them):

* ``gpt``: width 256, MLP 1024, 6 matrices per layer (q, k, v, o ``256 x 256``; up
  ``256 x 1024``; down ``1024 x 256``);
* ``mla``: the demo model's MLA layer (``examples/train_mla_lm.py``: width 128, 4 heads,
  q_lora 64, kv_lora 32, head dims 16 + 16, values 16, SwiGLU 384), 8 matrices per layer.

Contenders: ``optax.adamw``, ``optax.contrib.muon`` (its defaults), ``mc.muon_adamw`` (the
default grouping) and ``mc.muon_adamw(ns_batch=1)`` (one matrix per call). ``--sharded``
compiles ``mc.muon_adamw(shard_orthogonalization=...)`` with the params sharded over 8 fake
CPU devices (FSDP on the larger axis), in a process of its own. ``--checkout LABEL=PATH`` adds the
default update of the package in another checkout (a git worktree at an earlier commit, say),
imported in this process under ``LABEL``: a change's compile time against the code before it, in
one process and the same rounds, where separate processes differ by the machine's drift.

Usage::

  PYTHONPATH=. python benchmarks/bench_compile.py                  # 12, 24, 48, 96 layers
  PYTHONPATH=. python benchmarks/bench_compile.py --sharded        # the distributed path, 8 devices
  PYTHONPATH=. python benchmarks/bench_compile.py --layers 12 --trees gpt --repeats 2   # quick
  PYTHONPATH=. python benchmarks/bench_compile.py --layers 48 96 --trees gpt --only optax.adamw "(default)" --compiles 5
  git worktree add /tmp/before <commit>   # then, against the code before a change:
  PYTHONPATH=. python benchmarks/bench_compile.py --layers 48 --only optax.adamw "(default)" --compiles 12 \
      --repeats 1 --checkout before=/tmp/before
"""

from __future__ import annotations

import sys

if "--sharded" in sys.argv:  # before jax starts
  import os

  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import importlib
import importlib.util
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import contrib

import muonclip_jax as mc
from muonclip_jax._orthogonalize import batching


def gpt_layer(d: int = 256, ff: int = 1024) -> dict:
  return {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "up": (d, ff), "down": (ff, d)}


def mla_layer(d: int = 128, heads: int = 4, q_lora: int = 64, kv_lora: int = 32, nope: int = 16, rope: int = 16,
              v: int = 16, ffn: int = 384) -> dict:
  return {"wq_a": (d, q_lora), "wq_b": (q_lora, heads * (nope + rope)), "wkv_a": (d, kv_lora + rope),
          "wkv_b": (kv_lora, heads * (nope + v)), "wo": (heads * v, d), "w_gate": (d, ffn), "w_up": (d, ffn),
          "w_down": (ffn, d)}


TREES = {"gpt": gpt_layer, "mla": mla_layer}


def params_of(layer: dict, layers: int) -> dict:
  keys = iter(jax.random.split(jax.random.key(0), len(layer) * layers))
  return {f"layer_{i}": {n: 0.02 * jax.random.normal(next(keys), s) for n, s in layer.items()} for i in range(layers)}


def contenders(sharded: Mesh | None, params: dict) -> dict:
  if sharded is not None:
    shardings = jax.tree.map(lambda x: x.sharding, params)
    return {"optax.adamw": optax.adamw(1e-3),
            "mc.muon_adamw (default)": mc.muon_adamw(1e-3),
            "mc.muon_adamw (shard_orthogonalization)": mc.muon_adamw(1e-3, shard_orthogonalization=shardings)}
  return {"optax.adamw": optax.adamw(1e-3), "optax.contrib.muon": contrib.muon(1e-3),
          "mc.muon_adamw (default)": mc.muon_adamw(1e-3), "mc.muon_adamw (ns_batch=1)": mc.muon_adamw(1e-3, ns_batch=1)}


def _with_budget(budget: float) -> optax.GradientTransformation:
  """``mc.muon_adamw`` whose update traces with ``_orthogonalize.batching.CALL_FLOPS = budget``."""
  opt = mc.muon_adamw(1e-3)

  def update(updates, state, params=None):
    saved, batching.CALL_FLOPS = batching.CALL_FLOPS, budget
    try:
      return opt.update(updates, state, params)
    finally:
      batching.CALL_FLOPS = saved

  return optax.GradientTransformation(opt.init, update)


def measure(make_opts: Callable[[], dict], params: dict, repeats: int, compiles: int) -> dict:
  """Median compile time of ``compiles`` fresh compiles per contender, and median step time.

  Every round builds the contenders anew (``make_opts``), so no compile is served from a
  cache, and compiles them in turn: the machine's drift falls on every contender alike. The
  first (``optax.adamw`` unless ``--only`` leaves it out: the scale) compiles first in every
  round; the others' order rotates from round to round, so that none always follows the same
  one.
  """
  grads = jax.tree.map(jnp.sin, params)
  runs, out = {}, {}
  for round_ in range(compiles):
    first, *rest = make_opts().items()
    turn = round_ % max(len(rest), 1)
    for name, opt in [first] + rest[turn:] + rest[:turn]:
      state = opt.init(params)
      t0, c0 = time.perf_counter(), time.process_time()
      compiled = jax.jit(opt.update).lower(grads, state, params).compile()
      r = out.setdefault(name, {"compiles": [], "cpu": [], "steps": []})
      r["compiles"].append(time.perf_counter() - t0)
      r["cpu"].append(time.process_time() - c0)
      if name not in runs:
        jax.block_until_ready(compiled(grads, state, params))
        runs[name] = (compiled, state)
  for _ in range(repeats):
    for name, (compiled, state) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(grads, state, params))
      out[name]["steps"].append(time.perf_counter() - t0)
  return out


def ratios(res: dict, key: str) -> dict:
  """Per contender, its ``key`` times over the first contender's, round by round."""
  base = next(iter(res.values()))[key]
  return {name: [t / b for t, b in zip(r[key], base)] for name, r in res.items()}


def _spread(times: list[float]) -> str:
  """`` (lo-hi)`` of several compiles, empty for one."""
  return f" ({min(times):.2f}-{max(times):.2f})" if len(times) > 1 else ""


def load_checkouts(specs: list[str], into: str) -> dict:
  """``{label: module}``: each ``LABEL=PATH``'s ``PATH/muonclip_jax`` copied to ``into/LABEL`` and
  imported under that name (the package imports itself by relative imports only)."""
  mods = {}
  sys.path.insert(0, into)
  for spec in specs:
    label, _, root = spec.partition("=")
    if not label.isidentifier() or not os.path.isdir(os.path.join(root, "muonclip_jax")):
      raise SystemExit(f"--checkout takes LABEL=PATH, an identifier and a directory holding muonclip_jax/; got {spec!r}")
    if label in mods or importlib.util.find_spec(label) is not None:  # it would import that module instead
      raise SystemExit(f"--checkout label {label!r} is taken (given twice, or an importable module); pick another")
    shutil.copytree(os.path.join(root, "muonclip_jax"), os.path.join(into, label),
                    ignore=shutil.ignore_patterns("__pycache__"))
    mods[label] = importlib.import_module(label)
  return mods


def shard(params: dict, mesh: Mesh) -> dict:
  def place(x):
    axis = int(np.argmax(x.shape))
    spec = [None] * x.ndim
    spec[axis] = "fsdp"
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))
  return jax.tree.map(place, params)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, nargs="*", default=[12, 24, 48, 96])
  parser.add_argument("--trees", nargs="*", default=list(TREES), choices=list(TREES))
  parser.add_argument("--repeats", type=int, default=5, help="step times per contender (median)")
  parser.add_argument("--compiles", type=int, default=1,
                      help="fresh compiles per contender, in rounds (median): one compile moves by 15-30%% "
                           "between runs on a small CPU")
  parser.add_argument("--sharded", action="store_true", help="8 fake CPU devices, params sharded (FSDP)")
  parser.add_argument("--only", nargs="*", default=None, metavar="NAME",
                      help="time only the contenders whose names contain one of these strings (substrings: "
                           "'adamw' also matches mc.muon_adamw; 'optax.adamw' does not)")
  parser.add_argument("--call-flops", type=float, nargs="*", default=[],
                      help="also time the default with these per-call FLOP budgets (the accelerator rule's "
                           "CALL_FLOPS; 0: one matrix per call)")
  parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=PATH",
                      help="also time the default update of the muonclip_jax in PATH (another checkout), "
                           "imported here as LABEL")
  args = parser.parse_args()
  copies = tempfile.TemporaryDirectory()  # removed when the process ends
  checkouts = load_checkouts(args.checkout, copies.name)
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind} x {len(jax.devices())}, {platform.machine()} x {os.cpu_count()} cores, "
        f"python {platform.python_version()}")
  print(f"command: {' '.join(['python'] + sys.argv)}\n")
  mesh = Mesh(np.array(jax.devices()), ("fsdp",)) if args.sharded else None
  for tree in args.trees:
    names, ratio_rows = None, []
    for layers in args.layers:
      params = params_of(TREES[tree](), layers)
      if mesh is not None:
        params = shard(params, mesh)
      def make_opts() -> dict:
        opts = contenders(mesh, params)
        if args.only is not None:
          opts = {name: opt for name, opt in opts.items() if any(key in name for key in args.only)}
        for budget in args.call_flops:
          opts[f"default, CALL_FLOPS={budget:.3g}"] = _with_budget(budget)
        for label, mod in checkouts.items():
          opts[f"{label}: muon_adamw (default)"] = mod.muon_adamw(1e-3)
        return opts

      res = measure(make_opts, params, args.repeats, args.compiles)
      if names is None:
        names = list(res)
        print(f"\n### {tree}, unscanned: compile s (median of {args.compiles}) / step ms (median of {args.repeats})\n")
        print("| layers | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
      cells = [f"{statistics.median(r['compiles']):.2f} s{_spread(r['compiles'])} / "
               f"{1e3 * statistics.median(r['steps']):.1f} ms" for r in res.values()]
      print(f"| {layers} | " + " | ".join(cells) + " |", flush=True)
      wall, cpu = ratios(res, "compiles"), ratios(res, "cpu")
      ratio_rows.append(f"| {layers} | " + " | ".join(
          f"{statistics.median(wall[n]):.2f}x{_spread(wall[n])} / {statistics.median(cpu[n]):.2f}x{_spread(cpu[n])}"
          for n in names[1:]) + " |")
    if len(names) > 1:
      print(f"\n{tree}: compile over {names[0]}'s in the same round, wall / CPU (median of {args.compiles})\n")
      print("| layers | " + " | ".join(names[1:]) + " |")
      print("|---" * len(names) + "|")
      print("\n".join(ratio_rows), flush=True)


if __name__ == "__main__":
  main()
