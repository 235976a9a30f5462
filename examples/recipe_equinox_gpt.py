"""Recipe: MuonClip on an Equinox GPT built from ``equinox.nn.MultiheadAttention``.

The lines marked ``# MuonClip (n/5)`` are all this model needs beyond choosing the
optimizer: the layout read from the attention module (its ``query_proj``/``key_proj``
``Linear`` weights, stored ``(out, in)``), the attention called through
``muonclip_jax.nn.equinox_attention`` (the module's own output, and its per-head max
logits), and the maxima returned keyed like the params, reduced over the batch and handed
to the optimizer. Muon needs no ``matrix_axes`` and the routing no ``labels``: both read
each parameter's role from its layer's type (``Linear`` weights to Muon; biases, norm gains
and ``Embedding`` tables to AdamW).

  python examples/recipe_equinox_gpt.py [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import muonclip_jax as mc
from muonclip_jax import nn as mnn
from _recipe_common import batches, train


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 16
  num_heads: int = 2
  mlp_dim: int = 32
  num_layers: int = 2
  seq_len: int = 8


class Block(eqx.Module):
  ln_1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  ln_2: eqx.nn.LayerNorm
  fc: eqx.nn.Linear
  proj: eqx.nn.Linear

  def __init__(self, cfg: Config, *, key):
    k_attn, k_fc, k_proj = jax.random.split(key, 3)
    self.ln_1, self.ln_2 = eqx.nn.LayerNorm(cfg.dim), eqx.nn.LayerNorm(cfg.dim)
    self.attn = eqx.nn.MultiheadAttention(cfg.num_heads, cfg.dim, use_query_bias=True, use_value_bias=True,
                                          use_output_bias=True, key=k_attn)  # a key bias shifts no softmax
    self.fc = eqx.nn.Linear(cfg.dim, cfg.mlp_dim, key=k_fc)
    self.proj = eqx.nn.Linear(cfg.mlp_dim, cfg.dim, key=k_proj)

  def __call__(self, x, mask):  # x: (seq, dim), one sequence
    h = jax.vmap(self.ln_1)(x)
    out, max_logits = mnn.equinox_attention(self.attn, h, h, h, mask)  # MuonClip (2/5): output and maxima
    x = x + out
    return x + jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln_2)(x)))), max_logits


class GPT(eqx.Module):
  embed: eqx.nn.Embedding
  pos_embed: eqx.nn.Embedding
  blocks: list[Block]
  ln_f: eqx.nn.LayerNorm
  lm_head: eqx.nn.Linear

  def __init__(self, cfg: Config, *, key):
    k_embed, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + cfg.num_layers)
    self.embed = eqx.nn.Embedding(cfg.vocab, cfg.dim, key=k_embed)
    self.pos_embed = eqx.nn.Embedding(cfg.seq_len, cfg.dim, key=k_pos)
    self.blocks = [Block(cfg, key=k) for k in k_blocks]
    self.ln_f = eqx.nn.LayerNorm(cfg.dim)
    self.lm_head = eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, key=k_head)

  def __call__(self, tokens):  # tokens: (seq,)
    seq = tokens.shape[0]
    x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos_embed)(jnp.arange(seq))
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    maxima = []
    for block in self.blocks:
      x, max_logits = block(x, mask)
      maxima.append({"attn": {"max_logits": max_logits}})  # MuonClip (3/5): keyed like the params
    return jax.vmap(self.lm_head)(jax.vmap(self.ln_f)(x)), {"blocks": maxima}


def layout(model: GPT) -> mc.GQALayout:
  return mc.GQALayout.from_equinox(model.blocks[0].attn)  # MuonClip (1/5): heads and projections


def optimizer(model: GPT, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=layout(model), qk_clip_threshold=tau)


def loss_fn(params, static, tokens):
  logits, maxima = jax.vmap(eqx.combine(params, static))(tokens[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, jax.tree.map(lambda m: m.max(axis=0), maxima)  # MuonClip (4/5): the maximum over the batch


def make_step(static, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, maxima), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, static, tokens)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=maxima)  # MuonClip (5/5)
    return optax.apply_updates(params, updates), opt_state, loss, maxima

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = Config()
  model = GPT(cfg, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  opt = optimizer(model)
  opt_state, jitted = opt.init(params), make_step(static, opt)

  def step(tokens):
    nonlocal params, opt_state
    params, opt_state, loss, maxima = jitted(params, opt_state, tokens)
    return loss, maxima

  train(step, batches(cfg, batch_size=8), args.steps)


if __name__ == "__main__":
  main()
