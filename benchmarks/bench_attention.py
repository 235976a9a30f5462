"""Benchmark: cost of max-logit capture, dense vs chunked, and the accelerator kernels.

Tables 1-2 are for ``MultiHeadLatentAttention`` (MLA) and ``GroupedQueryAttention`` (GQA):

1. Capture overhead: jitted forward+backward (``value_and_grad`` over the parameters) with
   the ``intermediates`` collection mutable (the maxima are returned, so XLA cannot drop
   them) vs not mutable, for ``dense``, ``chunked`` and ``dpa_max`` (for which "off" is
   plain ``jax.nn.dot_product_attention``, so the row is the max-only pass's overhead).
   Goal: <= 3%. Wall-clock
   differences of a few percent are within noise on a shared CPU, so the table also gives
   the deterministic extra work from XLA's cost analysis of the compiled programs.
2. Dense vs chunked at several sequence lengths: forward+backward time with capture on,
   and the compiled temporary memory (``compiled.memory_analysis().temp_size_in_bytes``,
   XLA's peak scratch) next to the size of one float32 ``(B, H, T, T)`` logit matrix.
3. Accelerator sections (each only when JAX sees its accelerator; otherwise it prints
   SKIPPED): the pure attention functions, forward+backward, bfloat16, causal, batch
   1, at 4096 and 8192 tokens, for MLA-shaped (16 heads, q/k width 192, v width 128) and
   GQA-shaped (32 query heads, 8 key/value heads, width 128) attention.
   TPU: tokamax's splash kernel (``impl="splash"``) with and without capture, and
   ``chunked`` with capture.
   GPU: tokamax's GPU kernel (``impl="tokamax_gpu"``: Mosaic GPU on SM90/SM100, else
   Triton) with and without capture (target overhead <= 3%); plain
   ``jax.nn.dot_product_attention(implementation="cudnn")`` without capture (for MLA the
   values are zero-padded to width 192, which cuDNN's JAX API needs; target: tokamax with
   capture at >= 0.67 of its speed); ``dpa_max`` with capture (its overhead over plain
   cuDNN); the library's ``chunked`` path with capture.

4. tokamax on the CPU (when tokamax is installed and no accelerator is present): no speed,
   only what can be measured here: the interpret-mode splash kernel's and the XLA
   tokamax op's largest difference from ``dense`` in output and per-head maxima at a
   small GQA/MLA shape, and whether the splash forward+backward lowers for TPU.

Timing: each contender is compiled and warmed up first; then the contenders of a row are
run alternately ``--repeats`` times and the median wall-clock time is reported (with the
min-max range), so that load drifts hit all of them alike. CPU by default.

Run (about 5 minutes on 2 CPU cores):

  PYTHONPATH=. .venv/bin/python benchmarks/bench_attention.py

On a GPU, the accelerator section alone:

  PYTHONPATH=. .venv/bin/python benchmarks/bench_attention.py --skip-overhead --skip-memory
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
  common = dict(impl=impl, block_size=args.block_size)
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
  for impl in args.overhead_impls:
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


ACCELERATOR_SHAPES = {  # name: (query heads, key/value heads, q/k width, v width)
    "MLA": (16, 16, 192, 128),
    "GQA": (32, 8, 128, 128),
}


def _attention_step(impl: str, capture: bool, is_causal: bool = True, block_size: int = 512):
  """jit(q, k, v) -> ((loss, maxima or 0), (dq, dk, dv)) through ``mnn.attention``."""

  def loss(q, k, v):
    out, m = mnn.attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, impl=impl,
                           block_size=block_size, is_causal=is_causal, return_max_logits=capture)
    return jnp.mean(out.astype(jnp.float32) ** 2), (m if capture else jnp.zeros(()))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _cudnn_step():
  """Plain ``jax.nn.dot_product_attention`` on cuDNN, no capture (v padded to q/k width)."""

  def loss(q, k, v):
    dv = v.shape[-1]
    v_pad = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
    out = jax.nn.dot_product_attention(q, k, v_pad, scale=q.shape[-1] ** -0.5, is_causal=True,
                                       implementation="cudnn")[..., :dv]
    return jnp.mean(out.astype(jnp.float32) ** 2), jnp.zeros(())

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _compile_or_report(fns: dict, args_: tuple, label: str) -> dict:
  for key in list(fns):  # a contender that does not compile is reported, not fatal
    try:
      jax.block_until_ready(fns[key](*args_))
    except Exception as e:  # noqa: BLE001 (any compile/runtime failure of one contender)
      print(f"<!-- {label} {key}: {type(e).__name__}: {str(e)[:200]} -->")
      del fns[key]
  return fns


def _bf16_qkv(seq, h, hkv, d, dv):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((1, seq, h, d), (1, seq, hkv, d), (1, seq, hkv, dv)))


def tpu(args) -> None:
  backend = jax.default_backend()
  if backend != "tpu":
    print(f"\n## TPU section: SKIPPED (backend {backend!r}; it needs a TPU). "
          "No splash figures were measured.")
    return
  print(f"\n## TPU: forward+backward, bf16, causal, batch 1, median of "
        f"{args.accelerator_repeats} (min-max), ms, on {jax.devices()[0].device_kind}\n")
  print("| shape | seq | splash+capture | splash | capture overhead | chunked+capture |")
  print("|---|---|---|---|---|---|")
  for seq in args.accelerator_seq_lens:
    for name, shape in ACCELERATOR_SHAPES.items():
      qkv = _bf16_qkv(seq, *shape)
      fns = _compile_or_report({
          "splash_on": _attention_step("splash", True),
          "splash_off": _attention_step("splash", False),
          "chunked_on": _attention_step("chunked", True, block_size=args.block_size),
      }, qkv, f"{name} {seq}")
      times = _time_alternating(fns, qkv, args.accelerator_repeats)
      med = {key: statistics.median(ts) for key, ts in times.items()}
      cell = lambda key: _fmt(times[key]) if key in times else "n/a"
      over = (f"{100 * (med['splash_on'] / med['splash_off'] - 1):+.1f}%"
              if "splash_on" in med and "splash_off" in med else "n/a")
      print(f"| {name} | {seq} | {cell('splash_on')} | {cell('splash_off')} | {over} | "
            f"{cell('chunked_on')} |", flush=True)


def tokamax_on_cpu(args) -> None:
  """Interpret-mode / XLA-op equality with dense, and TPU lowering of splash (no speed)."""
  del args
  if jax.default_backend() != "cpu":
    return
  try:
    import tokamax  # noqa: F401
  except ImportError:
    print("\n## tokamax on the CPU: SKIPPED (tokamax not installed: pip install 'muonclip_jax[tokamax]')")
    return
  from muonclip_jax.nn._impl.splash import splash_attention  # its interpret=False: lowering for TPU

  print("\n## tokamax on the CPU: equality with dense (no speed: splash runs in Pallas "
        "interpret mode here)\n")
  print("| impl | shape (B, T, H, Hkv, Dqk, Dv) | dtype | masks | max abs diff out | "
        "max abs diff max_logits |")
  print("|---|---|---|---|---|---|")
  b, t, h, hkv, d, dv = 2, 100, 4, 2, 24, 16
  rng = np.random.default_rng(0)
  seg = jnp.asarray((np.arange(t)[None] >= np.array([[t], [40]])).astype(np.int32))
  kw = dict(softmax_scale=d ** -0.5, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg,
            kv_mask=jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 7]])),
            return_max_logits=True)
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
               for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, dv)))
    out_d, m_d = jax.jit(lambda q, k, v: mnn.attention(q, k, v, impl="dense", **kw))(q, k, v)
    for impl in ("splash", "tokamax_gpu"):
      out, m = jax.jit(lambda q, k, v, impl=impl: mnn.attention(q, k, v, impl=impl, **kw))(q, k, v)
      diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_d.astype(jnp.float32))))
      print(f"| {impl}{' (XLA op)' if impl == 'tokamax_gpu' else ' (interpret)'} | "
            f"({b}, {t}, {h}, {hkv}, {d}, {dv}) | {jnp.dtype(dtype).name} | causal, segments, "
            f"padding | {diff:.1e} | {float(jnp.max(jnp.abs(m - m_d))):.1e} |", flush=True)

  def f(q, k, v):
    def loss(q, k, v):
      out, m = splash_attention(q, k, v, softmax_scale=0.1, is_causal=True, return_max_logits=True,
                                interpret=False)
      return jnp.sum(out.astype(jnp.float32)), m
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  h, hkv, d, dv = ACCELERATOR_SHAPES["GQA"]
  shapes = ((1, 4096, h, d), (1, 4096, hkv, d), (1, 4096, hkv, dv))
  structs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  try:
    text = jax.jit(f).trace(*structs).lower(lowering_platforms=("tpu",)).as_text()
    print(f"\nsplash fwd (with capture) + bwd, GQA 4096 tokens bf16, lowered for TPU on the CPU: "
          f"{text.count('tpu_custom_call')} Mosaic TPU custom calls")
  except Exception as e:  # noqa: BLE001
    print(f"\nsplash lowering for TPU failed: {type(e).__name__}: {str(e)[:300]}")


def accelerator(args) -> None:
  backend = jax.default_backend()
  if backend != "gpu":
    print(f"\n## GPU section: SKIPPED (backend {backend!r}; it needs a GPU). "
          "No tokamax GPU or cuDNN figures were measured.")
    return
  print(f"\n## Accelerator: forward+backward, bf16, causal, batch 1, median of "
        f"{args.accelerator_repeats} (min-max), ms, on {jax.devices()[0].device_kind}\n")
  print("| shape | seq | tokamax_gpu+capture | tokamax_gpu | capture overhead "
        "| cuDNN (no capture) | tokamax_gpu+capture speed / cuDNN | dpa_max+capture "
        "| dpa_max overhead over cuDNN | chunked+capture |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for seq in args.accelerator_seq_lens:
    for name, (h, hkv, d, dv) in ACCELERATOR_SHAPES.items():
      rng = np.random.default_rng(0)
      q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((1, seq, h, d), (1, seq, hkv, d), (1, seq, hkv, dv)))
      fns = {
          "tokamax_gpu_on": _attention_step("tokamax_gpu", True),
          "tokamax_gpu_off": _attention_step("tokamax_gpu", False),
          "cudnn": _cudnn_step(),
          "dpa_max_on": _attention_step("dpa_max", True),
          "chunked_on": _attention_step("chunked", True, block_size=args.block_size),
      }
      for key in list(fns):  # a contender that does not compile is reported, not fatal
        try:
          jax.block_until_ready(fns[key](q, k, v))
        except Exception as e:  # noqa: BLE001 (any compile/runtime failure of one contender)
          print(f"<!-- {name} {seq} {key}: {type(e).__name__}: {str(e)[:200]} -->")
          del fns[key]
      times = _time_alternating(fns, (q, k, v), args.accelerator_repeats)
      med = {key: statistics.median(ts) for key, ts in times.items()}
      cell = lambda key: _fmt(times[key]) if key in times else "n/a"
      ratio = lambda a, b, f: f(med[a], med[b]) if a in med and b in med else "n/a"
      print(
          f"| {name} | {seq} | {cell('tokamax_gpu_on')} | {cell('tokamax_gpu_off')} | "
          f"{ratio('tokamax_gpu_on', 'tokamax_gpu_off', lambda a, b: f'{100 * (a / b - 1):+.1f}%')} | "
          f"{cell('cudnn')} | {ratio('cudnn', 'tokamax_gpu_on', lambda a, b: f'{a / b:.2f}')} | "
          f"{cell('dpa_max_on')} | "
          f"{ratio('dpa_max_on', 'cudnn', lambda a, b: f'{100 * (a / b - 1):+.1f}%')} | "
          f"{cell('chunked_on')} |",
          flush=True,
      )


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
  parser.add_argument("--overhead-impls", nargs="+", default=["dense", "chunked", "dpa_max"],
                      choices=[i for i in mnn.ATTENTION_IMPLS
                               if i not in ("splash", "tokamax_gpu")])
  parser.add_argument("--skip-overhead", action="store_true")
  parser.add_argument("--skip-memory", action="store_true")
  parser.add_argument("--skip-accelerator", action="store_true")
  parser.add_argument("--accelerator-seq-lens", type=int, nargs="+", default=[4096, 8192])
  parser.add_argument("--accelerator-repeats", type=int, default=20)
  args = parser.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
  start = time.perf_counter()
  if not args.skip_overhead:
    capture_overhead(args)
  if not args.skip_memory:
    dense_vs_chunked(args)
  if not args.skip_accelerator:
    tpu(args)
    accelerator(args)
    tokamax_on_cpu(args)
  print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
