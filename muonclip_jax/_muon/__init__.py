"""Muon: which leaves it updates, their matrix axes and blocks, and the scale_by_muon transform."""

from .alias import muon, muon_adamw
from .attention_axes import attention_matrix_axes
from .blocks import piece_dims
from .labels import muon_labels
from .layout_matrices import muon_blocks_lookup
from .matrix_axes_rules import axes_from_names, logical_matrix_axes, matrix_axes_lookup
from .scale_by_muon import scale_by_muon, ScaleByMuonState
from .state_upgrade import upgrade_opt_state

__all__ = [
    "attention_matrix_axes", "axes_from_names", "logical_matrix_axes", "matrix_axes_lookup", "muon",
    "muon_adamw", "muon_blocks_lookup", "muon_labels", "piece_dims", "scale_by_muon", "ScaleByMuonState",
    "upgrade_opt_state",
]
