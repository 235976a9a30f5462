"""Which parameters Muon updates and which AdamW: the default routing of ``muon_adamw``.

Muon (Keller Jordan 2024; Moonlight, arXiv 2502.16982, section 2) is for the hidden weight
matrices of a network. Embedding tables, the output head, norm scales, biases and other
vectors go to AdamW. Decisions depend on paths, shapes and logical axis names, never on values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._boxes import MetadataMemo, has_boxes, is_box, leaf_shape, logical_names
from ._paths import path_str

MUON = "muon"
ADAM = "adam"
VOCAB = "vocab"  # the logical axis name of an embedding table's or output head's vocabulary

# Path components (lower-cased) that mark an embedding table or an output head.
_EMBEDDING_WORDS = ("embed", "wte", "wpe")
_HEAD_NAMES = frozenset({"lm_head", "head", "unembed", "output", "output_head", "output_layer", "logits",
                         "logits_dense", "classifier"})
_VECTOR_LEAF_NAMES = frozenset({"bias", "scale", "embedding"})


def _is_position_table(parts: list[str]) -> bool:
  return any(p == "wpe" or "pos" in p for p in parts)


def vocab_sizes(params: Any) -> frozenset[tuple[int, int]]:
  """``(vocabulary, width)`` of the token-embedding tables in ``params``.

  A table is a 2-D leaf named ``embedding`` (``nn.Embed``, ``nnx.Embed``) or under a path
  component containing ``embed`` or ``wte``, but not a position table (a component ``wpe``
  or containing ``pos``). Its vocabulary is its axis named ``"vocab"`` when it has logical
  names, else its first axis; a table whose vocabulary equals its width is left out (a
  square hidden matrix could not be told from the head).
  """
  sizes = set()
  for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
    parts = [c.lower() for c in path_str(p).split("/") if c]
    shape = leaf_shape(x)
    if len(shape) != 2 or not parts or _is_position_table(parts):
      continue
    if parts[-1] != "embedding" and not any("embed" in c or "wte" in c for c in parts):
      continue
    names = logical_names(x) if is_box(x) else None
    vocab_axis = names.index(VOCAB) if names is not None and VOCAB in names else 0
    if shape[vocab_axis] != shape[1 - vocab_axis]:
      sizes.add((shape[vocab_axis], shape[1 - vocab_axis]))
  return frozenset(sizes)


def _in_numbered_layer(parts: list[str]) -> bool:
  """A path component ``0``, ``layers_3``, ``h_1``, ``block12``: inside one of a model's repeated layers."""
  return any(p[-1:].isdigit() for p in parts[:-1])


def default_label(path: str, shape: tuple[int, ...], names: tuple | None = None, *,
                  vocab: frozenset[tuple[int, int]] = frozenset()) -> str:
  """``"muon"`` for a hidden weight matrix, ``"adam"`` for everything else.

  The rules, in order; the first that applies decides:

  1. rank < 2 (biases, norm scales, any vector): AdamW.
  2. a leaf named ``bias``, ``scale`` or ``embedding`` (Flax's norm scales, stacked or not,
     and ``nn.Embed``/``nnx.Embed`` tables): AdamW.
  3. a path component containing ``embed``, ``wte`` or ``wpe`` (embedding tables under any
     leaf name): AdamW.
  4. a path component named ``lm_head``, ``head``, ``unembed``, ``output``, ``output_head``,
     ``output_layer``, ``logits``, ``logits_dense`` or ``classifier`` (output heads; MaxText's
     is ``logits_dense``): AdamW. Whole components only: ``heads`` is not ``head``.
  5. a ``"vocab"`` logical axis name (``names``; Linen boxes, NNX ``sharding`` metadata,
     short specs padded with None as Flax pads them): AdamW.
  6. a 2-D leaf of shape ``(width, vocabulary)`` or ``(vocabulary, width)`` of one of the
     tree's token-embedding tables (``vocab``, from ``vocab_sizes``): an output head under a
     name rule 4 does not know: AdamW. Not applied to a leaf with logical names (rule 5
     decides those: names without ``"vocab"`` say it is no head), nor inside a numbered layer
     (a path component such as ``0``, ``layers_3`` or ``h_1``: heads sit outside the layer
     stack), so an MLP whose hidden size happens to equal the vocabulary stays with Muon.
     Outside those, a hidden matrix of that shape goes to AdamW too: pass ``labels``.
  7. everything else of rank >= 2: Muon (stacked layers and DenseGeneral kernels included;
     which axes form the matrix is ``matrix_axes``'s business).

  ``muon_labels`` applies these to a whole tree, and ``muon_adamw`` reads a boxed tree's
  labels once, at ``init``, and reuses them at ``update`` for the bare arrays of the same
  paths and shapes (``nnx.Optimizer`` hands ``init`` boxed ``nnx.Param`` values and
  ``update`` bare arrays, so names-based rules would otherwise differ between the two).
  """
  parts = [p.lower() for p in path.split("/") if p]
  if len(shape) < 2 or (parts and parts[-1] in _VECTOR_LEAF_NAMES):
    return ADAM
  if any(w in p for p in parts for w in _EMBEDDING_WORDS) or any(p in _HEAD_NAMES for p in parts):
    return ADAM
  if names is not None and VOCAB in names:
    return ADAM
  if (len(shape) == 2 and names is None and not _in_numbered_layer(parts)
      and any(shape in ((v, w), (w, v)) for v, w in vocab)):
    return ADAM
  return MUON


def muon_labels(params: Any) -> Any:
  """The default routing: a tree of ``"muon"``/``"adam"`` labels (rules: ``default_label``).

  Boxed leaves (``nn.Partitioned``, NNX variables) keep their box, with the label inside;
  their logical axis names take part (a ``"vocab"`` axis goes to AdamW).

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> params = {"embed": {"embedding": jnp.ones((16, 8))},
    ...           "layers_0": {"mlp": {"kernel": jnp.ones((8, 32)), "bias": jnp.ones((32,))}},
    ...           "lm_head": {"kernel": jnp.ones((8, 16))}}
    >>> mc.muon_labels(params)  # hidden matrices to Muon; embeddings, head and vectors to AdamW
    {'embed': {'embedding': 'adam'}, 'layers_0': {'mlp': {'bias': 'adam', 'kernel': 'muon'}},
     'lm_head': {'kernel': 'adam'}}
  """
  vocab = vocab_sizes(params)

  def label(p, x):
    if not is_box(x):
      return default_label(path_str(p), tuple(x.shape), vocab=vocab)
    return jax.tree.map(lambda _: default_label(path_str(p), leaf_shape(x), logical_names(x), vocab=vocab), x)

  return jax.tree_util.tree_map_with_path(label, params, is_leaf=is_box)


def remembering_labels(labels: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """``labels`` (a callable from params to labels) that reads a boxed tree once and reuses it.

  The labels computed for a boxed tree (``init`` under ``nnx.Optimizer``) are returned, by
  path, for a later bare tree of the same paths and shapes (its ``update``), so both calls
  route every leaf alike. Each call of this function keeps its own memory: use one per
  optimizer.
  """
  memo = MetadataMemo()

  def fn(tree: Any) -> Any:
    table = memo.recall(tree)
    if table is not None:
      return jax.tree_util.tree_map_with_path(lambda p, _: table[path_str(p)], tree)
    out = labels(tree)
    if has_boxes(tree):
      memo.remember(tree, {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(out)[0]})
    return out

  return fn
