"""Which axes of a parameter form the matrix that Muon orthogonalizes.

Which parameters go to Muon at all is ``_muon.labels``. Decisions depend on paths, shapes and
logical axis names only, never on values.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax

from .._util import (decided_leaves, EXPERT_NAMES, HEAD_AXIS_NAMES, is_box, LAYER_NAMES, leaf_shape, logical_names,
                     MatrixAxes, MatrixAxesSpec, names_by_path, path_str, STACK_NAMES)
from .._clip import declared_matrix_axes, storage_axes
from .labels import router_batch_names as batch_names

# Logical axis names (Flax's nn.with_logical_partitioning, NNX sharding metadata).
LAYERS = "layers"  # the name the hints suggest for a stacked-layer axis
EXPERTS = "exp"  # the name the hints suggest for an expert axis (MaxText's)


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
    try:
      return MatrixAxes(spec.reduction_axis, spec.output_axis)
    except TypeError as e:
      raise TypeError(f"{where}: {spec!r} (reduction_axis: fan_in, output_axis: fan_out): {e}") from None
  raise ValueError(f"{where}: expected a MatrixAxes, an optax.contrib.MuonDimensionNumbers or None, got {spec!r}")




def axes_from_names(path: str, shape: tuple[int, ...], names: tuple) -> MatrixAxes:
  """The matrix of a leaf from its logical axis names.

  Rule: axes named for stacked layers (``"layers"``, ``"stage"``) or for experts (``"exp"``,
  ``"expert"``, ``"experts"``, ``"num_experts"``, ``"n_experts"``; ``_util.logical_axes``) are
  batch axes, in any order: MaxText's scanned experts ``("exp", "layers", "embed_no_exp",
  "mlp")`` are one ``embed x mlp`` matrix per expert and layer. A router's expert axis is its
  matrix's output, not a batch axis: ``("embed", "exp")`` under a module ``gate`` or ``router``
  is one ``embed x experts`` matrix (``labels.router_batch_names``). Of the others, in order,
  the first group is the fan-in and the rest the fan-out: with two axes each is one group,
  named or not (MaxText's gate ``("embed", None)``, scanned ``("embed", "layers", None)``);
  with more, all named, the head axes (``heads``, ``q_heads``, ``kv_heads``, ``kv``,
  ``head_dim``, ...) form one group and the remaining axes the other, e.g. a DenseGeneral query kernel
  ``("embed", "heads", "kv")`` is one ``embed x heads*kv`` matrix and an output projection
  ``("heads", "kv", "embed")`` one ``heads*kv x embed`` matrix. Names that fit neither, and
  names with two expert axes, raise ValueError naming the path, shape and names.
  """
  if len(names) != len(shape):
    raise ValueError(f"{path}: logical axis names {names} do not match the shape {shape}")
  experts = [a for a, n in enumerate(names) if n in EXPERT_NAMES]
  if len(experts) > 1:
    raise ValueError(
        f"{path}: the logical axis names {names} of the parameter of shape {shape} name {len(experts)} expert axes "
        f"{tuple(names[a] for a in experts)} (axes {tuple(experts)}); a mixture-of-experts kernel has one expert "
        f"axis, batched by Muon (one matrix per expert): name the other axes for what they are (e.g. "
        f"('{EXPERTS}', 'embed', 'mlp')), or pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) for it")
  rest = [a for a, n in enumerate(names) if n not in batch_names(path, names)]
  fail = (f"{path}: cannot tell the matrix of a parameter of shape {shape} from its logical axis names "
          f"{names}: expected two axes besides the batch axes (stacked layers {LAYER_NAMES!r}, experts "
          f"{sorted(EXPERT_NAMES)}), or, all named, a group of head axes {sorted(HEAD_AXIS_NAMES)} "
          "before or after the other axes; pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) for it")
  if names[-1] is None and len(names) >= 3:  # how a stack whose layer axis nothing names reads
    fail += (f"; names shorter than the shape are padded with None at the end, as Flax pads them: if the "
             f"parameter is stacked, name its layer axis '{LAYERS}' (nnx.vmap/nnx.scan(..., transform_metadata="
             f"{{nnx.PARTITION_NAME: '{LAYERS}'}}), nn.scan(..., metadata_params={{nn.PARTITION_NAME: '{LAYERS}'}}))")
  if len(rest) == 2:
    return MatrixAxes((rest[0],), (rest[1],))
  if len(rest) < 2 or any(names[a] is None for a in rest):
    raise ValueError(fail)
  is_head = [names[a] in HEAD_AXIS_NAMES for a in rest]
  splits = [i for i in range(1, len(rest))
            if len(set(is_head[:i])) == 1 and len(set(is_head[i:])) == 1 and is_head[0] != is_head[i]]
  if len(splits) != 1:
    raise ValueError(fail)
  return MatrixAxes(tuple(rest[:splits[0]]), tuple(rest[splits[0]:]))


def logical_matrix_axes(params: Any) -> Any:
  """A ``matrix_axes`` pytree read from the logical axis names of boxed ``params``.

  Each boxed leaf with names (``nn.Partitioned``, NNX variables with ``out_sharding``)
  becomes ``axes_from_names``'s ``MatrixAxes``; every other leaf None, and so does a named
  leaf with fewer than two axes besides its layer and expert axes (a norm scale or bias,
  stacked or per expert: not a matrix; the default routing sends it to AdamW), and a 2-D leaf with an unnamed axis
  (``(in, out)`` as any 2-D leaf). Short names are padded with None as Flax pads them. ``scale_by_muon`` reads the names itself at ``init`` and reuses them for
  the bare arrays of ``update`` (``nnx.Optimizer``), so this is needed only where a transform
  never sees the boxes, e.g. ``matrix_axes=logical_matrix_axes(nnx.state(model, nnx.Param))``.

  Example:
    >>> import flax.linen as nn, jax.numpy as jnp, muonclip_jax as mc
    >>> params = {"query": {"kernel": nn.Partitioned(jnp.ones((8, 2, 4)), names=("embed", "heads", "kv"))},
    ...           "mlp": {"kernel": nn.Partitioned(jnp.ones((3, 8, 32)), names=("layers", "embed", "mlp"))},
    ...           "norm": {"scale": nn.Partitioned(jnp.ones((8,)), names=("embed",))}}
    >>> axes = mc.logical_matrix_axes(params)
    >>> axes["query"]["kernel"]  # one embed x heads*kv matrix
    MatrixAxes(fan_in=(0,), fan_out=(1, 2))
    >>> axes["mlp"]["kernel"]  # a stack of 3 embed x mlp matrices
    MatrixAxes(fan_in=(1,), fan_out=(2,))
    >>> axes["norm"]["scale"] is None  # not a matrix
    True
  """

  def axes(p, x):
    names = logical_names(x) if is_box(x) else None
    if names is None or sum(n not in batch_names(path_str(p), names) for n in names) < 2:  # a vector, stacked or not
      return None
    if len(names) == 2 and None in names:  # a 2-D matrix with a short or partial spec: (in, out)
      return None
    return axes_from_names(path_str(p), leaf_shape(x), names)

  return jax.tree_util.tree_map_with_path(axes, params, is_leaf=is_box)


def _undeclared(path: str, shape: tuple[int, ...]) -> ValueError:
  """The error for a leaf of rank other than 2 whose matrix nobody declared."""
  hints = ["pass matrix_axes=MatrixAxes(fan_in=..., fan_out=...) for it (or an "
           "optax.contrib.MuonDimensionNumbers), a pytree of them, or route it to AdamW"]
  if len(shape) >= 3:
    lead, *mid, last = shape
    matrices = f"{'x'.join(map(str, shape[-2:]))} matrices"
    hints.append(f"if it is a stack of {lead} layers (nn.scan) of {matrices}: "
                 "MatrixAxes((-2,), (-1,)), or name the stacked axis 'layers' "
                 "(nn.scan(..., metadata_params={nn.PARTITION_NAME: 'layers'}) with logically partitioned kernels)")
    hints.append(f"if it is the expert stack of a mixture-of-experts layer, {lead} experts of {matrices} "
                 f"((experts, in, out), or (experts, layers, in, out) / (layers, experts, in, out) when scanned): "
                 f"MatrixAxes((-2,), (-1,)) too, which orthogonalizes each expert's matrix on its own, or give the "
                 f"kernel logical axis names with an expert axis ({', '.join(repr(n) for n in sorted(EXPERT_NAMES))}), "
                 f"e.g. ('{EXPERTS}', 'embed', 'mlp')")
    hints.append(f"if it is one DenseGeneral kernel (in, heads, head_dim): MatrixAxes((0,), {tuple(range(1, len(shape)))}) "
                 f"is one {lead} x {math.prod(shape[1:])} matrix, and an output projection (heads, head_dim, out) "
                 f"is MatrixAxes({tuple(range(len(shape) - 1))}, ({len(shape) - 1},)); for the kernels of Flax's "
                 "attention modules use matrix_axes=muonclip_jax.attention_matrix_axes(layout)")
  return ValueError(f"{path}: Muon needs to know which axes of a parameter of shape {shape} form its matrix; "
                    + "; ".join(hints))


def _check_batch_names(path: str, shape: tuple[int, ...], names: tuple, axes: MatrixAxes, *,
                       per_leaf: bool = False) -> None:
  """Checks explicit ``axes`` against the logical ``names`` of a leaf.

  They contradict when an axis ``axes`` batches is named for something other than stacked
  layers or experts (``batch_names``; unnamed is fine), or when an expert axis is made part of
  the matrix (all experts as one matrix). One ``MatrixAxes`` given for every leaf
  (``per_leaf=False``) was not aimed at this leaf: a contradiction raises ValueError, which
  names the declaration that works. An entry of a ``matrix_axes`` pytree (or of a callable's
  result) for this very leaf (``per_leaf=True``) is what its author means, and names may
  describe sharding rather than meaning (MaxText's ``fsdp_shard_on_exp`` names the expert axis
  of ``(experts, embed, mlp)`` ``"embed_no_exp"``: ``("embed_no_exp", None, "mlp")``): the
  contradiction is a UserWarning naming the path, the names and the axes, and ``axes`` stand.
  """
  if len(names) != len(shape):
    raise ValueError(f"{path}: logical axis names {names} do not match the shape {shape}")
  batch, fi, fo = axes.resolve(path, shape)
  allowed = batch_names(path, names)  # a router's expert axis is its matrix's output, not a batch axis
  bad = tuple(a for a in batch if names[a] is not None and names[a] not in allowed)
  merged = tuple(a for a in fi + fo if names[a] in allowed & EXPERT_NAMES)
  if not bad and not merged:
    return
  count = math.prod(shape[a] for a in batch)
  rows, cols = math.prod(shape[a] for a in fi), math.prod(shape[a] for a in fo)
  matrices = f"{'one' if count == 1 else count} {rows}x{cols} {'matrix' if count == 1 else 'matrices'}"
  verb = "orthogonalizes" if per_leaf else "would orthogonalize"
  if merged:
    what = (f"makes the expert axes {merged} of the parameter of shape {shape} (logical names {names}) part of "
            f"the matrix, so Muon {verb} its experts together as {matrices}")
  else:
    what = (f"makes axes {bad} of the parameter of shape {shape} batch axes, so Muon {verb} "
            f"{count} separate {rows}x{cols} matrices; but its logical axis names {names} call "
            f"{tuple(names[a] for a in bad)} part of the matrix")
  if per_leaf:
    warnings.warn(
        f"{path}: the matrix_axes entry for this parameter, {axes}, {what}. The entry for this leaf wins over "
        "its names (names may describe sharding only, as the names ('embed_no_exp', None, 'mlp') of MaxText's "
        "fsdp_shard_on_exp expert kernels do); leave it at None to let the names decide", UserWarning, stacklevel=2)
    return
  try:
    fix = ("leave this parameter at None in matrix_axes so that its names decide "
           f"({axes_from_names(path, shape, names)})")
  except ValueError:
    fix = "pass MatrixAxes whose batch axes are only its stacked-layer and expert axes"
  nested = repr(axes)
  for part in reversed(path.split("/")):
    nested = f"{{{part!r}: {nested}}}"
  works = (f"If the names describe sharding, not the matrix (MaxText's fsdp_shard_on_exp names its expert axis "
           f"'embed_no_exp'), and you do mean {matrices}, declare them for this leaf alone: an entry of a "
           f"matrix_axes pytree (or of a callable's result) for {path}, e.g. matrix_axes={nested}, wins over its "
           "names (with a UserWarning); one MatrixAxes for every leaf is checked against every leaf's names")
  if merged:
    raise ValueError(f"{path}: matrix_axes={axes} {what}; each expert's matrix is its own (a batch axis). "
                     f"{fix[0].upper() + fix[1:]}. {works}")
  raise ValueError(
      f"{path}: matrix_axes={axes} {what} (expected only stacked-layer {LAYER_NAMES!r}, "
      f"expert {sorted(EXPERT_NAMES)} or unnamed axes as batch axes). {fix[0].upper() + fix[1:]}. {works}")


def matrix_axes_lookup(spec: MatrixAxesSpec, tree: Any, *,
                       rms_match: str | None = None) -> Callable[[str, tuple[int, ...]], MatrixAxes]:
  """Turns a ``matrix_axes`` argument into ``(path, shape) -> MatrixAxes``.

  ``spec`` is ``None``, one ``MatrixAxes`` (or ``optax.contrib.MuonDimensionNumbers``) for
  every leaf, a pytree of them (``None`` leaves) with the structure of the parameters, or a
  callable from the parameters to such a pytree. Trees are matched by path, so a sub-tree
  (as ``optax.partition`` passes) works too. A leaf the spec leaves at ``None`` is resolved,
  in order, from the type of the layer that owns it (an Equinox ``Linear`` weight is
  ``(*layers, out, in)``), from its logical axis names when
  ``tree`` carries them (``axes_from_names``), as ``(in, out)`` when it is 2-D, else with a
  ValueError naming its path and shape.

  The 2-D default guesses nothing that changes Muon's result when ``rms_match`` is
  ``"moonlight"`` or None: the orthogonalized ``(out, in)`` matrix is the transpose of the
  orthogonalized ``(in, out)`` one, with the same RMS factor. Keller's factor
  ``sqrt(max(1, fan_out / fan_in))`` does depend on which side is the fan-in, so with
  ``rms_match="keller"`` an undeclared non-square 2-D leaf named ``weight`` (torch's
  ``(out, in)`` convention) is a ValueError.

  Explicit axes win over logical names; how they may disagree with them depends on whom they
  were given for (``_check_batch_names``). Disagreeing means batching an axis not named for
  stacked layers or experts (unnamed is fine, as ``nn.scan`` without a partition name leaves
  it), or putting an expert axis into the matrix.

  * An entry of a ``matrix_axes`` pytree (or of a callable's result) declares this leaf's
    matrix: it is used even where the names disagree, with a UserWarning naming the path, the
    names and the axes (once per leaf for this lookup, i.e. per ``init``). Names can describe
    sharding only: MaxText's ``fsdp_shard_on_exp`` names its expert kernels ``(experts, embed,
    mlp)`` ``("embed_no_exp", None, "mlp")``, and ``MatrixAxes((-2,), (-1,))`` for them is one
    matrix per expert, as MaxText's ``muon_utils.py`` declares.
  * One ``MatrixAxes`` for every leaf was not aimed at any one leaf: disagreeing with a leaf's
    names is a ValueError that names the per-leaf entry that works. So the scan hint
    ``MatrixAxes((-2,), (-1,))`` cannot quietly split a DenseGeneral kernel ``("embed",
    "heads", "kv")`` into one matrix per ``embed`` row, nor ``MatrixAxes((0, 1), (2,))`` merge
    the experts of ``("exp", "embed", "mlp")`` into one matrix.
  """
  if callable(spec) and not isinstance(spec, MatrixAxes):
    spec = spec(decided_leaves(tree))
  if _is_spec_leaf(spec):
    table, single = None, as_matrix_axes(spec)
  else:
    table, single = {}, None
    for p, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]:
      table[path_str(p)] = as_matrix_axes(leaf, f"matrix_axes: leaf at {path_str(p)}")
  names = names_by_path(tree)
  typed = storage_axes(tree)
  checked: set[str] = set()  # per-leaf entries already checked against the names (warned at most once)

  def lookup(path: str, shape: tuple[int, ...]) -> MatrixAxes:
    if table is not None and table.get(path) is not None:
      if path in names and path not in checked:
        _check_batch_names(path, shape, names[path], table[path], per_leaf=True)
        checked.add(path)
      return table[path]
    if single is not None:
      if path in names:
        _check_batch_names(path, shape, names[path], single)
      return single
    if path in typed:
      return declared_matrix_axes(typed[path])
    if path in names and not (len(shape) == 2 and None in names[path]):
      return axes_from_names(path, shape, names[path])
    if len(shape) == 2:
      if rms_match == "keller" and shape[0] != shape[1] and path.rpartition("/")[2] == "weight":
        raise ValueError(
            f"{path}: a {shape[0]}x{shape[1]} leaf named 'weight' (torch's (out, in) convention?) whose axes "
            "nothing declares; rms_match='keller' scales by sqrt(max(1, fan_out / fan_in)), which depends on "
            "which side is the fan-in: pass matrix_axes=MatrixAxes(fan_in=(1,), fan_out=(0,)) for (out, in) "
            "storage (MatrixAxes((0,), (1,)) for (in, out)), or a pytree of them")
      return MatrixAxes((0,), (1,))
    raise _undeclared(path, shape)

  return lookup


def matrix_dims(axes: MatrixAxes, path: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """``(fan_in, fan_out)`` sizes of the matrix of a leaf."""
  _, fi, fo = axes.resolve(path, shape)
  return math.prod(shape[a] for a in fi), math.prod(shape[a] for a in fo)
