"""A tiny byte LM with 3+ attention layers: MLA or GQA, layers scanned (nn.scan) or unrolled.

For the promises that must hold on models deeper than one attention layer (the exact clip).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from muonclip_jax.nn import GroupedQueryAttention, MultiHeadLatentAttention

VOCAB = 32


@dataclasses.dataclass(frozen=True)
class DeepConfig:
  attention: str = "mla"  # "mla" or "gqa"
  scan: bool = True
  num_layers: int = 3
  dim: int = 16
  dropout: float = 0.0

  def attn(self, name):
    if self.attention == "mla":
      return MultiHeadLatentAttention(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                      qk_rope_head_dim=4, v_head_dim=4, name=name)
    return GroupedQueryAttention(num_heads=4, num_kv_heads=2, head_dim=4, name=name)

  @property
  def layout(self):
    return self.attn(None).layout


class Block(nn.Module):
  cfg: DeepConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, _):
    x = x + self.cfg.attn("attn")(nn.RMSNorm(name="attn_norm")(x))
    x = nn.Dropout(self.cfg.dropout, deterministic=self.deterministic)(x)
    h = nn.Dense(2 * self.cfg.dim, use_bias=False, name="w_up")(nn.RMSNorm(name="mlp_norm")(x))
    return x + nn.Dense(self.cfg.dim, use_bias=False, name="w_down")(nn.gelu(h)), None


class DeepLM(nn.Module):
  cfg: DeepConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(VOCAB, cfg.dim, name="embed")(tokens)
    if cfg.scan:
      x, _ = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True, "dropout": True},
                     length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})(
                         cfg, self.deterministic, name="layers")(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = Block(cfg, self.deterministic, name=f"block_{i}")(x, None)
    return nn.Dense(VOCAB, use_bias=False, name="lm_head")(nn.RMSNorm(name="final_norm")(x))


def init_params(cfg: DeepConfig, seed: int = 0):
  """The params, from an init compiled once per config (eagerly, each call compiled it anew)."""
  return _jitted_init(cfg)(jax.random.key(seed))["params"]


@functools.cache
def _jitted_init(cfg: DeepConfig):
  return jax.jit(lambda key: DeepLM(cfg).init(key, jnp.zeros((1, 8), jnp.int32)))


def make_loss_fn(cfg: DeepConfig):
  """``loss_fn(params, tokens (B, T+1)[, rng]) -> (cross-entropy, intermediates)``."""

  def loss_fn(params, tokens, rng=None):
    model = DeepLM(cfg, deterministic=rng is None)
    rngs = {} if rng is None else {"dropout": rng}
    logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, state["intermediates"]

  return loss_fn


def batches(n: int = 2, batch: int = 4, seq: int = 8, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.integers(0, VOCAB, (batch, seq + 1)), jnp.int32) for _ in range(n)]
