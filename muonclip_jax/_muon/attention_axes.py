"""``attention_matrix_axes``: Muon's matrices of attention kernels, read from their layout.

A thin layer over ``_muon.layout_matrices`` (what ``scale_by_muon(layout=...)`` reads itself),
for ``muon``/``scale_by_muon`` without a layout and for a ``default`` of the other leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._util import is_box, leaf_shape, logical_names, MatrixAxes, path_str
from .._clip import GQALayout, MLALayout
from .layout_matrices import layout_blocks

# Leaf names of vectors (biases, norm scales) and embedding tables: never matrices of an attention layer.
_VECTOR_LEAF_NAMES = frozenset({"bias", "scale", "embedding"})


def attention_matrix_axes(layout: Any, *, value: Any = None, out: Any = None,
                          default: MatrixAxes | None = None) -> Callable[[Any], Any]:
  """``matrix_axes`` for attention kernels, from their layout.

  ``muonclip(layout=...)``, ``muon_adamw(layout=...)`` and ``scale_by_muon(layout=...)``
  read the layout themselves; this helper gives the same matrices as a ``matrix_axes``
  pytree, for ``muon``/``scale_by_muon`` without a layout and to set a ``default`` for the
  other leaves. In every attention module of the layout (the modules holding its
  query/key projections), each query, key, value and output kernel is one matrix, in any
  storage the layout describes (``_muon.layout_matrices``: the kernel forms of ``qk_clip``,
  declared ``Projection(axes=...)``, logical names; stacked layers batched). For the
  DenseGeneral form, ``matrix_axes=attention_matrix_axes(layout)`` makes each query, key and value kernel
  ``(*stack, in, heads, head_dim)`` one ``in x heads*head_dim`` matrix
  (``MatrixAxes((-3,), (-2, -1))``) and each output kernel ``(*stack, heads, head_dim, out)``
  one ``heads*head_dim x out`` matrix (``MatrixAxes((-3, -2), (-1,))``); leading axes are
  stacked layers. That is the form of ``flax.linen.MultiHeadDotProductAttention`` and
  ``flax.nnx.MultiHeadAttention`` (names ``query``, ``key``, ``value``, ``out``: use
  ``GQALayout(..., query="query", key="key")``) and of MaxText. Projection names come from
  the layout (GQA: ``query``/``key`` or ``qkv``, ``value``, ``out``; MLA: ``wq_b``/``wq``
  or ``query``, ``key_value``, ``out``), overridden by ``value``/``out`` here. A value or
  output kernel that does not hold the layout's heads is left to the rules below.

  Every other leaf, by rank:

  - rank 3 or more, not a ``bias``/``scale``/``embedding``, with the trailing two axes, or
    the two axes before the last, equal to one of those ``(heads, width)`` pairs: it is
    almost surely a DenseGeneral projection under a name the layout was not told, and
    ``default`` would split it into per-head or per-row matrices, so ValueError naming the
    path and shape (pass ``value=``/``out=``, the layout's names, or ``matrix_axes`` for it).
    A leaf that carries logical axis names is left at None instead: its names decide.
  - rank 3: ``default`` (e.g. ``MatrixAxes((-2,), (-1,))`` for the other kernels of a
    ``nn.scan`` stack, ``(layers, in, out)``).
  - any other rank: None (resolved by logical names, as a 2-D matrix, or with a ValueError).
    ``default`` is not applied at rank 4 or more, where a stacked ``(layers, heads,
    head_dim, out)`` kernel and a stack of matrices cannot be told apart.

  Args:
    layout: a ``GQALayout``/``MLALayout``, or a mapping from module-path glob patterns to them.
    value: name of the value projection (GQA), or a ``muonclip_jax.Projection``; None
      (default): the layout's ``value``.
    out: name of the output projection, or a ``Projection`` (an output kernel
      ``(heads, head_dim, embed)`` declares ``axes=("in", "in", "out")``); None (default):
      the layout's ``out``.
    default: ``MatrixAxes`` for every other leaf of rank 3, or None.

  A projection declared with ``muonclip_jax.Projection(name, leaf=..., axes=...)`` (in the
  layout or as ``value``/``out``) gets the matrix of its declaration, at any rank:
  ``"layers"`` axes batched, ``"in"`` axes the fan-in, every other axis the fan-out; a
  declared kernel whose rank differs from its axes is a ValueError.

  Example:
    >>> import jax, jax.numpy as jnp, muonclip_jax as mc
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4, query="query", key="key")
    >>> params = {"attn": {"query": {"kernel": jnp.ones((8, 2, 4))}, "key": {"kernel": jnp.ones((8, 2, 4))},
    ...                    "value": {"kernel": jnp.ones((8, 2, 4))}, "out": {"kernel": jnp.ones((2, 4, 8))}}}
    >>> axes = mc.attention_matrix_axes(layout)(params)
    >>> axes["attn"]["query"]["kernel"]  # (in, heads, head_dim): one in x heads*head_dim matrix
    MatrixAxes(fan_in=(-3,), fan_out=(-2, -1))
    >>> axes["attn"]["out"]["kernel"]  # (heads, head_dim, out): one heads*head_dim x out matrix
    MatrixAxes(fan_in=(-3, -2), fan_out=(-1,))
    >>> opt = mc.muon(0.01, matrix_axes=mc.attention_matrix_axes(layout))  # without it, init raises
    >>> updates, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
    >>> updates["attn"]["out"]["kernel"].shape
    (2, 4, 8)
  """

  layouts = layout if isinstance(layout, Mapping) else {"*": layout}
  for lay in layouts.values():
    if not isinstance(lay, (GQALayout, MLALayout)):
      raise TypeError(f"attention_matrix_axes: expected a GQALayout or MLALayout (or a mapping to them), got {lay!r}")

  def told(lay):
    changes = {} if out is None else {"out": out}
    if value is not None and isinstance(lay, GQALayout):
      changes["value"] = value
    return dataclasses.replace(lay, **changes) if changes else lay

  layouts = {pattern: told(lay) for pattern, lay in layouts.items()}
  resolved = layouts if isinstance(layout, Mapping) else layouts["*"]
  # (heads, width) pairs of every projection of every layout: an unmatched leaf ending in one
  # of them is a DenseGeneral kernel under a name this helper was not told.
  head_shapes = set()
  for lay in layouts.values():
    if isinstance(lay, GQALayout):
      head_shapes |= {(lay.num_heads, lay.head_dim), (lay.num_kv_heads, lay.head_dim)}
    else:
      h = lay.num_heads
      head_shapes |= {(h, lay.qk_head_dim), (h, lay.qk_nope_head_dim + lay.v_head_dim), (h, lay.v_head_dim)}
  names = sorted({n for lay in layouts.values() for n in _projection_names(lay)})

  def fallback(path: str, shape: tuple[int, ...], named: bool) -> MatrixAxes | None:
    if len(shape) < 3 or path.split("/")[-1].lower() in _VECTOR_LEAF_NAMES:
      return None
    if tuple(shape[-2:]) in head_shapes or tuple(shape[-3:-1]) in head_shapes:
      if named:
        return None
      raise ValueError(
          f"{path}: attention_matrix_axes: a parameter of shape {shape} has, last or before its last axis, the "
          f"(heads, head width) of the layout's projections {sorted(head_shapes)}, so it looks like a DenseGeneral "
          "attention kernel, but its "
          f"name matches none of the projections {names}, and a stack-of-matrices default would orthogonalize it "
          "per head or per row instead of as one matrix. If it is the value or output projection, "
          "pass value=/out= with its name or a muonclip_jax.Projection declaring its axes (query/key names "
          "are the layout's); otherwise pass matrix_axes for it explicitly")
    return default if len(shape) == 3 else None

  def spec(params: Any) -> Any:
    declared: set[str] = set()
    table = layout_blocks(params, resolved, "matrix", "attention_matrix_axes", declared)

    def axes_for(p, x):
      path, shape = path_str(p), leaf_shape(x)
      if path not in table:
        return fallback(path, shape, is_box(x) and logical_names(x) is not None)
      axes = table[path].axes[0]
      if path in declared:
        return axes
      nd = len(shape)  # recognized from the shape, leading axes stacked layers: counted from the end
      return MatrixAxes(tuple(a - nd for a in axes.fan_in), tuple(a - nd for a in axes.fan_out))

    return jax.tree_util.tree_map_with_path(axes_for, params, is_leaf=is_box)

  return spec


def _projection_names(lay: Any) -> list[str]:
  """The projection names a layout gives (for messages)."""
  if isinstance(lay, GQALayout):
    fields = (lay.qkv,) if lay.qkv is not None else (lay.query, lay.key, lay.value)
  else:
    fields = (lay.query or "wq_b", lay.key_value)
  return [f if isinstance(f, str) else f.name for f in fields + (lay.out,) if f is not None]
