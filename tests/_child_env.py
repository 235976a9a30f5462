"""The environment of a test's child process (``subprocess``): this run's, with the XLA
compile flags ``conftest.py`` chose, but no device count (the child sets its own)."""

import os


def child_env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return {**env, **extra}
