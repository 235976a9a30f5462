"""Every accelerator measurement in one prepared run, written as one Markdown report.

  PYTHONPATH=. python3 benchmarks/accelerator.py --out report.md    # on one H100/H200: ~5 minutes
  PYTHONPATH=. python benchmarks/accelerator.py --dry-run           # every section, tiny shapes, CPU

A GPU is lent to a session for a few minutes at most, so the run is planned beforehand and
each section is timed, reported and written to ``--out`` as soon as it ends (a run cut off
by its time limit keeps the tables it finished). A section that fails is reported with its
error and the run goes on. Sections:

1. **Newton–Schulz in bf16** on 4096x4096 and 4096x16384: ``muonclip_jax.muon`` with the
   default preset (``polar_express_4``) and Keller Jordan's (``muon``, 5 steps), each
   ``standard`` and ``gram``, against ``optax.contrib.muon`` configured the same way (same
   coefficients, steps and normalization), and a plain bf16 matmul ``P @ X`` of the same
   shapes (``P`` the ``m x m`` left block) timed in the same loop. Each contender is a whole
   jitted update of a one-matrix tree (Nesterov 0.95, update RMS 0.2 sqrt(max(m, n)), no
   weight decay), whose Newton–Schulz is nearly all of its work. FLOPs are the matmuls'
   (``ns_flops``; optax: ``steps (4 m^2 n + 2 m^3)``).
2. **The Gram iteration's precision** on a 4096x16384 matrix whose rows span three decades:
   the library's Gram method at the backend's policy (``_orthogonalize.precision``; on a GPU
   float16 operands, restarted every 2 steps) and at ``precision="highest"`` (``m x m``
   iteration in float32, every product ``HIGHEST``), a bf16 ``m x m`` iteration written here for
   the comparison, and ``standard`` at the backend's policy. Time, and the response
   ``d_i = u_i^T O v_i`` of the output along each input singular pair (1 for an exact polar
   factor) over singular values above 3e-3 of the Frobenius norm.
   **2b. The update's band** on this backend: ``mc.muon``'s update of a condition-1e6 and a
   low-rank (16) plus noise float32 gradient, for ``ns_method`` ``auto`` (the default),
   ``standard`` and ``gram``: the largest singular value and the min and max ``d_i``.
3. **Whole updates**, float32 weights: the GPT-2-small (12 layers) and MLA (4 layers) hidden
   matrices of ``bench_per_head.py``: the default, ``ns_batch=1``, ``muon_blocks="head"``
   (per-head Muon, from the attention layout) and ``optax.contrib.muon``, alternating.
4. **An expert stack**: 64 experts of 2048x7168 in bf16 (a DeepSeek-V3-shaped slice),
   orthogonalized per expert (``MatrixAxes((-2,), (-1,))``: the leading axis batched),
   against ``optax.contrib.muon`` with ``MuonDimensionNumbers((1,), (2,))`` and the batched
   plain matmul.
5. **Attention with max-logit capture**, bf16, causal, batch 1, 4096 and 8192 tokens, MLA
   (16 heads, q/k 192, v 128) and GQA (32/8 heads, 128): tokamax's GPU kernel
   (``impl="tokamax_gpu"``) with and without capture, and cuDNN through
   ``jax.nn.dot_product_attention(implementation="cudnn")`` (values zero-padded to the q/k
   width for MLA, as its JAX API needs); forward and forward+backward.
6. **Compile time** of one update on ``bench_compile.py``'s 48-layer unscanned GPT tree:
   ``muon_adamw`` against ``optax.adamw``, fresh compiles in alternating rounds.

Timing: every contender is compiled and run once, then the contenders of a table run in
turn, ``--repeats`` times; the report gives the median and the min-max spread.

``--dry-run`` runs every section on tiny shapes on whatever JAX sees (the CPU in CI; there
tokamax's XLA op stands in for its GPU kernel and XLA's attention for cuDNN), so the script
cannot rot between the sessions that have a GPU (tests/test_accelerator_script.py).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from optax import contrib  # noqa: E402

import bench_attention  # noqa: E402
import bench_per_head  # noqa: E402
import muonclip_jax as mc  # noqa: E402
from muonclip_jax._orthogonalize import ns_flops, presets  # noqa: E402
from muonclip_jax import nn as mnn  # noqa: E402


class Sizes(NamedTuple):
  ns_shapes: tuple[tuple[int, int], ...]
  experts: tuple[int, int, int]  # count, rows, cols
  attn_seqs: tuple[int, ...]
  attn_shapes: dict  # name: (heads, kv_heads, qk width, v width)
  compile_tree: tuple[int, int, int]  # layers, width, mlp of bench_compile.py's GPT tree
  repeats: int
  compiles: int
  presets: tuple[str, ...] = ("polar_express_4", "muon")  # of sections 1 and 4
  lean: bool = False  # the dry run: leave out the contenders that only change an option, and the MLA tree,
  # whose update compiles long; one layer of each model set (compile time)


FULL = Sizes(((4096, 4096), (4096, 16384)), (64, 2048, 7168), (4096, 8192),
             {"MLA": (16, 16, 192, 128), "GQA": (32, 8, 128, 128)}, (48, 256, 1024), 10, 2)
DRY = Sizes(((16, 48),), (2, 8, 24), (32,), {"GQA": (4, 2, 8, 8)}, (2, 8, 16), 1, 1, ("polar_express_4",), True)

CUTOFF = 3e-3  # singular values below this fraction of the Frobenius norm are left out of the band


class Report:
  """Markdown written to stdout and, after every table, to ``path``."""

  def __init__(self, path: str | None):
    self.path, self.lines = path, []

  def add(self, *lines: str) -> None:
    for line in lines:
      print(line, flush=True)
      self.lines.append(line)
    if self.path:
      with open(self.path, "w") as f:
        f.write("\n".join(self.lines) + "\n")

  def table(self, header: list[str], rows: list[list[str]]) -> None:
    self.add("", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             *("| " + " | ".join(r) + " |" for r in rows), "")


def run_alternating(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
  """Each ``fn`` run once (compile, warm-up), then all in turn ``repeats`` times, the order
  reversed every other round: seconds (``bench_attention._time_alternating``, the suite's timer)."""
  return bench_attention._time_alternating(fns, (), repeats)


def ms(ts: list[float]) -> str:
  return f"{1e3 * statistics.median(ts):.2f} ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f})"


def med(ts: list[float]) -> float:
  return statistics.median(ts)


def compiled_update(opt: optax.GradientTransformation, grads, params) -> Callable[[], object]:
  state = opt.init(params)
  fn = jax.jit(opt.update).lower(grads, state, params).compile()
  return lambda: fn(grads, state, params)


def optax_like(preset: str, **kw) -> optax.GradientTransformation:
  """``optax.contrib.muon`` with the preset's coefficients, steps and normalization."""
  common = dict(beta=0.95, nesterov=True, consistent_rms=0.2, weight_decay=0.0, **kw)
  if preset == "muon":
    return contrib.muon(1.0, ns_steps=5, **common)
  table, scale = presets.resolve_coeffs(preset, None)
  steps = presets.resolve_steps(None, preset)
  rows = np.asarray([table[min(i, len(table) - 1)] for i in range(steps)], np.float64)
  rows[0] = rows[0] / np.asarray([scale, scale**3, scale**5])  # p(x / s): the norm scale folded in
  schatten = presets.resolve_options(preset, None, "standard", None, ())[0] == "schatten4"
  return contrib.muon(1.0, ns_coeffs=tuple(map(tuple, rows)), ns_steps=steps,
                      preconditioning="schatten" if schatten else "frobenius", **common)


def optax_flops(shape: tuple[int, ...], steps: int) -> int:
  *batch, r, c = shape
  m, n = min(r, c), max(r, c)
  return math.prod(batch) * steps * (4 * m * m * n + 2 * m**3)


def ours(preset: str, method: str, **kw) -> optax.GradientTransformation:
  return mc.muon(1.0, weight_decay=0.0, ns_coeffs=preset, ns_method=method, **kw)


def plain_matmul(x: jax.Array, chain: int = 8) -> tuple[Callable[[], object], int]:
  """``chain`` products ``W <- P @ W`` in one program (``P`` the leading ``m x m`` block of the
  matrix made wide, ``W`` of its shape), batched; and their FLOPs. Chained, so that one
  dispatch does not dominate a product of a fraction of a millisecond."""
  w = x if x.shape[-2] <= x.shape[-1] else jnp.swapaxes(x, -1, -2)
  m, n = w.shape[-2:]

  def products(w):
    p, out = w[..., :m], w
    for _ in range(chain):
      out = jnp.matmul(p, out)
    return out

  fn = jax.jit(products).lower(w).compile()
  return (lambda: fn(w)), chain * 2 * math.prod(w.shape[:-2]) * m * m * n


# ----------------------------------------------------------------------------- 1. Newton–Schulz


def section_newton_schulz(rep: Report, sz: Sizes) -> None:
  rep.add("## 1. Newton–Schulz in bf16, one matrix", "",
          "Median (min-max) ms of one jitted update of a one-matrix bf16 tree; TFLOP/s from the "
          "matmul FLOPs; % of the rate of plain bf16 matmuls `P @ X` of the same shapes (8 chained "
          "in one program) timed in the same loop; ratio = time "
          "over `optax.contrib.muon` configured with the same preset (below 1: faster).")
  rows = []
  for shape in sz.ns_shapes:
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    params, grads = {"w": x}, {"w": jnp.sin(x)}
    mm, mm_flops = plain_matmul(x)
    fns, flops = {"plain bf16 matmul": mm}, {"plain bf16 matmul": mm_flops}
    for preset in sz.presets:
      steps = presets.resolve_steps(None, preset)
      key = f"optax.contrib.muon ({preset})"
      fns[key], flops[key] = compiled_update(optax_like(preset), grads, params), optax_flops(shape, steps)
      for method in ("standard", "gram") if sz.lean else ("standard", "gram", "auto"):
        key = f"muonclip_jax ({preset}, {method})"
        fns[key] = compiled_update(ours(preset, method), grads, params)
        flops[key] = ns_flops(shape, steps=None, coeffs=preset, method=method)
    times = run_alternating(fns, sz.repeats)
    plain_rate = flops["plain bf16 matmul"] / med(times["plain bf16 matmul"])
    for key, ts in times.items():
      rate = flops[key] / med(ts)
      preset = "polar_express_4" if "polar_express_4" in key else "muon"
      base = f"optax.contrib.muon ({preset})"
      ratio = "" if key == "plain bf16 matmul" else f"{med(ts) / med(times[base]):.2f}"
      rows.append([f"{shape[0]}x{shape[1]}", key, ms(ts), f"{flops[key] / 1e9:.1f}", f"{rate / 1e12:.1f}",
                   f"{100 * rate / plain_rate:.0f}%", ratio])
  rep.table(["matrix", "contender", "ms", "GFLOP", "TFLOP/s", "% of bf16 matmul", "ratio to optax"], rows)


def gram_bf16(x: jax.Array, preset: str = "polar_express_4", eps: float = 1e-7) -> jax.Array:
  """The Gram iteration with its ``m x m`` products in bf16 (for comparison only; wide ``x``).

  Same polynomial as ``newton_schulz(method="gram")``: ``X0 = x / ||x||_F``, ``R = X0 X0^T``
  scaled by the Schatten-4 norm (times the preset's 1.02), ``H_k = a I + b R + c R^2``,
  ``Q <- H_k Q``, ``R <- H_k R H_k``, output ``Q X0``.
  """
  table, scale = presets.resolve_coeffs(preset, None)
  steps = presets.resolve_steps(None, preset)
  xf = x.astype(jnp.float32)
  x0 = (xf / (jnp.linalg.norm(xf) + eps)).astype(jnp.bfloat16)
  r = jnp.matmul(x0, x0.T, preferred_element_type=jnp.float32)
  s = scale * jnp.sqrt(jnp.linalg.norm(r)) + eps
  r = (r / (s * s)).astype(jnp.bfloat16)
  eye = jnp.eye(r.shape[0], dtype=jnp.bfloat16)
  q = None
  for k in range(steps):
    a, b, c = (float(v) for v in table[min(k, len(table) - 1)])
    h = a * eye + b * r + c * (r @ r)
    q = h if q is None else h @ q
    if k + 1 < steps:
      r = h @ (r @ h)
  return (jnp.matmul(q, x0, preferred_element_type=jnp.float32) / s).astype(x.dtype)


def responses(x: jax.Array, o: jax.Array) -> tuple[float, float, float, int]:
  """(min, max, RMS - 1) of ``d_i = u_i^T O v_i`` over the input's singular values >= CUTOFF
  of its Frobenius norm, and their count (float32, highest precision; ``x`` wide)."""
  with jax.default_matmul_precision("highest"):
    xf, of = x.astype(jnp.float32), o.astype(jnp.float32)
    s2, u = jnp.linalg.eigh(xf @ xf.T)  # x x^T = U diag(s^2) U^T; v_i = x^T u_i / s_i
    s = jnp.sqrt(jnp.maximum(s2, 0))
    d = jnp.sum((u.T @ of) * (u.T @ xf), axis=1) / jnp.where(s > 0, s, 1)
    keep = s >= CUTOFF * jnp.linalg.norm(xf)
    d = np.asarray(d)[np.asarray(keep)]
  return float(d.min()), float(d.max()), float(np.sqrt(np.mean((d - 1) ** 2))), int(d.size)


def section_gram_precision(rep: Report, sz: Sizes) -> None:
  shape = sz.ns_shapes[-1]
  rep.add(f"## 2. The Gram iteration's precision, {shape[0]}x{shape[1]} bf16", "",
          "Rows scaled log-uniformly over three decades (condition ~1e3). `d_i` is the output's "
          "response along the input's i-th singular pair (exact polar factor: all 1), over singular "
          f"values >= {CUTOFF:g} of the Frobenius norm. Distance: to the same polynomial run in "
          "float32 at the highest precision on the same (bf16-rounded) input.")
  g = jax.random.normal(jax.random.key(1), shape, jnp.float32)
  x = (g * jnp.logspace(0, -3, shape[0])[:, None]).astype(jnp.bfloat16)
  ns = lambda method, precision=None: (lambda x: mc.newton_schulz(x, steps=None, coeffs="polar_express_4",
                                                                  method=method, precision=precision))
  variants = {
      "gram, the backend's policy (GPU: float16 operands, a restart)": (ns("gram"), None),
      "gram, the same under jax_default_matmul_precision=bfloat16 (no effect)": (ns("gram"), "bfloat16"),
      "gram, precision=\"highest\" (m x m in float32, HIGHEST)": (ns("gram", "highest"), None),
      "gram, m x m in bf16 (written here)": (gram_bf16, None),
      "standard, the backend's policy": (ns("standard"), None),
  }
  fns, outs = {}, {}
  for key, (f, precision) in variants.items():
    ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    with ctx:
      compiled = jax.jit(f).lower(x).compile()
    fns[key] = lambda c=compiled: c(x)
    outs[key] = compiled(x)
  times = run_alternating(fns, sz.repeats)
  with jax.default_matmul_precision("highest"):  # the same polynomial on the same input, in float32
    ref = jax.jit(ns("standard", "highest"))(x.astype(jnp.float32))
  rows = []
  for key, ts in times.items():
    lo, hi, rms, count = responses(x, outs[key])
    dist = jnp.linalg.norm(outs[key].astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    rows.append([key, ms(ts), f"{lo:.3f}", f"{hi:.3f}", f"{rms:.3f}", str(count), f"{float(dist):.4f}"])
  rep.table(["variant", "ms", "min d_i", "max d_i", "RMS(d - 1)", "directions",
             "distance to float32 (rel. Frobenius)"], rows)


def band_inputs(shape: tuple[int, int]) -> dict[str, jax.Array]:
  """Condition-1e6 (``U diag(s) V^T``, ``s`` log-spaced 1 to 1e-6) and rank-16 plus 1e-3 noise inputs."""
  m, n = shape
  k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
  u, _ = jnp.linalg.qr(jax.random.normal(k1, (m, m)))
  v, _ = jnp.linalg.qr(jax.random.normal(k2, (n, m)))
  with jax.default_matmul_precision("highest"):
    cond = (u * jnp.logspace(0, -6, m)[None, :]) @ v.T
    low = jax.random.normal(k3, (m, 16)) @ jax.random.normal(k4, (16, n)) / 4.0
  low = low / jnp.sqrt(jnp.mean(low**2)) + 1e-3 * jax.random.normal(k4, (m, n))
  return {"condition 1e6": cond, "rank 16 + 1e-3 noise": low}


def section_band(rep: Report, sz: Sizes) -> None:
  shape = sz.ns_shapes[-1]
  rep.add(f"## 2b. The update's band on this backend, {shape[0]}x{shape[1]} float32 gradients", "",
          "`mc.muon(1.0, weight_decay=0, beta=0, ns_method=...)`'s update divided by Moonlight's "
          "`0.2 sqrt(max(m, n))`, each method at the backend's precision policy "
          "(`_orthogonalize.precision`; `auto` is the default). Required: the largest singular value "
          f"<= 1.25 and every response `d_i` along an input singular value >= {CUTOFF:g} of the norm in "
          "[0.70, 1.25] (`polar_express_4`: [0.779, 1.200]).")
  rows = []
  for name, g in band_inputs(shape).items():
    for method in ("auto", "standard", "gram"):
      opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=method)
      u = jax.jit(opt.update)({"w": g}, opt.init({"w": g}), {"w": g})[0]["w"]
      x = -u / (0.2 * math.sqrt(max(shape)))
      with jax.default_matmul_precision("highest"):
        top = float(jnp.linalg.svd(x.astype(jnp.float32), compute_uv=False)[0])
      lo, hi, _, count = responses(g, x)
      rows.append([name, method, f"{top:.3f}", f"{lo:.3f}", f"{hi:.3f}", str(count)])
  rep.table(["input", "ns_method", "largest singular value", "min d_i", "max d_i", "directions"], rows)


# ----------------------------------------------------------------------------- 3. whole updates


def trees(sz: Sizes) -> dict:
  """``{name: (params, layout)}``: ``bench_per_head.models``' GPT-2-small (12 layers) and
  DeepSeek-style MLA (4 layers) sets; the dry run takes their one-layer versions, GPT-2 only
  (the MLA update's compile time)."""
  out = {}
  for name, (params, _, layout) in bench_per_head.models(quick=sz.lean).items():
    if not sz.lean or "GPT" in name:
      out[f"{name}, {len(params)} layer{'s' if len(params) > 1 else ''}"] = (params, layout)
  return out


def section_updates(rep: Report, sz: Sizes) -> None:
  rep.add("## 3. Whole updates, float32 weights", "",
          "One jitted update (Nesterov 0.95, RMS 0.2 sqrt(max(m, n)), no weight decay), median "
          "(min-max) ms, contenders alternating; ratio to `optax.contrib.muon` (its defaults: "
          "Keller Jordan's 5 steps).")
  rows = []
  for name, (params, layout) in trees(sz).items():
    grads = jax.tree.map(jnp.sin, params)
    opts = {
        "optax.contrib.muon": optax_like("muon"),
        "muonclip_jax default": mc.muon(1.0, weight_decay=0.0),
        "muonclip_jax ns_batch=1": mc.muon(1.0, weight_decay=0.0, ns_batch=1),
        'muonclip_jax muon_blocks="head"': mc.muon(1.0, weight_decay=0.0, layout=layout, muon_blocks="head"),
    }
    if sz.lean:
      del opts["muonclip_jax ns_batch=1"]
    times = run_alternating({k: compiled_update(o, grads, params) for k, o in opts.items()}, sz.repeats)
    for key, ts in times.items():
      rows.append([name, key, ms(ts), f"{med(ts) / med(times['optax.contrib.muon']):.2f}"])
  rep.table(["tree", "contender", "ms", "ratio to optax"], rows)


# ----------------------------------------------------------------------------- 4. experts


def section_experts(rep: Report, sz: Sizes) -> None:
  e, r, c = sz.experts
  shape = (e, r, c)
  rep.add(f"## 4. An expert stack: {e} experts of {r}x{c}, bf16", "",
          "Each expert's matrix orthogonalized on its own (one jitted update; ours: "
          "`matrix_axes=MatrixAxes((-2,), (-1,))`, optax: `MuonDimensionNumbers((1,), (2,))`); % of the "
          "rate of batched plain bf16 matmuls (8 chained) timed in the same loop.")
  x = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
  params, grads = {"experts": x}, {"experts": jnp.sin(x)}
  axes = mc.MatrixAxes((-2,), (-1,))
  dims = {"experts": contrib.MuonDimensionNumbers((1,), (2,))}
  mm, mm_flops = plain_matmul(x)
  fns, flops = {"plain bf16 matmul (batched)": mm}, {"plain bf16 matmul (batched)": mm_flops}
  for preset in sz.presets:
    steps = presets.resolve_steps(None, preset)
    key = f"optax.contrib.muon ({preset})"
    fns[key] = compiled_update(optax_like(preset, muon_weight_dimension_numbers=dims), grads, params)
    flops[key] = optax_flops(shape, steps)
    for method, batch in (("auto", None), ("auto", e)) + (() if sz.lean else (("standard", e),)):
      key = f"muonclip_jax ({preset}, {method}{'' if batch is None else f', ns_batch={batch}'})"
      fns[key] = compiled_update(ours(preset, method, matrix_axes=axes, ns_batch=batch), grads, params)
      flops[key] = ns_flops(shape, steps=None, coeffs=preset, method=method)
  times = run_alternating(fns, sz.repeats)
  plain_rate = mm_flops / med(times["plain bf16 matmul (batched)"])
  rows = []
  for key, ts in times.items():
    rate = flops[key] / med(ts)
    base = "optax.contrib.muon (muon)" if "(muon" in key else "optax.contrib.muon (polar_express_4)"
    ratio = f"{med(ts) / med(times[base]):.2f}" if "optax" in key or "muonclip" in key else ""
    rows.append([key, ms(ts), f"{flops[key] / 1e9:.0f}", f"{rate / 1e12:.1f}", f"{100 * rate / plain_rate:.0f}%",
                 ratio])
  rep.table(["contender", "ms", "GFLOP", "TFLOP/s", "% of bf16 matmul", "ratio to optax (same preset)"], rows)


# ----------------------------------------------------------------------------- 5. attention


def attention_fns(impl: str, capture: bool, backward: bool) -> Callable:
  """jit(q, k, v) through ``mnn.attention`` (``impl="cudnn"``/``"xla"``: plain
  ``jax.nn.dot_product_attention`` with that implementation, no capture)."""

  def forward(q, k, v):
    if impl in ("cudnn", "xla"):
      dv = v.shape[-1]
      v_pad = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
      out = jax.nn.dot_product_attention(q, k, v_pad, scale=q.shape[-1] ** -0.5, is_causal=True,
                                         implementation=impl)[..., :dv]
      return out, jnp.zeros(())
    out, m = mnn.attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, impl=impl, is_causal=True,
                           return_max_logits=capture)
    return out, (m if capture else jnp.zeros(()))

  if not backward:
    return jax.jit(forward)

  def loss(q, k, v):
    out, m = forward(q, k, v)
    return jnp.mean(out.astype(jnp.float32) ** 2), m

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def section_attention(rep: Report, sz: Sizes) -> None:
  on_gpu = jax.default_backend() == "gpu"
  reference = "cudnn" if on_gpu else "xla"
  rep.add("## 5. Attention with max-logit capture, bf16, causal, batch 1", "",
          "`tokamax_gpu`: tokamax's GPU kernel (Mosaic GPU on SM90/SM100), with the per-head maxima "
          "returned or not; "
          + ("cuDNN: `jax.nn.dot_product_attention(implementation=\"cudnn\")`, no capture. "
             if on_gpu else "no GPU: tokamax's XLA op and XLA's attention stand in (dry run). ")
          + "Median (min-max) ms; overhead = with / without capture - 1; speed vs reference = "
          "reference time / tokamax-with-capture time; the captured per-head maxima against "
          "`impl=\"dense\"`'s (float32 logits of the same bf16 inputs).")
  rows = []
  for seq in sz.attn_seqs:
    for name, (h, hkv, d, dv) in sz.attn_shapes.items():
      rng = np.random.default_rng(0)
      q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((1, seq, h, d), (1, seq, hkv, d), (1, seq, hkv, dv)))
      for backward in (False, True):
        fns = {"on": attention_fns("tokamax_gpu", True, backward),
               "off": attention_fns("tokamax_gpu", False, backward),
               "ref": attention_fns(reference, False, backward)}
        errors = []
        for key in list(fns):  # a contender that does not compile is reported, not fatal
          try:
            jax.block_until_ready(fns[key](q, k, v))
          except Exception as e:  # noqa: BLE001
            errors.append(f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            del fns[key]
        times = run_alternating({key: (lambda f=f: f(q, k, v)) for key, f in fns.items()}, sz.repeats)
        cell = lambda key: ms(times[key]) if key in times else "failed"
        both = lambda a, b, f: f(med(times[a]), med(times[b])) if a in times and b in times else "n/a"
        diff = ""
        if not backward and "on" in fns:  # the captured maxima against dense attention's
          dense = jax.jit(lambda q, k, v: mnn.attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, impl="dense",
                                                        is_causal=True, return_max_logits=True)[1])(q, k, v)
          got = fns["on"](q, k, v)[1]
          diff = f"{float(jnp.max(jnp.abs(got - dense))):.1e} (of {float(jnp.max(jnp.abs(dense))):.1f})"
        rows.append([name, str(seq), "fwd+bwd" if backward else "fwd", cell("on"), cell("off"),
                     both("on", "off", lambda a, b: f"{100 * (a / b - 1):+.1f}%"), cell("ref"),
                     both("ref", "on", lambda a, b: f"{a / b:.2f}"), diff])
        for err in errors:
          rep.add(f"<!-- {name} {seq} {'fwd+bwd' if backward else 'fwd'} {err} -->")
  rep.table(["shape", "tokens", "pass", "tokamax_gpu + capture", "tokamax_gpu", "capture overhead",
             reference if on_gpu else "xla (stand-in)", "speed vs reference",
             "max abs diff of the maxima vs dense"], rows)


# ----------------------------------------------------------------------------- 6. compile time


def section_compile(rep: Report, sz: Sizes) -> None:
  from bench_compile import gpt_layer, params_of

  layers, width, hidden = sz.compile_tree
  rep.add(f"## 6. Compile time of one update, {layers}-layer unscanned GPT tree (bench_compile.py)", "",
          f"Fresh compiles in alternating rounds ({sz.compiles} per contender), median (min-max) s; "
          "step: median (min-max) ms of the compiled update.")
  params = params_of(gpt_layer(width, hidden), layers)
  grads = jax.tree.map(jnp.sin, params)
  compiles, runs = {}, {}
  for _ in range(sz.compiles):
    for name, opt in {"optax.adamw": optax.adamw(1e-3), "muonclip_jax.muon_adamw": mc.muon_adamw(1e-3)}.items():
      state = opt.init(params)
      t0 = time.perf_counter()
      fn = jax.jit(opt.update).lower(grads, state, params).compile()
      compiles.setdefault(name, []).append(time.perf_counter() - t0)
      runs[name] = lambda fn=fn, state=state: fn(grads, state, params)
  steps = run_alternating(runs, sz.repeats)
  base = med(compiles["optax.adamw"])
  rows = [[name, f"{med(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})", f"{med(ts) / base:.2f}", ms(steps[name])]
          for name, ts in compiles.items()]
  rep.table(["optimizer", "compile s", "ratio to optax.adamw", "step ms"], rows)


# ----------------------------------------------------------------------------- main

SECTIONS = {"ns": section_newton_schulz, "experts": section_experts, "updates": section_updates,
            "attention": section_attention, "gram": section_gram_precision, "band": section_band,
            "compile": section_compile}


def environment() -> list[str]:
  dev = jax.devices()[0]
  try:
    platform_version = jax.extend.backend.get_backend().platform_version
  except Exception:  # noqa: BLE001
    platform_version = "unknown"
  try:
    import tokamax
    tk = getattr(tokamax, "__version__", "installed")
  except ImportError:
    tk = "not installed"
  return [f"- device: {dev.device_kind} x {jax.device_count()} ({jax.default_backend()})",
          f"- jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}, "
          f"optax {optax.__version__}, tokamax {tk}, Python {platform.python_version()}",
          f"- runtime: {platform_version.strip()}",
          f"- host: {platform.machine()} x {os.cpu_count()} cores"]


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dry-run", action="store_true", help="every section on tiny shapes (CPU, seconds)")
  p.add_argument("--out", default=None, help="write the Markdown report here as well")
  p.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--ns-shape", type=int, nargs=2, default=None, metavar=("M", "N"),
                 help="the one matrix of sections 1 and 2 instead of their defaults")
  args = p.parse_args(argv)
  sz = DRY if args.dry_run else FULL
  if args.repeats:
    sz = sz._replace(repeats=args.repeats)
  if args.ns_shape:
    sz = sz._replace(ns_shapes=(tuple(args.ns_shape),))
  if not args.dry_run and jax.default_backend() == "cpu":
    p.error("no accelerator visible to JAX: the full run needs a GPU (use --dry-run on the CPU)")
  rep = Report(args.out)
  rep.add("# Accelerator report" + (" (dry run: tiny shapes, not figures)" if args.dry_run else ""), "",
          *environment(), f"- command: `{' '.join(['python', 'benchmarks/accelerator.py'] + (argv or sys.argv[1:]))}`",
          f"- repeats per contender: {sz.repeats}", "")
  failed = []
  start = time.perf_counter()
  for name in args.only:
    t0 = time.perf_counter()
    try:
      SECTIONS[name](rep, sz)
    except Exception:  # noqa: BLE001: one failed section is reported, the others still run
      failed.append(name)
      rep.add(f"**Section {name} failed:**", "", "```", traceback.format_exc()[-3000:], "```", "")
    rep.add(f"_(section {name}: {time.perf_counter() - t0:.0f} s)_", "")
  rep.add(f"Total: {time.perf_counter() - start:.0f} s." + (f" Failed sections: {failed}." if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
