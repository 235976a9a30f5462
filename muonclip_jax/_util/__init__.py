"""Shared helpers: argument checks, pytree paths, boxed metadata, frozen leaves, logical and matrix axes,
powers of two from exponent bits."""

from .boxes import (accept_bare_updates, decided_leaves, has_boxes, is_box, leaf_shape, logical_names, MetadataMemo,
                    names_by_path, skeleton)
from .checks import check_bool, check_float_dtype, check_number, check_positive_int, is_int
from .frozen_leaves import skip_frozen_leaves
from .logical_axes import EXPERT_NAMES, HEAD_AXIS_NAMES, LAYER_NAMES, LOGICAL_AXES, STACK_NAMES, VOCAB
from .matrix_axes import from_matrices, MatrixAxes, MatrixAxesSpec, to_matrices
from .paths import join, key_name, keystr, path_str, strip_value
from .powers_of_two import power_of_two_below
from .sequence import after

__all__ = [
    "accept_bare_updates", "after", "check_bool", "check_float_dtype", "check_number", "check_positive_int", "decided_leaves",
    "EXPERT_NAMES", "from_matrices", "has_boxes",
    "HEAD_AXIS_NAMES", "is_box", "is_int", "join", "key_name", "keystr", "LAYER_NAMES", "leaf_shape", "LOGICAL_AXES",
    "logical_names", "MatrixAxes", "MatrixAxesSpec", "MetadataMemo", "names_by_path", "path_str", "power_of_two_below",
    "skeleton", "skip_frozen_leaves", "STACK_NAMES", "strip_value", "to_matrices", "VOCAB",
]
