"""Attention that reports each head's largest logit, for QK-Clip.

Modules (Linen, and NNX twins captured with ``nnx.capture(model, nnx.Intermediate)``):
``MultiHeadLatentAttention`` (DeepSeek-V3 MLA) and ``GroupedQueryAttention`` (GQA/MHA),
``MultiHeadLatentAttentionNNX``, ``GroupedQueryAttentionNNX``. Each sows
``intermediates/.../max_logits`` (float32, ``(num_heads,)``) and reports its ``layout``
(the ``MLALayout``/``GQALayout`` for ``muonclip``). Logical axis names: "embed", "q_lora",
"kv_lora", "heads", "kv_heads", "norm".

The pure function: ``attention(q, k, v, impl=...) -> (out, max_logits)``, one entry point
for every implementation (``ATTENTION_IMPLS``: dense, chunked, dpa_max, tokamax's splash and
GPU kernels; ``"auto"`` picks one by backend).

Third-party models: ``dot_product_attention`` is a drop-in ``attention_fn`` for Flax's
``nn.MultiHeadDotProductAttention``/``nnx.MultiHeadAttention``;
``dot_product_attention_weights`` stands in for ``flax.linen.dot_product_attention_weights``
(Hugging Face Flax models); ``sow_max_logits`` sows maxima from logits computed by hand;
``capture_gemma()`` makes the ``gemma`` package's own models (``gm.nn.Gemma3_*``) sow theirs,
``capture_tunix()`` Tunix's (Llama 3, Qwen 3 and Qwen3-MoE, Gemma, Gemma 3), with
``tunix_layout(model)`` their layout and ``capture_tunix_trainer(trainer)`` the wiring of
Tunix's ``PeftTrainer`` to ``muonclip``;
``equinox_attention(mha, query, key_, value, mask)`` runs an ``equinox.nn.MultiheadAttention``
and returns ``(out, max_logits)``.

Rotary embeddings and checkpoints: ``apply_rope``, ``rope_frequencies``, ``YarnScaling``,
``yarn_mscale``, ``softmax_scale``; ``mla_from_hf_config``/``mla_nnx_from_hf_config`` and
``load_hf_mla_params`` (DeepSeek-V3 / Kimi K2 configs and safetensors, extra ``hf``).
"""

from ._attention import ATTENTION_IMPLS as ATTENTION_IMPLS
from ._attention import attention as attention
from ._deepseek import load_hf_mla_params as load_hf_mla_params
from ._deepseek import mla_from_hf_config as mla_from_hf_config
from ._deepseek import mla_nnx_from_hf_config as mla_nnx_from_hf_config
from .._clip import equinox_attention as equinox_attention
from ._capture import capture_gemma as capture_gemma
from ._capture import capture_tunix as capture_tunix
from ._capture import capture_tunix_trainer as capture_tunix_trainer
from ._capture import dot_product_attention as dot_product_attention
from ._capture import dot_product_attention_weights as dot_product_attention_weights
from ._capture import sow_max_logits as sow_max_logits
from ._capture import tunix_layout as tunix_layout
from ._gqa import GroupedQueryAttention as GroupedQueryAttention
from ._mla import MultiHeadLatentAttention as MultiHeadLatentAttention
from ._nnx import GroupedQueryAttentionNNX as GroupedQueryAttentionNNX
from ._nnx import MultiHeadLatentAttentionNNX as MultiHeadLatentAttentionNNX
from ._rope import YarnScaling as YarnScaling
from ._rope import apply_rope as apply_rope
from ._rope import rope_frequencies as rope_frequencies
from ._rope import softmax_scale as softmax_scale
from ._rope import yarn_mscale as yarn_mscale
