"""What the test suite's XLA flags (tests/conftest.py) do to compile time.

Compiles the train step of the tests' 2-layer MLA language model (``tests/_tiny_lm.py``)
with ``optax.adamw``, ``muon_adamw`` and ``muonclip``, each in a fresh process per flag set
(XLA reads ``XLA_FLAGS`` once per process), and prints the seconds spent in trace+lower,
in XLA's compile, and in one run of the compiled step. A flag set this jaxlib does not know
is reported as such (XLA aborts on an unknown flag).

  PYTHONPATH=. .venv/bin/python benchmarks/bench_test_compile.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FLAG_SETS = {
    "default": "",
    "-O0": "--xla_backend_optimization_level=0",
    "-O0 + legacy emitters": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
}

_CHILD = r"""
import json, sys, time
sys.path.insert(0, "tests")
import jax, optax
import muonclip_jax as mc
from muonclip_jax import training
from _tiny_lm import BATCHES, CFG, init_params, make_loss_fn, matrix_axes
loss_fn, params, out = make_loss_fn(CFG), init_params(CFG, 0), {}
for name, opt, kw in [("adamw", optax.adamw(1e-2), {"qk_clip_threshold": 5.0}),
                      ("muon_adamw", mc.muon_adamw(0.1, matrix_axes=matrix_axes), {"qk_clip_threshold": 5.0}),
                      ("muonclip", mc.muonclip(0.1, layout=CFG.layout, matrix_axes=matrix_axes,
                                               qk_clip_threshold=5.0), {})]:
  step, state = jax.jit(training.make_train_step(loss_fn, opt, **kw)), opt.init(params)
  t0 = time.perf_counter(); lowered = step.lower(params, state, BATCHES[0])
  t1 = time.perf_counter(); compiled = lowered.compile()
  t2 = time.perf_counter(); jax.block_until_ready(compiled(params, state, BATCHES[0]))
  t3 = time.perf_counter()
  out[name] = [t1 - t0, t2 - t1, t3 - t2]
print(json.dumps(out))
"""


def _measure(flags: str) -> dict | None:
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
  if run.returncode != 0:
    return None
  return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="processes per flag set (medians are printed)")
  args = parser.parse_args(argv)
  import jax  # noqa: PLC0415 (only for the version line)
  print(f"JAX {jax.__version__}, Python {sys.version.split()[0]}; seconds, median of {args.repeats} processes")
  print("| flags | step | trace+lower | compile | run |")
  print("|---|---|---:|---:|---:|")
  for label, flags in FLAG_SETS.items():
    runs = [_measure(flags) for _ in range(args.repeats)]
    if any(r is None for r in runs):
      print(f"| {label} | (flag unknown to this jaxlib) | | | |")
      continue
    for step in runs[0]:
      cols = [statistics.median(r[step][i] for r in runs) for i in range(3)]
      print(f"| {label} | {step} | {cols[0]:.2f} | {cols[1]:.2f} | {cols[2]:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
