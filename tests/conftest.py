"""Test configuration: 8 fake CPU devices before JAX starts, strict rank promotion."""

import jax

# Must run before any JAX operation initializes the backend.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import settings  # noqa: E402

settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.load_profile("default")
