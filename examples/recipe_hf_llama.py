"""Recipe 5: MuonClip on Hugging Face's Flax Llama (``transformers<5``), patched in one line.

Hugging Face's Flax attention has no ``attention_fn`` hook: it imports Flax's
``dot_product_attention_weights`` into its module and calls it without ``module=``. The
line marked ``# MuonClip (1/4)`` replaces that import by ``muonclip_jax.nn``'s drop-in,
which returns the same weights and sows each head's max logit on the calling attention
module (``.../self_attn/max_logits``). The other marked lines name the ``q_proj``/``k_proj``
projections (2-D ``(in, heads*head_dim)`` kernels, grouped-query heads), capture the
``intermediates`` and hand them to the optimizer. Embeddings and ``lm_head`` go to AdamW.

  python examples/recipe_hf_llama.py [--steps N]
"""

from __future__ import annotations

import dataclasses
import sys

import optax
import transformers.models.llama.modeling_flax_llama as hf_llama
from transformers import LlamaConfig

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
import _hf_common
from _hf_common import forward, loss_fn, make_step  # noqa: F401 (MuonClip 3/4 and 4/4 are there)
from _recipe_common import batches  # noqa: F401 (recipe.batches: the tests' data)

hf_llama.dot_product_attention_weights = mcnn.dot_product_attention_weights  # MuonClip (1/4): the patch


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_dim: int = 96
  num_layers: int = 2
  seq_len: int = 8

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads

  @property
  def hf_config(self) -> LlamaConfig:
    return LlamaConfig(vocab_size=self.vocab, hidden_size=self.dim, intermediate_size=self.mlp_dim,
                       num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                       num_key_value_heads=self.num_kv_heads,
                       max_position_embeddings=max(self.seq_len, 2 * self.head_dim))  # HF's rotary needs 2*head_dim

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (2/4): heads and the names of the q/k projections
    return mc.GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, query="q_proj", key="k_proj",
                        value="v_proj", out="o_proj")


def model_and_params(cfg: Config, seed: int = 0):
  model = hf_llama.FlaxLlamaForCausalLM(cfg.hf_config, seed=seed)
  return model.module, model.params


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def main(argv=None):
  _hf_common.main(sys.modules[__name__], argv)


if __name__ == "__main__":
  main()
