"""QK-Clip: attention layouts, kernel forms, max logits, the clip and its Optax transform."""

from .accumulation import merge_max_logits, MultiStepsMaxLogitsState
from .attention_modules import attention_modules, leaves_by_module, names_under
from .equinox import (EMBEDDING, equinox_attention, GAIN, held_raw, leaf_roles, linear_leaf, MATRIX, storage_axes,
                      VECTOR)
from .exact import exact_clip_step, exact_qk_clip, exact_rtol
from .kernel_forms import check_orientation, DECLARED, DENSE_GENERAL, detect, Found, HEAD_MAJOR
from .layouts import check_layout, GQALayout, LayoutSpec, MLALayout, report_layout, reported_layouts
from .max_logits import CAPTURE_HINT, collect_max_logits, nest_max_logits, reduce_max_logits
from .multi_steps import multi_steps
from .projection import as_projection, axes_from_logical, declared_matrix_axes, fits_declared, Projection
from .qk_clip import (clip_decisions, init_max_logits, no_clip_decisions, qk_clip, qk_clip_stats,
                      threshold_or_nan)
from .state_checks import check_opt_state
from .transform import qk_clip_transform, QKClipState

__all__ = [
    "as_projection", "attention_modules", "axes_from_logical", "CAPTURE_HINT", "check_layout", "check_orientation",
    "check_opt_state", "clip_decisions", "collect_max_logits", "DECLARED", "declared_matrix_axes",
    "DENSE_GENERAL", "detect", "EMBEDDING", "equinox_attention", "exact_clip_step", "exact_qk_clip",
    "exact_rtol", "fits_declared", "Found", "GAIN", "GQALayout", "HEAD_MAJOR", "held_raw", "init_max_logits",
    "LayoutSpec", "leaf_roles", "leaves_by_module", "linear_leaf", "MATRIX", "merge_max_logits", "MLALayout", "multi_steps",
    "MultiStepsMaxLogitsState", "names_under", "nest_max_logits", "no_clip_decisions", "Projection",
    "qk_clip", "qk_clip_stats", "qk_clip_transform", "QKClipState", "reduce_max_logits", "report_layout",
    "reported_layouts", "storage_axes",
    "threshold_or_nan", "VECTOR",
]
