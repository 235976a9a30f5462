"""Newton–Schulz orthogonalization: the iteration, its presets, batching, and the distributed plans."""

from .batching import orthogonalize_leaves
from .distributed import (check_target, mesh_of, ns_flops_of, orthogonalize_leaves_sharded,
                          orthogonalize_sharded)
from .newton_schulz import newton_schulz, ns_flops
from .planner import entry_axes
from .precision import policy
from .presets import resolve_coeffs, resolve_options
from .symmetric import gram_of

__all__ = [
    "check_target", "entry_axes", "gram_of", "mesh_of", "newton_schulz", "ns_flops", "ns_flops_of",
    "orthogonalize_leaves", "orthogonalize_leaves_sharded", "orthogonalize_sharded", "policy", "resolve_coeffs",
    "resolve_options",
]
