"""The pieces of make_train_step: forward, microbatches, the optimizer-state view, metrics."""

from .forward import capturing_forward, LossFn
from .metrics import (applied_clip_metrics, clip_metrics, grad_norm, metrics_to_floats, optimizer_clip,
                      optimizer_clip_metrics, step_threshold, threshold_metrics)
from .microbatches import loss_grads_maxima, maxima_on, split_microbatches
from .opt_state_view import OptStateView, view_opt_state

__all__ = [
    "applied_clip_metrics", "capturing_forward", "clip_metrics", "grad_norm", "loss_grads_maxima", "LossFn",
    "maxima_on", "metrics_to_floats", "optimizer_clip", "optimizer_clip_metrics", "OptStateView", "split_microbatches",
    "step_threshold", "threshold_metrics", "view_opt_state",
]
