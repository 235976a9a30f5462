"""The logical axis names the library reads (Flax's ``nn.with_logical_partitioning``, NNX
``sharding`` metadata, MaxText's names), in one list.

Each declared axis role of a ``Projection`` has the names that stand for it; the routing
(``_muon.labels``), Muon's matrix axes (``_muon.matrix_axes_rules``) and the clip's kernel forms
(``_clip.projection``) all read them from here.

Two roles stack independent matrices, and Muon batches them (``STACK_NAMES``): stacked layers
(``nn.scan``'s ``"layers"``) and the experts of a mixture-of-experts layer (MaxText's
``"exp"``: ``wi_0`` ``("exp", "embed_no_exp", "mlp")``; Flaxformer's ``"expert"``). Each
expert's matrix is its own, as MaxText's ``muon_utils.py`` (``MuonDimensionNumbers((-2,),
(-1,))`` for expert stacks) and Moonlight treat it.
"""

from __future__ import annotations

from typing import Any

import jax


class NameSet(frozenset):
  """A set of axis names that also holds every name ending in one of its ``suffixes``.

  A stacked-layer axis is ``"layers"``, ``"stage"`` or any name ending in ``"_layers"``:
  MaxText 0.2.5 scans its dense and mixture-of-experts blocks apart, as ``dense_layers`` and
  ``moe_layers``.
  """

  suffixes: tuple[str, ...] = ()

  def __new__(cls, names: Any = (), suffixes: tuple[str, ...] = ()):
    out = super().__new__(cls, names)
    out.suffixes = tuple(suffixes)
    return out

  def __contains__(self, name: object) -> bool:
    return frozenset.__contains__(self, name) or (isinstance(name, str) and bool(self.suffixes)
                                                   and name.endswith(self.suffixes))

  def __or__(self, other: Any) -> NameSet:
    return NameSet(frozenset(self) | frozenset(other), self.suffixes + tuple(getattr(other, "suffixes", ())))

  def __and__(self, other: Any) -> frozenset:
    return frozenset(n for n in frozenset(self) | frozenset(other) if n in self and n in other)

  def __repr__(self) -> str:
    return f"{sorted(self)} and *{', *'.join(self.suffixes)}" if self.suffixes else repr(sorted(self))


# Names recognized for each declared axis role, by role.
LOGICAL_AXES: dict[str, frozenset[str]] = {
    # nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"}); MaxText 0.2.5's dense_layers, moe_layers
    "layers": NameSet({"layers", "stage"}, suffixes=("_layers",)),
    "experts": frozenset({"exp", "expert", "experts", "num_experts", "n_experts"}),  # one matrix per expert
    "heads": frozenset({"heads", "q_heads", "kv_heads"}),
    "head_dim": frozenset({"kv", "head_dim", "qk_head_dim", "kv_head_dim", "v_head_dim", "qkv_head_dim"}),
    "parts": frozenset({"qkv", "kv_parts", "parts"}),
    "in": frozenset({"embed", "q_lora", "kv_lora", "embed_no_exp", "hidden", "model"}),
}
LAYER_NAMES = LOGICAL_AXES["layers"]
EXPERT_NAMES = LOGICAL_AXES["experts"]
# Axes that stack independent matrices: Muon batches them (one matrix per layer, per expert).
STACK_NAMES = LAYER_NAMES | EXPERT_NAMES
# The axes of an attention head's columns: they stay together in one matrix.
HEAD_AXIS_NAMES = LOGICAL_AXES["heads"] | LOGICAL_AXES["head_dim"]
VOCAB = "vocab"  # the vocabulary axis of an embedding table or output head


# Mesh axis names that some code puts in parameter metadata where logical names belong
# (Tunix: ``nnx.with_partitioning(init, ("fsdp", "tp"))``; a MaxText mesh: data, fsdp, tensor, ...).
MESH_AXIS_NAMES = frozenset({
    "dp", "fsdp", "tp", "sp", "ep",  # Tunix's ShardingConfig and the usual short forms
    "data", "diloco", "fsdp_transpose", "sequence", "context", "context_autoregressive",  # MaxText's mesh
    "context_usp_ulysses", "tensor", "tensor_transpose", "tensor_sequence", "autoregressive",
})


def is_logical(name: object) -> bool:
  """Whether the library reads ``name`` for a role (``LOGICAL_AXES``, ``*_layers`` included, and
  ``VOCAB``)."""
  return name == VOCAB or any(name in known for known in LOGICAL_AXES.values())


def mesh_axis_names() -> frozenset[str]:
  """The names that metadata may hold for a mesh's axes, not for a role: ``MESH_AXIS_NAMES`` and
  the axis names of the mesh in context (``jax.set_mesh``, ``jax.sharding.use_abstract_mesh``),
  less every name the library reads as a logical name (``is_logical``).

  Rule: a name in parameter metadata is a mesh axis name, and says nothing about the matrix,
  when it is one of the usual mesh axis names above or an axis of the mesh in context, and is
  not a logical name the library knows. So MaxText's mesh axes ``stage`` and ``expert``, which
  are also logical names here (stacked layers, experts), keep their logical reading, and so
  does ``model`` (a fan-in name). Read at ``init`` and kept for the updates.
  """
  in_context = frozenset(jax.sharding.get_abstract_mesh().axis_names)
  return frozenset(n for n in MESH_AXIS_NAMES | in_context if isinstance(n, str) and not is_logical(n))
