"""The reference MuonClip train step: forward with max-logit capture, gradients, update, clip.

``make_train_step`` builds a pure ``step(params, opt_state, batch, rng=None) -> (params,
opt_state, metrics)`` to be wrapped in ``jax.jit``. It works with any Optax optimizer (AdamW, Muon,
MuonClip): the per-head maxima of the forward pass are handed to the optimizer as the extra
argument ``max_logits`` (ignored by optimizers that do not take it), as in Kimi K2
(arXiv 2507.20534), Algorithm 1. Everything stays on device: no host synchronization.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ._accumulation import MultiStepsMaxLogitsState, merge_max_logits
from ._exact_clip import exact_clip_with_factors as _exact_clip
from ._exact_clip import exact_qk_clip as exact_qk_clip
from ._checks import check_number
from ._muonclip import QKClipState
from ._max_logits import collect_max_logits, nest_max_logits
from ._qk_clip import clip_decisions, qk_clip_stats, threshold_or_nan
from ._state_checks import check_opt_state

__all__ = ["applied_clip_metrics", "clip_metrics", "exact_qk_clip", "make_train_step", "metrics_to_floats"]

LossFn = Callable[..., tuple[jax.Array, Any]]


def clip_metrics(maxima: dict[str, jax.Array], threshold: Any) -> dict[str, Any]:
  """Logging metrics of one step's maxima ``{module: (*stack, H)}`` (all arrays, jit-safe).

  ``max_logits`` (the maxima themselves, per head), ``max_logit`` (largest over all heads),
  ``max_logit_per_layer`` (``{module: (*stack,)}``) and ``num_above_threshold`` (heads
  with S_max > tau: the heads a clip with these maxima would scale, whether or not one
  did; 0 when tau is None). What was clipped is ``applied_clip_metrics``.
  """
  stats = qk_clip_stats(nest_max_logits(maxima), qk_clip_threshold=threshold)
  return {
      "max_logits": dict(maxima),
      "max_logit": jnp.max(jnp.stack([jnp.max(s["max_logit"]) for s in stats.values()])),
      "max_logit_per_layer": {m: s["max_logit"] for m, s in stats.items()},
      "num_above_threshold": sum(jnp.sum(s["num_clipped"]) for s in stats.values()),
  }


def applied_clip_metrics(scaled: dict[str, jax.Array], gamma: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """``num_clipped``, ``clipped_fraction`` and ``min_gamma`` of the scaling a step applied.

  ``scaled`` and ``gamma`` are ``{module: (*stack, H)}``: whether each head was scaled at
  least once in the step, and the product of the factors gamma_h applied to it (over the
  optimizer's clip and every pass of the exact clip). ``num_clipped`` counts the scaled
  heads, ``clipped_fraction`` divides by all heads (Kimi K2 reports 12.7% of heads
  triggering in K2's first 70k steps), ``min_gamma`` is the smallest product (1.0: none).
  """
  num_clipped = sum(jnp.sum(v, dtype=jnp.int32) for v in scaled.values())
  num_heads = sum(math.prod(v.shape) for v in scaled.values())
  return {
      "num_clipped": num_clipped,
      "clipped_fraction": num_clipped / num_heads,
      "min_gamma": jnp.min(jnp.stack([jnp.min(g) for g in gamma.values()])),
  }


def _split_microbatches(batch: Any, k: int) -> Any:
  def split(path, x):
    if jnp.ndim(x) == 0 or x.shape[0] % k:
      raise ValueError(
          f"make_train_step: batch leaf {jax.tree_util.keystr(path)} of shape {jnp.shape(x)} has no leading "
          f"axis divisible by num_microbatches={k} (pass a dropout key as step(..., rng=key), not in the batch)")
    return _split_leading(x, k)

  return jax.tree_util.tree_map_with_path(split, batch)


def _split_leading(x: jax.Array, k: int) -> jax.Array:
  """``(B, ...) -> (k, B // k, ...)``, microbatch i = rows ``[i B/k, (i+1) B/k)``.

  On a mesh with explicit axes a batch sharded over its leading axis cannot be reshaped
  without saying where the result lives: each microbatch is sharded like the batch was
  (or replicated when ``B / k`` does not divide over those devices), so a sharded step
  sees the same microbatches, in the same order, as a single-device step.
  """
  shape = (k, x.shape[0] // k, *x.shape[1:])
  sharding = jax.typeof(x).sharding
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
  if spec[0] is None:
    return x.reshape(shape)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  lead = spec[0] if shape[1] % math.prod(sharding.mesh.shape[a] for a in axes) == 0 else None
  out = NamedSharding(sharding.mesh, PartitionSpec(None, lead, *spec[1:x.ndim]))
  return jax.lax.reshape(x, shape, out_sharding=out)


def _split_output(out: Any) -> tuple[jax.Array, Any, Any]:
  """``loss_fn``'s ``(loss, intermediates)`` or ``(loss, (intermediates, aux))``."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(f"make_train_step: loss_fn must return (loss, intermediates) or (loss, (intermediates, aux)), "
                    f"got {type(out).__name__}")
  loss, rest = out
  if isinstance(rest, (tuple, list)):
    if len(rest) != 2:
      raise TypeError(f"make_train_step: loss_fn returned (loss, <{type(rest).__name__} of {len(rest)}>); "
                      "expected (loss, intermediates) or (loss, (intermediates, aux))")
    return loss, rest[0], rest[1]
  return loss, rest, None


def _clip_state(opt_state: Any) -> QKClipState | None:
  """The ``QKClipState`` inside an optimizer state (muonclip's clip), or None."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, QKClipState))
           if isinstance(x, QKClipState)]
  if len(found) > 1:
    raise ValueError(f"make_train_step: the optimizer has {len(found)} QK-Clip transforms; the metrics and "
                     "exact_clip need one tau")
  return found[0] if found else None


def _maxima_the_clip_sees(opt_state: Any, maxima: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The maxima the optimizer hands its clip: the step's, with ``multi_steps``' running maximum."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MultiStepsMaxLogitsState))
           if isinstance(x, MultiStepsMaxLogitsState)]
  if len(found) != 1:  # none, or nested ones (not tracked: the per-head metrics use the step's)
    return maxima
  return merge_max_logits(collect_max_logits(found[0].max_logits, "make_train_step"), maxima)


def _optimizer_clip_metrics(before: QKClipState, after: QKClipState, maxima: dict[str, jax.Array]) -> dict:
  """``num_clipped``, ``clipped_fraction`` and ``min_gamma`` of the clip the optimizer made.

  Under ``multi_steps``/``optax.MultiSteps`` the optimizer, and its clip, act only at the
  last micro-step (on the running maximum over the micro-steps): before that the step
  clipped nothing, whatever this microbatch's own maxima were.
  """
  acted = after.count != before.count
  num_clipped = jnp.where(acted, after.num_clipped, 0)
  num_heads = sum(math.prod(s.shape) for s in maxima.values())
  return {
      "num_clipped": num_clipped,
      "clipped_fraction": num_clipped / num_heads,
      "min_gamma": jnp.where(acted, after.min_gamma, 1.0),
  }


def _applied_an_update(opt_state: Any) -> jax.Array | None:
  """Whether a ``MultiSteps`` optimizer made its real update this call (None: no MultiSteps)."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
           if isinstance(x, optax.MultiStepsState)]
  if not found:
    return None
  return functools.reduce(jnp.logical_and, [x.mini_step == 0 for x in found])


def _step_count(opt_state: Any) -> jax.Array:
  """The optimizer's step count: its QK-Clip count, else the first ``count`` in its state."""
  clip = _clip_state(opt_state)
  if clip is not None:
    return clip.count
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  if not counts:
    raise ValueError("make_train_step: a qk_clip_threshold schedule needs a step count, but the optimizer "
                     "state has no 'count' field; pass a number, or a schedule to muonclip(qk_clip_threshold=...)")
  return counts[0][1]


def _learning_rates(opt_state: Any) -> Any:
  """The injected learning rate(s) (``optax.inject_hyperparams``): one array, a dict by path, or None."""
  found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
  found = [(jax.tree_util.keystr(p, simple=True, separator="/"), v) for p, v in found
           if isinstance(v, (jax.Array, np.ndarray)) and v.ndim == 0]  # not the schedules' states
  if len(found) <= 1:
    return found[0][1] if found else None
  return dict(found)


def metrics_to_floats(metrics: Any) -> dict[str, float]:
  """A flat ``{name: float}`` of a step's metrics, for logging (``json.dumps`` takes it).

  Nested keys are joined with ``/`` and every array element gets its index, e.g.
  ``max_logit_per_layer/layers/attn/0``. One host transfer (``jax.device_get``); call it
  outside the jitted step. NaN and infinities stay (``json`` writes them as ``NaN`` and
  ``Infinity``).
  """
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(metrics))[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    values = np.asarray(leaf, np.float64)
    if values.ndim == 0:
      flat[name] = float(values)
    for index in np.ndindex(values.shape if values.ndim else ()):
      if values.ndim:
        flat[f"{name}/{'/'.join(map(str, index))}"] = float(values[index])
  return flat


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    qk_clip_threshold: Any = None,
    layout: Any = None,
    num_microbatches: int = 1,
    compute_dtype: Any = None,
    exact_clip: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
  """Builds ``step(params, opt_state, batch, rng=None) -> (params, opt_state, metrics)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> (loss, intermediates)``, where ``intermediates``
      is the collection of ``model.apply({"params": params}, ..., mutable=["intermediates"])``
      (its ``max_logits`` leaves are what QK-Clip needs). It may return
      ``(loss, (intermediates, aux))``: ``aux`` (a pytree of arrays, e.g. accuracy) comes
      back as ``metrics["aux"]``, averaged over microbatches like the loss. When the step
      is called with ``rng``, it is called as ``loss_fn(params, batch, rng)`` (dropout).
    optimizer: any Optax optimizer; ``muonclip`` clips inside its update, and the step
      reads what it did from its ``QKClipState``, wherever it sits in the state. The clip
      must be the optimizer's last transform (nothing after it in a chain), and gradient
      accumulation around it must be ``muonclip_jax.multi_steps``, not ``optax.MultiSteps``.
    qk_clip_threshold: tau for the metrics when the optimizer does not clip, and for
      ``exact_clip``: a number, or a schedule evaluated at the optimizer's step count (the
      ``count`` of its ``QKClipState``, else the first ``count`` in its state). ``None``:
      the optimizer's tau (muonclip's, a schedule included), or no clip counted when the
      optimizer does not clip. When the optimizer clips, the metrics always report its tau
      and its clip, whatever is given here.
    layout: the attention layout; needed only with ``exact_clip``.
    num_microbatches: k > 1 splits the batch's leading axis into k microbatches and scans
      over them (``lax.scan``): gradients are averaged, maxima combined by maximum, and
      the optimizer (hence the clip) runs once, on the whole step's maxima. ``rng`` is
      split into k keys, one per microbatch.
    compute_dtype: e.g. ``jnp.bfloat16``: the forward/backward pass runs on a copy of the
      (float32 master) params cast to this dtype; gradients, the update and the clip act
      on the master params, and the next step's copy is cast from them again.
    exact_clip: Kimi K2 clips with the maxima of the step's forward pass, which saw the
      weights before the update, so on the step's batch the updated weights can overshoot
      tau. With ``exact_clip=True`` the step then measures the updated params' maxima on the
      same batch (a forward pass without gradient) and clips with them, repeating until no
      head is above tau (1 + rtol), at most once per attention layer (``exact_qk_clip``):
      after the step every head's max logit on the step's batch is at most tau (1 + rtol),
      for any depth (rtol = 1e-4, or the machine epsilon of a lower-precision
      ``compute_dtype``/param dtype). Costs one forward pass, more when clipping a layer
      pushes a later one above tau (metric ``exact_clip_passes``); use it with
      ``muon_adamw`` (or with ``muonclip``, which then clips twice). Under
      ``multi_steps``/``optax.MultiSteps`` it runs only at the micro-step that updates the
      weights (``exact_clip_passes`` is 0 at the others).

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
    (heads whose forward-pass max logit is above tau, clipped or not),
    ``qk_clip_threshold`` (that tau; NaN when a schedule or an injected tau gave a NaN,
    zero or negative value, which clips nothing and cannot raise inside jit) and
    ``qk_clip_threshold_valid`` (bool, False exactly then). And when they apply:
    ``learning_rate`` (the optimizer's, when injected with ``optax.inject_hyperparams``; a
    dict by state path when several are), ``aux`` (``loss_fn``'s extra outputs) and
    ``exact_clip_passes`` (int32, the forward passes the exact clip took, 1 to the number
    of attention layers). ``metrics_to_floats`` turns them into a flat dict of floats for
    logging.

  Raises:
    ValueError: at the first trace, when the optimizer has a transform after its QK-Clip,
      wraps the clip in a plain ``optax.MultiSteps`` (use ``muonclip_jax.multi_steps``), or
      its state does not fit the params in structure or shape (e.g. restored from another
      model); see ``muonclip_jax.check_opt_state``.
  """
  if not isinstance(num_microbatches, int) or num_microbatches < 1:
    raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
  if qk_clip_threshold is not None and not callable(qk_clip_threshold):
    check_number("qk_clip_threshold", qk_clip_threshold, low=0.0, low_open=True)
  if exact_clip and layout is None:
    raise ValueError("make_train_step: exact_clip=True needs the layout")
  opt = optax.with_extra_args_support(optimizer)
  k = num_microbatches

  def forward(params, batch, rng):
    compute = params if compute_dtype is None else optax.tree.cast(params, compute_dtype)
    loss, intermediates, aux = _split_output(loss_fn(compute, batch) if rng is None else loss_fn(compute, batch, rng))
    return loss.astype(jnp.float32), (collect_max_logits(intermediates), aux)

  grad_fn = jax.value_and_grad(forward, has_aux=True)

  def loss_grads_maxima(params, batch, rng):
    if k == 1:
      (loss, (maxima, aux)), grads = grad_fn(params, batch, rng)
      return loss, grads, maxima, aux
    micro = (_split_microbatches(batch, k), None if rng is None else jax.random.split(rng, k))
    _, (maxima_shape, aux_shape) = jax.eval_shape(forward, params, *jax.tree.map(lambda x: x[0], micro))
    init = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(jnp.zeros_like, params),
        {m: jnp.full(s.shape, -jnp.inf, jnp.float32) for m, s in maxima_shape.items()},
        jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), aux_shape),
    )

    def body(carry, mb):
      loss_sum, grad_sum, running, aux_sum = carry
      (loss, (maxima, aux)), grads = grad_fn(params, *mb)
      grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
      aux_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), aux_sum, aux)
      return (loss_sum + loss, grad_sum, merge_max_logits(running, maxima), aux_sum), None

    (loss_sum, grad_sum, maxima, aux_sum), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g: (g / k).astype(g.dtype), grad_sum)
    return loss_sum / k, grads, maxima, jax.tree.map(lambda a: a / k, aux_sum)

  def step(params, opt_state, batch, rng=None):
    # At trace time only: the clip comes last, no plain MultiSteps around it, and the state
    # fits the params (structure and shapes, abstractly).
    check_opt_state(opt_state, optimizer=opt, params=params, caller="make_train_step")
    loss, grads, maxima, aux = loss_grads_maxima(params, batch, rng)
    given = qk_clip_threshold(_step_count(opt_state)) if callable(qk_clip_threshold) else qk_clip_threshold
    if given is not None:
      given = threshold_or_nan(given)  # a schedule's invalid value shows as NaN
    before, seen = _clip_state(opt_state), _maxima_the_clip_sees(opt_state, maxima)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=nest_max_logits(maxima))
    params = optax.apply_updates(params, updates)
    clip = _clip_state(opt_state)
    tau = clip.threshold if clip is not None else given  # the clip's own is NaN when invalid
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **clip_metrics(maxima, tau)}
    if tau is not None:
      metrics["qk_clip_threshold"] = jnp.asarray(tau, jnp.float32)
      metrics["qk_clip_threshold_valid"] = ~jnp.isnan(metrics["qk_clip_threshold"])
    learning_rate = _learning_rates(opt_state)
    if learning_rate is not None:
      metrics["learning_rate"] = learning_rate
    if aux is not None:
      metrics["aux"] = aux
    # What the optimizer's clip did, per head (it clipped with `seen` at its tau, if it acted).
    ones = {m: jnp.ones(s.shape, jnp.float32) for m, s in maxima.items()}
    scaled, gamma = {m: jnp.zeros(s.shape, bool) for m, s in maxima.items()}, ones
    if clip is not None:
      acted = clip.count != before.count
      for m, s in seen.items():
        hit, g = clip_decisions(s, clip.threshold)
        scaled[m], gamma[m] = hit & acted, jnp.where(acted, g, 1.0)
    if not exact_clip:
      metrics.update(applied_clip_metrics(scaled, gamma))
      if clip is not None:  # exactly what the optimizer's state reports
        metrics.update(_optimizer_clip_metrics(before, clip, maxima))
      return params, opt_state, metrics
    tau = given if given is not None else tau
    if tau is None:
      raise ValueError("make_train_step: exact_clip=True needs qk_clip_threshold, or an optimizer that clips "
                       "(muonclip), whose tau it then uses")
    measure = lambda p: _maxima_on(forward, p, batch, rng, k)
    clip_now = lambda p: _exact_clip(p, measure, qk_clip_threshold=tau, layout=layout,
                                     rtol=_exact_rtol(params, compute_dtype))
    stepped = _applied_an_update(opt_state)
    if stepped is None:
      params, passes, exact_scaled, exact_gamma = clip_now(params)
    else:  # accumulating (MultiSteps): the weights change, and get clipped, only at the real update
      skip = lambda p: (p, jnp.zeros((), jnp.int32), {m: jnp.zeros(v.shape, bool) for m, v in ones.items()}, ones)
      params, passes, exact_scaled, exact_gamma = jax.lax.cond(stepped, clip_now, skip, params)
    metrics["exact_clip_passes"] = passes
    metrics.update(applied_clip_metrics({m: scaled[m] | exact_scaled[m] for m in scaled},
                                        {m: gamma[m] * exact_gamma[m] for m in gamma}))
    return params, opt_state, metrics

  return step


def _maxima_on(forward, params, batch, rng, k):
  """The maxima of a gradient-free forward pass over the whole batch (microbatch by microbatch)."""
  params = jax.lax.stop_gradient(params)
  if k == 1:
    return forward(params, batch, rng)[1][0]
  micro = (_split_microbatches(batch, k), None if rng is None else jax.random.split(rng, k))
  maxima = jax.lax.map(lambda mb: forward(params, *mb)[1][0], micro)
  return {m: jnp.max(v, axis=0) for m, v in maxima.items()}


def _exact_rtol(params: Any, compute_dtype: Any) -> float:
  """1e-4, or the machine epsilon of the forward's lowest-precision float dtype if larger."""
  dtypes = [jnp.dtype(compute_dtype)] if compute_dtype is not None else [
      jnp.result_type(x) for x in jax.tree.leaves(params) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  return max([1e-4] + [float(jnp.finfo(d).eps) for d in dtypes])
