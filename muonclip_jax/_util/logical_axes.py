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

# Names recognized for each declared axis role, by role.
LOGICAL_AXES: dict[str, frozenset[str]] = {
    "layers": frozenset({"layers", "stage"}),  # nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"})
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
