"""The reference MuonClip train step: forward with max-logit capture, gradients, update, clip.

``make_train_step`` builds a pure ``step(params, opt_state, batch, rng=None) -> (params,
opt_state, metrics)`` to be wrapped in ``jax.jit``. It works with any Optax optimizer (AdamW, Muon,
MuonClip): the per-head maxima of the forward pass are handed to the optimizer as the extra
argument ``max_logits`` (ignored by optimizers that do not take it), as in Kimi K2
(arXiv 2507.20534), Algorithm 1. Everything stays on device: no host synchronization.

The step is composed of pieces that each have one home: the forward pass with capture
(``_train.forward``), the microbatch loop (``_train.microbatches``), what it reads from the optimizer
state (``_train.opt_state_view``), the exact clip (``_clip.exact``) and the metrics
(``_train.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from ._clip import (CAPTURE_HINT, check_layout, check_opt_state, exact_clip_step, exact_qk_clip, exact_rtol,
                    LayoutSpec, nest_max_logits, reported_layouts)
from ._util import check_bool, check_float_dtype, check_number, check_positive_int
from ._train import (applied_clip_metrics, capturing_forward, clip_metrics, grad_norm, loss_grads_maxima, LossFn,
                     maxima_on, metrics_to_floats, optimizer_clip, optimizer_clip_metrics, OptStateView,
                     step_threshold, threshold_metrics, view_opt_state)

__all__ = ["exact_qk_clip", "make_train_step", "metrics_to_floats"]


def _apply_optimizer(optimizer: optax.GradientTransformationExtraArgs, params: Any, opt_state: Any, grads: Any,
                    maxima: dict[str, jax.Array]) -> tuple[Any, Any, OptStateView, OptStateView]:
  """One optimizer update with the step's maxima, applied: ``(params, opt_state, before, after)``.

  The maxima go to the optimizer as ``max_logits`` (nested as the ``intermediates``
  collection); ``before``/``after`` are the ``OptStateView``s of the state around the update.
  """
  before = view_opt_state(opt_state)
  max_logits = nest_max_logits(maxima) if maxima else None  # none captured: nothing needs them
  updates, opt_state = optimizer.update(grads, opt_state, params, max_logits=max_logits)
  return optax.apply_updates(params, updates), opt_state, before, view_opt_state(opt_state)


def _check_maxima_captured(maxima: dict, opt_state: Any, qk_clip_threshold: Any, exact_clip: bool) -> None:
  """The maxima are optional unless something reads them: a clip, a tau, ``multi_steps``."""
  if maxima:
    return
  view = view_opt_state(opt_state)
  needs = [why for why, yes in (
      ("the optimizer clips (it holds a QKClipState: muonclip, qk_clip_transform)", view.clip is not None),
      ("the optimizer accumulates them (multi_steps)", view.running_max_logits is not None),
      (f"qk_clip_threshold={qk_clip_threshold!r} was given", qk_clip_threshold is not None),
      ("exact_clip=True", exact_clip)) if yes]
  if needs:
    raise ValueError(f"make_train_step: loss_fn's intermediates hold no max_logits, but {needs[0]}, which needs "
                     "each attention's per-head maxima. " + CAPTURE_HINT)


def _exact_clip_layout(layout: LayoutSpec | None, held: list[tuple[str, LayoutSpec]]) -> LayoutSpec:
  """The layout of the exact clip: the optimizer's QK-Clip's, else its Muon's, else ``layout=``.

  ``held`` is what the optimizer's update reported (``reported_layouts``). A ``layout=``
  that differs from the optimizer's clip's is refused: the exact clip must clip the heads
  the optimizer clips.
  """
  def distinct(holder):
    found = []
    for h, lay in held:
      if h == holder and not any(lay == f for f in found):
        found.append(lay)
    return found

  clips, muons = distinct("qk_clip"), distinct("muon")
  if len(clips) > 1 or (layout is None and not clips and len(muons) > 1):
    raise ValueError(f"make_train_step: the optimizer holds {len(clips) or len(muons)} different layouts, so "
                     "exact_clip=True cannot tell which heads to clip; pass layout=")
  if layout is not None:
    if clips and clips[0] != layout:
      raise ValueError(f"make_train_step: layout={layout!r} differs from the layout of the optimizer's QK-Clip, "
                       f"{clips[0]!r}; the exact clip clips the optimizer's heads: leave layout= out")
    return layout
  if clips or muons:
    return (clips or muons)[0]
  raise ValueError("make_train_step: exact_clip=True needs the attention layout, and the optimizer holds none "
                   "(muonclip, qk_clip_transform and muon_adamw(layout=...) do): pass layout=module.layout")


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    qk_clip_threshold: optax.ScalarOrSchedule | None = None,
    layout: LayoutSpec | None = None,
    num_microbatches: int = 1,
    compute_dtype: jax.typing.DTypeLike | None = None,
    exact_clip: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
  """Builds ``step(params, opt_state, batch, rng=None) -> (params, opt_state, metrics)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, intermediates)``, where ``intermediates``
      is the collection of ``model.apply({"params": params}, ..., mutable=["intermediates"])``
      or of ``nnx.capture(model, nnx.Intermediate)`` (its ``max_logits`` leaves are what
      QK-Clip needs). They are optional when nothing reads them (an optimizer that does not
      clip, no ``qk_clip_threshold``, no ``exact_clip``, no ``multi_steps``): ``loss_fn``
      may then return ``(loss, None)`` or ``(loss, {})``, and the max-logit and clip
      metrics are left out. Where something reads them, their absence is a ValueError at
      the first trace that says what needs them and how to capture them. It may return
      ``(loss, (intermediates, aux))``: ``aux`` (a pytree of arrays, e.g. accuracy) comes
      back as ``metrics["aux"]``, averaged over microbatches like the loss. When the step
      is called with ``rng``, it is called as ``loss_fn(params, batch, rng)`` (dropout).
    optimizer: any Optax optimizer; ``muonclip`` clips inside its update, and the step
      reads what it did from its ``QKClipState``, wherever it sits in the state. The clip
      must be the optimizer's last transform (nothing after it in a chain), and gradient
      accumulation around it must be ``muonclip_jax.multi_steps``, not ``optax.MultiSteps``.
    qk_clip_threshold: tau for an optimizer that does not clip (``muon_adamw``, AdamW): the
      tau of the metrics and of ``exact_clip``; a number, or a schedule evaluated at the
      optimizer's step count (the first ``count`` in its state). An optimizer that clips
      (``muonclip``) has its own tau, the step's only one: leave this None (passing it too
      is a ValueError at the first trace). None with an optimizer
      that does not clip: no tau, nothing counted as above it.
    layout: the attention layout of ``exact_clip``, read by default from the optimizer: the
      layout of its QK-Clip (``muonclip``, ``qk_clip_transform``), else of its Muon
      (``muon_adamw(layout=...)``), as its update reports it at trace time (an optimizer is
      closures and its state holds arrays only, so nothing else exposes it). Needed with
      ``exact_clip`` when the optimizer holds none (AdamW, Muon with ``matrix_axes``) or
      several different ones; one that differs from the optimizer's QK-Clip's is a
      ValueError (the exact clip clips the heads the optimizer clips). Unused without
      ``exact_clip``.
    num_microbatches: k > 1 splits the batch's leading axis into k microbatches and scans
      over them (``lax.scan``): gradients are averaged, maxima combined by maximum, and
      the optimizer (hence the clip) runs once, on the whole step's maxima. ``rng`` is
      split into k keys, one per microbatch.
    compute_dtype: e.g. ``jnp.bfloat16``: the forward/backward pass runs on a copy of the
      (float32 master) params cast to this dtype; gradients, the update and the clip act
      on the master params, and the next step's copy is cast from them again.
    exact_clip: a ``bool`` (anything else is a TypeError). Kimi K2 clips with the maxima of the step's forward pass, which saw the
      weights before the update, so on the step's batch the updated weights can overshoot
      tau. With ``exact_clip=True`` the step then measures the updated params' maxima on the
      same batch (a forward pass without gradient) and clips with them, repeating until no
      head is above tau (1 + rtol), at most once per attention layer (``exact_qk_clip``):
      after the step every head's max logit on the step's batch is at most tau (1 + rtol),
      for any depth (rtol = 1e-4, or the machine epsilon of a lower-precision
      ``compute_dtype``/param dtype). Costs one forward pass, and one more after each clip
      (metric ``exact_clip_passes``); the last one's largest max logit is the metric
      ``exact_clip_max_logit``, above tau (1 + rtol) only where the logits do not follow the
      query/key kernels (a QK-norm the layout does not declare, weights shared across
      depth) after one clip per attention layer, or where a maximum is +inf or NaN (which
      no clip scales: see ``qk_clip``); use it with
      ``muon_adamw`` (or with ``muonclip``, which then clips twice). Under
      ``multi_steps``/``optax.MultiSteps`` it runs only at the micro-step that updates the
      weights (``exact_clip_passes`` is 0 at the others), on that call's batch alone: the
      earlier micro-steps' batches are gone, so the bound (and ``exact_clip_max_logit``)
      covers the last micro-batch only; ``num_microbatches`` holds every microbatch in one
      call and bounds the whole batch.

  Returns:
    The step function; ``rng`` (optional) is a key handed to ``loss_fn`` (split per
    microbatch). ``metrics`` holds ``loss``, ``grad_norm`` (global norm of the averaged
    gradient, before the optimizer), the forward pass's ``max_logits`` (per head), ``max_logit``,
    ``max_logit_per_layer``, and what the step did to the weights: ``num_clipped`` (heads
    scaled at least once in this call), ``clipped_fraction`` (of all heads) and
    ``min_gamma`` (the product of the factors gamma_h applied to the most-scaled head; 1.0
    when none), counting the optimizer's clip (read from its ``QKClipState``: 0 at the
    micro-steps of ``multi_steps`` that do not update) and every pass of the exact clip. An
    optimizer that does not clip, without ``exact_clip``, clips nothing: 0 and 1.0. When a
    tau is known (the optimizer's, else ``qk_clip_threshold``): ``num_above_threshold``
    (heads whose forward-pass max logit is above tau, clipped or not; a +inf maximum
    counts, though the clip leaves that head as it is: see ``qk_clip``),
    ``qk_clip_threshold`` (that tau; NaN when a schedule or an injected tau gave a NaN,
    zero or negative value, which clips nothing and cannot raise inside jit) and
    ``qk_clip_threshold_valid`` (bool, False exactly then). And when they apply:
    ``learning_rate`` (the optimizer's, when injected with ``optax.inject_hyperparams``; a
    dict by state path when several are), ``aux`` (``loss_fn``'s extra outputs) and
    ``exact_clip_passes`` (int32, the forward passes the exact clip took, 1 to the number
    of attention layers plus one) and ``exact_clip_max_logit`` (float32, the largest max
    logit of the returned params on the step's batch, the exact clip's last measurement; the
    forward pass's at micro-steps that do not update). Without captured maxima (see ``loss_fn``) only ``loss``,
    ``grad_norm``, ``learning_rate`` and ``aux``. ``metrics_to_floats`` turns them into a
    flat dict of floats for logging.

  Integer and boolean leaves of ``params`` (a step counter) are differentiated with
  ``allow_int=True``: their gradient is a zero of their dtype, which the library's
  optimizers leave alone (optax's own may not: ``optax.adamw`` decays them), and
  ``compute_dtype`` casts only the floating-point leaves.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> import muonclip_jax as mc
    >>> from muonclip_jax import nn as mnn, training
    >>> attn = mnn.GroupedQueryAttention(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    >>> params = attn.init(jax.random.key(1), x)["params"]
    >>> def loss_fn(params, x):
    ...   y, state = attn.apply({"params": params}, x, mutable=["intermediates"])
    ...   return jnp.mean(y ** 2), state["intermediates"]
    >>> opt = mc.muonclip(0.01, layout=attn.layout, qk_clip_threshold=100.0, labels=jax.tree.map(lambda _: "muon", params))
    >>> step = jax.jit(training.make_train_step(loss_fn, opt))
    >>> params, state, metrics = step(params, opt.init(params), x)
    >>> int(metrics["num_clipped"]), float(metrics["qk_clip_threshold"])
    (0, 100.0)
    >>> sorted(metrics)
    ['clipped_fraction', 'grad_norm', 'loss', 'max_logit', 'max_logit_per_layer', 'max_logits', 'min_gamma',
     'num_above_threshold', 'num_clipped', 'qk_clip_threshold', 'qk_clip_threshold_valid']

  Raises:
    TypeError: ``exact_clip`` that is not a bool; a ``compute_dtype`` that is not a floating
      dtype of 16 bits or more (an integer one would truncate the weights, and their
      gradients would be zero).
    ValueError: at the first trace, when ``loss_fn`` captured no maxima and something needs
      them (see ``loss_fn``), when ``exact_clip`` has no layout or two (see ``layout``), when the optimizer has a transform after its QK-Clip,
      wraps the clip in a plain ``optax.MultiSteps`` (use ``muonclip_jax.multi_steps``), or
      its state does not fit the params in structure or shape (e.g. restored from another
      model); see ``muonclip_jax.check_opt_state``.
  """
  check_positive_int("num_microbatches", num_microbatches)
  if qk_clip_threshold is not None and not callable(qk_clip_threshold):
    check_number("qk_clip_threshold", qk_clip_threshold, low=0.0, low_open=True)
  check_bool("exact_clip", exact_clip)
  check_float_dtype("compute_dtype", compute_dtype, none_means="the params' own")
  if layout is not None:
    check_layout(layout, "make_train_step")
  opt = optax.with_extra_args_support(optimizer)
  forward = capturing_forward(loss_fn, compute_dtype)
  k = num_microbatches

  def step(params, opt_state, batch, rng=None):
    # At trace time only: the clip comes last, no plain MultiSteps around it, and the state
    # fits the params (structure and shapes, abstractly).
    check_opt_state(opt_state, optimizer=opt, params=params, caller="make_train_step")
    loss, grads, maxima, aux = loss_grads_maxima(forward, params, batch, rng, k)
    _check_maxima_captured(maxima, opt_state, qk_clip_threshold, exact_clip)
    with reported_layouts() as held:  # the layouts the optimizer's transforms hold
      params, opt_state, before, after = _apply_optimizer(opt, params, opt_state, grads, maxima)
    tau = step_threshold(qk_clip_threshold, before, after)
    metrics = {"loss": loss, "grad_norm": grad_norm(grads)}
    if after.learning_rate is not None:
      metrics["learning_rate"] = after.learning_rate
    if aux is not None:
      metrics["aux"] = aux
    if not maxima:  # nothing captured, nothing clipped (_check_maxima_captured): no max-logit metrics
      return params, opt_state, metrics
    metrics.update(clip_metrics(maxima, tau))
    if tau is not None:
      metrics.update(threshold_metrics(tau))
    if not exact_clip:
      if after.clip is not None:  # exactly what the optimizer's state reports
        metrics.update(optimizer_clip_metrics(before, after, maxima))
      else:
        metrics.update(applied_clip_metrics(*optimizer_clip(before, after, maxima)))
      return params, opt_state, metrics
    if tau is None:
      raise ValueError("make_train_step: exact_clip=True needs qk_clip_threshold, or an optimizer that clips "
                       "(muonclip), whose tau it then uses")
    scaled, gamma = optimizer_clip(before, after, maxima)
    params, passes, exact_scaled, exact_gamma, last = exact_clip_step(
        params, lambda p: maxima_on(forward, p, batch, rng, k), qk_clip_threshold=tau,
        rtol=exact_rtol(params, compute_dtype), updated=after.updated, like=maxima,
        layout=_exact_clip_layout(layout, held))
    metrics["exact_clip_passes"] = passes
    metrics["exact_clip_max_logit"] = clip_metrics(last, None)["max_logit"]
    metrics.update(applied_clip_metrics({m: scaled[m] | exact_scaled[m] for m in scaled},
                                        {m: gamma[m] * exact_gamma[m] for m in gamma}))
    return params, opt_state, metrics

  return step
