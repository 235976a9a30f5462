"""Recipe 1: MuonClip on a Linen GPT built from ``flax.linen.MultiHeadDotProductAttention``.

The lines marked ``# MuonClip (n/4)`` are all this model needs beyond choosing the
optimizer: Flax's attention function swapped for ``muonclip_jax.nn.dot_product_attention``
(same output, plus each head's max logit), the layout that names Flax's ``query``/``key``
DenseGeneral kernels, and the ``intermediates`` collection handed from the forward pass to
the optimizer. The layout is Muon's declaration too: every ``(in, heads, head_dim)``
kernel (and the ``(heads, head_dim, out)`` output kernel) is one matrix, no ``matrix_axes``.

``Config(scan=True)`` stacks the blocks with ``nn.scan`` and gives every kernel logical
axis names (as sharded Linen models do); with ``metadata_params={nn.PARTITION_NAME:
"layers"}`` the stacked axis is named ``"layers"``, and Muon batches it.

  python examples/recipe_linen_gpt.py [--scan] [--steps N]
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
  scan: bool = False

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/4): heads, and the names of Flax's q/k projections
    return mc.GQALayout(self.num_heads, self.num_heads, self.dim // self.num_heads, query="query", key="key")


def _init(cfg: Config, *names: str):
  init = nn.initializers.lecun_normal()
  return nn.with_logical_partitioning(init, names) if cfg.scan else init


class Block(nn.Module):
  """Pre-norm block: causal multi-head attention and a GELU MLP."""

  cfg: Config
  attention_fn: Callable = dot_product_attention  # MuonClip (2/4): Flax's attention + max logits

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.cfg
    named = {}
    if cfg.scan:
      named = dict(kernel_init=_init(cfg, "embed", "heads", "kv"), out_kernel_init=_init(cfg, "heads", "kv", "embed"))
    attn = nn.MultiHeadDotProductAttention(cfg.num_heads, attention_fn=self.attention_fn, name="attn", **named)
    x = x + attn(nn.LayerNorm(name="ln_1")(x), mask=nn.make_causal_mask(x[..., 0]))
    h = nn.Dense(4 * cfg.dim, kernel_init=_init(cfg, "embed", "mlp"), name="fc")(nn.LayerNorm(name="ln_2")(x))
    return x + nn.Dense(cfg.dim, kernel_init=_init(cfg, "mlp", "embed"), name="proj")(nn.gelu(h)), None


class GPT(nn.Module):
  cfg: Config
  attention_fn: Callable = dot_product_attention

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.dim, name="embed")(tokens)
    x = x + nn.Embed(cfg.seq_len, cfg.dim, name="pos_embed")(jnp.arange(tokens.shape[-1]))[None]
    if cfg.scan:
      stack = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                      length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(cfg, self.attention_fn, name="layers")(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = Block(cfg, self.attention_fn, name=f"block_{i}")(x)
    return nn.Dense(cfg.vocab, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def loss_fn(params, model: GPT, tokens):
  # MuonClip (3/4): the forward pass returns the sown max logits
  logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, state["intermediates"]


def make_step(model: GPT, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, tokens)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=intermediates)  # MuonClip (4/4)
    return optax.apply_updates(params, updates), opt_state, loss, intermediates

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scan", action="store_true")
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = Config(scan=args.scan)
  model, opt = GPT(cfg), optimizer(cfg)
  train_linen(model, opt, make_step, cfg, args.steps)


if __name__ == "__main__":
  main()
