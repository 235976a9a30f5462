"""Recipe 7: MuonClip on a Gemma-style Linen model: einsum kernels ``w``, head-first axes, fused k|v.

Written the way Google DeepMind's ``gemma`` writes attention: ``Einsum`` modules whose kernel
leaf is ``w``, ``q_einsum/w`` ``(heads, embed, head_dim)``, ``kv_einsum/w``
``(2, kv_heads, embed, head_dim)`` (k then v along the leading axis), ``attn_vec_einsum/w``
``(heads, head_dim, embed)``, RoPE, and logits computed by hand
(``einsum("BTNH,BSNH->BTNS")``). Two variants, chosen in ``Config``:

* ``soft_cap``: Gemma 2's ``cap * tanh(logits / cap)``. The max logit is sown *before* the
  cap: the cap hides the growth of ``q . k`` but does not stop it (a capture after it could
  never exceed the cap).
* ``qk_norm``: Gemma 3's RMSNorm of each head's q and k (``_query_norm``/``_key_norm``,
  scale ``(head_dim,)`` shared by heads, applied as ``x * (1 + scale)``, hence
  ``norm_scale_offset=1.0``; Gemma 4's QK-norm applies ``x * scale``, offset 0). Scaling the
  kernels would be undone by the norm, so the layout names the norms and the clip scales
  their ``scale`` (per layer, by the smallest gamma over its heads, which is weaker than
  per-head clipping; see ``muonclip_jax.GQALayout``).

The lines marked ``# MuonClip`` are all it needs beyond choosing the optimizer: one call
to ``muonclip_jax.nn.sow_max_logits`` where the logits are computed, the layout that
declares the storage (``mc.Projection``; Muon reads its matrices from the same
declarations), the captured ``intermediates`` and handing them to the optimizer.

  python examples/recipe_gemma.py [--steps N] [--soft-cap CAP] [--qk-norm]
"""

from __future__ import annotations

import argparse
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
from _recipe_common import batches, train_linen  # noqa: F401 (recipe.batches: the tests' data)

K_MASK = -2.3819763e38  # gemma's masked-logit value


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  dim: int = 32
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8
  mlp_dim: int = 96
  num_layers: int = 2
  seq_len: int = 8
  soft_cap: float | None = None
  qk_norm: bool = False

  @property
  def layout(self) -> mc.GQALayout:  # MuonClip (1/4): how the q, k|v and output kernels are stored
    norms = dict(query_norm="_query_norm", key_norm="_key_norm", norm_scale_offset=1.0) if self.qk_norm else {}
    return mc.GQALayout(
        self.num_heads, self.num_kv_heads, self.head_dim,
        query=mc.Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
        key=mc.Projection("kv_einsum", leaf="w", axes=("parts", "heads", "in", "head_dim"), parts=("k", "v")),
        out=mc.Projection("attn_vec_einsum", leaf="w", axes=("in", "in", "out")),  # (heads, head_dim, embed)
        **norms)


class Einsum(nn.Module):
  shape: tuple[int, ...]

  @nn.compact
  def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
    return jnp.einsum(eqn, x, self.param("w", nn.initializers.normal(0.5), self.shape))


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def apply_rope(x: jax.Array, positions: jax.Array, max_wavelength: float = 10_000.0) -> jax.Array:
  """Gemma's rotary embedding of ``x`` ``(B, T, N, H)``: halves rotated as pairs."""
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
  angle = (positions[..., None] / timescale)[..., None, :]  # (B, T, 1, H/2)
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, positions, mask):
    cfg = self.cfg
    q = Einsum((cfg.num_heads, cfg.dim, cfg.head_dim), name="q_einsum")("BTD,NDH->BTNH", x)
    k, v = Einsum((2, cfg.num_kv_heads, cfg.dim, cfg.head_dim), name="kv_einsum")("BSD,CKDH->CBSKH", x)
    if cfg.qk_norm:
      q, k = RMSNorm(name="_query_norm")(q), RMSNorm(name="_key_norm")(k)
    q = apply_rope(q, positions) * cfg.head_dim ** -0.5
    k = apply_rope(k, positions)
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BTNS", q, k)
    mcnn.sow_max_logits(self, logits, mask=mask[:, :, None, :], head_axis=2)  # MuonClip (2/4): before the cap
    if cfg.soft_cap is not None:
      logits = jnp.tanh(logits / cfg.soft_cap) * cfg.soft_cap
    logits = jnp.where(mask[:, :, None, :], logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1)
    encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, v)
    return Einsum((cfg.num_heads, cfg.head_dim, cfg.dim), name="attn_vec_einsum")("BTNH,NHD->BTD", encoded)


class Block(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, positions, mask):
    cfg = self.cfg
    x = x + Attention(cfg, name="attn")(RMSNorm(name="pre_attention_norm")(x), positions, mask)
    h = RMSNorm(name="pre_ffw_norm")(x)
    h = nn.gelu(Einsum((cfg.dim, cfg.mlp_dim), name="gating")("BTD,DF->BTF", h))
    return x + Einsum((cfg.mlp_dim, cfg.dim), name="linear")("BTF,FD->BTD", h)


class Gemma(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    embedder = self.param("embedder", nn.initializers.normal(cfg.dim ** -0.5), (cfg.vocab, cfg.dim))
    x = embedder[tokens] * jnp.sqrt(cfg.dim)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    mask = jnp.tril(jnp.ones((tokens.shape[-1],) * 2, bool))[None]  # (1, T, S)
    for i in range(cfg.num_layers):
      x = Block(cfg, name=f"layer_{i}")(x, positions, mask)
    return RMSNorm(name="final_norm")(x) @ embedder.T  # tied embedding


def optimizer(cfg: Config, learning_rate=3e-3, tau=30.0) -> optax.GradientTransformationExtraArgs:
  return mc.muonclip(learning_rate, layout=cfg.layout, qk_clip_threshold=tau)


def loss_fn(params, model: Gemma, tokens):
  # MuonClip (3/4): the forward pass returns the sown max logits
  logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, state["intermediates"]


def make_step(model: Gemma, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, tokens)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=intermediates)  # MuonClip (4/4)
    return optax.apply_updates(params, updates), opt_state, loss, intermediates

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--soft-cap", type=float, default=None)
  parser.add_argument("--qk-norm", action="store_true")
  args = parser.parse_args(argv)
  cfg = Config(soft_cap=args.soft_cap, qk_norm=args.qk_norm)
  model, opt = Gemma(cfg), optimizer(cfg)
  train_linen(model, opt, make_step, cfg, args.steps)


if __name__ == "__main__":
  main()
