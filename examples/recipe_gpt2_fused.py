"""Recipe 4: MuonClip on a GPT-2-style Linen model whose q, k and v share one ``c_attn`` kernel.

The lines marked ``# MuonClip (n/4)`` are all this model needs beyond choosing the
optimizer. ``GQALayout(..., qkv="c_attn")`` names the fused projection: its kernel
``(dim, 3*dim)`` holds the query columns, then the key columns, then the value columns, each
head-major (GPT-2's layout); QK-Clip scales query and key columns of a head and never the
value columns. The fused kernel is one ``dim x 3*dim`` matrix for Muon, as any 2-D kernel.
GPT-2 ties the LM head to the token embedding ``wte`` (AdamW, as ``wpe``).

  python examples/recipe_gpt2_fused.py [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import muonclip_jax as mc
from muonclip_jax.nn import dot_product_attention
from _recipe_common import batches, train_linen  # noqa: F401 (recipe.batches: the tests' data)


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  seq_len: int = 16

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/4): heads, and the name of the fused projection
    return mc.GQALayout(self.num_heads, self.num_heads, self.dim // self.num_heads, qkv="c_attn", out="c_proj")


class Attention(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention  # MuonClip (2/4): Flax's attention + max logits

  @nn.compact
  def __call__(self, x):
    cfg, (b, t, d) = self.cfg, x.shape
    qkv = nn.Dense(3 * d, name="c_attn")(x)
    q, k, v = (y.reshape(b, t, cfg.num_heads, d // cfg.num_heads) for y in jnp.split(qkv, 3, axis=-1))
    out = self.attention_fn(q, k, v, mask=nn.make_causal_mask(x[..., 0]))
    return nn.Dense(d, name="c_proj")(out.reshape(b, t, d))


class Block(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.cfg, self.attention_fn, name="attn")(nn.LayerNorm(name="ln_1")(x))
    h = nn.gelu(nn.Dense(4 * self.cfg.dim, name="c_fc")(nn.LayerNorm(name="ln_2")(x)))
    return x + nn.Dense(self.cfg.dim, name="c_proj")(h)


class GPT2(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    wte = nn.Embed(cfg.vocab, cfg.dim, name="wte")
    x = wte(tokens) + nn.Embed(cfg.seq_len, cfg.dim, name="wpe")(jnp.arange(tokens.shape[-1]))[None]
    for i in range(cfg.num_layers):
      x = Block(cfg, self.attention_fn, name=f"h_{i}")(x)
    return wte.attend(nn.LayerNorm(name="ln_f")(x))


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def loss_fn(params, model: GPT2, tokens):
  # MuonClip (3/4): the forward pass returns the sown max logits
  logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, state["intermediates"]


def make_step(model: GPT2, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, tokens)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=intermediates)  # MuonClip (4/4)
    return optax.apply_updates(params, updates), opt_state, loss, intermediates

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = Config()
  model, opt = GPT2(cfg), optimizer(cfg)
  train_linen(model, opt, make_step, cfg, args.steps)


if __name__ == "__main__":
  main()
