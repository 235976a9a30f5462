"""Recipe 3: MuonClip on a Llama-style Linen model (GQA, RoPE, ``q_proj/k_proj/v_proj/o_proj``).

The lines marked ``# MuonClip (n/4)`` are all this model needs beyond choosing the
optimizer: the attention call goes through ``muonclip_jax.nn.dot_product_attention``
(Flax's arguments, grouped-query heads allowed; it sows the per-head max logits on the
module that calls it), the layout names the ``q_proj``/``k_proj`` projections, and the
``intermediates`` collection goes from the forward pass to the optimizer. The kernels are
2-D ``(in, heads*head_dim)``, so Muon needs no ``matrix_axes``.

  python examples/recipe_llama_gqa.py [--steps N]
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
from muonclip_jax.nn import apply_rope, dot_product_attention
from _recipe_common import batches, train_linen  # noqa: F401 (recipe.batches: the tests' data)


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8
  mlp_dim: int = 64
  num_layers: int = 2
  seq_len: int = 16

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/4): heads, and the names of the q/k projections
    return mc.GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, query="q_proj", key="k_proj",
                        value="v_proj", out="o_proj")


class Attention(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention  # MuonClip (2/4): Flax's attention + max logits

  @nn.compact
  def __call__(self, x, positions):
    cfg, (b, t, _) = self.cfg, x.shape
    dense = lambda n, name: nn.Dense(n * cfg.head_dim, use_bias=False, name=name)  # noqa: E731
    q = apply_rope(dense(cfg.num_heads, "q_proj")(x).reshape(b, t, cfg.num_heads, cfg.head_dim), positions)
    k = apply_rope(dense(cfg.num_kv_heads, "k_proj")(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions)
    v = dense(cfg.num_kv_heads, "v_proj")(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    out = self.attention_fn(q, k, v, mask=nn.make_causal_mask(x[..., 0]))
    return nn.Dense(cfg.dim, use_bias=False, name="o_proj")(out.reshape(b, t, -1))


class DecoderLayer(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention

  @nn.compact
  def __call__(self, x, positions):
    cfg = self.cfg
    x = x + Attention(cfg, self.attention_fn, name="self_attn")(nn.RMSNorm(name="input_layernorm")(x), positions)
    h = nn.RMSNorm(name="post_attention_layernorm")(x)
    gate = nn.Dense(cfg.mlp_dim, use_bias=False, name="gate_proj")(h)
    up = nn.Dense(cfg.mlp_dim, use_bias=False, name="up_proj")(h)
    return x + nn.Dense(cfg.dim, use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Llama(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.dim, name="embed_tokens")(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    for i in range(cfg.num_layers):
      x = DecoderLayer(cfg, self.attention_fn, name=f"layers_{i}")(x, positions)
    return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm")(x))


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def loss_fn(params, model: Llama, tokens):
  # MuonClip (3/4): the forward pass returns the sown max logits
  logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, state["intermediates"]


def make_step(model: Llama, opt: optax.GradientTransformationExtraArgs):
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
  model, opt = Llama(cfg), optimizer(cfg)
  train_linen(model, opt, make_step, cfg, args.steps)


if __name__ == "__main__":
  main()
