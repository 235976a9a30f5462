"""The logical axis names the library reads (Flax's ``nn.with_logical_partitioning``, NNX
``sharding`` metadata, MaxText's names), in one list.

Each declared axis role of a ``Projection`` has the names that stand for it; the routing
(``_muon.labels``), Muon's matrix axes (``_muon.matrix_axes_rules``) and the clip's kernel forms
(``_clip.projection``) all read them from here.
"""

from __future__ import annotations

# Names recognized for each declared axis role, by role.
LOGICAL_AXES: dict[str, frozenset[str]] = {
    "layers": frozenset({"layers", "stage"}),  # nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"})
    "heads": frozenset({"heads", "q_heads", "kv_heads"}),
    "head_dim": frozenset({"kv", "head_dim", "qk_head_dim", "kv_head_dim", "v_head_dim", "qkv_head_dim"}),
    "parts": frozenset({"qkv", "kv_parts", "parts"}),
    "in": frozenset({"embed", "q_lora", "kv_lora", "embed_no_exp", "hidden", "model"}),
}
LAYER_NAMES = LOGICAL_AXES["layers"]
# The axes of an attention head's columns: they stay together in one matrix.
HEAD_AXIS_NAMES = LOGICAL_AXES["heads"] | LOGICAL_AXES["head_dim"]
VOCAB = "vocab"  # the vocabulary axis of an embedding table or output head
