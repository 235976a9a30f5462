"""The ``max_logits`` tree: per-head maxima sown by attention modules, found by module path.

Attention modules sow a leaf ``max_logits`` of shape ``(*stack, num_heads)`` in the
``intermediates`` collection at their own module path (next to their query/key
projections in ``params``). This module reads such a tree into ``{module path: maxima}``
and writes one back.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._util import join, key_name, keystr

MAX_LOGITS = "max_logits"
INTERMEDIATES = "intermediates"

# How to get the maxima, for Linen and for NNX (appended to the errors that find none).
CAPTURE_HINT = (
    "Linen: pass the 'intermediates' collection of `y, state = model.apply(variables, x, "
    "mutable=['intermediates'])`; NNX: pass the intermediates of `y, intermediates = "
    "nnx.capture(model, nnx.Intermediate)(x)`. Every attention must sow them: the modules of "
    "muonclip_jax.nn do; Flax's attention needs attention_fn=muonclip_jax.nn.dot_product_attention, "
    "and nnx.MultiHeadAttention sows only when called with sow_weights=True (`model(x, sow_weights=True)`)"
)


def _reject_apply_output(max_logits: Any, caller: str) -> None:
  """A tuple at the top is the ``(output, state)`` pair of ``apply``/``nnx.capture``: say so."""
  if not isinstance(max_logits, (tuple, list)):
    return
  holds = [
      i for i, x in enumerate(max_logits)
      if isinstance(x, Mapping) and INTERMEDIATES in x
      or any(MAX_LOGITS in map(key_name, p) for p, _ in jax.tree_util.tree_flatten_with_path(x)[0])
  ]
  where = f"; element {holds[0]} holds the maxima" if holds else ""
  raise TypeError(
      f"{caller}: max_logits is a {type(max_logits).__name__} of length {len(max_logits)}{where}. "
      "Expected the 'intermediates' collection (a mapping): from "
      "`y, state = model.apply(variables, x, mutable=['intermediates'])` pass state "
      "(or state['intermediates']), not the (y, state) pair; from "
      "`y, intermediates = nnx.capture(model, nnx.Intermediate)(x)` pass intermediates"
  )


def collect_max_logits(max_logits: Any, caller: str = "qk_clip", *, required: bool = True) -> dict[str, jax.Array]:
  """``{module path: float32 maxima (*stack, H)}`` of an ``intermediates``-like tree.

  Accepts the bare ``intermediates`` collection or ``{"intermediates": ...}`` (the mutable
  state of ``apply``), leaves wrapped in a tuple (Flax's default ``sow``; several entries are
  merged by maximum), NNX ``Intermediate`` boxes (trailing ``value`` key) and flat dicts
  keyed as flat parameters may be (``"attn.max_logits"``, ``("attn", "max_logits")``,
  ``"attn/max_logits"``: ``keystr``).

  With ``required=False`` a tree without any ``max_logits`` leaf (``None``, ``{}``) gives
  ``{}`` (a train step whose optimizer does not clip).

  Raises:
    TypeError: a tuple or list at the top (the ``(y, state)`` pair of ``apply``).
    ValueError: no ``max_logits`` leaf (when ``required``; the message gives Linen's and
      NNX's ways to capture them); a leaf under another ``intermediates`` key; leaves of one
      module with different shapes, or of rank 0.
  """
  _reject_apply_output(max_logits, caller)
  if isinstance(max_logits, Mapping) and INTERMEDIATES in max_logits:
    max_logits = max_logits[INTERMEDIATES]
  found: dict[str, list[jax.Array]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(max_logits)[0]:
    names = keystr(path).split("/")  # flat dicts' keys too: "attn/max_logits", "attn.max_logits", tuples
    if MAX_LOGITS not in names:
      continue
    i = len(names) - 1 - names[::-1].index(MAX_LOGITS)
    if any(not (n.isdigit() or n == "value") for n in names[i + 1 :]):
      raise ValueError(
          f"{caller}: unexpected structure under {'/'.join(names[: i + 1])!r}: {keystr(path)!r}; "
          "expected an array, a tuple of arrays or an NNX Intermediate"
      )
    if INTERMEDIATES in names[:i]:
      raise ValueError(
          f"{caller}: max_logits leaf at {keystr(path)!r} lies under an "
          f"{INTERMEDIATES!r} key; pass the 'intermediates' collection itself (or "
          "{'intermediates': ...}), whose paths are the attention modules' paths"
      )
    found.setdefault("/".join(names[:i]), []).append(jnp.asarray(leaf))
  if not found:
    if not required:
      return {}
    raise ValueError(f"{caller}: no leaf named 'max_logits' in max_logits: no attention reported its maxima. "
                     + CAPTURE_HINT)
  result = {}
  for module, arrays in found.items():
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or arrays[0].ndim < 1:
      raise ValueError(
          f"{caller}: {join(module, MAX_LOGITS)}: expected shape (..., num_heads), "
          f"got {[a.shape for a in arrays]}"
      )
    result[module] = functools.reduce(jnp.maximum, arrays).astype(jnp.float32)
  return result


def nest_max_logits(flat: Mapping[str, jax.Array]) -> dict:
  """``{"a/b": x}`` -> ``{"a": {"b": {"max_logits": x}}}``, the shape of ``intermediates``."""
  tree: dict = {}
  for module, value in flat.items():
    node = tree
    for part in module.split("/") if module else []:
      node = node.setdefault(part, {})
    node[MAX_LOGITS] = value
  return tree


def reduce_max_logits(max_logits: Any, *, child: str = "attention_op", batch_axis: int = -2) -> dict:
  """Per-batch maxima sown one level below the attention module -> ``qk_clip``'s tree.

  MaxText's attention writes ``max_logits`` of shape ``(batch, heads)`` (under ``nn.scan``:
  ``(layers, batch, heads)``) in its child ``attention_op``, one level below the module that
  holds the query/key projections. ``qk_clip``, ``muonclip``/``qk_clip_transform`` and
  ``multi_steps`` read maxima ``(*stack, heads)`` at the attention module's own path, so
  pass them ``reduce_max_logits(intermediates)``: every ``max_logits`` leaf under a module
  named ``child`` becomes the maximum over its ``batch_axis``, moved up to the parent
  module's path; every other leaf is kept. The batch axis is reduced, never read as layers
  (``qk_clip`` refuses maxima under ``child`` and names this helper). Pure, jit-friendly.

  Args:
    max_logits: an ``intermediates``-like tree, as for ``qk_clip``.
    child: the name of the sub-module that writes the per-batch maxima.
    batch_axis: the batch axis of those leaves (default ``-2``: ``(..., batch, heads)``).

  Returns:
    A nested ``{..: {"max_logits": (*stack, heads) float32}}`` tree.

  With a model: ``y, state = model.apply(variables, tokens, mutable=["intermediates"])``,
  then ``opt.update(grads, opt_state, params, max_logits=mc.reduce_max_logits(state))``.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> per_batch = jnp.array([[[1.0, 5.0], [3.0, 2.0]]])  # (layers=1, batch=2, heads=2), as MaxText writes it
    >>> intermediates = {"layers": {"attn": {"attention_op": {"max_logits": per_batch}}}}
    >>> mc.reduce_max_logits(intermediates)  # the maximum over the batch, at the attention module's path
    {'layers': {'attn': {'max_logits': Array([[3., 5.]], dtype=float32)}}}
  """
  flat = collect_max_logits(max_logits, "reduce_max_logits")
  out: dict[str, jax.Array] = {}
  for module, s in flat.items():
    parent, _, last = module.rpartition("/")
    if last == child:
      if s.ndim < 2 or not -s.ndim <= batch_axis < s.ndim or batch_axis % s.ndim == s.ndim - 1:
        raise ValueError(f"reduce_max_logits: {join(module, MAX_LOGITS)} has shape {s.shape}; expected "
                         f"(..., batch, heads) with the batch at axis {batch_axis}")
      s, module = jnp.max(s, axis=batch_axis), parent
    if module in out:
      raise ValueError(f"reduce_max_logits: two max_logits leaves for module {module!r}")
    out[module] = s
  return nest_max_logits(out)
