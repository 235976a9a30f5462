"""MuonClip for JAX: Muon as Optax transforms, QK-Clip over Flax parameter pytrees."""

from ._layouts import GQALayout as GQALayout
from ._layouts import MLALayout as MLALayout

__version__ = "0.1.0"
