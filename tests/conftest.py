"""Test configuration, set before JAX starts: 8 fake CPU devices, strict rank promotion, and
XLA:CPU compiling fast.

Compiling dominates this suite (a train step of the 2-layer toy model took 4.6 s to compile
and 0.1 s to run), so the tests ask XLA:CPU for quick code rather than fast code:

* ``--xla_backend_optimization_level=0``: LLVM without its optimization passes (XLA's HLO
  passes, fusion included, are unchanged).
* On the XLA versions that still have them (JAX 0.10; gone in 0.12, where an unknown flag
  aborts the process, so a subprocess tries it first), the legacy fusion emitters,
  ``--xla_cpu_use_fusion_emitters=false``. They round some programs differently from the
  default emitters, as another CPU does: ``_exactness.py`` holds the rule that makes the
  suite pass under either, on any machine. A run that sets
  ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=true`` keeps the default emitters.

No persistent compilation cache: one per run, shared by the pytest-xdist workers, saved no
time (both suites with and without it on one machine: ``benchmarks/RESULTS.md``), and the
two crashes seen in the suite, segmentation faults of a JAX 0.12 worker, came on its path
(once in its write, once in the compile before it). Neither reproduced, so it is not shown
to be their cause.

Child processes get the same flags (``_child_env.py``). Timings are never measured here
(``benchmarks/`` does).
"""

import os
import subprocess
import sys

_DECIDED_VAR = "MUONCLIP_JAX_TEST_FLAGS"  # set once the flags are chosen
_FAST = "--xla_backend_optimization_level=0"
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib knows ``flag`` (XLA aborts on an unknown one, so ask a subprocess)."""
  env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True).returncode == 0


# The process that starts first (pytest-xdist's controller, or a run without workers) decides
# once; the workers it starts inherit its environment.
if _DECIDED_VAR not in os.environ:
  # A run that names the emitters itself (``XLA_FLAGS=--xla_cpu_use_fusion_emitters=true``, to
  # check the suite under the default ones) keeps its choice.
  chosen = "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", "")
  legacy = not chosen and _xla_accepts(LEGACY_EMITTERS_FLAG)
  flags = [_FAST] + ([LEGACY_EMITTERS_FLAG] if legacy else [])
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
  os.environ[_DECIDED_VAR] = os.environ["XLA_FLAGS"]

import jax  # noqa: E402

# Must run before any JAX operation initializes the backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.load_profile("default")
