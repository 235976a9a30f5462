"""QK-Clip: per-head rescaling of query/key weights that keeps attention logits bounded.

Kimi K2 (arXiv 2507.20534), section 2.1 and Algorithm 1 (MuonClip). After each optimizer
step, for every attention head h with largest pre-softmax logit

  S_max^h = softmax_scale * max_{x in batch} max_{i, j unmasked} q_i^h . k_j^h

above a threshold tau, the head's query/key weights are shrunk by

  gamma_h = min(1, tau / S_max^h)

so that, for the weights that produced the batch, every logit of the head is at most tau.
Heads with S_max^h <= tau are not touched; the forward and backward passes are unchanged.
Per-head (not per-layer) factors leave the heads that were not exploding alone (section 2.1).

How gamma_h is split between query and key depends on the head layout:

* MLA (``MLALayout``): q^C (the head's nope query columns) and k^C (its k_nope columns of
  ``wkv_b``) by sqrt(gamma_h), q^R (its rope query columns) by gamma_h; the shared rotary key
  k^R (from ``wkv_a``) and v are untouched. Every logit of head h is scaled by gamma_h exactly.
* MHA / GQA (``GQALayout``), ``clip_mode="split"``: query head h by sqrt(gamma_h), key head g
  by sqrt(min_{h in group g} gamma_h). The new maximum of head h is at most
  sqrt(gamma_h * gamma_min) S_max^h <= gamma_h S_max^h <= tau, but the group's other heads
  shrink too. For MHA (one query head per key head) this is the symmetric sqrt(gamma_h) on
  query and key of the paper.
* GQA, ``clip_mode="query"``: query head h by gamma_h, keys untouched; every logit of head h
  is scaled by gamma_h exactly and no other head changes.

A projection bias is part of the projection: its head slice is scaled like the kernel columns.
Which leaves hold a head's columns (projection names, 2-D / DenseGeneral / fused QKV kernel
forms) is the layout's business, in ``_clip.kernel_forms``; this module computes the factors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import optax
import jax.numpy as jnp
import numpy as np

from .attention_modules import attention_modules, layouts_of, leaves_by_module, names_under
from .._util import check_number, join, names_by_path
from .equinox import held_raw, storage_axes
from .layouts import check_layout, GQALayout, layout_for, LayoutSpec, MLALayout
from .max_logits import collect_max_logits, MAX_LOGITS, nest_max_logits
from .kernel_forms import detect, missing_projections
from .qk_norm import check_undeclared, scale_norms

_Layout = MLALayout | GQALayout


# ----------------------------------------------------------------------------- inputs


def _resolve_threshold(threshold: Any) -> jax.Array | None:
  """Validates tau; returns it as a float32 scalar, or None when clipping is off.

  None or +inf turns the clip off. The types ``muonclip(qk_clip_threshold=...)`` takes are
  taken (``check_number``): a concrete NaN or non-positive value is a ValueError, a string
  or a bool a TypeError. A traced value cannot be checked; it is handled numerically
  (``_gamma`` clips nothing when tau is NaN, infinite or <= 0; ``threshold_or_nan`` flags it).
  """
  if threshold is None:
    return None
  if isinstance(threshold, (jax.Array, np.ndarray)) and jnp.ndim(threshold) != 0:
    raise ValueError(f"qk_clip: qk_clip_threshold must be a scalar, got shape {jnp.shape(threshold)}")
  if isinstance(threshold, jax.core.Tracer):  # e.g. optax.inject_hyperparams inside jit
    return jnp.asarray(threshold, jnp.float32)
  check_number("qk_clip: qk_clip_threshold", threshold, low=0.0, low_open=True)
  value = float(threshold)
  if math.isinf(value):
    return None
  return jnp.asarray(value, jnp.float32)


def threshold_or_nan(tau: Any) -> jax.Array:
  """tau as float32, NaN where it cannot be a threshold (NaN, zero, negative; +inf stays).

  A traced tau (a schedule, ``optax.inject_hyperparams``) cannot raise inside jit; such a
  tau clips nothing, and this is how the state and the metrics show it.
  """
  tau = jnp.asarray(tau, jnp.float32)
  return jnp.where(tau > 0, tau, jnp.nan)


def _check_not_variables(module: str, by_module: Mapping[str, Any], caller: str) -> None:
  """A missing module found under a top-level ``params`` key: the variables dict was passed."""
  nested = f"params/{module}" if module else "params"
  own = by_module.get(module, {})
  if nested in by_module and all(k.startswith("params/") for k in own):
    raise ValueError(
        f"{caller}: params has a top-level 'params' key and the attention parameters of "
        f"{module or '<root>'!r} lie under {nested!r}: pass the 'params' "
        "collection (variables['params']), not the whole variables dict {'params': ...}"
    )


# ----------------------------------------------------------------------------- math


def _gamma(s: jax.Array, tau: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-head (clipped, gamma): clipped = S finite and S > tau > 0; gamma = tau / S there, else 1.

  The guards make gamma lie in (0, 1] for any S (NaN, +-inf, <= 0) and any traced tau (NaN,
  inf, <= 0 clip nothing), so nothing is ever multiplied by a non-finite or negative number.
  An S of +inf is above tau but not clipped: its factor tau / S would be 0, which zeroes the
  head's query/key weights (a reset, not a clip); see ``qk_clip``'s "Non-finite maxima".
  """
  clipped = jnp.isfinite(s) & (s > tau) & (tau > 0)
  gamma = jnp.where(clipped, tau / jnp.where(clipped, s, 1.0), 1.0)
  return clipped, gamma


def clip_decisions(max_logits: jax.Array, threshold: Any) -> tuple[jax.Array, jax.Array]:
  """Per head ``(clipped, gamma)`` of ``qk_clip`` for maxima ``(..., H)`` at a traced or concrete tau.

  ``clipped``: S_max finite and above tau > 0; ``gamma``: tau / S_max there, else 1. A tau
  that is NaN, infinite or <= 0 clips nothing.
  """
  return _gamma(jnp.asarray(max_logits, jnp.float32), jnp.asarray(threshold, jnp.float32))


def no_clip_decisions(max_logits: Mapping[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """``clip_decisions`` of a clip that scales nothing, per module of ``{module: (*stack, H)}``: False and 1."""
  return ({m: jnp.zeros(jnp.shape(s), bool) for m, s in max_logits.items()},
          {m: jnp.ones(jnp.shape(s), jnp.float32) for m, s in max_logits.items()})


def _per_head(*parts: tuple[jax.Array, int]) -> jax.Array:
  """Per-head factors (..., H) repeated over each head's column segments -> (..., H, sum(w))."""
  segments = [jnp.broadcast_to(f[..., None], (*f.shape, w)) for f, w in parts if w]
  return jnp.concatenate(segments, axis=-1)


def _role_factors(s: jax.Array, tau: jax.Array, lay: _Layout) -> dict[str, jax.Array]:
  """{role: factor (*stack, heads, width)} per head and column of each scaled projection role."""
  gamma = _gamma(s, tau)[1]
  root = jnp.sqrt(gamma)
  if isinstance(lay, MLALayout):
    nope, rope, v = lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim
    factors = {"query": _per_head((root, nope), (gamma, rope))}
    if nope:  # k^C by sqrt(gamma); v is untouched
      factors["key_value"] = _per_head((root, nope), (jnp.ones_like(gamma), v))
    return factors
  if lay.clip_mode == "query":
    return {"query": _per_head((gamma, lay.head_dim))}
  group_min = gamma.reshape(*s.shape[:-1], lay.num_kv_heads, lay.group_size).min(axis=-1)
  return {
      "query": _per_head((root, lay.head_dim)),
      "key": _per_head((jnp.sqrt(group_min), lay.head_dim)),
  }


# ----------------------------------------------------------------------------- modules


def qk_clip(params: optax.Params, max_logits: Mapping[str, Any], *, qk_clip_threshold: float | jax.Array | None,
            layout: LayoutSpec, names: Mapping[str, tuple] | None = None) -> optax.Params:
  """Applies QK-Clip (Kimi K2, arXiv 2507.20534, section 2.1, Algorithm 1) to attention params.

  For each attention module with per-head maxima S_max^h (pre-softmax logits times the softmax
  scale, over the batch and all unmasked query/key pairs) and each head h with
  S_max^h > tau: gamma_h = tau / S_max^h, and the head's query/key columns (kernel and bias)
  are scaled as described in this module's docstring (MLA: q^C, k^C by sqrt(gamma_h), q^R by
  gamma_h; GQA "split": q by sqrt(gamma_h), shared k by sqrt(min of its group); GQA "query":
  q by gamma_h). Heads with S_max^h <= tau, or with a non-finite or non-positive S_max^h, are
  left bit-for-bit as they are, and so are value columns (of ``wkv_b`` or of a fused QKV
  kernel), ``wkv_a``, the value and output projections and all other leaves.

  With QK-norm (``GQALayout(query_norm=..., key_norm=...)``) the kernels are left alone and
  the norms' scales (and biases) are scaled instead (per head, or
  per layer by the smallest gamma where the scale is shared by heads); an undeclared norm with
  a gain (``query_ln``, ``q_norm``, ...; Flax's ``RMSNorm_0``: a warning) is a ValueError, since
  scaling the kernels would have no effect.

  Non-finite maxima: a head whose S_max^h is not finite is left as it is, and reported.
  +inf (the forward pass overflowed; the loss is then usually not finite either) is above
  any tau, but no finite gamma_h brings it to tau: the limit tau / inf = 0 would zero the
  head's query/key weights, a reset rather than a clip, so the head is skipped and
  ``qk_clip_stats`` counts it in ``num_above_threshold`` and ``num_nonfinite``, not in
  ``num_clipped``. NaN is not above tau (skipped, counted in ``num_nonfinite``); -inf is
  the maximum over no logit at all (every pair of the head masked, or a running maximum
  that saw nothing) and is below any tau (counted in ``num_nonfinite`` only).

  Pure and jit-friendly: shape checks only at trace time, no host sync, no branching on
  values. Each scaled leaf is multiplied elementwise by a factor built from the small maxima
  (in float32 or wider, cast back), so dtypes and shardings are kept and a head-sharded
  kernel is scaled in place without gathering it.

  Args:
    params: a Flax ``params`` collection (not the variables dict ``{"params": ...}``): plain
      arrays, boxed leaves (``nn.Partitioned``) or an ``nnx.State``. The projections named by
      the layout sit under each attention module's path (``<path>/wq/kernel``,
      ``<path>/query/kernel``, ``<path>/c_attn/kernel``, ...), each kernel in one of the
      forms 2-D head-major ``(*stack, in, heads * width)``, DenseGeneral
      ``(*stack, in, heads, width)`` or, for ``GQALayout(qkv=...)``, fused
      ``(*stack, in, (H + 2 Hkv) * head_dim)`` / ``(*stack, in, 3, H, head_dim)``; a bias
      has the kernel's shape without ``in``. ``*stack`` are optional leading stacked-layer
      axes (``nn.scan``); the form is detected per projection from the layout and the shape.
    max_logits: the ``intermediates`` collection (or ``{"intermediates": ...}``; not the
      ``(y, state)`` pair of ``apply``) in which each attention module has a leaf
      ``max_logits`` of shape ``(*stack, num_heads)``, matched to the parameters at the same
      module path.
    qk_clip_threshold: tau > 0 (Kimi K2 uses 100). None or +inf: no clip, ``params`` is returned as
      is and ``max_logits`` is not read. May be a traced scalar (not validated then; a NaN,
      infinite or non-positive traced tau clips nothing).
    layout: one ``MLALayout``/``GQALayout`` for every module, or a mapping from glob patterns
      (``fnmatch``, matched against the module path such as ``"layers/attn"``) to layouts;
      exactly one pattern must match each module. ``module.layout`` of the library's
      attention modules is the recommended source. A projection may be a
      ``muonclip_jax.Projection`` that declares how its kernel is stored (any axis order,
      leaf name, layer axes anywhere, fused parts); a kernel that carries logical axis
      names (boxed ``params``) is read by them (``Projection``'s module docstring).
    names: ``{leaf path: logical axis names}`` to use when ``params`` are bare arrays
      (``qk_clip_transform`` records them from the boxed parameters its ``init`` sees);
      None: read from ``params``' boxes.

  Returns:
    ``params`` with the same structure, box types, dtypes and shardings.

  Raises:
    ValueError: a concrete ``qk_clip_threshold`` that is NaN or <= 0; no ``max_logits`` leaf
      (the message gives Linen's and NNX's ways to capture them); a module
      without the projections its layout names (or with both ``wq`` and ``wq_b`` for MLA);
      a kernel that fits no form, or two; head counts or widths that disagree with the
      kernels or the maxima; leading stack shapes that differ; an MLA ``wkv_a`` whose rotary
      width disagrees with the layout; a layout mapping in which zero or several patterns
      match a module; params passed as the variables dict ``{"params": ...}``.
    TypeError: a layout that is not an ``MLALayout``/``GQALayout`` or a mapping of them;
      ``max_logits`` given as a tuple (the ``(y, state)`` pair of ``apply``).

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=2)
    >>> params = {"attn": {"wq": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))},
    ...                    "wk": {"kernel": jnp.ones((3, 4))}},
    ...           "mlp": {"kernel": jnp.ones((4, 4))}}
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}  # head 0 above tau
    >>> new = mc.qk_clip(params, max_logits, qk_clip_threshold=100.0, layout=layout)
    >>> new["attn"]["wq"]["kernel"][0], new["attn"]["wq"]["bias"]  # head 0's columns by sqrt(100 / 400)
    (Array([0.5, 0.5, 1. , 1. ], dtype=float32), Array([0.5, 0.5, 1. , 1. ], dtype=float32))
    >>> new["attn"]["wk"]["kernel"][0]
    Array([0.5, 0.5, 1. , 1. ], dtype=float32)
    >>> new["mlp"]["kernel"] is params["mlp"]["kernel"]  # every other leaf is kept as it is
    True
  """
  check_layout(layout)
  tau = _resolve_threshold(qk_clip_threshold)
  if tau is None:
    return params
  maxima = collect_max_logits(max_logits)
  names = names_by_path(params) if names is None else names
  typed, raw = storage_axes(params), held_raw(params)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [leaf for _, leaf in flat]
  by_module = leaves_by_module(flat)
  for module, s in maxima.items():
    _check_not_variables(module, by_module, "qk_clip")
    _check_not_child(module, by_module, leaves, layout, s, typed)
    lay = layout_for(module, layout)
    if s.shape[-1] != lay.num_heads:
      raise ValueError(
          f"qk_clip: {join(module, MAX_LOGITS)} has shape {s.shape} ({s.shape[-1]} heads), "
          f"but the layout says num_heads={lay.num_heads}: {lay}"
      )
    index = by_module.get(module, {})
    shapes = {name: jnp.shape(leaves[i]) for name, i in index.items()}
    factors = _role_factors(s, tau, lay)
    found = detect(module, lay, shapes, stack=s.shape[:-1], names=names_under(module, names),
                   typed=names_under(module, typed), raw=names_under(module, raw))
    if isinstance(lay, GQALayout):
      check_undeclared(module, lay, shapes, "qk_clip", s.shape[:-1])
      if lay.query_norm is not None:  # QK-norm: the norms' scales, not the kernels
        scale_norms(module, lay, index, leaves, _gamma(s, tau)[1])
        continue
    for proj in found:
      k, b = index[proj.spec.kernel], index.get(proj.spec.bias)
      kernel, bias = proj.scale(leaves[k], None if b is None else leaves[b], factors)
      leaves[k] = kernel
      if b is not None:
        leaves[b] = bias
  _check_all_reported(by_module, leaves, layout, maxima, typed)
  return treedef.unflatten(leaves)


def _check_not_child(module: str, by_module: Mapping[str, Mapping[str, int]], leaves: list, layout: Any,
                     s: jax.Array, typed: Mapping[str, tuple]) -> None:
  """Maxima sown below the attention module (MaxText's ``attention_op``): name the helper."""
  parent = module.rpartition("/")[0]
  if not module:
    return
  shapes = {n: jnp.shape(leaves[i]) for n, i in by_module.get(parent, {}).items()}
  own = {n: jnp.shape(leaves[i]) for n, i in by_module.get(module, {}).items()}
  looks = lambda m, sh, lay: not missing_projections(m, lay, sh, "qk_clip", names_under(m, typed))
  if any(looks(module, own, lay) for lay in layouts_of(module, layout)):
    return
  if any(looks(parent, shapes, lay) for lay in layouts_of(parent, layout)):
    raise ValueError(
        f"qk_clip: {join(module, MAX_LOGITS)} of shape {s.shape} lies below the attention module "
        f"{parent or '<root>'!r}, which holds the query/key projections. Per-batch maxima written by a "
        "child module (MaxText's attention_op, (..., batch, heads)) must be reduced over the batch and "
        "moved to the attention module: pass muonclip_jax.reduce_max_logits(intermediates, "
        f"child={module.rpartition('/')[2]!r})"
    )


def _check_all_reported(by_module: Mapping[str, Mapping[str, int]], leaves: list, layout: Any,
                        maxima: Mapping[str, jax.Array], typed: Mapping[str, tuple]) -> None:
  """Every attention module of ``params`` must have sown ``max_logits``: none is skipped.

  An attention whose capture is off (e.g. ``nnx.MultiHeadAttention`` called without
  ``sow_weights=True``, or a layer that does not use a capturing ``attention_fn``) would
  otherwise never be clipped, silently.
  """
  shapes = {m: {n: jnp.shape(leaves[i]) for n, i in index.items()} for m, index in by_module.items()}
  missing = sorted(set(attention_modules(shapes, layout, "qk_clip", typed)) - set(maxima))
  if missing:
    raise ValueError(
        f"qk_clip: the attention modules {missing} have the query/key projections of their "
        f"layout but no max_logits in max_logits (which has {sorted(maxima)}): their "
        "attention did not report its maxima, so they would never be clipped. Use a "
        "capturing attention (the library's modules, or attention_fn="
        "muonclip_jax.nn.dot_product_attention; nnx.MultiHeadAttention also needs "
        "sow_weights=True) in every attention layer"
    )


def qk_clip_stats(max_logits: Mapping[str, Any], *, qk_clip_threshold: float | jax.Array | None) -> dict[str, dict[str, jax.Array]]:
  """What QK-Clip does with these maxima, per module and per head (Kimi K2, section 2.1).

  The library's one report on the clip: the factors ``gamma_h = min(1, tau / S_max^h)``
  that ``qk_clip`` applies and the counts to log; pure arrays, so it runs inside jit. It
  takes the ``max_logits`` tree that ``qk_clip`` and ``muonclip`` take (the
  ``intermediates`` collection); the train step's metrics (``make_train_step``) are built
  from it.

  Args:
    max_logits: as for ``qk_clip``.
    qk_clip_threshold: as for ``qk_clip`` (None or +inf: nothing is clipped).

  Returns:
    ``{module path: stats}`` with, for maxima of shape ``(*stack, H)``, ``gamma`` (float32,
    ``(*stack, H)``: each head's factor, in (0, 1]; 1 where S_max <= tau, where S_max is
    non-finite or <= 0, and everywhere when the clip is off) and arrays of shape ``stack``
    (``()`` for one layer, ``(L,)`` for ``nn.scan``-stacked layers): ``num_clipped`` (int32, heads ``qk_clip`` scales: finite S_max > tau),
    ``num_above_threshold`` (int32, heads with S_max > tau, +inf included: it is above any
    tau, but ``qk_clip`` skips it, see its "Non-finite maxima"; 0 when the clip is off),
    ``min_gamma`` (float32, min_h gamma_h; 1.0 when nothing is clipped), ``max_logit``
    (float32, max_h S_max^h; NaN if any head is NaN, +inf if one is +inf), ``num_heads``
    (int32, H) and ``num_nonfinite`` (int32, heads whose S_max is NaN, +inf or -inf; they are
    never clipped). ``num_above_threshold > num_clipped`` says that a head above tau had an
    infinite maximum and was left as it was.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> max_logits = {"layers": {"attn": {"max_logits": jnp.array([[400.0, 50.0], [200.0, 80.0]])}}}  # 2 layers
    >>> stats = mc.qk_clip_stats(max_logits, qk_clip_threshold=100.0)
    >>> list(stats)
    ['layers/attn']
    >>> stats["layers/attn"]["num_clipped"], stats["layers/attn"]["min_gamma"]  # per layer
    (Array([1, 1], dtype=int32), Array([0.25, 0.5 ], dtype=float32))
    >>> stats["layers/attn"]["gamma"]  # per head: tau / S_max above tau, 1 elsewhere
    Array([[0.25, 1.  ],
           [0.5 , 1.  ]], dtype=float32)
    >>> inf = mc.qk_clip_stats({"attn": {"max_logits": jnp.array([jnp.inf, 400.0])}}, qk_clip_threshold=100.0)
    >>> [int(inf["attn"][k]) for k in ("num_above_threshold", "num_clipped", "num_nonfinite")]  # +inf: skipped
    [2, 1, 1]
  """
  tau = _resolve_threshold(qk_clip_threshold)
  stats = {}
  for module, s in collect_max_logits(max_logits, "qk_clip_stats").items():
    if tau is None:
      clipped, gamma = jnp.zeros(s.shape, bool), jnp.ones(s.shape, jnp.float32)
      above = clipped
    else:
      clipped, gamma = _gamma(s, tau)
      above = (s > tau) & (tau > 0)  # NaN is not above; +inf is (and is not clipped)
    stats[module] = {
        "gamma": gamma,
        "num_clipped": jnp.sum(clipped, axis=-1, dtype=jnp.int32),
        "num_above_threshold": jnp.sum(above, axis=-1, dtype=jnp.int32),
        "min_gamma": jnp.min(gamma, axis=-1),
        "max_logit": jnp.max(s, axis=-1),
        "num_heads": jnp.full(s.shape[:-1], s.shape[-1], jnp.int32),
        "num_nonfinite": jnp.sum(~jnp.isfinite(s), axis=-1, dtype=jnp.int32),
    }
  return stats


def init_max_logits(params: optax.Params, layout: LayoutSpec) -> dict:
  """A ``max_logits`` tree of ``-inf`` for every attention module of ``params``.

  The tree has the structure of the ``intermediates`` collection that the attention modules
  sow (``{"layers": {"attn": {"max_logits": (*stack, num_heads)}}}``), so that a running
  maximum over several forward passes (gradient accumulation) can live in a fixed-shape
  optimizer state. A module is an attention module when it has the query/key projections
  its layout names (MLA: ``query`` or ``wq_b``/``wq``, and ``key_value``; GQA: ``query`` and
  ``key``, or ``qkv``); the stacked-layer shape ``*stack`` is read off their kernels, in any
  form ``qk_clip`` accepts (the projections of a module must agree on it).

  Raises:
    ValueError: no attention module; a module whose kernels fit no form or two, or disagree
      on the stacked-layer shape; a layout mapping in which zero or several patterns match
      an attention module; params passed as the variables dict ``{"params": ...}``.
    TypeError: a layout that is not an ``MLALayout``/``GQALayout`` or a mapping of them.

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
    >>> params = {"layers": {"attn": {"wq": {"kernel": jnp.ones((3, 8, 8))},  # 3 layers stacked by nn.scan
    ...                               "wk": {"kernel": jnp.ones((3, 8, 8))}},
    ...                      "mlp": {"kernel": jnp.ones((3, 8, 32))}}}
    >>> running = mc.init_max_logits(params, layout)
    >>> jax.tree.map(jnp.shape, running)  # (layers, heads), for the attention module only
    {'layers': {'attn': {'max_logits': (3, 2)}}}
    >>> running["layers"]["attn"]["max_logits"][0]
    Array([-inf, -inf], dtype=float32)
  """
  check_layout(layout, "init_max_logits")
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  by_module = {
      module: {name: jnp.shape(flat[i][1]) for name, i in index.items()}
      for module, index in leaves_by_module(flat).items()
  }
  names, typed, raw = names_by_path(params), storage_axes(params), held_raw(params)
  tree: dict[str, jax.Array] = {}
  for module, lay in attention_modules(by_module, layout, "init_max_logits", typed).items():
    found = detect(module, lay, by_module[module], caller="init_max_logits", names=names_under(module, names),
                   typed=names_under(module, typed), raw=names_under(module, raw))
    stack = found[0].stack
    tree[module] = jnp.full((*stack, lay.num_heads), -jnp.inf, jnp.float32)
  if isinstance(params, Mapping) and "params" in params and all(
      m == "params" or m.startswith("params/") for m in tree
  ):
    raise ValueError(
        "init_max_logits: params has a top-level 'params' key"
        + (f" and the attention modules {sorted(tree)} lie under it" if tree else "")
        + ": pass the 'params' collection (variables['params']), not the whole variables "
        "dict {'params': ...}"
    )
  if not tree:
    raise ValueError(
        f"init_max_logits: no attention module for layout {layout!r} in params (a module "
        "with the query/key projections the layout names)"
    )
  return nest_max_logits(tree)
