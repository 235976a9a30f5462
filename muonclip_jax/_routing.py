"""Which axes of a parameter form the matrix that Muon orthogonalizes.

Which parameters go to Muon at all is ``_labels``. Decisions depend on paths, shapes and
logical axis names only, never on values.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from ._boxes import is_box as _is_box
from ._boxes import leaf_shape as _shape
from ._boxes import logical_names as logical_names
from ._boxes import names_by_path as names_by_path
from ._paths import path_str

# Leaf names of vectors (biases, norm scales) and embedding tables: never matrices of an attention layer.
_VECTOR_LEAF_NAMES = frozenset({"bias", "scale", "embedding"})


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
  """Which axes of a parameter are the rows (fan-in) and columns (fan-out) of its matrix.

  Every other axis is a batch axis: the parameter is a stack of independent matrices, each
  orthogonalized on its own. The matrix of a leaf is ``prod(fan_in sizes) x prod(fan_out
  sizes)``. Negative axes count from the end.

  Examples: a Dense kernel ``(in, out)`` is ``MatrixAxes((0,), (1,))`` (the default for
  2-D leaves); a kernel stacked by ``nn.scan``, ``(layers, in, out)``, is
  ``MatrixAxes((-2,), (-1,))``; a DenseGeneral kernel ``(in, heads, head_dim)`` is
  ``MatrixAxes((0,), (1, 2))``; an output projection ``(heads, head_dim, out)`` is
  ``MatrixAxes((0, 1), (2,))``.

  Attributes:
    fan_in: axes that form the rows.
    fan_out: axes that form the columns.
  """

  fan_in: tuple[int, ...]
  fan_out: tuple[int, ...]

  def __post_init__(self):
    object.__setattr__(self, "fan_in", tuple(int(a) for a in self.fan_in))
    object.__setattr__(self, "fan_out", tuple(int(a) for a in self.fan_out))
    if not self.fan_in or not self.fan_out:
      raise ValueError(f"MatrixAxes needs at least one fan_in and one fan_out axis, got {self}")

  def resolve(self, path: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Returns ``(batch, fan_in, fan_out)`` axes of ``shape``, normalized to be non-negative."""
    nd = len(shape)
    for a in self.fan_in + self.fan_out:
      if not -nd <= a < nd:
        raise ValueError(f"{path}: {self} names axis {a}, but the parameter has shape {shape}")
    fi = tuple(a % nd for a in self.fan_in)
    fo = tuple(a % nd for a in self.fan_out)
    if len(set(fi + fo)) != len(fi + fo):
      raise ValueError(f"{path}: {self} repeats an axis of shape {shape}")
    batch = tuple(a for a in range(nd) if a not in fi + fo)
    return batch, fi, fo


MatrixAxesSpec = MatrixAxes | Any | Callable[[Any], Any] | None

# Logical axis names (Flax's nn.with_logical_partitioning, NNX sharding metadata).
LAYERS = "layers"  # a stack of layers (nn.scan with metadata_params={nn.PARTITION_NAME: "layers"})
# Names of axes that belong to the heads of an attention projection; they stay together.
_HEAD_AXIS_NAMES = frozenset({"heads", "q_heads", "kv_heads", "kv", "head_dim", "qk_head_dim", "v_head_dim",
                              "kv_head_dim"})


def _is_dim_numbers(x: Any) -> bool:
  return isinstance(x, optax.contrib.MuonDimensionNumbers)


def _is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, MatrixAxes) or _is_dim_numbers(x)


def as_matrix_axes(spec: Any, where: str = "matrix_axes") -> MatrixAxes | None:
  """A ``MatrixAxes`` from itself, ``optax.contrib.MuonDimensionNumbers`` or None.

  ``MuonDimensionNumbers(reduction_axis, output_axis)`` is ``MatrixAxes(fan_in=reduction_axis,
  fan_out=output_axis)``: the reduction axes are the matrix's rows, every other axis is batched.
  """
  if spec is None or isinstance(spec, MatrixAxes):
    return spec
  if _is_dim_numbers(spec):
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
    return MatrixAxes(as_tuple(spec.reduction_axis), as_tuple(spec.output_axis))
  raise ValueError(f"{where}: expected a MatrixAxes, an optax.contrib.MuonDimensionNumbers or None, got {spec!r}")


def axes_from_names(path: str, shape: tuple[int, ...], names: tuple) -> MatrixAxes:
  """The matrix of a leaf from its logical axis names.

  Rule: axes named ``"layers"`` are batch axes (a stack of layers). Of the others, in order,
  the first group is the fan-in and the rest the fan-out: with two axes each is one group;
  with more, the head axes (``heads``, ``q_heads``, ``kv_heads``, ``kv``, ``head_dim``, ...)
  form one group and the remaining axes the other, e.g. a DenseGeneral query kernel
  ``("embed", "heads", "kv")`` is one ``embed x heads*kv`` matrix and an output projection
  ``("heads", "kv", "embed")`` one ``heads*kv x embed`` matrix. Names that fit neither raise
  ValueError naming the path, shape and names.
  """
  if len(names) != len(shape):
    raise ValueError(f"{path}: logical axis names {names} do not match the shape {shape}")
  rest = [a for a, n in enumerate(names) if n != LAYERS]
  fail = (f"{path}: cannot tell the matrix of a parameter of shape {shape} from its logical axis names "
          f"{names}: expected two non-'{LAYERS}' axes, or a group of head axes {sorted(_HEAD_AXIS_NAMES)} "
          "before or after the other axes; pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) for it")
  if len(rest) < 2 or any(names[a] is None for a in rest):
    raise ValueError(fail)
  if len(rest) == 2:
    return MatrixAxes((rest[0],), (rest[1],))
  is_head = [names[a] in _HEAD_AXIS_NAMES for a in rest]
  splits = [i for i in range(1, len(rest))
            if len(set(is_head[:i])) == 1 and len(set(is_head[i:])) == 1 and is_head[0] != is_head[i]]
  if len(splits) != 1:
    raise ValueError(fail)
  return MatrixAxes(tuple(rest[:splits[0]]), tuple(rest[splits[0]:]))


def logical_matrix_axes(params: Any) -> Any:
  """A ``matrix_axes`` pytree read from the logical axis names of boxed ``params``.

  Each boxed leaf with names (``nn.Partitioned``, NNX variables with ``out_sharding``)
  becomes ``axes_from_names``'s ``MatrixAxes``; every other leaf None, and so does a named
  leaf with fewer than two axes not named ``"layers"`` (a norm scale or bias, stacked or not:
  not a matrix; the default routing sends it to AdamW), and a 2-D leaf with an unnamed axis
  (``(in, out)`` as any 2-D leaf). Short names are padded with None as Flax pads them. ``scale_by_muon`` reads the names itself at ``init`` and reuses them for
  the bare arrays of ``update`` (``nnx.Optimizer``), so this is needed only where a transform
  never sees the boxes, e.g. ``matrix_axes=logical_matrix_axes(nnx.state(model, nnx.Param))``.
  """

  def axes(p, x):
    names = logical_names(x) if _is_box(x) else None
    if names is None or sum(n != LAYERS for n in names) < 2:  # a vector (norm scale, bias), stacked or not
      return None
    if len(names) == 2 and None in names:  # a 2-D matrix with a short or partial spec: (in, out)
      return None
    return axes_from_names(path_str(p), _shape(x), names)

  return jax.tree_util.tree_map_with_path(axes, params, is_leaf=_is_box)


def _undeclared(path: str, shape: tuple[int, ...]) -> ValueError:
  """The error for a leaf of rank other than 2 whose matrix nobody declared."""
  hints = ["pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) for it (or an "
           "optax.contrib.MuonDimensionNumbers), a pytree of them, or route it to AdamW"]
  if len(shape) >= 3:
    lead, *mid, last = shape
    hints.append(f"if it is a stack of {lead} layers (nn.scan) of {'x'.join(map(str, shape[-2:]))} matrices: "
                 "MatrixAxes((-2,), (-1,)), or name the stacked axis 'layers' "
                 "(nn.scan(..., metadata_params={nn.PARTITION_NAME: 'layers'}) with logically partitioned kernels)")
    hints.append(f"if it is one DenseGeneral kernel (in, heads, head_dim): MatrixAxes((0,), {tuple(range(1, len(shape)))}) "
                 f"is one {lead} x {math.prod(shape[1:])} matrix, and an output projection (heads, head_dim, out) "
                 f"is MatrixAxes({tuple(range(len(shape) - 1))}, ({len(shape) - 1},)); for the kernels of Flax's "
                 "attention modules use matrix_axes=muonclip_jax.attention_matrix_axes(layout)")
  return ValueError(f"{path}: Muon needs to know which axes of a parameter of shape {shape} form its matrix; "
                    + "; ".join(hints))


def _check_batch_names(path: str, shape: tuple[int, ...], names: tuple, axes: MatrixAxes) -> None:
  """Raises ValueError when explicit ``axes`` batch over an axis the logical ``names`` call part of a matrix."""
  if len(names) != len(shape):
    raise ValueError(f"{path}: logical axis names {names} do not match the shape {shape}")
  batch, fi, fo = axes.resolve(path, shape)
  bad = tuple(a for a in batch if names[a] not in (LAYERS, None))
  if not bad:
    return
  try:
    fix = ("leave this parameter at None in matrix_axes so that its names decide "
           f"({axes_from_names(path, shape, names)})")
  except ValueError:
    fix = "pass MatrixAxes whose batch axes are only stacked-layer axes"
  count = math.prod(shape[a] for a in batch)
  rows, cols = math.prod(shape[a] for a in fi), math.prod(shape[a] for a in fo)
  raise ValueError(
      f"{path}: matrix_axes={axes} makes axes {bad} of the parameter of shape {shape} batch axes, so Muon would "
      f"orthogonalize {count} separate {rows}x{cols} matrices; but its logical axis names {names} call "
      f"{tuple(names[a] for a in bad)} part of the matrix (expected only '{LAYERS}' or unnamed axes as batch "
      f"axes). {fix[0].upper() + fix[1:]}, or, if it really is a stack of layers, name that axis '{LAYERS}'")


def matrix_axes_lookup(spec: MatrixAxesSpec, tree: Any) -> Callable[[str, tuple[int, ...]], MatrixAxes]:
  """Turns a ``matrix_axes`` argument into ``(path, shape) -> MatrixAxes``.

  ``spec`` is ``None``, one ``MatrixAxes`` (or ``optax.contrib.MuonDimensionNumbers``) for
  every leaf, a pytree of them (``None`` leaves) with the structure of the parameters, or a
  callable from the parameters to such a pytree. Trees are matched by path, so a sub-tree
  (as ``optax.partition`` passes) works too. A leaf the spec leaves at ``None`` is resolved,
  in order, from its logical axis names when ``tree`` carries them (``axes_from_names``),
  as ``(in, out)`` when it is 2-D, else with a ValueError naming its path and shape.

  Explicit axes win over logical names, but may not contradict them: an axis the spec makes
  a batch axis must be named ``"layers"`` (or carry no name, as ``nn.scan`` without a
  partition name leaves it), else ValueError. So an explicit ``MatrixAxes((-2,), (-1,))``
  cannot quietly split a DenseGeneral kernel ``("embed", "heads", "kv")`` into one matrix
  per ``embed`` row.
  """
  if callable(spec) and not isinstance(spec, MatrixAxes):
    spec = spec(tree)
  if _is_spec_leaf(spec):
    table, single = None, as_matrix_axes(spec)
  else:
    table, single = {}, None
    for p, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]:
      table[path_str(p)] = as_matrix_axes(leaf, f"matrix_axes: leaf at {path_str(p)}")
  names = names_by_path(tree)

  def lookup(path: str, shape: tuple[int, ...]) -> MatrixAxes:
    axes = single if table is None else table.get(path)
    if axes is not None:
      if path in names:
        _check_batch_names(path, shape, names[path], axes)
      return axes
    if path in names and not (len(shape) == 2 and None in names[path]):
      return axes_from_names(path, shape, names[path])
    if len(shape) == 2:
      return MatrixAxes((0,), (1,))
    raise _undeclared(path, shape)

  return lookup


def matrix_dims(axes: MatrixAxes, path: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """``(fan_in, fan_out)`` sizes of the matrix of a leaf."""
  _, fi, fo = axes.resolve(path, shape)
  return math.prod(shape[a] for a in fi), math.prod(shape[a] for a in fo)


def attention_matrix_axes(layout: Any, *, value: Any = "value", out: Any = "out",
                          default: MatrixAxes | None = None) -> Callable[[Any], Any]:
  """``matrix_axes`` for attention kernels of the DenseGeneral form, from their layout.

  ``matrix_axes=attention_matrix_axes(layout)`` makes each query, key and value kernel
  ``(*stack, in, heads, head_dim)`` one ``in x heads*head_dim`` matrix
  (``MatrixAxes((-3,), (-2, -1))``) and each output kernel ``(*stack, heads, head_dim, out)``
  one ``heads*head_dim x out`` matrix (``MatrixAxes((-3, -2), (-1,))``); leading axes are
  stacked layers. That is the form of ``flax.linen.MultiHeadDotProductAttention`` and
  ``flax.nnx.MultiHeadAttention`` (names ``query``, ``key``, ``value``, ``out``: use
  ``GQALayout(..., query="query", key="key")``) and of MaxText. Query/key names come from
  the layout (GQA: ``query``/``key``; MLA: ``wq_b``/``wq`` or ``query``, and
  ``key_value``), value and output names from ``value``/``out``. A kernel is matched only
  when its trailing axes are the layout's ``(heads, head_dim)`` (key/value: ``num_kv_heads``;
  MLA: ``qk_head_dim``, ``nope + v`` and ``v_head_dim`` widths).

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
    value: name of the value projection (GQA), or a ``muonclip_jax.Projection``.
    out: name of the output projection, or a ``Projection`` (an output kernel
      ``(heads, head_dim, embed)`` declares ``axes=("in", "in", "out")``).
    default: ``MatrixAxes`` for every other leaf of rank 3, or None.

  A projection declared with ``muonclip_jax.Projection(name, leaf=..., axes=...)`` (in the
  layout or as ``value``/``out``) gets the matrix of its declaration, at any rank:
  ``"layers"`` axes batched, ``"in"`` axes the fan-in, every other axis the fan-out; a
  declared kernel whose rank differs from its axes is a ValueError.
  """
  from ._layouts import GQALayout, MLALayout  # noqa: PLC0415 (no import cycle at load time)
  from ._projection import as_projection  # noqa: PLC0415

  layouts = layout if isinstance(layout, Mapping) else {"*": layout}
  for lay in layouts.values():
    if not isinstance(lay, (GQALayout, MLALayout)):
      raise TypeError(f"attention_matrix_axes: expected a GQALayout or MLALayout (or a mapping to them), got {lay!r}")
  in_axes, out_axes = MatrixAxes((-3,), (-2, -1)), MatrixAxes((-3, -2), (-1,))
  value, out = as_projection(value), as_projection(out)

  def projections(lay) -> dict[str, tuple[tuple[int, ...] | None, MatrixAxes, Any]]:
    """{kernel path relative to the module: (expected trailing shape, axes, declared axes)}."""
    if isinstance(lay, GQALayout):
      hd, kv = (lay.num_heads, lay.head_dim), (lay.num_kv_heads, lay.head_dim)
      if lay.qkv is not None:  # fused (in, 3, heads, head_dim): one in x 3*heads*head_dim matrix
        found = [(lay.qkv, (3, *hd), MatrixAxes((-4,), (-3, -2, -1)))]
      else:
        found = [(lay.query, hd, in_axes), (lay.key, kv, in_axes)]
      found += [(value, kv, in_axes), (out, hd, out_axes)]
    else:
      h = lay.num_heads
      found = [(q, (h, lay.qk_head_dim), in_axes) for q in ((lay.query,) if lay.query else ("wq_b", "wq"))]
      found += [(lay.key_value, (h, lay.qk_nope_head_dim + lay.v_head_dim), in_axes), (out, (h, lay.v_head_dim), out_axes)]
    table = {}
    for proj, trailing, axes in found:
      proj = as_projection(proj)
      table[proj.kernel] = (trailing, axes, proj.axes) if proj.axes is None else (None, proj.matrix_axes(), proj.axes)
    return table

  # (heads, width) pairs of every projection of every layout: an unmatched leaf ending in one
  # of them is a DenseGeneral kernel under a name this helper was not told.
  head_shapes = {tuple(t[-2:]) for lay in layouts.values() for t, _, _ in projections(lay).values() if t}

  def declared(path: str, shape: tuple[int, ...]) -> MatrixAxes | None:
    matches = []
    for pattern, lay in layouts.items():
      for rel, (trailing, axes, decl) in projections(lay).items():
        if path != rel and not path.endswith("/" + rel):
          continue
        module = path[: len(path) - len(rel)].rstrip("/")
        if fnmatch.fnmatchcase(module, pattern):
          matches.append((trailing, axes, decl))
    if len(matches) != 1 and len({(a, d) for _, a, d in matches}) != 1:
      return None
    trailing, axes, decl = matches[0]
    if decl is not None:
      if len(decl) != len(shape):
        raise ValueError(f"{path}: attention_matrix_axes: declared axes {decl} do not match the shape {shape}")
      return axes
    if len(shape) < 3:
      return None
    got = shape[-3:-1] if axes is out_axes else shape[-len(trailing):]
    return axes if len(shape) > len(trailing) and tuple(got) == trailing else None

  def axes_for(path: str, shape: tuple[int, ...], named: bool) -> MatrixAxes | None:
    parts = path.split("/")
    found = declared(path, shape)
    if found is not None:
      return found
    if len(shape) < 3 or parts[-1].lower() in _VECTOR_LEAF_NAMES:
      return None
    if tuple(shape[-2:]) in head_shapes or tuple(shape[-3:-1]) in head_shapes:
      if named:
        return None
      names = sorted({n.rsplit("/", 1)[0] for lay in layouts.values() for n in projections(lay)})
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
    return jax.tree_util.tree_map_with_path(
        lambda p, x: axes_for(path_str(p), _shape(x), _is_box(x) and logical_names(x) is not None),
        params, is_leaf=_is_box)

  return spec
