"""Muon's Newton–Schulz band at each backend's default matmul precision, emulated on the CPU.

  python benchmarks/emulated_band.py            # every shape (~40 s on 2 cores)
  python benchmarks/emulated_band.py --quick    # wide and square only
  python benchmarks/emulated_band.py --flops    # the GPU policy's matmul FLOPs against optax's
  python benchmarks/emulated_band.py --large    # the GPU policy's band on 2048x8192
  python benchmarks/emulated_band.py --more     # 15 other inputs on 11 other shapes (~10 min)
  python benchmarks/emulated_band.py --small    # spectra ending just above the cutoff, sides 4 to 32
  python benchmarks/emulated_band.py --clusters # a flat tail just above the cutoff, sides 8 to 768
  python benchmarks/emulated_band.py --localized # the same tail in a small block of a larger matrix
  python benchmarks/emulated_band.py --sharded  # split over 8 fake devices against one device

For each emulated backend (``tests/_emulated_backend.py``: float32 dots that name no
precision get bf16 operands on "tpu", TF32 on "gpu", exact float32 on "cpu"), each
``ns_method`` ("auto", "standard", "gram") and compute dtype (float32, bfloat16), one update
of ``mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=..., compute_dtype=...)`` on
Gaussian, low-rank (rank 16 + 1e-3 noise) and condition-1e6 inputs of the shapes of
``_emulated_backend.SHAPES``. The update is divided by ``-0.2 sqrt(max(rows, cols))``
(Moonlight's RMS factor; learning rate 1 negates it) and measured by ``band``: the largest
singular value (ideally <= 1.2; flagged above 1.205) and the smallest and largest response
``u_i^T X v_i`` along the input's singular pairs with ``s_i >= 3e-3 ||G||_F`` (required:
within [0.70, 1.25]). Nothing is asserted; prints a summary (worst case per backend, method
and dtype) and the full Markdown table.

``--large`` measures instead the GPU policy on 2048x8192 Gaussian and condition-1e6 inputs
(``"auto"`` and ``"gram"``, float32 and bfloat16 compute), where the first step's ``X X^T``
has entries that float16 holds only as subnormals (``_orthogonalize/precision.py``).

``--more`` runs the same update on other inputs (``MORE_KINDS``: low rank with other ranks and
noise, condition 1e3 and 1e8, linear and clustered spectra, an orthogonal matrix, heavy tails,
an outlier row or column, sparse, mean-dominated with float32 and with bfloat16 values, entries
of 1e20) and other shapes (``MORE_SHAPES``: 2 to 4096 rows, aspect up to 4096, stacks), each
matrix of a stack drawn anew,
and prints the worst case per backend, method and dtype and every case outside the band.

``--small`` runs it on small matrices (``SMALL_SHAPES``: sides 4 to 32), 40 draws each of
spectra that end just above the cutoff (``small_kinds``: geometric from 1 to 3.2e-3, 3.5e-3
and 4e-3 of the largest, and condition 1e6), of float32 values and of bfloat16 values: where
bfloat16 compute's rounding of the input (about 2^-9 of its entries; none for bfloat16 values,
which ``newton_schulz`` scales by powers of two only) is of the size of the smallest singular
value measured.

``--clusters`` runs it on ``CLUSTER_SHAPES`` (sides 8 to 768), 20 draws each of float32
spectra with one or four singular values at 1 and the rest at 3.02e-3 or 3.1e-3 of the norm
(``cluster_kinds``), 1.007 and 1.03 times the cutoff: where the 8-bit rounding of a float32 input
(a TPU's one pass, bfloat16 compute) moves them below it, most on the smallest matrices.

``--localized`` puts the same spectra (one singular value at 1, the rest at 1.007 or 1.03 times
the cutoff) in a ``b x c`` block (``LOCALIZED_BLOCKS``: 4x8 to 32x32) of a zero matrix of
``LOCALIZED_SHAPES`` (65x64 to 256x1024), 5 draws each: a gradient that lies in a few rows and
columns is rounded like a matrix of the block's size, whatever the matrix's.

``--sharded`` runs the update split over 8 fake CPU devices (``shard_orthogonalization`` on a
mesh of 8, ``shard_split="always"``: every matrix's Newton–Schulz split over the devices) and on
one device, on 64x512 Gaussian and condition-1e6 inputs and ``--clusters``' spectra (one value
at 1, the rest at 1.007 times the cutoff) on 64x512 and 16x512, 2 draws each, and prints per
backend, method and compute dtype the largest difference of the two over the update's largest
entry and each one's band: the two round differently, most along singular directions below
the cutoff, which Newton–Schulz does not resolve.

``--flops`` prints instead the GPU policy's matmul FLOPs, traced (no arrays) on the
shapes (4096x16384, 4096x4096, a 64x2048x7168 expert stack) as if on a GPU, against
``optax.contrib.muon``'s with its defaults: a product with a float32 operand counted twice (the
TF32 rate is half the 16-bit one; ``_emulated_backend.weighted_flops``), with the operand dtypes
and the batch sizes of the products (one batched call for the stack).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--sharded" in sys.argv:  # before JAX starts
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_var, "1")  # NumPy's SVDs beside XLA's threads: no oversubscription
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _emulated_backend as eb  # noqa: E402
import muonclip_jax as mc  # noqa: E402

METHODS = ("auto", "standard", "gram")
DTYPES = (("float32", None), ("bfloat16", jnp.bfloat16))
LOW, HIGH, TOP = 0.70, 1.25, 1.2
TOP_SLACK = 5e-3  # "top > 1.2" flags only what exceeds it by more than this (1.2002 is 1.2)


def _update_fn(method: str, compute_dtype):
  opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=method, compute_dtype=compute_dtype,
                matrix_axes=mc.MatrixAxes((-2,), (-1,)))  # 2-D: the matrix; 3-D: per expert

  @jax.jit
  def update(grads, state, params):
    return opt.update(grads, state, params)[0]

  return opt, update


def large() -> None:
  """The ``--large`` table (module docstring)."""
  print(f"JAX {jax.__version__}; emulated GPU (float16 policy), 2048x8192\n")
  print("| input | method | compute dtype | largest singular value | min response | max response |")
  print("|---|---|---|---|---|---|")
  for kind in ("gaussian", "cond_1e6"):
    g = jnp.asarray(eb.make_input(kind, (2048, 8192)))
    svd = eb.input_svd(g)
    for method in ("auto", "gram"):
      for cd_name, cd in DTYPES:
        opt, update = _update_fn(method, cd)
        with eb.emulate("gpu"):
          out = update(g, opt.init(g), g)
        b = eb.band(out, g, scale=-eb.moonlight_scale(g.shape), svd=svd)
        print(f"| {kind} | {method} | {cd_name} | {b.top:.3f} | {b.low:.3f} | {b.high:.3f} |", flush=True)


FLOP_SHAPES = {"4096x16384": (4096, 16384), "4096x4096": (4096, 4096), "64 experts of 2048x7168": (64, 2048, 7168)}


def flops() -> None:
  """The ``--flops`` table (module docstring)."""
  from optax import contrib
  print(f"JAX {jax.__version__}; matmul FLOPs of one update traced as if on a GPU, a product with a float32 "
        "operand counted twice\n")
  print("| matrices | compute dtype | ours (GFLOP, weighted) | operands | batch | optax.contrib.muon | ratio |")
  print("|---|---|---|---|---|---|---|")
  for name, shape in FLOP_SHAPES.items():
    g = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    stack = len(shape) == 3
    theirs_opt = contrib.muon(1.0, muon_weight_dimension_numbers={"w": contrib.MuonDimensionNumbers((1,), (2,))}
                              if stack else None)
    theirs, _, _ = eb.weighted_flops(lambda t: theirs_opt.update(t, theirs_opt.init(t), t), g)
    for cd_name, cd in DTYPES:
      opt = mc.muon(1.0, compute_dtype=cd, matrix_axes=mc.MatrixAxes((-2,), (-1,)))
      ours, dtypes, batches = eb.weighted_flops(lambda t: opt.update(t, opt.init(t), t), g)
      print(f"| {name} | {cd_name} | {ours / 1e9:.0f} | {', '.join(sorted(str(d) for d in dtypes))} "
            f"| {', '.join(map(str, sorted(batches)))} | {theirs / 1e9:.0f} | {ours / theirs:.3f} |")


MORE_SHAPES = ((64, 4096), (4096, 64), (200, 300), (128, 256), (256, 128), (33, 1000), (512, 512), (4, 64, 512),
               (7, 96, 40), (2, 8192), (3, 16, 2048))


def more_kinds(m: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """``--more``'s inputs of one ``m x n`` matrix (module docstring)."""
  k = min(m, n)

  def spectrum(s):
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return (u * s) @ v.T

  def low_rank(r, noise):
    return rng.standard_normal((m, r)) @ rng.standard_normal((r, n)) / np.sqrt(r) + noise * rng.standard_normal((m, n))

  return {
      "rank 1 + 1e-4": low_rank(1, 1e-4),
      "rank 4 + 1e-2": low_rank(4, 1e-2),
      "rank 64 + 1e-5": low_rank(min(64, k), 1e-5),
      "condition 1e3": spectrum(np.logspace(0, -3, k)),
      "condition 1e8": spectrum(np.logspace(0, -8, k)),
      "linear to 1e-6": spectrum(np.linspace(1, 1e-6, k)),
      "two clusters": spectrum(np.where(np.arange(k) < k // 2, 1.0, 1e-4)),
      "orthogonal": spectrum(np.ones(k)),
      "student-t, 2 dof": rng.standard_t(2, (m, n)),
      "outlier column": rng.standard_normal((m, n)) * np.where(np.arange(n) == 3, 1e3, 1.0),
      "outlier row": rng.standard_normal((m, n)) * np.where(np.arange(m)[:, None] == 1, 1e3, 1.0),
      "sparse (5%)": rng.standard_normal((m, n)) * (rng.random((m, n)) < 0.05),
      "mean-dominated": 1.0 + 0.01 * rng.standard_normal((m, n)),
      "entries of 1e20": 1e20 * rng.standard_normal((m, n)),
      "mean-dominated, bf16 values": (1.0 + 0.01 * rng.standard_normal((m, n))).astype(jnp.bfloat16),
  }


SMALL_SHAPES = ((4, 4), (8, 8), (16, 16), (8, 32), (32, 8), (32, 32))


def small_kinds(m: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """``--small``'s inputs of one ``m x n`` shape (module docstring): 40 draws of each kind."""
  k, out = min(m, n), {}
  for draw in range(40):
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    for low in (3.2e-3, 3.5e-3, 4e-3, 1e-6):
      g = (u * np.geomspace(1.0, low, k)) @ v.T
      name = f"condition 1e6 #{draw}" if low == 1e-6 else f"geometric to {low:g} #{draw}"
      out[name] = g
      out[name.replace(" #", ", bf16 values #")] = g.astype(jnp.bfloat16).astype(np.float32)
  return out


CLUSTER_SHAPES = ((8, 8), (16, 16), (24, 24), (32, 32), (48, 48), (64, 64), (96, 96), (128, 128), (16, 256),
                  (64, 768))


def cluster_kinds(m: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """``--clusters``' inputs of one ``m x n`` shape (module docstring): 20 draws of each kind."""
  k, out = min(m, n), {}
  for draw in range(20):
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    for top in (1, 4):
      for rel in (3.02e-3, 3.1e-3):  # of the Frobenius norm, with the top ones at 1
        small = rel * np.sqrt(top / (1 - (k - top) * rel**2))
        out[f"{top} at 1, the rest at {rel:g} #{draw}"] = (u * np.array([1.0] * top + [small] * (k - top))) @ v.T
  return out


LOCALIZED_SHAPES = ((65, 64), (128, 128), (128, 256), (256, 1024))
LOCALIZED_BLOCKS = ((4, 8), (4, 32), (8, 8), (16, 16), (32, 32))


def localized_kinds(m: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """``--localized``' inputs of one ``m x n`` shape (module docstring): 5 draws of each block."""
  out = {}
  for b, c in LOCALIZED_BLOCKS:
    k = min(b, c)
    for draw in range(5):
      u, _ = np.linalg.qr(rng.standard_normal((b, k)))
      v, _ = np.linalg.qr(rng.standard_normal((c, k)))
      for rel in (3.02e-3, 3.1e-3):
        small = rel / np.sqrt(1 - (k - 1) * rel**2)
        g = np.zeros((m, n))
        g[:b, :c] = (u * np.array([1.0] + [small] * (k - 1))) @ v.T
        out[f"{b}x{c} block, the rest at {rel:g} #{draw}"] = g
  return out


def more(shapes=MORE_SHAPES, kinds=more_kinds, what="other inputs and shapes") -> None:
  """The ``--more`` sweep (module docstring); ``--small``'s with its shapes and kinds."""
  print(f"JAX {jax.__version__}, emulated backends; {what}\n")
  worst, bad, start = {}, [], time.perf_counter()
  for shape in shapes:
    rng = np.random.default_rng([7, *shape])
    *batch, m, n = shape
    mats = [kinds(m, n, rng) for _ in range(int(np.prod(batch)) if batch else 1)]
    grads = {kind: jnp.asarray(np.stack([x[kind] for x in mats]).reshape(shape).astype(np.float32))
             for kind in mats[0]}
    svds = {kind: eb.input_svd(g) for kind, g in grads.items()}
    for cd_name, cd in DTYPES:
      for method in METHODS:
        opt, update = _update_fn(method, cd)
        state = opt.init(grads)
        for backend in eb.BACKENDS:
          with eb.emulate(backend):
            out = jax.device_get(update(grads, state, grads))
          for kind, g in grads.items():
            b = eb.band(out[kind], g, scale=-eb.moonlight_scale(g.shape), svd=svds[kind])
            key = (backend, method, cd_name)
            w = worst.get(key, (0.0, 9.0, 0.0))
            worst[key] = (max(w[0], b.top), min(w[1], b.low), max(w[2], b.high))
            if b.top > HIGH or b.low < LOW or b.high > HIGH:
              bad.append(f"| {backend} | {method} | {cd_name} | {kind} | {'x'.join(map(str, shape))} "
                         f"| {b.top:.3f} | {b.low:.3f} | {b.high:.3f} |")
    print(f"# {shape}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
  print("| backend | method | compute dtype | largest singular value | min response | max response |")
  print("|---|---|---|---|---|---|")
  for (backend, method, cd_name), (top, low, high) in sorted(worst.items()):
    print(f"| {backend} | {method} | {cd_name} | {top:.3f} | {low:.3f} | {high:.3f} |")
  print(f"\n{len(bad)} cases outside [{LOW:.2f}, {HIGH:.2f}] or above {HIGH}:\n")
  if bad:
    print("| backend | method | compute dtype | input | shape | largest singular value | min response | max response |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(bad))


def sharded() -> None:
  """The ``--sharded`` table (module docstring)."""
  mesh = jax.make_mesh((8,), ("model",))
  print(f"JAX {jax.__version__}, emulated backends; 8 fake CPU devices, shard_split='always', against one device\n")
  print("| backend | method | compute dtype | largest difference / largest entry | input | band, 1 device "
        "(top / low / high) | band, 8 devices | largest band difference, every input |")
  print("|---|---|---|---|---|---|---|---|")
  grads = {}
  for draw in range(2):
    rng = np.random.default_rng([11, draw])
    for kind in ("gaussian", "cond_1e6"):
      grads[f"{kind} #{draw}"] = jnp.asarray(eb.make_input(kind, (64, 512), seed=draw))
    for m in (64, 16):
      grads[f"clusters {m}x512 #{draw}"] = jnp.asarray(cluster_kinds(m, 512, rng)["1 at 1, the rest at 0.00302 #0"],
                                                       jnp.float32)
  svds = {k: eb.input_svd(g) for k, g in grads.items()}
  fmt = lambda b: f"{b.top:.4f} / {b.low:.4f} / {b.high:.4f}"  # noqa: E731
  for backend in eb.BACKENDS:
    for method in METHODS:
      for cd_name, cd in DTYPES:
        out = []
        for target in (None, mesh):
          opt = mc.muon(1.0, weight_decay=0.0, beta=0.0, ns_method=method, compute_dtype=cd,
                        shard_orthogonalization=target, shard_split="always")
          with eb.emulate(backend):
            out.append(jax.device_get(jax.jit(lambda g, s, o=opt: o.update(g, s, g)[0])(grads, opt.init(grads))))
        diffs = {k: float(np.max(np.abs(out[1][k] - out[0][k])) / np.max(np.abs(out[0][k]))) for k in grads}
        bands = {k: [eb.band(o[k], g, scale=-eb.moonlight_scale(g.shape), svd=svds[k]) for o in out]
                 for k, g in grads.items()}
        moved = max(abs(getattr(b[0], f) - getattr(b[1], f)) for b in bands.values() for f in ("top", "low", "high"))
        k = max(diffs, key=diffs.get)
        print(f"| {backend} | {method} | {cd_name} | {diffs[k]:.1e} | {k} | {fmt(bands[k][0])} | {fmt(bands[k][1])} "
              f"| {moved:.1e} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="wide and square shapes only")
  parser.add_argument("--flops", action="store_true", help="the GPU policy's weighted matmul FLOPs instead")
  parser.add_argument("--large", action="store_true", help="the GPU policy's band on 2048x8192 instead")
  parser.add_argument("--more", action="store_true", help="other inputs and shapes instead (~10 min)")
  parser.add_argument("--small", action="store_true", help="small matrices, spectra ending just above the cutoff")
  parser.add_argument("--clusters", action="store_true",
                      help="sides 8 to 768, one or four large singular values and the rest just above the cutoff")
  parser.add_argument("--localized", action="store_true",
                      help="--clusters' spectra in a small block of a larger matrix")
  parser.add_argument("--sharded", action="store_true", help="split over 8 fake devices against one device")
  args = parser.parse_args()
  if args.sharded:
    return sharded()
  if args.more:
    return more()
  if args.small:
    return more(SMALL_SHAPES, small_kinds, "small matrices, spectra ending just above the cutoff")
  if args.clusters:
    return more(CLUSTER_SHAPES, cluster_kinds, "a flat tail of singular values just above the cutoff")
  if args.localized:
    return more(LOCALIZED_SHAPES, localized_kinds, "a flat tail just above the cutoff in a small block")
  if args.flops:
    return flops()
  if args.large:
    return large()
  shapes = {k: v for k, v in eb.SHAPES.items() if not args.quick or k in ("wide", "square")}
  grads = {f"{kind}/{name}": jnp.asarray(eb.make_input(kind, shape))
           for name, shape in shapes.items() for kind in eb.INPUT_KINDS}
  params = jax.tree.map(jnp.zeros_like, grads)
  svds = {key: eb.input_svd(g) for key, g in grads.items()}  # once per input
  rows, start = [], time.perf_counter()
  for cd_name, cd in DTYPES:
    for method in METHODS:
      opt, update = _update_fn(method, cd)
      state = opt.init(params)
      for backend in eb.BACKENDS:
        with eb.emulate(backend):  # re-traced per backend (jax.make_user_context)
          out = jax.device_get(update(grads, state, params))
        for key, g in grads.items():
          kind, name = key.split("/")
          b = eb.band(out[key], g, scale=-eb.moonlight_scale(g.shape), svd=svds[key])
          rows.append((backend, method, cd_name, kind, name, "x".join(map(str, g.shape)), b))
      print(f"# {cd_name} {method}: {time.perf_counter() - start:.0f} s", file=sys.stderr)

  def flag(b):
    out = []
    if b.top > TOP + TOP_SLACK:
      out.append(f"top > {TOP}")
    if b.low < LOW or b.high > HIGH:
      out.append(f"outside [{LOW:.2f}, {HIGH:.2f}]")
    return "; ".join(out)

  print(f"JAX {jax.__version__}, {jax.devices()[0].platform} (emulated backends), "
        f"{time.perf_counter() - start:.0f} s\n")
  print("## Worst case over inputs and shapes\n")
  print("| backend | method | compute dtype | largest singular value | min response "
        "| max response | flagged cases |")
  print("|---|---|---|---|---|---|---|")
  for cd_name, _ in DTYPES:
    for method in METHODS:
      for backend in eb.BACKENDS:
        sel = [r for r in rows if r[:3] == (backend, method, cd_name)]
        bs = [r[-1] for r in sel]
        bad = [f"{r[3]} {r[4]}" for r in sel if flag(r[-1])]
        print(f"| {backend} | {method} | {cd_name} | {max(b.top for b in bs):.3f} "
              f"| {min(b.low for b in bs):.3f} | {max(b.high for b in bs):.3f} "
              f"| {', '.join(bad) if bad else '-'} |")
  print("\n## Every case\n")
  print("| backend | method | compute dtype | input | shape | largest singular value "
        "| min response | max response | flag |")
  print("|---|---|---|---|---|---|---|---|---|")
  for backend, method, cd_name, kind, name, shape, b in rows:
    print(f"| {backend} | {method} | {cd_name} | {kind} | {name} {shape} | {b.top:.3f} "
          f"| {b.low:.3f} | {b.high:.3f} | {flag(b)} |")


if __name__ == "__main__":
  main()
