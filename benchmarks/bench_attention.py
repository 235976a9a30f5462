"""Benchmark: cost of max-logit capture, and dense vs chunked attention (time and memory).

Two tables, for ``MultiHeadLatentAttention`` (MLA) and ``GroupedQueryAttention`` (GQA):

1. Capture overhead: jitted forward+backward (``value_and_grad`` over the parameters) with
   the ``intermediates`` collection mutable (the maxima are returned, so XLA cannot drop
   them) vs not mutable, for both attention implementations. Goal: <= 3%. Wall-clock
   differences of a few percent are within noise on a shared CPU, so the table also gives
   the deterministic extra work from XLA's cost analysis of the compiled programs.
2. Dense vs chunked at several sequence lengths: forward+backward time with capture on,
   and the compiled temporary memory (``compiled.memory_analysis().temp_size_in_bytes``,
   XLA's peak scratch) next to the size of one float32 ``(B, H, T, T)`` logit matrix.

Timing: each contender is compiled and warmed up first; then the contenders of a row are
run alternately ``--repeats`` times and the median wall-clock time is reported (with the
min-max range), so that load drifts hit all of them alike. CPU by default.

Run (about 5 minutes on 2 CPU cores):

  PYTHONPATH=. .venv/bin/python benchmarks/bench_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from muonclip_jax import nn as mnn


def _modules(args, impl: str):
  common = dict(attention_impl=impl, block_size=args.block_size)
  mla = mnn.MultiHeadLatentAttention(
      num_heads=args.heads, q_lora_rank=args.dim // 2, kv_lora_rank=args.dim // 4,
      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, **common,
  )
  gqa = mnn.GroupedQueryAttention(
      num_heads=args.heads, num_kv_heads=max(args.heads // 2, 1), head_dim=48, **common
  )
  return {"MLA": mla, "GQA": gqa}


def _step(module, capture: bool):
  """jit(params, x) -> (loss, maxima or 0, grads): one forward+backward pass."""

  def loss(params, x):
    if capture:
      y, state = module.apply({"params": params}, x, mutable=["intermediates"])
      return jnp.mean(y * y), state["intermediates"]["max_logits"]
    return jnp.mean(jnp.square(module.apply({"params": params}, x))), jnp.zeros((), jnp.float32)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _time_alternating(fns: dict, args_: tuple, repeats: int) -> dict[str, list[float]]:
  for fn in fns.values():  # compile + warm up
    jax.block_until_ready(fn(*args_))
  times = {name: [] for name in fns}
  names = list(fns)
  for i in range(repeats):
    for name in names if i % 2 == 0 else names[::-1]:  # alternate, and alternate the order
      fn = fns[name]
      start = time.perf_counter()
      jax.block_until_ready(fn(*args_))
      times[name].append(time.perf_counter() - start)
  return times


def _fmt(ts: list[float]) -> str:
  return f"{1e3 * statistics.median(ts):8.1f} ({1e3 * min(ts):.0f}-{1e3 * max(ts):.0f})"


def _inputs(module, batch: int, seq: int, dim: int):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, seq, dim)), jnp.float32)
  params = jax.jit(module.init)(jax.random.key(0), x)["params"]
  return params, x


def capture_overhead(args) -> None:
  print(f"\n## Capture overhead: forward+backward, batch={args.batch}, seq={args.overhead_seq}, "
        f"dim={args.dim}, heads={args.heads}, median of {args.overhead_repeats} (min-max), ms\n")
  print("| module | impl | capture off | capture on | overhead (medians) | overhead (minima) "
        "| extra XLA flops | extra XLA bytes accessed |")
  print("|---|---|---|---|---|---|---|---|")
  for impl in ("dense", "chunked"):
    for name, module in _modules(args, impl).items():
      params, x = _inputs(module, args.batch, args.overhead_seq, args.dim)
      fns = {"off": _step(module, False), "on": _step(module, True)}
      cost = {k: fn.lower(params, x).compile().cost_analysis() for k, fn in fns.items()}
      extra = {}
      for key in ("flops", "bytes accessed"):
        on, off = cost["on"][key], cost["off"][key]
        extra[key] = f"{on - off:+.3g} ({100 * (on / off - 1):+.2f}%)"
      times = _time_alternating(fns, (params, x), args.overhead_repeats)
      med = {k: statistics.median(v) for k, v in times.items()}
      low = {k: min(v) for k, v in times.items()}
      by_median = 100 * (med["on"] / med["off"] - 1)
      by_min = 100 * (low["on"] / low["off"] - 1)
      print(f"| {name} | {impl} | {_fmt(times['off'])} | {_fmt(times['on'])} | "
            f"{by_median:+.1f}% | {by_min:+.1f}% | {extra['flops']} | {extra['bytes accessed']} |",
            flush=True)


def dense_vs_chunked(args) -> None:
  print(f"\n## Dense vs chunked (block {args.block_size}): forward+backward with capture, "
        f"batch={args.batch}, dim={args.dim}, heads={args.heads}, "
        f"median of {args.repeats} (min-max)\n")
  print("| module | seq | (B,H,T,T) f32 logits MiB | dense temp MiB | chunked temp MiB "
        "| dense ms | chunked ms | max-logit diff |")
  print("|---|---|---|---|---|---|---|---|")
  for seq in args.seq_lens:
    for name in ("MLA", "GQA"):
      modules = {impl: _modules(args, impl)[name] for impl in ("dense", "chunked")}
      params, x = _inputs(modules["dense"], args.batch, seq, args.dim)
      fns = {impl: _step(m, True) for impl, m in modules.items()}
      temp = {
          impl: fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes
          for impl, fn in fns.items()
      }
      times = _time_alternating(fns, (params, x), args.repeats)
      (_, m_d), _ = fns["dense"](params, x)
      (_, m_c), _ = fns["chunked"](params, x)
      diff = float(jnp.max(jnp.abs(m_d - m_c)))
      logits = args.batch * args.heads * seq * seq * 4
      mib = 1 / 2**20
      print(f"| {name} | {seq} | {logits * mib:.0f} | {temp['dense'] * mib:.1f} | "
            f"{temp['chunked'] * mib:.1f} | {_fmt(times['dense'])} | {_fmt(times['chunked'])} | "
            f"{diff:.1e} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--block-size", type=int, default=512)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--overhead-seq", type=int, default=1024)
  parser.add_argument("--overhead-repeats", type=int, default=31)
  parser.add_argument("--skip-overhead", action="store_true")
  parser.add_argument("--skip-memory", action="store_true")
  args = parser.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
  start = time.perf_counter()
  if not args.skip_overhead:
    capture_overhead(args)
  if not args.skip_memory:
    dense_vs_chunked(args)
  print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
