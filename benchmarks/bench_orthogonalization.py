"""Orthogonalization benchmark: time, accuracy, FLOP rate and memory of Muon.

  PYTHONPATH=. python benchmarks/bench_orthogonalization.py            # the full run
  PYTHONPATH=. python benchmarks/bench_orthogonalization.py --quick    # a few-minute check

Prints Markdown tables (copied into benchmarks/RESULTS.md):

1. **Timing.** One jitted Muon update (Nesterov 0.95, update RMS 0.2 sqrt(max(m, n)), no
   weight decay, learning rate 1) on the hidden matrices of a GPT-2-small-like model (12
   layers of four 768x768 attention matrices, 768x3072 and 3072x768) and of a DeepSeek-style
   MLA model (wq_a, wq_b, wkv_a, wkv_b, wo and a SwiGLU MLP). Contenders run in one process,
   alternating, medians reported, next to their analytic FLOPs (matmuls only, see
   ``ns_flops``), achieved GFLOP/s, XLA's temporary memory of the compiled update, and the
   rate of a plain matmul (``P @ X`` with ``P`` of ``m x m``, one per matrix, same shapes)
   timed in the same loop. Headline at full size; the per-preset table (each preset vs
   ``optax.contrib.muon`` given the same coefficients and normalization) on fewer layers,
   since every layer repeats the same work.
2. **Accuracy.** For each preset, method and compute dtype: the response ``d_i = u_i^T O
   v_i`` of the output ``O`` along each singular pair of the input (SVD in float64; ``O =
   U V^T`` gives all ones), on the Nesterov directions of a small training run (a 2-layer
   GPT on a synthetic Markov text) and on Gaussian and condition-1e6 matrices: the band of
   ``d_i`` over singular values >= 3e-3 of the Frobenius norm, percentiles over all, the
   largest output singular value, and RMS(d - 1) over all directions.
3. **Accelerator** (only when JAX sees a GPU/TPU): bfloat16 orthogonalization of 4096x4096
   and 4096x16384 matrices vs ``optax.contrib.muon``'s and vs the bfloat16 matmul rate.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import contrib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import muonclip_jax as mc  # noqa: E402
from bench_muon import gpt2_hidden_matrices, mla_hidden_matrices  # noqa: E402
from muonclip_jax._orthogonalize import ns_flops, presets  # noqa: E402

CUTOFF = 3e-3  # singular values below this fraction of the Frobenius norm are left out of bands


def flops_of(params: dict, **kw) -> int:
  """Matmul FLOPs of the library's ``newton_schulz`` on every matrix (``ns_flops``)."""
  return sum(ns_flops(x.shape, **kw) for x in jax.tree.leaves(params))


def optax_flops(params: dict, steps: int) -> int:
  """``optax.contrib.muon``: ``steps (4 m^2 n + 2 m^3)`` per matrix (full products)."""
  return sum(steps * (4 * min(x.shape) ** 2 * max(x.shape) + 2 * min(x.shape) ** 3)
             for x in jax.tree.leaves(params))


def plain_matmul_flops(params: dict) -> int:
  return sum(2 * min(x.shape) ** 2 * max(x.shape) for x in jax.tree.leaves(params))


def plain_matmul_fn(params: dict):
  """One ``P @ X`` per matrix (``P`` is ``m x m``, ``X`` the matrix made wide): the plain rate."""
  def fn(tree):
    out = []
    for x in jax.tree.leaves(tree):
      w = x if x.shape[0] <= x.shape[1] else x.T
      out.append(w[:, : w.shape[0]] @ w)
    return out
  return fn


# ----------------------------------------------------------------------------- contenders


def _optax_table(preset: str) -> tuple[np.ndarray, str]:
  """The preset's coefficients for optax: the 1.02 norm scale folded into the first row."""
  table, scale = presets.resolve_coeffs(preset, None)
  steps = presets.resolve_steps(None, preset)
  rows = np.asarray([table[min(i, len(table) - 1)] for i in range(steps)], np.float64)
  rows[0] = rows[0] / np.asarray([scale, scale**3, scale**5])  # p(x / s)
  return rows, presets._PRESETS[preset].normalize


def optax_muon(preset: str | None = None) -> optax.GradientTransformation:
  """``optax.contrib.muon`` as configured by the library's Muon, or its default (``None``)."""
  common = dict(beta=0.95, nesterov=True, consistent_rms=0.2, weight_decay=0.0)
  if preset in (None, "muon"):
    return contrib.muon(1.0, ns_steps=5, **common)
  rows, normalize = _optax_table(preset)
  return contrib.muon(1.0, ns_coeffs=tuple(map(tuple, rows)), ns_steps=len(rows),
                      preconditioning="schatten" if normalize == "schatten4" else "frobenius", **common)


def ours(preset: str = "polar_express_4", method: str = "auto", **kw) -> optax.GradientTransformation:
  return mc.muon(1.0, weight_decay=0.0, ns_coeffs=preset, ns_method=method, **kw)


def ours_flops(params: dict, preset: str, method: str) -> int:
  return flops_of(params, steps=None, coeffs=preset, method=method)


# ----------------------------------------------------------------------------- timing


def time_contenders(contenders: dict, params: dict, repeats: int) -> list[dict]:
  """Compiles every contender, then times them alternating (with the plain matmul)."""
  grads = jax.tree.map(jnp.sin, params)
  runs = {}
  for name, (opt, flops) in contenders.items():
    state = opt.init(params)
    compiled = jax.jit(opt.update).lower(grads, state, params).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(grads, state, params))
    runs[name] = (lambda c=compiled, s=state: c(grads, s, params), flops,
                  getattr(mem, "temp_size_in_bytes", float("nan")))
  mm = jax.jit(plain_matmul_fn(params)).lower(params).compile()
  jax.block_until_ready(mm(params))
  runs["plain matmul"] = (lambda: mm(params), plain_matmul_flops(params), float("nan"))
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, (fn, _, _) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
  plain_rate = plain_matmul_flops(params) / statistics.median(times["plain matmul"])
  rows = []
  for name, (_, flops, temp) in runs.items():
    med = statistics.median(times[name])
    rows.append(dict(name=name, ms=med * 1e3, flops=flops, rate=flops / med, of_plain=flops / med / plain_rate,
                     temp_mb=temp / 2**20, spread=(min(times[name]) * 1e3, max(times[name]) * 1e3)))
  return rows


def print_timing(title: str, rows: list[dict], base: str, largest_mb: float) -> None:
  base_ms = next(r["ms"] for r in rows if r["name"] == base)
  print(f"\n### {title}\n")
  print(f"Largest matrix: {largest_mb:.1f} MiB (float32). Ratios are to `{base}`.\n")
  print("| contender | median ms (min-max) | ratio | GFLOP | GFLOP/s | % of plain matmul | temp MiB |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    temp = "" if math.isnan(r["temp_mb"]) else f"{r['temp_mb']:.1f}"
    print(f"| {r['name']} | {r['ms']:.0f} ({r['spread'][0]:.0f}-{r['spread'][1]:.0f}) | {r['ms'] / base_ms:.2f} "
          f"| {r['flops'] / 1e9:.0f} | {r['rate'] / 1e9:.1f} | {100 * r['of_plain']:.0f}% | {temp} |")


def largest_mb(params: dict) -> float:
  return max(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 2**20


def headline(params: dict, repeats: int, title: str) -> None:
  contenders = {
      "optax.contrib.muon (default: Keller, 5 steps)": (optax_muon(), optax_flops(params, 5)),
      "optax.contrib.muon (polar_express_4 table, schatten)": (
          optax_muon("polar_express_4"), optax_flops(params, 4)),
      "muonclip_jax.muon before the fast path (Keller, 5, standard)": (
          ours("muon", "standard"), ours_flops(params, "muon", "standard")),
      "muonclip_jax.muon default (polar_express_4, 4, auto)": (
          ours(), ours_flops(params, "polar_express_4", "auto")),
      "muonclip_jax.muon default, one matrix per call (ns_batch=1)": (
          ours(ns_batch=1), ours_flops(params, "polar_express_4", "auto")),
  }
  rows = time_contenders(contenders, params, repeats)
  print_timing(title, rows, "optax.contrib.muon (default: Keller, 5 steps)", largest_mb(params))


def presets_table(params: dict, repeats: int, title: str) -> None:
  contenders = {}
  for preset in presets.PRESETS:
    steps = presets.resolve_steps(None, preset)
    contenders[f"optax.contrib.muon ({preset}, {steps})"] = (optax_muon(preset), optax_flops(params, steps))
    for method in ("standard", "auto"):
      contenders[f"muonclip_jax ({preset}, {steps}, {method})"] = (
          ours(preset, method), ours_flops(params, preset, method))
  rows = time_contenders(contenders, params, repeats)
  print_timing(title, rows, "optax.contrib.muon (muon, 5)", largest_mb(params))


# ----------------------------------------------------------------------------- training run


def _markov_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
  """Token batches from a fixed random Markov chain (8 likely successors per token)."""
  rng = np.random.default_rng(seed)
  succ = rng.integers(0, vocab, (vocab, 8))
  cum = np.cumsum(rng.dirichlet(np.full(8, 0.5), vocab), axis=-1)
  out = np.empty((steps, batch, seq + 1), np.int32)
  cur = rng.integers(0, vocab, (steps, batch))
  for t in range(seq + 1):
    out[:, :, t] = cur
    idx = (rng.random((steps, batch))[..., None] > cum[cur]).sum(-1).clip(0, 7)
    cur = succ[cur, idx]
  return out


def _tiny_gpt(key, vocab: int, d: int, layers: int, ff: int, seq: int) -> dict:
  keys = iter(jax.random.split(key, 2 + 6 * layers))
  nrm = lambda shape, std: std * jax.random.normal(next(keys), shape)
  p = {"wte": nrm((vocab, d), 0.02), "wpe": nrm((seq, d), 0.01)}
  out_std = d**-0.5 / math.sqrt(2 * layers)
  for i in range(layers):
    p[f"h{i}"] = {"wq": nrm((d, d), d**-0.5), "wk": nrm((d, d), d**-0.5), "wv": nrm((d, d), d**-0.5),
                  "wo": nrm((d, d), out_std), "fc": nrm((d, ff), d**-0.5), "proj": nrm((ff, d), out_std)}
  return p


def _gpt_loss(p: dict, tokens: jax.Array, heads: int) -> jax.Array:
  def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

  inp, tgt = tokens[:, :-1], tokens[:, 1:]
  b, t = inp.shape
  x = p["wte"][inp] + p["wpe"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for i in range(sum(k.startswith("h") for k in p)):
    lp, h = p[f"h{i}"], rms(x)
    d = x.shape[-1]
    q, k, v = [(h @ lp[n]).reshape(b, t, heads, d // heads) for n in ("wq", "wk", "wv")]
    att = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads), -1e9)
    x = x + jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v).reshape(b, t, d) @ lp["wo"]
    x = x + jax.nn.gelu(rms(x) @ lp["fc"]) @ lp["proj"]
  logits = rms(x) @ p["wte"].T
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1))


def training_directions(steps: int = 60, capture=(9, 59), d: int = 256, layers: int = 2) -> list[np.ndarray]:
  """Nesterov directions ``g + 0.95 m`` of the hidden matrices of a tiny GPT trained with
  ``muonclip_jax.muon_adamw`` on a synthetic Markov text, at the steps in ``capture``."""
  seq, vocab, heads = 64, 256, 4
  data = _markov_batches(steps, 16, seq, vocab)
  params = _tiny_gpt(jax.random.key(0), vocab, d, layers, 4 * d, seq)
  opt = mc.muon_adamw(0.01)
  state = opt.init(params)

  @jax.jit
  def step(params, state, tokens):
    loss, g = jax.value_and_grad(_gpt_loss)(params, tokens, heads)
    u, state = opt.update(g, state, params)
    return optax.apply_updates(params, u), state, loss, {k: v for k, v in g.items() if k.startswith("h")}

  mom, out, loss = None, [], float("nan")
  for t in range(steps):
    params, state, loss, g = step(params, state, jnp.asarray(data[t]))
    mom = g if mom is None else jax.tree.map(lambda m, x: 0.95 * m + x, mom, g)
    if t in capture:
      out += [np.asarray(x) for x in jax.tree.leaves(jax.tree.map(lambda m, x: x + 0.95 * m, mom, g))]
  print(f"training run: {layers}-layer GPT, d={d}, {steps} steps, final loss {float(loss):.3f} "
        f"(uniform: {math.log(vocab):.3f}); {len(out)} directions captured at steps {[c + 1 for c in capture]}")
  return out


def synthetic_matrices(seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  out = []
  for shape in [(256, 256), (256, 1024), (1024, 256)]:
    x = rng.standard_normal(shape)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    out += [x, (u * np.logspace(0, -6, min(shape))) @ vt]
  return out


# ----------------------------------------------------------------------------- accuracy


def optax_orthogonalize(x: jax.Array) -> jax.Array:
  """``optax.contrib.muon``'s default orthogonalization alone (no momentum: beta = 0)."""
  tx = contrib.scale_by_muon(beta=0.0, nesterov=False,
                             weight_dimension_numbers={"w": contrib.MuonDimensionNumbers()})
  return tx.update({"w": x}, tx.init({"w": x}))[0]["w"]


def response(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
  """``(d_i, sigma_i / ||x||_F, max singular value of y)`` from the SVD of ``x``."""
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  d = np.einsum("ij,ik,kj->j", u, y, vt.T)
  return d, s / np.linalg.norm(x), float(np.linalg.norm(y, 2))


def accuracy_row(fn, mats: list[np.ndarray], dtype) -> dict:
  ds, keep, top = [], [], 0.0
  for x in mats:
    xq = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the rounded input
    y = np.asarray(fn(jnp.asarray(x, dtype)).astype(jnp.float32), np.float64)
    d, rel, t = response(xq, y)
    ds.append(d)
    keep.append(rel >= CUTOFF)
    top = max(top, t)
  d, k = np.concatenate(ds), np.concatenate(keep)
  return dict(lo=d[k].min(), hi=d[k].max(), p1=np.percentile(d, 1), p50=np.median(d), top=top,
              rms=float(np.sqrt(np.mean((d - 1) ** 2))), d=d)


def accuracy_table(real: list[np.ndarray], synthetic: list[np.ndarray], flops_params: dict) -> None:
  cases = [("optax.contrib.muon default", None, "standard", jnp.float32, None)]
  for preset in presets.PRESETS:
    for method in ("standard", "auto"):
      for dtype in (jnp.float32, jnp.bfloat16):
        cases.append((f"{preset}", preset, method, dtype, dtype))
  print("\n### Orthogonality error vs FLOPs\n")
  print(f"`d_i = u_i^T O v_i` per singular pair of the input; band over `sigma_i >= {CUTOFF} ||G||_F`; "
        "p1/p50 and RMS(d - 1) over all directions; `max sigma(O)` is the largest output singular value. "
        f"{len(real)} real directions, {len(synthetic)} synthetic matrices (Gaussian and condition 1e6, "
        "256x256, 256x1024, 1024x256). Closer / farther: the share of real directions whose |1 - d_i| is "
        "smaller / larger by more than 0.02 than with optax's default. "
        "`auto` is Gram Newton-Schulz on the 256x1024 and 1024x256 "
        "matrices and the standard iteration on the squares. GFLOP: one update of the 12-layer GPT-2 set.\n")
  print("| orthogonalization | method | dtype | steps | GFLOP | real: band | real: p1, p50 | real: RMS(d-1) "
        "| real: closer / farther | real: max sigma(O) | synthetic: band | synthetic: max sigma(O) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  base = None
  for name, preset, method, dtype, compute in cases:
    steps = presets.resolve_steps(None, preset or "muon")
    if preset is None:
      def fn(x):
        return optax_orthogonalize(x)
      gflop = optax_flops(flops_params, 5) / 1e9
    else:
      gflop = flops_of(flops_params, steps=steps, coeffs=preset, method=method) / 1e9

      def fn(x, preset=preset, method=method, compute=compute):
        return mc.newton_schulz(x, steps=None, coeffs=preset, method=method, compute_dtype=compute)
    fn = jax.jit(fn)
    r, s = accuracy_row(fn, real, dtype), accuracy_row(fn, synthetic, dtype)
    base = r["d"] if base is None else base
    gap = np.abs(1 - r["d"]) - np.abs(1 - base)  # per direction, against optax's default
    vs = f"{100 * np.mean(gap < -0.02):.0f}% / {100 * np.mean(gap > 0.02):.0f}%"
    print(f"| {name} | {method} | {jnp.dtype(dtype).name} | {steps} | {gflop:.0f} | [{r['lo']:.3f}, {r['hi']:.3f}] "
          f"| {r['p1']:.3f}, {r['p50']:.3f} | {r['rms']:.3f} | {vs} | {r['top']:.3f} | [{s['lo']:.3f}, {s['hi']:.3f}] "
          f"| {s['top']:.3f} |")


# ----------------------------------------------------------------------------- accelerator


def accelerator_section(repeats: int) -> None:
  """bfloat16 orthogonalization of 4096x4096 and 4096x16384 vs optax and the bf16 matmul rate."""
  print(f"\n### bfloat16 on {jax.devices()[0].device_kind}\n")
  print("| matrix | contender | median ms | GFLOP | TFLOP/s | % of bf16 matmul | ratio to optax |")
  print("|---|---|---|---|---|---|---|")
  for shape in [(4096, 4096), (4096, 16384)]:
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    m, n = min(shape), max(shape)
    fns = {
        "plain bf16 matmul": (jax.jit(lambda x: x[:, :m] @ x), 2 * m * m * n),
        "optax.contrib.muon": (jax.jit(optax_orthogonalize), 5 * (4 * m * m * n + 2 * m**3)),
        "muonclip_jax default": (jax.jit(lambda x: mc.newton_schulz(
            x, steps=None, coeffs="polar_express_4", method="auto")),
            ns_flops(shape, steps=None, coeffs="polar_express_4", method="auto")),
    }
    times = {k: [] for k in fns}
    for fn, _ in fns.values():
      jax.block_until_ready(fn(x))
    for _ in range(repeats):
      for k, (fn, _) in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = fns["plain bf16 matmul"][1] / med["plain bf16 matmul"]
    for k, (_, fl) in fns.items():
      print(f"| {shape[0]}x{shape[1]} | {k} | {med[k] * 1e3:.2f} | {fl / 1e9:.0f} | {fl / med[k] / 1e12:.1f} "
            f"| {100 * fl / med[k] / plain:.0f}% | {med[k] / med['optax.contrib.muon']:.2f} |")


# ----------------------------------------------------------------------------- main


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="headline on 1 layer each, 2 repeats, no preset tables, short training run")
  parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers of the headline timing")
  parser.add_argument("--mla-layers", type=int, default=4, help="MLA layers of the headline timing")
  parser.add_argument("--preset-layers", type=int, default=2, help="GPT-2 layers of the per-preset table")
  parser.add_argument("--preset-mla-layers", type=int, default=1, help="MLA layers of the per-preset table")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip", nargs="*", default=(), choices=("headline", "presets", "accuracy", "accelerator"))
  args = parser.parse_args()
  if args.quick:
    args.layers, args.mla_layers, args.preset_layers, args.preset_mla_layers, args.repeats = 1, 1, 1, 1, 2
    args.skip = tuple(args.skip) + ("presets",)
  t_start = time.perf_counter()
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"{jax.devices()[0].device_kind}, {platform.machine()} x {os.cpu_count()} cores, "
        f"{platform.python_version()}")
  print(f"command: {' '.join(['python'] + sys.argv)}")
  if "headline" not in args.skip:
    headline(gpt2_hidden_matrices(args.layers), args.repeats,
             f"One Muon update, GPT-2-small hidden matrices, {args.layers} layers")
    headline(mla_hidden_matrices(args.mla_layers), args.repeats,
             f"One Muon update, DeepSeek-style MLA hidden matrices, {args.mla_layers} layers")
  if "presets" not in args.skip:
    presets_table(gpt2_hidden_matrices(args.preset_layers), args.repeats,
                  f"Presets vs optax configured the same way, GPT-2, {args.preset_layers} layers")
    presets_table(mla_hidden_matrices(args.preset_mla_layers), args.repeats,
                  f"Presets vs optax configured the same way, MLA, {args.preset_mla_layers} layers")
  if "accuracy" not in args.skip:
    real = training_directions(steps=20 if args.quick else 60, capture=(9, 19) if args.quick else (9, 59))
    accuracy_table(real, synthetic_matrices(), jax.eval_shape(lambda: gpt2_hidden_matrices(12)))
  if "accelerator" not in args.skip:
    if jax.default_backend() == "cpu":
      print("\n### Accelerator\n\nNo GPU/TPU visible to JAX: the bfloat16 4096x4096 / 4096x16384 section was skipped.")
    else:
      accelerator_section(args.repeats)
  print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
  main()
