"""Parameters that carry metadata (Flax boxes), their logical axis names, and metadata read once.

Linen wraps a parameter in ``nn.Partitioned``/``nn.LogicallyPartitioned``; NNX keeps it in an
``nnx.Variable`` whose metadata holds its ``sharding`` (``out_sharding``) names. Bare arrays
carry nothing. ``nnx.Optimizer`` hands an optimizer's ``init`` the boxed ``nnx.Param`` values
and its ``update`` bare arrays, so whatever is derived from metadata is derived once, at
``init``, and recalled at ``update`` for the bare tree of the same paths and shapes
(``MetadataMemo``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.core import meta as flax_meta

from .logical_axes import mesh_axis_names
from .paths import path_str


def is_box(x: Any) -> bool:
  """A leaf that carries metadata: Linen ``nn.Partitioned``-style boxes, NNX variables."""
  return isinstance(x, (flax_meta.AxisMetadata, nnx.Variable))


def leaf_shape(x: Any) -> tuple[int, ...]:
  """The shape of a leaf or of the one array in a box."""
  leaves = jax.tree.leaves(x) if is_box(x) else [x]
  return tuple(jnp.shape(leaves[0])) if len(leaves) == 1 else ()


def logical_names(leaf: Any) -> tuple | None:
  """The logical axis names of a boxed leaf (``nn.Partitioned.names``, NNX ``out_sharding``).

  A spec shorter than the leaf's rank is padded with ``None`` at the end, as Flax pads it
  (``PartitionSpec(*names)`` leaves the trailing axes unsharded): ``nnx.with_partitioning(init,
  (None, "model"))`` on a ``(64, 4, 16)`` kernel names it ``(None, "model", None)``.

  Names that are mesh axis names, not logical ones (``logical_axes.mesh_axis_names``: Tunix
  puts ``("fsdp", "tp")`` in its ``nnx.Param`` metadata, and ``("fsdp", "sp")`` for one axis
  sharded over two), say nothing about the matrix and read as ``None``; a spec of mesh axis
  names only is no names at all (None).
  """
  names = None
  if isinstance(leaf, flax_meta.Partitioned):
    names = tuple(leaf.names)
  elif isinstance(leaf, nnx.Variable):
    meta = leaf.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
      if meta.get(key) is not None:
        names = tuple(meta[key])
        break
  if names is None:
    return None
  mesh = mesh_axis_names()
  is_mesh = lambda n: (n in mesh if isinstance(n, str)  # noqa: E731  (a tuple: an axis sharded over several)
                       else isinstance(n, tuple) and bool(n) and all(isinstance(m, str) and m in mesh for m in n))
  if any(is_mesh(n) for n in names):
    names = tuple(None if is_mesh(n) else n for n in names)
    if all(n is None for n in names):
      return None
  rank = len(leaf_shape(leaf))
  return names + (None,) * (rank - len(names)) if len(names) < rank else names


def names_by_path(tree: Any) -> dict[str, tuple]:
  """``{path: logical names}`` of the boxed leaves of ``tree``."""
  table = {}
  for p, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
    names = logical_names(leaf) if is_box(leaf) else None
    if names is not None:
      table[path_str(p)] = names
  return table


def decided_leaves(tree: Any) -> Any:
  """``tree`` as a ``matrix_axes`` callable is given it: the leaves another
  transform holds (``optax.MaskedNode``, as ``optax.partition``/``optax.masked`` leave them, or
  a box around one, as they leave an ``nnx.Param``) are None, so a function of the leaves
  (``x.ndim``, ``x.shape``) sees only arrays or boxes around arrays."""
  def masked(x):
    return isinstance(x, optax.MaskedNode) or (is_box(x) and not jax.tree.leaves(x))
  return jax.tree.map(lambda x: None if masked(x) else x, tree,
                      is_leaf=lambda x: isinstance(x, optax.MaskedNode) or is_box(x))


def has_boxes(tree: Any) -> bool:
  return any(is_box(x) for x in jax.tree.leaves(tree, is_leaf=is_box))


def skeleton(tree: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """The paths and shapes of a tree's array leaves, the same for a boxed tree and its bare arrays
  (a box around an empty node, as ``optax.masked`` leaves one, counts as nothing, as the node)."""
  return tuple((path_str(p), tuple(jnp.shape(x))) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0])


class MetadataMemo:
  """What one transform derived from a boxed tree, by path, for the bare tree of the same skeleton.

  ``remember(tree, table)`` stores ``{path: value}`` when ``tree`` has boxes; ``recall(tree)``
  returns the table stored for a bare ``tree`` of the same paths and shapes, else None (a
  boxed tree, or one never seen boxed, is read afresh). Python state at trace time only.
  """

  def __init__(self):
    self._tables: dict[tuple, dict[str, Any]] = {}

  def remember(self, tree: Any, table: dict[str, Any]) -> None:
    if has_boxes(tree):
      self._tables[skeleton(tree)] = dict(table)

  def recall(self, tree: Any) -> dict[str, Any] | None:
    if has_boxes(tree):
      return None
    return self._tables.get(skeleton(tree))


def _is_linen_box(x: Any) -> bool:
  return isinstance(x, flax_meta.AxisMetadata)


def accept_bare_updates(tx: Any) -> Any:
  """``tx`` whose ``update`` takes bare arrays against a state that a boxed ``init`` made.

  Linen params boxed at ``init`` (``nn.with_logical_partitioning``) give a state whose
  per-parameter leaves keep their boxes (so ``nn.get_partition_spec`` shards the state as the
  params), and optax's transforms then refuse bare gradients at ``update`` (a box meets an
  array). Here the state's Linen boxes are opened for the update and the new state is put back
  into the same boxes, so both forms work: the state keeps its structure and metadata.
  Boxed updates, or a state without Linen boxes (NNX: ``nnx.Optimizer`` hands bare state), go
  to ``tx`` as they are.
  """

  def update_fn(updates, state, params=None, **extra_args):
    if has_boxes(updates) or not any(_is_linen_box(x) for x in jax.tree.leaves(state, is_leaf=_is_linen_box)):
      return tx.update(updates, state, params, **extra_args)
    bare = jax.tree.map(lambda x: x.value if _is_linen_box(x) else x, state, is_leaf=_is_linen_box)
    updates, new = tx.update(updates, bare, params, **extra_args)
    return updates, jax.tree.map(lambda old, x: old.replace_boxed(x) if _is_linen_box(old) else x, state, new,
                                 is_leaf=_is_linen_box)

  return type(tx)(tx.init, update_fn)
