"""Which parameters Muon updates and which AdamW: the default routing of ``muon_adamw``.

Muon (Keller Jordan 2024; Moonlight, arXiv 2502.16982, section 2) is for the hidden weight
matrices of a network. Embedding tables, the output head, norm scales, biases and other
vectors go to AdamW, one vector per layer of a stack included. Decisions depend on paths,
shapes, logical axis names and the types of the layers that own the leaves (Equinox),
never on values.

Mixture-of-experts layers: expert weights are matrices (Muon, one matrix per expert; which
axes is ``matrix_axes``' business). The router (gate) goes to Muon, as Moonlight's reference
Muon (every 2-D weight but the embedding and the head) and MaxText's ``muon_utils.py`` (the
gate ``((0,), (-1,))``) send it, whatever its orientation and its siblings;
``muon_labels(params, router="adam")`` sends it to AdamW. A routing bias that the model moves
outside the gradient (DeepSeek-V3's ``e_score_correction_bias``, moved by its load-balancing
rule) is ``"frozen"``: ``muon_adamw`` leaves it as it is, with no weight decay.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import jax

from .._util import (EXPERT_NAMES, has_boxes, is_box, LAYER_NAMES, leaf_shape, logical_names, MetadataMemo,
                     path_str, STACK_NAMES, VOCAB)
from .._clip import EMBEDDING, leaf_roles, MATRIX

MUON = "muon"
ADAM = "adam"
FROZEN = "frozen"  # left as it is: a zero update, no weight decay (``muon_adamw``)

# Path components (lower-cased) that mark an embedding table or an output head.
_EMBEDDING_WORDS = ("embed", "wte", "wpe")
_HEAD_NAMES = frozenset({"lm_head", "head", "unembed", "output", "output_head", "output_layer", "logits",
                         "logits_dense", "classifier"})
_VECTOR_LEAF_NAMES = frozenset({"bias", "scale", "embedding"})
_LINEN_AUTO_NAME = re.compile(r"[A-Z][A-Za-z0-9]*_[0-9]+")  # Linen's name for an unnamed submodule: Dense_1
STACKED_VECTOR = "stacked vector"  # the role of a rank-2 leaf that a stack shows to be one vector per layer
# Path components that name a mixture-of-experts router (Hugging Face's Mixtral, DeepSeek-V3,
# Qwen-MoE and MaxText: ``gate``; torchtitan, Switch: ``router``).
ROUTER_NAMES = frozenset({"gate", "router"})
# Leaf names of a routing bias moved outside the gradient (DeepSeek-V3, Kimi K2 in Hugging Face's naming).
ROUTING_BIAS_NAMES = frozenset({"e_score_correction_bias"})


def _is_router(parts: list[str]) -> bool:
  return any(p in ROUTER_NAMES for p in parts)


def router_batch_names(path: str, names: tuple) -> frozenset:
  """The logical names of a leaf's batch axes: stacked layers and experts (``STACK_NAMES``), but
  only stacked layers for a router's own matrix whose expert axis is its output: a leaf of a
  module (or itself) named ``gate`` or ``router`` whose names, besides the layer and expert
  axes, hold one axis, the model width (a name containing ``embed``, or None): ``("embed",
  "exp")`` is one ``embed x experts`` matrix. A per-expert vector under such a module
  (``("exp", "mlp")``) stays a vector, and a stack of experts (``("exp", "embed", "mlp")``) a
  batch of matrices."""
  parts = path.lower().split("/")
  rest = [n for n in names if n not in STACK_NAMES]
  if (any(p in ROUTER_NAMES for p in parts[-2:]) and len(rest) == 1 and any(n in EXPERT_NAMES for n in names)
      and (rest[0] is None or "embed" in str(rest[0]))):
    return LAYER_NAMES
  return STACK_NAMES


def _is_norm(part: str) -> bool:
  """A path component naming a norm: containing ``norm`` (``input_layernorm``, ``LayerNorm_0``,
  ``q_norm``), or GPT-2's ``ln``, ``ln_1``, ``ln_f``."""
  return "norm" in part or re.fullmatch(r"ln(_[a-z0-9]+|[0-9]*)", part) is not None


def _is_position_table(parts: list[str]) -> bool:
  return any(p == "wpe" or "pos" in p for p in parts)


def vocab_sizes(params: Any) -> frozenset[tuple[int, int]]:
  """``(vocabulary, width)`` of the token-embedding tables in ``params``.

  A table is a 2-D leaf named ``embedding`` (``nn.Embed``, ``nnx.Embed``), owned by an
  ``eqx.nn.Embedding``, or under a path component containing ``embed`` or ``wte``, but not
  a position table (a component ``wpe``
  or containing ``pos``). Its vocabulary is its axis named ``"vocab"`` when it has logical
  names, else its first axis; a table whose vocabulary equals its width is left out (a
  square hidden matrix could not be told from the head).
  """
  sizes = set()
  roles = leaf_roles(params)
  for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
    parts = [c.lower() for c in path_str(p).split("/") if c]
    shape = leaf_shape(x)
    if len(shape) != 2 or not parts or _is_position_table(parts):
      continue
    typed = path_str(p) in roles and roles[path_str(p)].kind == EMBEDDING
    if not typed and parts[-1] != "embedding" and not any("embed" in c or "wte" in c for c in parts):
      continue
    names = logical_names(x) if is_box(x) else None
    vocab_axis = names.index(VOCAB) if names is not None and VOCAB in names else 0
    if shape[vocab_axis] != shape[1 - vocab_axis]:
      sizes.add((shape[vocab_axis], shape[1 - vocab_axis]))
  return frozenset(sizes)


def _in_numbered_layer(parts: list[str]) -> bool:
  """A path component ``0``, ``layers_3``, ``h_1``, ``block12``: inside one of a model's repeated layers.

  ``parts`` as written (not lower-cased). The leaf's own module under a Linen auto-name
  (``Dense_1``: the class, then its index among its parent's submodules of that class) is
  no layer: that is an unnamed ``nn.Dense``, such as an LM head.
  """
  owner = len(parts) - 2
  return any(p[-1:].isdigit() and not (i == owner and _LINEN_AUTO_NAME.fullmatch(p))
             for i, p in enumerate(parts[:-1]))


def default_label(path: str, shape: tuple[int, ...], names: tuple | None = None, *,
                  vocab: frozenset[tuple[int, int]] = frozenset(), role: str | None = None,
                  router: str = MUON, layer_module: bool | None = None) -> str:
  """``"muon"`` for a hidden weight matrix, ``"frozen"`` for a routing bias, ``"adam"`` for everything else.

  The rules, in order, are listed in ``muon_labels``' docstring (``role`` is what the type
  of the layer that owns the leaf says, rules 2 and 9; ``vocab`` the tree's embedding tables,
  rule 8; ``router`` the label of a router's matrix, rule 10; ``layer_module``: whether a head
  name in the path is a repeated layer's own sub-module, rule 6, which ``muon_labels`` reads
  from the tree, ``layer_modules``; None: from the path and names alone, ``_layer_root``).
  """
  raw = [p for p in path.split("/") if p]
  parts = [p.lower() for p in raw]
  if parts and parts[-1] in ROUTING_BIAS_NAMES:
    return FROZEN
  if layer_module is None:
    first = _head_position(raw)
    layer_module = first is not None and _layer_root(raw, first, _named_stack(names)) is not None
  label = _matrix_or_adam(parts, shape, names, vocab, role, _in_numbered_layer(raw), layer_module)
  return router if label == MUON and _is_router(parts) else label


def _head_position(raw: list[str]) -> int | None:
  """The index of a head name (rule 6) that holds a named module of its own: not the leaf's own
  module (``ViT_0/head/kernel``) nor followed by numbered parts (``classifier/1/kernel``)."""
  first = next((i for i, p in enumerate(raw) if p.lower() in _HEAD_NAMES), None)
  return first if first is not None and first < len(raw) - 2 and not raw[first + 1][-1:].isdigit() else None


def _named_stack(names: tuple | None) -> int | None:
  """Where stacked layers start by a leaf's logical names: a layer axis, below the top-level module."""
  return 1 if names is not None and any(n in LAYER_NAMES for n in names) else None


def _layer_root(raw: list[str], first: int, stack_root: int | None) -> int | None:
  """The length of the path of the repeated layer that holds the head name at ``first``: its
  stacked layers' (``stack_root``, when the name lies below it), else the last numbered component
  before it (``layer/0``); None when the name lies in no layer."""
  if stack_root is not None and stack_root <= first:
    return stack_root
  numbered = [j for j in range(first) if raw[j][-1:].isdigit()]
  return numbered[-1] + 1 if numbered else None


def layer_modules(leaves: list[tuple[str, tuple[int, ...], tuple | None]], roots: dict[str, int]) -> frozenset[str]:
  """The paths (of ``(path, shape, names)`` leaves) whose head name is a repeated layer's own
  sub-module (rule 6): it holds a named module of its own, lies in a layer (``_layer_root``;
  ``roots``: ``read_stacks``' stacked layers) and that layer holds a matrix beside the head's
  module and no embedding table: a layer, not a lone stack of heads (an ensemble of heads,
  ``nn.vmap``-ed) nor a whole model (an ensemble of models, listed or ``eqx.filter_vmap``-ed)."""
  split = [(path.split("/"), shape) for path, shape, _ in leaves]
  found = set()
  for path, shape, names in leaves:
    raw = path.split("/")
    first = _head_position(raw)
    root = None if first is None else _layer_root(raw, first, roots.get(path, _named_stack(names)))
    if root is None:
      continue
    inside = [(p, s) for p, s in split if p[:root] == raw[:root]]
    beside = any(len(s) >= 2 and p[:first + 1] != raw[:first + 1] for p, s in inside)
    model = any(w in c.lower() for p, _ in inside for c in p[root:] for w in _EMBEDDING_WORDS)
    if beside and not model:
      found.add(path)
  return frozenset(found)


def _unit_side(parts: list[str], shape: tuple[int, ...], names: tuple | None, role: str | None) -> bool:
  """A matrix with a side of size 1 (rule 1): a 2-D leaf with an axis of size 1, or a stack whose
  matrices are known to be such, by the layer type (an Equinox ``Linear``'s ``(*layers, out, in)``)
  or by logical names (two axes besides the layer and expert axes, one of size 1)."""
  if len(shape) == 2 or role == MATRIX:
    return 1 in shape[-2:]
  if names is None or len(names) != len(shape):
    return False
  batch = router_batch_names("/".join(parts), names)
  sides = [size for size, n in zip(shape, names) if n not in batch]
  return len(sides) == 2 and 1 in sides


def _matrix_or_adam(parts: list[str], shape: tuple[int, ...], names: tuple | None,
                    vocab: frozenset[tuple[int, int]], role: str | None, numbered: bool,
                    layer_module: bool = False) -> str:
  if len(shape) < 2 or _unit_side(parts, shape, names, role) or role not in (None, MATRIX, STACKED_VECTOR):
    return ADAM
  if role is None and parts and (parts[-1] in _VECTOR_LEAF_NAMES or any(_is_norm(p) for p in parts)):
    return ADAM
  vocab_shaped = len(shape) == 2 and any(shape in ((v, w), (w, v)) for v, w in vocab)
  head_shaped = any(shape[-2:] in ((v, w), (w, v)) for v, w in vocab)  # stacked too
  if any(w in p for p in parts for w in _EMBEDDING_WORDS) or (
      any(p in _HEAD_NAMES for p in parts) and (not layer_module or head_shaped)):
    return ADAM
  # a router's expert axis is its matrix's output (``("embed", "exp")``), not a batch axis
  batch = STACK_NAMES if names is None else router_batch_names("/".join(parts), names)
  if names is not None and (VOCAB in names or sum(n not in batch for n in names) < 2):
    return ADAM
  if names is None and not numbered and vocab_shaped:
    return ADAM
  return ADAM if role == STACKED_VECTOR else MUON


def read_stacks(params: Any) -> tuple[frozenset[str], dict[str, int]]:
  """What stacks of layers show: the paths of the leaves that are one vector per layer (rule 9 of
  ``default_label``), and, for every leaf that lies in stacked layers, the length of the path of
  their sub-tree (rule 6: a head name below it is a layer's sub-module).

  Stacking layers (``nn.scan``, ``eqx.filter_vmap``, ``jnp.stack`` by hand) puts one leading
  axis of the same size L on every leaf of the stacked sub-tree: a norm gain becomes
  ``(L, dim)``, a kernel ``(L, in, out)``. A sub-tree of two leaves or more in which every
  leaf has rank >= 2 and the same leading size, and one has rank >= 3 (a stacked matrix,
  which shows the layer axis), is read as stacked layers; a leaf lies in stacked layers when
  the largest such sub-tree above it is one. A 2-D leaf ``(L, dim)`` there without logical
  names or a known layer type is a stacked vector, unless it is named ``kernel`` (Flax's name
  for a matrix: stacked, a kernel has rank >= 3; an unscanned attention of a DenseGeneral
  query ``(d, heads, head_dim)`` beside Dense ``(d, kv)`` keys and values has the same leading
  size everywhere) or is a router's (a path component ``gate`` or ``router``: stored
  ``(experts, d)`` beside its ``(experts, d, f)`` experts, its leading size is theirs, yet it
  is one matrix). Unstacked layers have rank-1 vectors (biases, gains) beside their matrices,
  and their matrices' leading sizes differ (``(d, 4d)`` and ``(4d, d)``), so such a sub-tree
  does not form there. Scanned experts stack twice: a sub-tree whose leaves all lead with the
  same two sizes ``(L, E)`` and have rank >= 3, two of them (the experts' matrices) rank >= 4,
  shows layers of experts, and a 3-D leaf ``(L, E, f)`` there, under a path component containing
  ``expert`` or ``moe``, whose ``f`` is the output size of one of those matrices is a vector per
  layer and expert (an unnamed per-expert bias, ``(E, f)`` unscanned). What can still be read as
  stacked: another genuine ``(E, d)`` matrix not named ``kernel`` in a sub-tree whose every
  leaf has leading size E and rank >= 2 next to a rank-3 leaf: it then goes to AdamW (pass
  ``labels`` to send it to Muon).
  """
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
  roles = leaf_roles(params)
  decided = set(roles) | {path_str(p) for p, x in flat if is_box(x) and logical_names(x) is not None}
  # (path, shape, neither named nor of a known layer type)
  everything = [(path_str(p), leaf_shape(x), path_str(p) not in decided) for p, x in flat]
  # (k, prefix) -> [leading k sizes, smallest rank, output sizes of the leaves of rank >= k + 2, leaves]:
  # k = 1 stacks layers (or experts), k = 2 layers of experts
  subtrees: dict[tuple[int, tuple[str, ...]], list] = {}
  for path, shape, _ in everything:
    parts = tuple(path.split("/"))
    for k, cut in itertools.product((1, 2), range(len(parts))):
      entry = subtrees.setdefault((k, parts[:cut]), [set(), len(shape), [], 0])
      entry[0].add(shape[:k] if len(shape) >= k else None)
      entry[1] = min(entry[1], len(shape))
      entry[2] += [shape[-1]] if len(shape) >= k + 2 else []
      entry[3] += 1
  vectors, members = set(), {}
  for path, shape, bare in everything:
    parts = tuple(path.split("/"))
    for k in (1, 2):
      for cut in range(len(parts)):  # from the root down: the first that qualifies is the largest
        sizes, rank, outputs, count = subtrees[(k, parts[:cut])]
        if len(sizes) == 1 and rank >= k + 1:
          stacked = bool(outputs) and count >= 2
          if stacked and k == 1:
            members[path] = cut
          bias_like = k == 1 or (len(outputs) >= 2 and shape[-1] in outputs
                                 and any("expert" in p.lower() or "moe" in p.lower() for p in parts))
          if (stacked and bias_like and bare and len(shape) == k + 1 and parts[-1] != "kernel"
              and not _is_router([p.lower() for p in parts])):
            vectors.add(path)
          break
  return frozenset(vectors), members


def muon_labels(params: Any, *, router: str = MUON) -> Any:
  """The default routing: a tree of ``"muon"``/``"adam"``/``"frozen"`` labels.

  The rules, in order; the first that applies decides:

  0. a leaf named ``e_score_correction_bias`` (DeepSeek-V3's and Kimi K2's routing bias, moved
     by the load-balancing rule, not by the gradient): ``"frozen"``, which ``muon_adamw``
     leaves unchanged (no update, no weight decay). Label a routing bias of another name
     ``"frozen"`` yourself (``labels=``), or keep it outside the params (see
     ``docs/your-model.md``, "Mixture of experts").
  1. rank < 2 (biases, norm scales, any vector), or a 2-D leaf with an axis of size 1 (a vector
     stored as a row or a column: Bart's ``final_logits_bias`` ``(1, vocab)``, a projection to
     one output): AdamW. Stacked too, where the stack's matrices are known: an Equinox
     ``Linear(d, 1)`` under ``eqx.filter_vmap`` (``(layers, 1, d)``), a scanned kernel named
     ``("embed", "layers", None)`` of shape ``(d, layers, 1)`` (two axes besides the layer and
     expert axes, one of size 1). An unnamed ``(layers, d, 1)`` is left to rule 10: without
     names its matrix is ``matrix_axes``' to declare.
  2. what the type of the layer that owns the leaf says it is (Equinox): a bias
     (``Linear.bias``), a norm's gain (``LayerNorm``, ``RMSNorm``, ``GroupNorm``,
     ``BatchNorm``) or an embedding table (``Embedding``):
     AdamW, stacked or not (``eqx.filter_vmap`` makes a gain ``(layers, dim)``). A matrix
     (``Linear.weight``) goes on to rules 5-8 (an output head is a ``Linear`` too).
  3. a leaf named ``bias``, ``scale`` or ``embedding`` (Flax's norm scales, stacked or not,
     and ``nn.Embed``/``nnx.Embed`` tables): AdamW.
  4. a path component naming a norm: containing ``norm`` (``input_layernorm``,
     ``LayerNorm_0``, ``q_norm``) or GPT-2's ``ln``, ``ln_1``, ``ln_f``: AdamW (a norm holds
     gains, stacked or not, whatever its leaves are named).
  5. a path component containing ``embed``, ``wte`` or ``wpe`` (embedding tables under any
     leaf name): AdamW.
  6. a path component named ``lm_head``, ``head``, ``unembed``, ``output``, ``output_head``,
     ``output_layer``, ``logits``, ``logits_dense`` or ``classifier`` (output heads; MaxText's
     is ``logits_dense``): AdamW. Whole components only: ``heads`` is not ``head``. A name inside
     one of the repeated layers (after a numbered component, rule 8's, or below the root of
     stacked layers, ``read_stacks``, or from the second path component on when the leaf's
     logical names hold a layer axis) that holds a named module of its own is that layer's
     sub-module, not a head (BERT's ``layer/0/output/dense`` and
     ``layer/0/attention/output/dense``, scanned ``layer/output/dense``: Muon), when that
     layer holds a matrix beside it and no embedding table (``layer_modules``: not a lone
     stack of heads, nor a whole model of an ensemble), unless the leaf has a token-embedding
     table's shape. A name that owns the leaf (``ViT_0/head/kernel``, DeepSeek-V3's
     multi-token-prediction head ``layers/61/shared_head/head``, ``models/0/classifier``) or
     is followed by numbered parts (``classifier/1``, ``head/layers_1``) is a head.
  7. logical axis names (``names``; Linen boxes, NNX ``sharding`` metadata, short specs
     padded with None as Flax pads them) with a ``"vocab"`` axis, or with fewer than two
     axes besides the layer and expert axes (a vector per layer of a stack, a bias per
     expert ``("exp", "mlp")``): AdamW. A router's expert axis counts as one of the two
     (a leaf of a module named ``gate`` or ``router`` named ``("embed", "exp")`` or ``("exp",
     "embed")``: its matrix's output, rule 10; ``router_batch_names``).
  8. a 2-D leaf of shape ``(width, vocabulary)`` or ``(vocabulary, width)`` of one of the
     tree's token-embedding tables (``vocab``, from ``vocab_sizes``): an output head under a
     name rule 6 does not know: AdamW. Not applied to a leaf with logical names (rule 7
     decides those: names without ``"vocab"`` say it is no head), nor inside a numbered layer
     (a path component such as ``0``, ``layers_3`` or ``h_1``: heads sit outside the layer
     stack; the leaf's own module under a Linen auto-name such as ``Dense_1``, an unnamed
     ``nn.Dense``, is not one), so an MLP whose hidden size happens to equal the vocabulary
     stays with Muon.
     Outside those, a hidden matrix of that shape goes to AdamW too: pass ``labels``.
  9. ``role`` ``STACKED_VECTOR``: a 2-D leaf without logical names or a known layer type
     that its stack shows to be one vector per layer (``read_stacks``: the largest
     sub-tree above it whose leaves all share its leading size and all have rank >= 2
     holds a leaf of rank >= 3, a stacked matrix, and another leaf), or a 3-D one per layer
     and expert (the same with two leading sizes, two expert matrices of rank 4, one of them
     of the leaf's output size, under a path component containing ``expert`` or ``moe``):
     AdamW. This covers ``nn.scan`` without logical names, ``eqx.filter_vmap`` stacks of
     layers of unknown types and hand-made stacks. Not applied to a router (below), nor to a
     leaf named ``kernel`` (Flax's matrices; stacked, a kernel has rank >= 3).
  10. everything else of rank >= 2: Muon (stacked layers, expert stacks and DenseGeneral
      kernels included; which axes form the matrix is ``matrix_axes``'s business). A
      mixture-of-experts router, i.e. a leaf under a path component named ``gate`` or
      ``router`` (Hugging Face's Mixtral, DeepSeek-V3 and Qwen-MoE ``gate/weight``, MaxText's
      ``gate/kernel``, torchtitan's ``router``), is a matrix too, ``(d, experts)`` or
      ``(experts, d)``, with or without siblings: it gets ``router``'s label, Muon by
      default, as in Moonlight's reference Muon (every 2-D weight but the embedding and the
      head) and MaxText's ``muon_utils.py``; ``router="adam"`` sends it to AdamW. (An MLP's
      own ``gate`` projection is named the same and follows the same choice.) So a ``(layers, dim)``
      vector that nothing shows to be stacked, i.e. no leaf name, norm name, logical names,
      layer type or stacked sibling (rules 2-4, 7, 9; e.g. a lone stacked leaf, or one
      whose stack also holds a vector per layer of rank 1, a stacked scalar), is read as a
      matrix: pass ``labels`` for it.

  This applies them to every leaf of a tree, and ``muon_adamw`` reads a boxed tree's
  labels once, at ``init``, and reuses them at ``update`` for the bare arrays of the same
  paths and shapes (``nnx.Optimizer`` hands ``init`` boxed ``nnx.Param`` values and
  ``update`` bare arrays, so names-based rules would otherwise differ between the two).

  For an Equinox model (``eqx.filter(model, eqx.is_array)``) the labels are a tree of the
  model's own structure, and each leaf's role is read from its layer's type: ``Linear``
  weights are matrices, their biases, norm gains and ``Embedding`` tables go to AdamW,
  stacked by ``eqx.filter_vmap`` or not.

  Boxed leaves (``nn.Partitioned``, NNX variables) keep their box, with the label inside;
  their logical axis names take part (a ``"vocab"`` axis goes to AdamW).

  Args:
    params: the parameters (boxed or not), or any tree of their shapes.
    router: the label of a router's matrix (rule 10): ``"muon"`` (default) or ``"adam"``.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> params = {"embed": {"embedding": jnp.ones((16, 8))},
    ...           "layers_0": {"mlp": {"kernel": jnp.ones((8, 32)), "bias": jnp.ones((32,))}},
    ...           "lm_head": {"kernel": jnp.ones((8, 16))}}
    >>> mc.muon_labels(params)  # hidden matrices to Muon; embeddings, head and vectors to AdamW
    {'embed': {'embedding': 'adam'}, 'layers_0': {'mlp': {'bias': 'adam', 'kernel': 'muon'}},
     'lm_head': {'kernel': 'adam'}}
    >>> moe = {"gate": {"weight": jnp.ones((4, 8)), "e_score_correction_bias": jnp.zeros((4,))},
    ...        "experts": {"w1": jnp.ones((4, 8, 16))}}  # 4 experts of 8 x 16, the router (experts, d)
    >>> mc.muon_labels(moe)
    {'experts': {'w1': 'muon'}, 'gate': {'e_score_correction_bias': 'frozen', 'weight': 'muon'}}
    >>> mc.muon_labels(moe, router="adam")["gate"]["weight"]
    'adam'
  """
  if router not in (MUON, ADAM):
    raise ValueError(f"muon_labels: router must be {MUON!r} or {ADAM!r}, got {router!r}")
  vocab, roles, (vectors, roots) = vocab_sizes(params), leaf_roles(params), read_stacks(params)
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
  modules = layer_modules([(path_str(p), leaf_shape(x), logical_names(x) if is_box(x) else None) for p, x in flat],
                          roots)

  def role(path):
    return roles[path].kind if path in roles else (STACKED_VECTOR if path in vectors else None)

  def label(p, x):
    path = path_str(p)
    if not is_box(x):
      return default_label(path, tuple(x.shape), vocab=vocab, role=role(path), router=router,
                           layer_module=path in modules)
    return jax.tree.map(lambda _: default_label(path, leaf_shape(x), logical_names(x), vocab=vocab, role=role(path),
                                                router=router, layer_module=path in modules), x)

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
