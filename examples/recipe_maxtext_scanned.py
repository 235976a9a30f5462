"""Recipe 5: MuonClip on a MaxText-style model: scanned layers on axis 1, logical names, its own maxima.

The model is written the way MaxText writes its decoder (read from its design, not its
code): every kernel carries logical axis names (``("embed", "q_heads", "kv")``, ...), the
decoder layers are stacked with ``nn.scan`` and ``param_scan_axis=1`` (the ``"layers"``
axis is inserted *second*: ``query/kernel`` is ``(embed, layers, q_heads, kv)``), the
attention is grouped-query with DenseGeneral ``query``/``key``/``value``/``out``, and the
attention's ``attention_op`` child writes its own ``max_logits`` of shape ``(batch,
heads)`` by assignment (``(layers, batch, heads)`` once scanned), as MaxText does.

The lines marked ``# MuonClip (n/3)`` are all it needs beyond choosing the optimizer: the
layout, which needs no axes (the kernels' logical names give them: ``"layers"`` anywhere,
``"embed"`` the fan-in, ``q_heads``/``kv_heads`` and ``kv``/``kv_head_dim`` the heads);
the forward pass returning ``intermediates``; and ``muonclip_jax.reduce_max_logits``, which
takes the maximum over the batch axis of the ``attention_op`` maxima and moves them to the
attention module. Muon reads each kernel's matrix from the same names (the parameters stay
boxed), so no ``matrix_axes`` either. ``clip_mode="query"`` scales only the clipped query
heads, so with shared key heads no other head changes (``GQALayout``).

  python examples/recipe_maxtext_scanned.py [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import muonclip_jax as mc
from muonclip_jax.nn import apply_rope
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
  def layout(self) -> mc.GQALayout:  # MuonClip (1/3): heads and the q/k names; axes from logical names
    return mc.GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, "query", query="query", key="key")


def _named(*names: str):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class AttentionOp(nn.Module):
  """Causal grouped-query attention; writes the per-(batch, head) max scaled logit, as MaxText."""

  @nn.compact
  def __call__(self, q, k, v):
    b, t, h, d = q.shape
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    if self.is_mutable_collection("intermediates"):  # MaxText's own capture, (batch, heads)
      max_logits = jnp.max(jnp.where(causal, logits, -jnp.inf), axis=(2, 3))
      self.variable("intermediates", "max_logits", jnp.zeros, (b, h), jnp.float32).value = max_logits
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])

    def proj(heads, head_names, name):
      return nn.DenseGeneral((heads, cfg.head_dim), use_bias=False, kernel_init=_named("embed", *head_names),
                             name=name)(x)

    q = apply_rope(proj(cfg.num_heads, ("q_heads", "kv"), "query"), positions)
    k = apply_rope(proj(cfg.num_kv_heads, ("kv_heads", "kv_head_dim"), "key"), positions)
    v = proj(cfg.num_kv_heads, ("kv_heads", "kv_head_dim"), "value")
    out = AttentionOp(name="attention_op")(q, k, v)
    return nn.DenseGeneral(cfg.dim, axis=(-2, -1), use_bias=False, kernel_init=_named("heads", "kv", "embed"),
                           name="out")(out)


class DecoderLayer(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    norm = lambda name: nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),  # noqa: E731
                                   name=name)
    x = x + Attention(cfg, name="self_attention")(norm("pre_self_attention_norm")(x))
    h = nn.Dense(cfg.mlp_dim, use_bias=False, kernel_init=_named("embed", "mlp"), name="wi")(norm("post_norm")(x))
    return x + nn.Dense(cfg.dim, use_bias=False, kernel_init=_named("mlp", "embed"), name="wo")(nn.silu(h)), None


class Transformer(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    embed = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    x = nn.Embed(cfg.vocab, cfg.dim, embedding_init=embed, name="token_embedder")(tokens)
    layers = nn.scan(DecoderLayer, variable_axes={"params": 1, "intermediates": 0},  # param_scan_axis=1
                     split_rngs={"params": True}, length=cfg.num_layers,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(cfg, name="layers")(x, None)
    x = nn.RMSNorm(name="decoder_norm")(x)
    return nn.Dense(cfg.vocab, use_bias=False, kernel_init=_named("embed", "vocab"), name="logits_dense")(x)


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def loss_fn(params, model: Transformer, tokens):
  # MuonClip (2/3): the forward pass returns the intermediates (MaxText's own max_logits)
  logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, state["intermediates"]


def make_step(model: Transformer, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, tokens)
    max_logits = mc.reduce_max_logits(intermediates)  # MuonClip (3/3): max over batch, at the attention
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=max_logits)
    return optax.apply_updates(params, updates), opt_state, loss, max_logits

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = Config()
  train_linen(Transformer(cfg), optimizer(cfg), make_step, cfg, args.steps)


if __name__ == "__main__":
  main()
