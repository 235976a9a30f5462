"""Equinox models: each parameter's role read from the type of the layer that owns it.

What optax receives from an Equinox model is ``eqx.filter(model, eqx.is_array)``: the
model's own tree of modules, arrays where the model holds arrays. So the layer that owns
each array is known, and nothing need be guessed from its shape:

* ``eqx.nn.Linear``: ``weight`` is a matrix stored ``(out, in)`` (torch's convention),
  ``bias`` a vector;
* ``eqx.nn.Embedding``: ``weight`` ``(vocabulary, width)`` is an embedding table;
* ``eqx.nn.LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm``: ``weight`` and ``bias``
  are gains.

Axes in front of a layer's own (a ``weight`` of rank 3 in a ``Linear``) are stacked layers
(``eqx.filter_vmap(Block)(keys)``): Muon batches them and the clip scales each layer on its
own. Leaves of other types, subclasses included, are not read here (the general rules of
``_muon.labels`` and ``_muon.matrix_axes_rules`` apply to them). But an array held by an
Equinox module of a type not known here (``held_raw``) follows Equinox's convention as far as
anyone can tell, ``x @ w.T`` like ``Linear``, while the general rule for undeclared kernels
reads Flax's ``(in, out)``: where both fit (a square projection) the layout refuses to guess
(``_clip.kernel_forms.check_orientation``).

A layout projection named by its module alone (``GQALayout(query="wq")``, leaf ``kernel`` by
default) where that module is a ``Linear`` reads its ``weight`` (``linear_leaf``).

``eqx.nn.MultiheadAttention`` has no hook for its logits; ``equinox_attention`` runs the
module itself and reads the per-head maxima from the q and k its public ``process_heads``
callback sees.

Every line that knows Equinox is in this module. Equinox stays optional: it is never
imported here, only looked up in ``sys.modules`` (a tree cannot hold Equinox modules unless
the user imported Equinox). Read from equinox 0.13.8 (public ``eqx.nn`` classes and the
``process_heads`` argument of ``MultiheadAttention.__call__``);
``tests/test_equinox.py`` fails if they move.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._util import key_name, keystr
from .projection import Projection

MATRIX = "matrix"  # a weight matrix (Muon)
VECTOR = "vector"  # a bias
EMBEDDING = "embedding"  # an embedding table
GAIN = "gain"  # a norm's weight or bias


@dataclasses.dataclass(frozen=True)
class Role:
  """What a parameter is, read from the type of its layer.

  Attributes:
    layer: the layer's class name, e.g. ``"Linear"``.
    kind: ``MATRIX``, ``VECTOR``, ``EMBEDDING`` or ``GAIN``.
    axes: for a matrix, its storage in ``Projection`` axis names, one per axis:
      ``("layers", ..., "out", "in")``; None otherwise.
  """

  layer: str
  kind: str
  axes: tuple[str, ...] | None = None


def _equinox() -> Any:
  return sys.modules.get("equinox")


def _fields(eqx: Any) -> dict[type, dict[str, str]]:
  """{layer type: {field: kind}} of the layers whose storage is known."""
  nn = eqx.nn
  gains = {"weight": GAIN, "bias": GAIN}
  return {nn.Linear: {"weight": MATRIX, "bias": VECTOR}, nn.Embedding: {"weight": EMBEDDING},
          nn.LayerNorm: gains, nn.RMSNorm: gains, nn.GroupNorm: gains, nn.BatchNorm: gains}


def leaf_roles(tree: Any) -> dict[str, Role]:
  """``{leaf path: Role}`` of the leaves of ``tree`` owned by a known Equinox layer.

  Paths are those of ``jax.tree_util.tree_flatten_with_path(tree)`` rendered ``a/b/c``.
  Empty when Equinox is not imported or the tree holds no known layer. Only the exact
  types are known: a subclass may store its arrays otherwise.
  """
  eqx = _equinox()
  if eqx is None:
    return {}
  known = _fields(eqx)
  roles = {}
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: type(x) in known)[0]:
    fields = known.get(type(node))
    if fields is None:
      continue
    for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
      kind = fields.get(key_name(sub[0])) if len(sub) == 1 else None
      if kind is None:
        continue
      axes = None
      if kind == MATRIX and jnp.ndim(leaf) >= 2:
        axes = ("layers",) * (jnp.ndim(leaf) - 2) + ("out", "in")
      roles[keystr((*path, *sub))] = Role(type(node).__name__, kind, axes)
  return roles


def storage_axes(tree: Any) -> dict[str, tuple[str, ...]]:
  """``{leaf path: declared axes}`` of the matrices whose storage their layer's type tells."""
  return {path: role.axes for path, role in leaf_roles(tree).items() if role.axes is not None}


def held_raw(tree: Any) -> dict[str, str]:
  """``{leaf path: owner class name}`` of the arrays of rank 2 or more held by an Equinox module
  of a type not known here (``Linear`` subclasses included), outside any module it holds.

  Their storage is undeclared, and Equinox's convention (``(out, in)``, ``x @ w.T``) differs from
  the general rule (Flax's ``(in, out)``): a layout never guesses between the two for them.
  Empty when Equinox is not imported.
  """
  eqx = _equinox()
  if eqx is None:
    return {}
  known = _fields(eqx)
  raw: dict[str, str] = {}

  def visit(prefix: tuple, node: Any) -> None:
    inner = lambda x: x is not node and isinstance(x, eqx.Module)  # noqa: E731
    for sub, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=inner)[0]:
      if isinstance(leaf, eqx.Module):
        visit((*prefix, *sub), leaf)
      elif isinstance(node, eqx.Module) and type(node) not in known and len(getattr(leaf, "shape", ())) >= 2:
        raw[keystr((*prefix, *sub))] = type(node).__name__

  visit((), tree)
  return raw


def linear_leaf(spec: Projection, typed: Mapping[str, tuple[str, ...]]) -> Projection:
  """``spec`` reading the ``weight`` of a ``Linear`` named by its module alone.

  A projection with the default leaf ``kernel`` and no such leaf, whose module holds a
  ``Linear`` weight (``typed``: ``storage_axes`` under the attention module), reads that weight:
  the type says where the matrix is (and, in ``detect``, how it is stored).
  """
  weight = f"{spec.name}/weight"
  if spec.leaf == "kernel" and spec.kernel not in typed and weight in typed:
    return dataclasses.replace(spec, leaf="weight")
  return spec


def _check_attention(where: str, mha: Any) -> Any:
  eqx = _equinox()
  if eqx is None or not isinstance(mha, eqx.nn.MultiheadAttention):
    raise TypeError(f"{where}: expected an equinox.nn.MultiheadAttention, got {type(mha).__name__}")
  return eqx


def attention_projections(mha: Any) -> tuple[int, int, dict[str, Projection | None]]:
  """``(num_heads, head_dim, projections)`` of an ``eqx.nn.MultiheadAttention``.

  The projections (``query``, ``key``, ``value``, ``out``) are its ``query_proj``,
  ``key_proj``, ``value_proj`` and ``output_proj`` ``Linear`` weights, declared
  ``("out", "in")`` (an output projection's ``"in"`` is its heads side), with a ``"layers"`` axis in front for each axis a stack added
  (``eqx.filter_vmap``); ``head_dim`` is its ``qk_size``. A layout has one head width, so
  the value and output projections are declared only when ``vo_size == qk_size`` (None
  otherwise: Muon then takes them whole).
  """
  _check_attention("GQALayout.from_equinox", mha)
  stack = jnp.ndim(mha.query_proj.weight) - 2
  axes = ("layers",) * stack + ("out", "in")
  same_width = mha.vo_size == mha.qk_size
  projections = {
      "query": Projection("query_proj", leaf="weight", axes=axes),
      "key": Projection("key_proj", leaf="weight", axes=axes),
      "value": Projection("value_proj", leaf="weight", axes=axes) if same_width else None,
      "out": Projection("output_proj", leaf="weight", axes=axes) if same_width else None,
  }
  return mha.num_heads, mha.qk_size, projections


def equinox_attention(
    mha: Any,
    query: jax.Array,
    key_: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    inference: bool | None = None,
    process_heads: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """``eqx.nn.MultiheadAttention`` with its per-head max logits: ``(out, max_logits)``.

  Calls ``mha(query, key_, value, mask, key=key, inference=inference,
  process_heads=...)`` itself, so ``out`` is the module's output, with its masking,
  dropout and ``inference`` flag. The q and k heads that enter its attention (after
  ``process_heads``, e.g. rotary embeddings) are read through its ``process_heads``
  callback, and

    max_logits[h] = max over queries i and keys j with mask[(h,) i, j] of q_i^h . k_j^h / sqrt(qk_size)

  (Kimi K2, arXiv 2507.20534, section 2.1), float32 of shape ``(num_heads,)``; a row with
  every key masked contributes nothing (-inf).

  Like the module it is unbatched (``query`` is ``(q_seq, query_size)``): under
  ``jax.vmap`` over a batch ``max_logits`` comes back ``(batch, num_heads)``, and QK-Clip
  needs its maximum over the batch, ``max_logits.max(axis=0)``.

  Args:
    mha: an ``eqx.nn.MultiheadAttention``.
    query, key_, value, mask, key, inference, process_heads: as for
      ``MultiheadAttention.__call__``.

  Returns:
    ``(out, max_logits)``: the module's output ``(q_seq, output_size)`` and the per-head
    maxima.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp
    >>> from muonclip_jax import nn as mnn
    >>> mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.key(0))
    >>> x = jax.random.normal(jax.random.key(1), (5, 8))
    >>> causal = jnp.tril(jnp.ones((5, 5), bool))
    >>> out, max_logits = mnn.equinox_attention(mha, x, x, x, causal)
    >>> bool(jnp.array_equal(out, mha(x, x, x, causal))), max_logits.shape  # the module's own output
    (True, (2,))
  """
  _check_attention("equinox_attention", mha)
  seen = []

  def capture(q, k, v):
    if process_heads is not None:
      q, k, v = process_heads(q, k, v)
    seen.append((q, k))
    return q, k, v

  out = mha(query, key_, value, mask, key=key, inference=inference, process_heads=capture)
  if len(seen) != 1:
    raise RuntimeError(f"equinox_attention: MultiheadAttention called process_heads {len(seen)} times, "
                       "expected once (equinox 0.13.8's behaviour): its capture cannot be trusted")
  q, k = seen[0]
  logits = jnp.einsum("qhd,khd->hqk", q / math.sqrt(q.shape[-1]), k)  # scaled as the module scales it
  if mask is not None:
    logits = jnp.where(jnp.broadcast_to(mask, logits.shape), logits, -jnp.inf)
  return out, jnp.max(logits, axis=(-2, -1)).astype(jnp.float32)
