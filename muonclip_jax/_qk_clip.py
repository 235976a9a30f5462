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
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ._layouts import GQALayout, MLALayout
from ._paths import key_name as _key_name
from ._paths import keystr as _path_str
from ._paths import strip_value as _strip_value

_Layout = MLALayout | GQALayout
_MAX_LOGITS = "max_logits"


# ----------------------------------------------------------------------------- paths


def _join(module: str, name: str) -> str:
  return f"{module}/{name}" if module else name


# ----------------------------------------------------------------------------- inputs


def _resolve_threshold(threshold: Any) -> jax.Array | None:
  """Validates tau; returns it as a float32 scalar, or None when clipping is off.

  None or +inf turns the clip off. A concrete NaN or non-positive value raises ValueError.
  A traced value cannot be checked; it is handled numerically (``_gamma`` clips nothing when
  tau is NaN, infinite or <= 0).
  """
  if threshold is None:
    return None
  if jnp.ndim(threshold) != 0:
    raise ValueError(f"qk_clip: threshold must be a scalar, got shape {jnp.shape(threshold)}")
  if isinstance(threshold, jax.core.Tracer):  # e.g. optax.inject_hyperparams inside jit
    return jnp.asarray(threshold, jnp.float32)
  value = float(threshold)
  if math.isnan(value) or value <= 0:
    raise ValueError(f"qk_clip: threshold must be > 0 (or None/inf for no clip), got {value}")
  if math.isinf(value):
    return None
  return jnp.asarray(value, jnp.float32)


def _check_layout(layout: Any) -> None:
  layouts = layout.values() if isinstance(layout, Mapping) else [layout]
  for lay in layouts:
    if not isinstance(lay, (MLALayout, GQALayout)):
      raise TypeError(
          "qk_clip: layout must be an MLALayout, a GQALayout or a mapping from path patterns "
          f"to them, got {type(lay).__name__}: {lay!r}"
      )


def _layout_for(module: str, layout: _Layout | Mapping[str, _Layout]) -> _Layout:
  """The layout of one module: the single layout, or the one whose glob pattern matches."""
  if not isinstance(layout, Mapping):
    return layout
  matches = [pattern for pattern in layout if fnmatch.fnmatchcase(module, pattern)]
  if len(matches) != 1:
    what = "no pattern" if not matches else f"{len(matches)} patterns {matches}"
    raise ValueError(
        f"qk_clip: {what} of the layout mapping match module path {module!r}; "
        f"exactly one must (patterns: {list(layout)})"
    )
  return layout[matches[0]]


def _collect_max_logits(max_logits: Any) -> dict[str, jax.Array]:
  """Finds the ``max_logits`` leaves; returns {module path: per-head maxima (..., H)}.

  Accepts the bare ``intermediates`` collection or ``{"intermediates": ...}``, leaves wrapped
  in a tuple (Flax's default ``sow``; several entries are merged by maximum) and NNX
  ``Intermediate`` boxes (trailing ``value`` key).
  """
  if isinstance(max_logits, Mapping) and "intermediates" in max_logits:
    max_logits = max_logits["intermediates"]
  found: dict[str, list[jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(max_logits)[0]:
    names = [_key_name(k) for k in path]
    if _MAX_LOGITS not in names:
      continue
    i = len(names) - 1 - names[::-1].index(_MAX_LOGITS)
    if any(not (isinstance(n, int) or n == "value") for n in names[i + 1 :]):
      raise ValueError(
          f"qk_clip: unexpected structure under {_path_str(path[: i + 1])!r}: {_path_str(path)!r}; "
          "expected an array, a tuple of arrays or an NNX Intermediate"
      )
    found.setdefault(_path_str(path[:i]), []).append(jnp.asarray(leaf))
  if not found:
    raise ValueError(
        "qk_clip: no leaf named 'max_logits' in max_logits; pass the 'intermediates' collection "
        "of model.apply(..., mutable=['intermediates'])"
    )
  result = {}
  for module, arrays in found.items():
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or arrays[0].ndim < 1:
      raise ValueError(
          f"qk_clip: {_join(module, _MAX_LOGITS)}: expected shape (..., num_heads), "
          f"got {[a.shape for a in arrays]}"
      )
    result[module] = functools.reduce(jnp.maximum, arrays).astype(jnp.float32)
  return result


# ----------------------------------------------------------------------------- math


def _gamma(s: jax.Array, tau: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-head (clipped, gamma): clipped = S finite and S > tau > 0; gamma = tau / S there, else 1.

  The guards make gamma lie in (0, 1] for any S (NaN, +-inf, <= 0) and any traced tau (NaN,
  inf, <= 0 clip nothing), so nothing is ever multiplied by a non-finite or negative number.
  """
  clipped = jnp.isfinite(s) & (s > tau) & (tau > 0)
  gamma = jnp.where(clipped, tau / jnp.where(clipped, s, 1.0), 1.0)
  return clipped, gamma


def clip_factors(max_logits: jax.Array, threshold: Any) -> jax.Array:
  """QK-Clip factors gamma_h = min(1, tau / S_max^h) (Kimi K2, section 2.1, Algorithm 1).

  Args:
    max_logits: per-head maxima S_max of shape ``(..., num_heads)``.
    threshold: tau > 0. None or +inf means no clip (all ones); a traced value is accepted.

  Returns:
    float32 array of ``max_logits``' shape with values in (0, 1]; 1 where S_max <= tau, and
    where S_max is non-finite or <= 0 (such a head is left as it is).
  """
  tau = _resolve_threshold(threshold)
  s = jnp.asarray(max_logits, jnp.float32)
  if tau is None:
    return jnp.ones(s.shape, jnp.float32)
  return _gamma(s, tau)[1]


def _per_column(*parts: tuple[jax.Array, int]) -> jax.Array:
  """Per-head factors (..., H) repeated over each head's column segments -> (..., H * sum(w))."""
  segments = [jnp.broadcast_to(f[..., None], (*f.shape, w)) for f, w in parts if w]
  factor = jnp.concatenate(segments, axis=-1)
  return factor.reshape(*factor.shape[:-2], -1)


def _scale(x: jax.Array, factor: jax.Array) -> jax.Array:
  """x * factor in (at least) float32, cast back to x's dtype. Elementwise, so it keeps sharding."""
  dtype = jnp.result_type(x)
  compute = jnp.promote_types(dtype, jnp.float32)
  return (x.astype(compute) * factor.astype(compute)).astype(dtype)


# ----------------------------------------------------------------------------- modules


def _column_factors(
    module: str, s: jax.Array, tau: jax.Array, lay: _Layout, shapes: Mapping[str, tuple]
) -> dict[str, jax.Array]:
  """Checks one module's shapes; returns {param name: per-column factor (*stack, cols)}."""
  stack, heads = s.shape[:-1], s.shape[-1]
  if heads != lay.num_heads:
    raise ValueError(
        f"qk_clip: {_join(module, _MAX_LOGITS)} has shape {s.shape} ({heads} heads), "
        f"but the layout says num_heads={lay.num_heads}: {lay}"
    )

  def require(name: str) -> None:
    if f"{name}/kernel" not in shapes:
      raise ValueError(
          f"qk_clip: {_join(module, _MAX_LOGITS)} has no matching attention parameter "
          f"{_join(module, name + '/kernel')!r} for {type(lay).__name__}; parameters under "
          f"{module or '<root>'!r}: {sorted(shapes)}"
      )

  def check(name: str, num: int, width: int) -> None:
    cols = num * width
    for leaf, tail in (("kernel", ("in", cols)), ("bias", (cols,))):
      shape = shapes.get(f"{name}/{leaf}")
      if shape is None:
        continue
      path = _join(module, f"{name}/{leaf}")
      if len(shape) != len(stack) + len(tail) or tuple(shape[: len(stack)]) != stack:
        raise ValueError(
            f"qk_clip: {path} has shape {shape}; expected {(*stack, *tail)}, whose leading "
            f"(stacked-layer) shape {stack} is that of max_logits {s.shape}"
        )
      if shape[-1] % width:
        raise ValueError(
            f"qk_clip: {path} has shape {shape}: {shape[-1]} columns are not a multiple of the "
            f"per-head width {width} of {lay}"
        )
      if shape[-1] != cols:
        raise ValueError(
            f"qk_clip: {path} has shape {shape}, i.e. {shape[-1] // width} heads of {width} "
            f"columns, but expected {num} heads ({cols} columns) from {lay} and max_logits "
            f"shape {s.shape}"
        )

  gamma = _gamma(s, tau)[1]
  root = jnp.sqrt(gamma)
  if isinstance(lay, MLALayout):
    if "wq/kernel" in shapes and "wq_b/kernel" in shapes:
      raise ValueError(
          f"qk_clip: {module or '<root>'!r} has both wq/kernel and wq_b/kernel; an MLA module "
          "has one query projection (wq_b with query LoRA, wq without)"
      )
    q = "wq_b" if "wq_b/kernel" in shapes else "wq"
    require(q)
    require("wkv_b")
    nope, rope, v = lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim
    check(q, heads, nope + rope)
    check("wkv_b", heads, nope + v)
    factors = {q: _per_column((root, nope), (gamma, rope))}
    if nope:  # k^C by sqrt(gamma); v is untouched
      factors["wkv_b"] = _per_column((root, nope), (jnp.ones_like(gamma), v))
    return factors

  require("wq")
  require("wk")
  check("wq", heads, lay.head_dim)
  check("wk", lay.num_kv_heads, lay.head_dim)
  if lay.clip_mode == "query":
    return {"wq": _per_column((gamma, lay.head_dim))}
  group_min = gamma.reshape(*stack, lay.num_kv_heads, lay.group_size).min(axis=-1)
  return {
      "wq": _per_column((root, lay.head_dim)),
      "wk": _per_column((jnp.sqrt(group_min), lay.head_dim)),
  }


def qk_clip(params: Any, max_logits: Any, *, threshold: Any, layout: Any) -> Any:
  """Applies QK-Clip (Kimi K2, arXiv 2507.20534, section 2.1, Algorithm 1) to attention params.

  For each attention module with per-head maxima S_max^h (pre-softmax logits times the softmax
  scale, over the batch and all unmasked query/key pairs) and each head h with
  S_max^h > tau: gamma_h = tau / S_max^h, and the head's query/key columns (kernel and bias)
  are scaled as described in this module's docstring (MLA: q^C, k^C by sqrt(gamma_h), q^R by
  gamma_h; GQA "split": q by sqrt(gamma_h), shared k by sqrt(min of its group); GQA "query":
  q by gamma_h). Heads with S_max^h <= tau, or with a non-finite or non-positive S_max^h, are
  left bit-for-bit as they are. ``wkv_a``, ``wv``, ``wo`` and all other leaves are untouched.

  Pure and jit-friendly: shape checks only at trace time, no host sync, no branching on
  values. Each scaled leaf is multiplied elementwise by a per-column factor built from the
  small maxima (in float32 or wider, cast back), so dtypes and shardings are kept and a
  head-sharded kernel is scaled in place without gathering it.

  Args:
    params: a Flax ``params`` collection: plain arrays, boxed leaves (``nn.Partitioned``) or an
      ``nnx.State``. Kernels are ``(*stack, in, cols)`` with head-major columns (see
      ``MLALayout`` / ``GQALayout``); ``*stack`` are optional leading stacked-layer axes
      (``nn.scan``).
    max_logits: the ``intermediates`` collection (or ``{"intermediates": ...}``) in which each
      attention module has a leaf ``max_logits`` of shape ``(*stack, num_heads)``, matched to
      the parameters at the same module path (``<path>/wq/kernel``, ...).
    threshold: tau > 0 (Kimi K2 uses 100). None or +inf: no clip, ``params`` is returned as
      is and ``max_logits`` is not read. May be a traced scalar (not validated then; a NaN,
      infinite or non-positive traced tau clips nothing).
    layout: one ``MLALayout``/``GQALayout`` for every module, or a mapping from glob patterns
      (``fnmatch``, matched against the module path such as ``"layers/attn"``) to layouts;
      exactly one pattern must match each module.

  Returns:
    ``params`` with the same structure, box types, dtypes and shardings.

  Raises:
    ValueError: a concrete threshold that is NaN or <= 0; no ``max_logits`` leaf; a module
      without the expected attention parameters (or with both ``wq`` and ``wq_b`` for MLA);
      head counts or head widths that disagree with the kernels or the maxima; leading stack
      shapes that differ; a layout mapping in which zero or several patterns match a module.
    TypeError: a layout that is not an ``MLALayout``/``GQALayout`` or a mapping of them.
  """
  _check_layout(layout)
  tau = _resolve_threshold(threshold)
  if tau is None:
    return params
  maxima = _collect_max_logits(max_logits)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [leaf for _, leaf in flat]
  # {module path: {"wq/kernel": leaf index, ...}} from paths <module>/<projection>/<kernel|bias>.
  by_module: dict[str, dict[str, int]] = {}
  for i, (path, _) in enumerate(flat):
    path = _strip_value(path)
    if len(path) >= 2:
      by_module.setdefault(_path_str(path[:-2]), {})[_path_str(path[-2:])] = i
  for module, s in maxima.items():
    index = by_module.get(module, {})
    shapes = {name: jnp.shape(leaves[i]) for name, i in index.items()}
    factors = _column_factors(module, s, tau, _layout_for(module, layout), shapes)
    for name, factor in factors.items():
      kernel = index[f"{name}/kernel"]
      leaves[kernel] = _scale(leaves[kernel], factor[..., None, :])
      bias = index.get(f"{name}/bias")
      if bias is not None:
        leaves[bias] = _scale(leaves[bias], factor)
  return treedef.unflatten(leaves)


def qk_clip_stats(max_logits: Any, *, threshold: Any) -> dict[str, dict[str, jax.Array]]:
  """Per-module QK-Clip statistics for logging (Kimi K2, section 2.1); runs inside jit.

  Args:
    max_logits: as for ``qk_clip``.
    threshold: as for ``qk_clip`` (None or +inf: nothing is clipped).

  Returns:
    ``{module path: stats}`` with, for maxima of shape ``(*stack, H)``, arrays of shape
    ``stack`` (``()`` for one layer, ``(L,)`` for ``nn.scan``-stacked layers):
    ``num_clipped`` (int32, heads with finite S_max > tau), ``min_gamma`` (float32,
    min_h gamma_h; 1.0 when nothing is clipped), ``max_logit`` (float32, max_h S_max^h; NaN
    if any head is NaN), ``num_heads`` (int32, H) and ``num_nonfinite`` (int32, heads whose
    S_max is NaN or +-inf; they are never clipped).
  """
  tau = _resolve_threshold(threshold)
  stats = {}
  for module, s in _collect_max_logits(max_logits).items():
    if tau is None:
      clipped, gamma = jnp.zeros(s.shape, bool), jnp.ones(s.shape, jnp.float32)
    else:
      clipped, gamma = _gamma(s, tau)
    stats[module] = {
        "num_clipped": jnp.sum(clipped, axis=-1, dtype=jnp.int32),
        "min_gamma": jnp.min(gamma, axis=-1),
        "max_logit": jnp.max(s, axis=-1),
        "num_heads": jnp.full(s.shape[:-1], s.shape[-1], jnp.int32),
        "num_nonfinite": jnp.sum(~jnp.isfinite(s), axis=-1, dtype=jnp.int32),
    }
  return stats


def init_max_logits(params: Any, layout: Any) -> dict:
  """A ``max_logits`` tree of ``-inf`` for every attention module of ``params``.

  The tree has the structure of the ``intermediates`` collection that the attention modules
  sow (``{"layers": {"attn": {"max_logits": (*stack, num_heads)}}}``), so that a running
  maximum over several forward passes (gradient accumulation) can live in a fixed-shape
  optimizer state. A module is an attention module when it has the query/key projections
  of its layout (MLA: ``wq_b`` or ``wq``, and ``wkv_b``; GQA: ``wq`` and ``wk``).
  """
  _check_layout(layout)
  by_module: dict[str, dict[str, tuple]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = _strip_value(path)
    if len(path) >= 2:
      by_module.setdefault(_path_str(path[:-2]), {})[_path_str(path[-2:])] = jnp.shape(leaf)
  tree: dict[str, jax.Array] = {}
  for module, shapes in by_module.items():
    q = "wq_b/kernel" if "wq_b/kernel" in shapes else "wq/kernel"
    is_mla = q in shapes and "wkv_b/kernel" in shapes
    is_gqa = "wq/kernel" in shapes and "wk/kernel" in shapes
    if not (is_mla or is_gqa):
      continue
    lay = _layout_for(module, layout)
    if (is_mla if isinstance(lay, MLALayout) else is_gqa):
      tree[module] = jnp.full((*shapes[q][:-2], lay.num_heads), -jnp.inf, jnp.float32)
  if not tree:
    raise ValueError(f"init_max_logits: no attention module for layout {layout!r} in params")
  return nest_max_logits(tree)


def nest_max_logits(flat: Mapping[str, jax.Array]) -> dict:
  """``{"a/b": x}`` -> ``{"a": {"b": {"max_logits": x}}}``, the shape of ``intermediates``."""
  tree: dict = {}
  for module, value in flat.items():
    node = tree
    for part in module.split("/") if module else []:
      node = node.setdefault(part, {})
    node[_MAX_LOGITS] = value
  return tree


def collect_max_logits(max_logits: Any) -> dict[str, jax.Array]:
  """``{module path: float32 maxima (*stack, H)}`` of an ``intermediates``-like tree."""
  return _collect_max_logits(max_logits)
