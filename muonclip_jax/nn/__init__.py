"""Flax attention modules that report per-head max logits for QK-Clip.

Linen: ``MultiHeadLatentAttention`` (DeepSeek-V3 MLA) and ``GroupedQueryAttention``
(GQA/MHA) sow ``intermediates/.../max_logits`` (float32, ``(num_heads,)``) when the
``intermediates`` collection is mutable. NNX twins: ``MultiHeadLatentAttentionNNX`` and
``GroupedQueryAttentionNNX``, captured with ``nnx.capture(model, nnx.Intermediate)``.
Each module's ``layout`` property is the ``MLALayout``/``GQALayout`` for ``qk_clip``.

The pure functions ``attention``, ``dense_attention``, ``chunked_attention``,
``dpa_max_attention``
(``jax.nn.dot_product_attention`` plus a max-only pass), ``splash_attention`` (tokamax's
TPU splash kernel) and ``tokamax_gpu_attention`` (tokamax's Mosaic GPU / Triton kernels;
both need the ``tokamax`` extra) return ``(out, max_logits)``; ``attention(impl="auto")``
picks one by backend;
``apply_rope``/``rope_frequencies``/``YarnScaling`` are the rotary embeddings
(``rope_interleave=True``: DeepSeek-V3's interleaved pairs).
``mla_from_hf_config``/``mla_nnx_from_hf_config`` build MLA from a Hugging Face
DeepSeek-V3 / Kimi K2 ``config.json`` dict and ``load_hf_mla_params`` converts its
attention weights (safetensors, optional extra ``hf``). Logical axis names: "embed",
"q_lora", "kv_lora", "heads", "kv_heads", "norm". ``dot_product_attention`` is a drop-in
``attention_fn`` for Flax's ``nn.MultiHeadDotProductAttention``/``nnx.MultiHeadAttention``
that sows the same ``max_logits``; ``dot_product_attention_weights`` is the same for
``flax.linen.dot_product_attention_weights`` (Hugging Face Flax models: a one-line patch), and
``sow_max_logits(module, logits, mask=..., head_axis=...)`` sows them from logits computed by
hand. ``attention``/``dot_product_attention`` take ``logits_soft_cap``; the counted logit is
the one before the cap.
"""

from ._attention import ATTENTION_IMPLS as ATTENTION_IMPLS
from ._attention import attention as attention
from ._chunked import chunked_attention as chunked_attention
from ._deepseek import load_hf_mla_params as load_hf_mla_params
from ._deepseek import mla_from_hf_config as mla_from_hf_config
from ._deepseek import mla_nnx_from_hf_config as mla_nnx_from_hf_config
from ._dense import dense_attention as dense_attention
from ._dpa_max import dpa_max_attention as dpa_max_attention
from ._flax_attention import dot_product_attention as dot_product_attention
from ._flax_weights import dot_product_attention_weights as dot_product_attention_weights
from ._gqa import GroupedQueryAttention as GroupedQueryAttention
from ._mla import MultiHeadLatentAttention as MultiHeadLatentAttention
from ._nnx import GroupedQueryAttentionNNX as GroupedQueryAttentionNNX
from ._nnx import MultiHeadLatentAttentionNNX as MultiHeadLatentAttentionNNX
from ._rope import YarnScaling as YarnScaling
from ._rope import apply_rope as apply_rope
from ._rope import rope_frequencies as rope_frequencies
from ._rope import softmax_scale as softmax_scale
from ._rope import yarn_mscale as yarn_mscale
from ._sow import sow_max_logits as sow_max_logits
from ._splash import splash_attention as splash_attention
from ._tokamax_gpu import tokamax_gpu_attention as tokamax_gpu_attention
