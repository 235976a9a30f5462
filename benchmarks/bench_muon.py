"""Time one jitted Muon update: muonclip_jax.muon vs optax.contrib.muon.

All run on the hidden matrices of a GPT-2-small-like model (12 layers of four 768x768
attention matrices, 768x3072 and 3072x768) with Nesterov momentum 0.95, update RMS 0.2 *
sqrt(max(n, m)) (optax: consistent_rms=0.2), no weight decay, learning rate 1:
``optax.contrib.muon`` (its default: 5 quintic Newton–Schulz steps with Keller Jordan's
coefficients), ``muonclip_jax.muon`` doing the same work (``ns_coeffs="muon", ns_steps=5,
ns_method="standard"``) and ``muonclip_jax.muon`` with its defaults (4 "polar_express_4"
steps, Gram Newton–Schulz on the rectangular matrices). They are timed in one process,
alternating; medians, ratios to optax and XLA's temporary memory are printed. The fuller
harness is bench_orthogonalization.py.

  PYTHONPATH=. python benchmarks/bench_muon.py [--layers 12] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from optax import contrib

import muonclip_jax as mc


def gpt2_hidden_matrices(layers: int, d: int = 768) -> dict:
  keys = iter(jax.random.split(jax.random.key(0), 6 * layers))
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "fc": (d, 4 * d), "proj": (4 * d, d)}
  return {f"h{i}": {n: jax.random.normal(next(keys), s, jnp.float32) for n, s in shapes.items()} for i in range(layers)}


def mla_hidden_matrices(layers: int, d: int = 1024, heads: int = 8, q_lora: int = 384, kv_lora: int = 256,
                        nope: int = 64, rope: int = 32, v: int = 64, ffn: int = 2816) -> dict:
  """DeepSeek-V2/V3-style MLA block shapes, scaled down (hidden 1024, 8 heads, SwiGLU 2816)."""
  shapes = {
      "wq_a": (d, q_lora), "wq_b": (q_lora, heads * (nope + rope)), "wkv_a": (d, kv_lora + rope),
      "wkv_b": (kv_lora, heads * (nope + v)), "wo": (heads * v, d),
      "w_gate": (d, ffn), "w_up": (d, ffn), "w_down": (ffn, d),
  }
  keys = iter(jax.random.split(jax.random.key(1), len(shapes) * layers))
  return {f"l{i}": {n: jax.random.normal(next(keys), s, jnp.float32) for n, s in shapes.items()}
          for i in range(layers)}


def contenders() -> dict:
  return {
      "optax.contrib.muon": contrib.muon(
          1.0, ns_steps=5, beta=0.95, nesterov=True, consistent_rms=0.2, weight_decay=0.0
      ),
      "muonclip_jax.muon(muon, 5, standard)": mc.muon(
          1.0, weight_decay=0.0, ns_coeffs="muon", ns_steps=5, ns_method="standard"
      ),
      "muonclip_jax.muon() defaults": mc.muon(1.0, weight_decay=0.0),
  }


def time_updates(opts: dict, params: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
  grads = jax.tree.map(lambda p: jnp.sin(p), params)
  compiled, temp = {}, {}
  for name, opt in opts.items():
    state = opt.init(params)
    fn = jax.jit(opt.update).lower(grads, state, params).compile()
    temp[name] = fn.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(fn(grads, state, params))  # warm up
    compiled[name] = (fn, state)
  times = {name: [] for name in opts}
  for _ in range(repeats):
    for name, (fn, state) in compiled.items():  # alternate the contenders
      t0 = time.perf_counter()
      jax.block_until_ready(fn(grads, state, params))
      times[name].append(time.perf_counter() - t0)
  return times, temp


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  params = gpt2_hidden_matrices(args.layers)
  print(f"jax {jax.__version__}, optax {optax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}, {args.layers} layers, {args.repeats} repeats")
  times, temp = time_updates(contenders(), params, args.repeats)
  med = {k: statistics.median(v) for k, v in times.items()}
  base = med["optax.contrib.muon"]
  for k, v in med.items():
    print(f"{k:40s} median {v * 1e3:9.1f} ms   ratio to optax {v / base:5.2f}   temp {temp[k]:7.1f} MiB")


if __name__ == "__main__":
  main()
