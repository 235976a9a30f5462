"""Recipe 6: MuonClip on Hugging Face's Flax GPT-2 (``transformers<5``), patched in one line.

Hugging Face's Flax attention has no ``attention_fn`` hook: it imports Flax's
``dot_product_attention_weights`` into its module and calls it without ``module=``. The
line marked ``# MuonClip (1/4)`` replaces that import by ``muonclip_jax.nn``'s drop-in,
which returns the same weights and sows each head's max logit on the calling attention
module (``.../attn/max_logits``). The other marked lines declare how the fused ``c_attn``
kernel is stored, capture the ``intermediates`` and hand them to the optimizer.

``FlaxConv1D`` stores kernels torch-style, ``(out, in)``: ``c_attn`` is ``(3 * dim, dim)``,
query rows, then key rows, then value rows, each head-major, and its bias ``(3 * dim,)``.
``mc.Projection("c_attn", axes=("out", "in"))`` says so; QK-Clip scales the query and key
rows of a clipped head and never the value rows. Muon reads the same declaration: ``c_attn``
is one ``dim x 3 dim`` matrix (its parts or heads with ``muon_blocks=``), and ``c_proj``,
also ``(out, in)``, is declared so that it can be cut per head too. The token embedding
``wte`` (tied to the LM head) and ``wpe`` go to AdamW.

  python examples/recipe_hf_gpt2.py [--steps N]
"""

from __future__ import annotations

import dataclasses
import sys

import optax
import transformers.models.gpt2.modeling_flax_gpt2 as hf_gpt2
from transformers import GPT2Config

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
import _hf_common
from _hf_common import forward, loss_fn, make_step  # noqa: F401 (MuonClip 3/4 and 4/4 are there)
from _recipe_common import batches  # noqa: F401 (recipe.batches: the tests' data)

hf_gpt2.dot_product_attention_weights = mcnn.dot_product_attention_weights  # MuonClip (1/4): the patch


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 8

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads

  @property
  def hf_config(self) -> GPT2Config:
    return GPT2Config(vocab_size=self.vocab, n_positions=self.seq_len, n_embd=self.dim, n_layer=self.num_layers,
                      n_head=self.num_heads)

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (2/4): heads, and how the fused c_attn kernel is stored
    return mc.GQALayout(self.num_heads, self.num_heads, self.head_dim,
                        qkv=mc.Projection("c_attn", axes=("out", "in")), out=mc.Projection("c_proj", axes=("out", "in")))


def model_and_params(cfg: Config, seed: int = 0):
  model = hf_gpt2.FlaxGPT2LMHeadModel(cfg.hf_config, seed=seed)
  return model.module, model.params


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def main(argv=None):
  _hf_common.main(sys.modules[__name__], argv)


if __name__ == "__main__":
  main()
