"""Recipe 2: MuonClip on an NNX GPT built from ``flax.nnx.MultiHeadAttention``, with ``nnx.Optimizer``.

The lines marked ``# MuonClip (n/4)`` are all this model needs beyond choosing the
optimizer. ``nnx.MultiHeadAttention`` hands its module to the attention function only when
called with ``sow_weights=True``; with ``muonclip_jax.nn.dot_product_attention`` that flag
sows the per-head max logits (not the attention weights) inside
``nnx.capture(model, nnx.Intermediate)``.

  python examples/recipe_nnx_gpt.py [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import optax
from flax import nnx

import muonclip_jax as mc
from muonclip_jax.nn import dot_product_attention
from _recipe_common import batches, train


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 16

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/4): heads, and the names of the q/k projections
    return mc.GQALayout(self.num_heads, self.num_heads, self.dim // self.num_heads, query="query", key="key")


class Block(nnx.Module):
  def __init__(self, cfg: Config, *, attention_fn: Callable, rngs: nnx.Rngs):
    self.ln_1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    # MuonClip (2/4): Flax's attention + max logits
    self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.dim, attention_fn=attention_fn, decode=False, rngs=rngs)
    self.ln_2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.fc = nnx.Linear(cfg.dim, 4 * cfg.dim, rngs=rngs)
    self.proj = nnx.Linear(4 * cfg.dim, cfg.dim, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln_1(x), is_causal=True, sow_weights=True)  # MuonClip (3/4): hands over the module
    return x + self.proj(nnx.gelu(self.fc(self.ln_2(x))))


class GPT(nnx.Module):
  def __init__(self, cfg: Config, *, attention_fn: Callable = dot_product_attention, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.seq_len, cfg.dim, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention_fn=attention_fn, rngs=rngs) for _ in range(cfg.num_layers)])
    self.ln_f = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[-1]))[None]
    for block in self.blocks:
      x = block(x)
    return self.lm_head(self.ln_f(x))


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)  # the layout gives Muon's matrices


def loss_fn(model: GPT, tokens):
  logits, intermediates = nnx.capture(model, nnx.Intermediate)(tokens[:, :-1])  # MuonClip (4/4)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, intermediates


@nnx.jit
def step(model: GPT, opt: nnx.Optimizer, tokens):
  (loss, intermediates), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
  opt.update(model, grads, max_logits=intermediates)  # (5/5, cont.) the maxima go to the clip
  return loss, intermediates


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = Config()
  model = GPT(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optimizer(cfg), wrt=nnx.Param)
  train(lambda tokens: step(model, opt, tokens), batches(cfg, batch_size=8), args.steps)


if __name__ == "__main__":
  main()
