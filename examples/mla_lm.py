"""A small byte-level DeepSeek-style language model built on the library's MLA module.

Decoder-only: byte embedding, ``num_layers`` pre-norm blocks stacked with ``nn.scan``
(RMSNorm, attention, RMSNorm, SwiGLU MLP), final RMSNorm, untied LM head. The attention is
``MultiHeadLatentAttention`` (``attention="mla"``, the default) or, with ``attention="gqa"``,
grouped-query attention: the library's ``GroupedQueryAttention``, or with ``qk_norm=True``
the same projections with QK-Norm (RMSNorm over each head's query and key, before RoPE;
Dehghani et al. arXiv 2302.05442, as in OLMo 2 and Qwen3). MLA has no plain QK-Norm: its
rotary key is one head shared by all heads. Used by ``train_mla_lm.py``,
``stability_study.py`` and the tests of the train step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import muonclip_jax as mc
from muonclip_jax.nn import GroupedQueryAttention, MultiHeadLatentAttention, apply_rope, attention

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class LMConfig:
  dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  q_lora_rank: int = 64
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 16
  v_head_dim: int = 16
  mlp_dim: int = 256
  impl: str = "dense"  # muonclip_jax.nn.attention implementation
  dtype: Any = None
  attention: str = "mla"  # "mla" or "gqa"
  num_kv_heads: int = 2  # gqa only
  head_dim: int = 32  # gqa only
  qk_norm: bool = False  # gqa only: RMSNorm on each head's queries and keys

  def __post_init__(self):
    if self.attention not in ("mla", "gqa"):
      raise ValueError(f"LMConfig.attention must be 'mla' or 'gqa', got {self.attention!r}")
    if self.qk_norm and self.attention != "gqa":
      raise ValueError("LMConfig.qk_norm needs attention='gqa' (MLA's rotary key is shared by all heads)")

  @property
  def layout(self) -> mc.MLALayout | mc.GQALayout:
    if self.attention == "gqa":
      return mc.GQALayout(self.num_heads, self.num_kv_heads, self.head_dim, value="wv", out="wo")
    return mc.MLALayout(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, out="wo")


def _kernel(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


def _rms_norm(cfg: LMConfig, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(dtype=cfg.dtype, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), name=name)


class QKNormAttention(nn.Module):
  """GQA whose per-head queries and keys are RMS-normalized (learned scale) before RoPE.

  ``logit = (g_q * q / rms(q)) . (g_k * k / rms(k)) / sqrt(D)``: bounded by
  ``|g_q| |g_k| sqrt(D)``, so logits grow only through the two norm scales. Same kernels,
  names and logical axes as ``GroupedQueryAttention``; sows ``max_logits`` ``(H,)``.
  """

  cfg: LMConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, dim = x.shape
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def dense(features, names, name, inp):
      return nn.Dense(features, use_bias=False, dtype=cfg.dtype, kernel_init=_kernel(*names), name=name)(inp)

    q = _rms_norm(cfg, "q_norm")(dense(h * d, ("embed", "heads"), "wq", x).reshape(b, t, h, d))
    k = _rms_norm(cfg, "k_norm")(dense(hkv * d, ("embed", "kv_heads"), "wk", x).reshape(b, t, hkv, d))
    v = dense(hkv * d, ("embed", "kv_heads"), "wv", x).reshape(b, t, hkv, d)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q, k = apply_rope(q, positions), apply_rope(k, positions)
    capture = self.is_mutable_collection("intermediates")
    out, max_logits = attention(q, k, v, softmax_scale=d**-0.5, impl=cfg.impl, is_causal=True,
                                return_max_logits=capture)
    if capture:
      self.sow("intermediates", "max_logits", max_logits,
               init_fn=lambda: jnp.full((h,), -jnp.inf, jnp.float32), reduce_fn=jnp.maximum)
    return dense(dim, ("heads", "embed"), "wo", out.reshape(b, t, h * d))


def _attention(cfg: LMConfig) -> nn.Module:
  if cfg.attention == "mla":
    return MultiHeadLatentAttention(
        num_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        impl=cfg.impl,
        dtype=cfg.dtype,
        name="attn",
    )
  if cfg.qk_norm:
    return QKNormAttention(cfg, name="attn")
  return GroupedQueryAttention(
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      impl=cfg.impl, dtype=cfg.dtype, kernel_init=nn.initializers.lecun_normal(), name="attn",
  )


class Block(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    x = x + _attention(cfg)(_rms_norm(cfg, "attn_norm")(x))
    h = _rms_norm(cfg, "mlp_norm")(x)
    dense = functools.partial(nn.Dense, use_bias=False, dtype=cfg.dtype)
    gate = dense(cfg.mlp_dim, kernel_init=_kernel("embed", "mlp"), name="w_gate")(h)
    up = dense(cfg.mlp_dim, kernel_init=_kernel("embed", "mlp"), name="w_up")(h)
    x = x + dense(x.shape[-1], kernel_init=_kernel("mlp", "embed"), name="w_down")(nn.silu(gate) * up)
    return x, None


class MLALM(nn.Module):
  """``apply(variables, tokens (B, T) int32) -> logits (B, T, 256)``."""

  cfg: LMConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(
        VOCAB, cfg.dim, embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
        dtype=cfg.dtype, name="embed",
    )(tokens)
    x, _ = nn.scan(
        Block,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, name="layers")(x, None)
    x = _rms_norm(cfg, "final_norm")(x)
    logits = nn.Dense(VOCAB, use_bias=False, dtype=cfg.dtype, kernel_init=_kernel("embed", "vocab"), name="lm_head")(x)
    return logits.astype(jnp.float32)


def init_params(cfg: LMConfig, seed: int, seq_len: int = 16) -> Any:
  """Float32 params, unboxed (the logical axis names stay available via ``logical_axes``)."""
  variables = MLALM(cfg).init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))
  return nn.unbox(variables["params"])


def logical_axes(cfg: LMConfig, seq_len: int = 16) -> Any:
  """The logical axis names of every parameter (``nn.get_partition_spec`` of the boxes)."""
  abstract = jax.eval_shape(lambda: MLALM(cfg).init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32)))
  return nn.get_partition_spec(abstract["params"])


def make_loss_fn(cfg: LMConfig):
  """``loss_fn(params, tokens (B, T+1)) -> (mean next-byte cross-entropy, intermediates)``."""
  model = MLALM(cfg)

  def loss_fn(params, tokens):
    logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, state["intermediates"]

  return loss_fn


# Every Muon-routed kernel of this model is (in, out) or stacked (layers, in, out): the last
# two axes are the matrix, leading axes are a stack of independent matrices.
MATRIX_AXES = mc.MatrixAxes((-2,), (-1,))
