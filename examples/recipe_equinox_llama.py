"""Recipe: MuonClip on a hand-written Equinox Llama (GQA, RoPE), layers stacked by
``eqx.filter_vmap`` and run by ``lax.scan``.

The lines marked ``# MuonClip (n/5)`` are all this model needs beyond choosing the
optimizer: the layout names the ``wq``/``wk``/``wv``/``wo`` projections by their modules
alone (``eqx.nn.Linear`` modules: their ``weight`` and its ``(layers, out, in)`` storage are
read from the type; the output projection's heads side is its ``in``), the attention goes through
``muonclip_jax.nn.attention`` (pure; it returns the per-head max logits), the scan stacks
each layer's maxima into ``(layers, heads)`` returned keyed like the params, reduced over
the batch and handed to the optimizer. Muon needs no ``matrix_axes`` (the stacked
``Linear`` weights are batched by layer) and the routing no ``labels`` (the stacked
``(layers, dim)`` RMSNorm gains go to AdamW, as their type says). With the same layout,
``optimizer(cfg, muon_blocks="head+out")`` orthogonalizes each head of the four projections
on its own (GQA groups: ``"group:kv+out"``).

  python examples/recipe_equinox_llama.py [--steps N]
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
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 4
  mlp_dim: int = 32
  num_layers: int = 2
  seq_len: int = 8

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/5): heads, and the names of the projections
    return mc.GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, query="wq", key="wk", value="wv", out="wo")


class Attention(eqx.Module):
  wq: eqx.nn.Linear
  wk: eqx.nn.Linear
  wv: eqx.nn.Linear
  wo: eqx.nn.Linear
  cfg: Config = eqx.field(static=True)

  def __init__(self, cfg: Config, *, key):
    kq, kk, kv, ko = jax.random.split(key, 4)
    self.wq = eqx.nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, use_bias=False, key=kq)
    self.wk = eqx.nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, use_bias=False, key=kk)
    self.wv = eqx.nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, use_bias=False, key=kv)
    self.wo = eqx.nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, use_bias=False, key=ko)
    self.cfg = cfg

  def qkv(self, x):  # x: (seq, dim) -> rotated q (seq, heads, head_dim), k and v (seq, kv_heads, head_dim)
    seq, cfg = x.shape[0], self.cfg
    q = jax.vmap(self.wq)(x).reshape(1, seq, cfg.num_heads, cfg.head_dim)
    k = jax.vmap(self.wk)(x).reshape(1, seq, cfg.num_kv_heads, cfg.head_dim)
    v = jax.vmap(self.wv)(x).reshape(seq, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.arange(seq)[None]
    return mnn.apply_rope(q, positions)[0], mnn.apply_rope(k, positions)[0], v

  def __call__(self, x):
    q, k, v = self.qkv(x)
    out, max_logits = mnn.attention(q[None], k[None], v[None], softmax_scale=self.cfg.head_dim ** -0.5,
                                    is_causal=True, return_max_logits=True)  # MuonClip (2/5)
    return jax.vmap(self.wo)(out[0].reshape(x.shape[0], -1)), max_logits


class Block(eqx.Module):
  attn_norm: eqx.nn.RMSNorm
  attn: Attention
  mlp_norm: eqx.nn.RMSNorm
  gate: eqx.nn.Linear
  up: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, cfg: Config, *, key):
    ka, kg, ku, kd = jax.random.split(key, 4)
    self.attn_norm = eqx.nn.RMSNorm(cfg.dim, use_bias=False)
    self.attn = Attention(cfg, key=ka)
    self.mlp_norm = eqx.nn.RMSNorm(cfg.dim, use_bias=False)
    self.gate = eqx.nn.Linear(cfg.dim, cfg.mlp_dim, use_bias=False, key=kg)
    self.up = eqx.nn.Linear(cfg.dim, cfg.mlp_dim, use_bias=False, key=ku)
    self.down = eqx.nn.Linear(cfg.mlp_dim, cfg.dim, use_bias=False, key=kd)

  def __call__(self, x):
    out, max_logits = self.attn(jax.vmap(self.attn_norm)(x))
    x = x + out
    h = jax.vmap(self.mlp_norm)(x)
    return x + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(h)) * jax.vmap(self.up)(h)), max_logits


class Llama(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: Block  # every array with a leading (num_layers,) axis
  norm: eqx.nn.RMSNorm
  lm_head: eqx.nn.Linear

  def __init__(self, cfg: Config, *, key):
    k_embed, k_head, k_blocks = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(cfg.vocab, cfg.dim, key=k_embed)
    self.blocks = eqx.filter_vmap(lambda k: Block(cfg, key=k))(jax.random.split(k_blocks, cfg.num_layers))
    self.norm = eqx.nn.RMSNorm(cfg.dim, use_bias=False)
    self.lm_head = eqx.nn.Linear(cfg.dim, cfg.vocab, use_bias=False, key=k_head)

  def __call__(self, tokens):  # tokens: (seq,)
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)
    x, max_logits = jax.lax.scan(lambda x, layer: eqx.combine(layer, static)(x), jax.vmap(self.embed)(tokens),
                                 dynamic)
    logits = jax.vmap(self.lm_head)(jax.vmap(self.norm)(x))
    return logits, {"blocks": {"attn": {"max_logits": max_logits}}}  # MuonClip (3/5): (layers, heads), like the params


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0, muon_blocks="matrix") -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau, muon_blocks=muon_blocks)


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
  params, static = eqx.partition(Llama(cfg, key=jax.random.key(0)), eqx.is_array)
  opt = optimizer(cfg)
  opt_state, jitted = opt.init(params), make_step(static, opt)

  def step(tokens):
    nonlocal params, opt_state
    params, opt_state, loss, maxima = jitted(params, opt_state, tokens)
    return loss, maxima

  train(step, batches(cfg, batch_size=8), args.steps)


if __name__ == "__main__":
  main()
