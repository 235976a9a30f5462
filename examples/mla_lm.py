"""A small byte-level DeepSeek-style language model built on the library's MLA module.

Decoder-only: byte embedding, ``num_layers`` pre-norm blocks stacked with ``nn.scan``
(RMSNorm, attention, RMSNorm, SwiGLU MLP or mixture of experts), final RMSNorm, untied LM
head. With ``num_experts > 0`` every block's MLP is a DeepSeek-V3 / Kimi K2 style MoE
(``MoE``): a shared expert plus ``top_k`` of ``num_experts`` routed experts, sigmoid gate
scores, and the auxiliary-loss-free balancing rule (``update_routing_bias``). The attention is
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
  num_experts: int = 0  # routed experts per block; 0: a dense SwiGLU MLP of width mlp_dim
  top_k: int = 2  # routed experts per token (MoE only)
  expert_dim: int = 64  # hidden width of each routed expert and of the shared expert
  route_scale: float = 1.0  # DeepSeek-V3's route_scale: the top-k gates sum to this

  def __post_init__(self):
    if self.attention not in ("mla", "gqa"):
      raise ValueError(f"LMConfig.attention must be 'mla' or 'gqa', got {self.attention!r}")
    if self.qk_norm and self.attention != "gqa":
      raise ValueError("LMConfig.qk_norm needs attention='gqa' (MLA's rotary key is shared by all heads)")
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"LMConfig.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")

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


def _swiglu(cfg: LMConfig, width: int, h):
  dense = functools.partial(nn.Dense, use_bias=False, dtype=cfg.dtype)
  gate = dense(width, kernel_init=_kernel("embed", "mlp"), name="w_gate")(h)
  up = dense(width, kernel_init=_kernel("embed", "mlp"), name="w_up")(h)
  return dense(h.shape[-1], kernel_init=_kernel("mlp", "embed"), name="w_down")(nn.silu(gate) * up)


class SwiGLU(nn.Module):
  """``w_down(silu(w_gate x) * w_up x)``: the dense MLP, and the MoE's shared expert."""

  cfg: LMConfig
  width: int

  @nn.compact
  def __call__(self, h):
    return _swiglu(self.cfg, self.width, h)


class Router(nn.Module):
  """``(scores, mask)``: sigmoid scores ``(B, T, E)`` and the top-k choice (1 on each token's
  ``top_k`` experts by ``scores + e_score_correction_bias``, else 0). Hugging Face's
  DeepSeek-V3 naming: ``gate/kernel`` beside ``gate/e_score_correction_bias``."""

  cfg: LMConfig

  @nn.compact
  def __call__(self, h):
    e = self.cfg.num_experts
    kernel = self.param("kernel", _kernel("embed", None), (h.shape[-1], e))
    bias = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (e,))
    scores = jax.nn.sigmoid(h.astype(jnp.float32) @ kernel)
    biased = scores + jax.lax.stop_gradient(bias)[(None,) * (scores.ndim - 1)]  # for the choice only
    _, chosen = jax.lax.top_k(biased, self.cfg.top_k)
    return scores, jax.nn.one_hot(chosen, e, dtype=scores.dtype).sum(-2)


class MoE(nn.Module):
  """DeepSeek-V3 / Kimi K2 mixture of experts: a shared expert plus top-k routed experts.

  Scores ``s = sigmoid(h @ gate/kernel)`` ``(B, T, E)`` (DeepSeek-V3's ``score_func="sigmoid"``).
  Each token's experts are the ``top_k`` largest ``s + e_score_correction_bias``: the bias
  only chooses (DeepSeek-V3's auxiliary-loss-free balancing, arXiv 2412.19437 section
  2.1.2); the gates are the chosen experts' unbiased scores, normalized to sum to
  ``route_scale``. The bias gets no gradient (it enters through ``top_k``'s indices
  only, under ``stop_gradient``); ``update_routing_bias`` moves it after each step, and the
  optimizers leave it as it is (``muon_labels`` gives it the label ``"frozen"``).

  Storage (MaxText-style logical names, no ``matrix_axes`` to declare): routed experts as
  stacks ``wi_0``/``wi_1`` ``(E, embed, expert_dim)`` named ``("exp", "embed", "mlp")`` and
  ``wo`` ``(E, expert_dim, embed)`` named ``("exp", "mlp", "embed")``: Muon orthogonalizes
  each expert's matrix on its own, and a mesh with an ``expert`` axis holds whole experts
  per device. The router ``gate/kernel`` ``(embed, E)`` is named ``("embed", None)`` (Muon,
  as in Moonlight and MaxText); ``gate/e_score_correction_bias`` ``(E,)`` is replicated.

  Dispatch is dense: every routed expert runs on every token and the outputs are summed
  with the gates, zero outside each token's top-k. At this size (a few experts, short
  sequences) that is the simplest program and shards with no all-to-all: the expert axis
  of the einsums is split over the ``expert`` mesh axis like the stacks. It costs
  ``E / top_k`` times the FLOPs of a token-dropping dispatch, fine for a demo, not at scale.

  Sows ``moe/expert_load`` ``(E,)``: the fraction of the step's tokens routed to each
  expert (their sum is ``top_k``).
  """

  cfg: LMConfig

  @nn.compact
  def __call__(self, h):
    cfg = self.cfg
    e, k, f, d = cfg.num_experts, cfg.top_k, cfg.expert_dim, h.shape[-1]
    shared = SwiGLU(cfg, f, name="shared_expert")(h)
    scores, mask = Router(cfg, name="gate")(h)
    gates = mask * scores
    gates = cfg.route_scale * gates / gates.sum(-1, keepdims=True)
    init = nn.initializers.lecun_normal(batch_axis=(0,))  # fan-in of one expert's matrix, not E times it
    stack = lambda name, names, shape: self.param(name, nn.with_logical_partitioning(init, names), shape)  # noqa: E731
    wi_0 = stack("wi_0", ("exp", "embed", "mlp"), (e, d, f))
    wi_1 = stack("wi_1", ("exp", "embed", "mlp"), (e, d, f))
    wo = stack("wo", ("exp", "mlp", "embed"), (e, f, d))
    if cfg.dtype is not None:
      h, wi_0, wi_1, wo = (a.astype(cfg.dtype) for a in (h, wi_0, wi_1, wo))
    act = nn.silu(jnp.einsum("btd,edf->btef", h, wi_0)) * jnp.einsum("btd,edf->btef", h, wi_1)
    routed = jnp.einsum("btef,efd,bte->btd", act, wo, gates.astype(act.dtype))
    self.sow("moe", "expert_load", mask.mean((0, 1)), init_fn=lambda: jnp.zeros((e,), jnp.float32),
             reduce_fn=lambda _, new: new)
    return shared + routed


class Block(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    x = x + _attention(cfg)(_rms_norm(cfg, "attn_norm")(x))
    h = _rms_norm(cfg, "mlp_norm")(x)
    if cfg.num_experts:
      return x + MoE(cfg, name="moe")(h), None
    return x + _swiglu(cfg, cfg.mlp_dim, h), None


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
        variable_axes={"params": 0, "intermediates": 0, "moe": 0},
        split_rngs={"params": True},
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, name="layers")(x, None)
    x = _rms_norm(cfg, "final_norm")(x)
    logits = nn.Dense(VOCAB, use_bias=False, dtype=cfg.dtype, kernel_init=_kernel("embed", "vocab"), name="lm_head")(x)
    return logits.astype(jnp.float32)


def init_params(cfg: LMConfig, seed: int, seq_len: int = 16) -> Any:
  """Float32 params, unboxed (the logical axis names stay available via ``logical_axes``).

  The init is compiled once per ``(cfg, seq_len)`` and called with each seed's key: run
  eagerly, every call compiled the scanned layers' init anew. It draws the same random
  values as the eager init.
  """
  return nn.unbox(_jitted_init(cfg, seq_len)(jax.random.key(seed))["params"])


@functools.cache
def _jitted_init(cfg: LMConfig, seq_len: int):
  return jax.jit(lambda key: MLALM(cfg).init(key, jnp.zeros((1, seq_len), jnp.int32)))


def _boxed_shapes(cfg: LMConfig, seq_len: int = 16) -> Any:
  """The params as ``nn.Partitioned`` boxes of ``jax.ShapeDtypeStruct`` (nothing computed)."""
  return jax.eval_shape(lambda: MLALM(cfg).init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32)))["params"]


def logical_axes(cfg: LMConfig, seq_len: int = 16) -> Any:
  """The logical axis names of every parameter (``nn.get_partition_spec`` of the boxes)."""
  return nn.get_partition_spec(_boxed_shapes(cfg, seq_len))


def logical_matrix_axes(cfg: LMConfig) -> Any:
  """Muon's ``matrix_axes`` read from the logical names (``mc.logical_matrix_axes``): the
  ``"layers"`` and ``"exp"`` axes batched, so each expert of each layer is one matrix.
  Nothing is declared by hand; the optimizer needs this because it sees the unboxed params."""
  return mc.logical_matrix_axes(_boxed_shapes(cfg))


def make_loss_fn(cfg: LMConfig):
  """``loss_fn(params, tokens (B, T+1)) -> (mean next-byte cross-entropy, intermediates)``.

  With experts, ``(loss, (intermediates, {"expert_load": (layers, E)}))``: the train step
  hands the load back as ``metrics["aux"]["expert_load"]``, for ``update_routing_bias``.
  """
  model = MLALM(cfg)

  def loss_fn(params, tokens):
    logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates", "moe"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    if not cfg.num_experts:
      return loss, state["intermediates"]
    return loss, (state["intermediates"], {"expert_load": state["moe"]["layers"]["moe"]["expert_load"]})

  return loss_fn


def update_routing_bias(params: Any, expert_load: jax.Array, speed: float) -> Any:
  """DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, section 2.1.2).

  ``b_i <- b_i + speed * sign(mean load - load_i)`` for every layer's routing bias
  ``gate/e_score_correction_bias`` (``(layers, E)``), from the step's ``expert_load``
  ``(layers, E)``: an overloaded expert's bias goes down, an underloaded one's up. Runs
  after the optimizer, outside the gradient (DeepSeek-V3 uses ``speed`` = 0.001 for most
  of its training).
  """
  layers = params["layers"]
  gate = layers["moe"]["gate"]
  bias = gate["e_score_correction_bias"]
  step = speed * jnp.sign(expert_load.mean(-1, keepdims=True) - expert_load)
  gate = {**gate, "e_score_correction_bias": bias + step.astype(bias.dtype)}
  return {**params, "layers": {**layers, "moe": {**layers["moe"], "gate": gate}}}


# Every Muon-routed kernel of this model is (in, out) or stacked (layers, [experts,] in, out):
# the last two axes are the matrix, leading axes are a stack of independent matrices. (The
# demo reads the same from the logical names instead: ``logical_matrix_axes``.)
MATRIX_AXES = mc.MatrixAxes((-2,), (-1,))


def with_balancing(step_fn, speed: float):
  """The train step, then DeepSeek-V3's balancing rule on the routing bias (``update_routing_bias``),
  from the step's expert load (``metrics["aux"]["expert_load"]``), outside the gradient."""

  def step(params, state, batch):
    params, state, metrics = step_fn(params, state, batch)
    return update_routing_bias(params, metrics["aux"]["expert_load"], speed), state, metrics

  return step


def adamw_keeping_frozen(learning_rate, params):
  """``optax.adamw`` on every leaf but those ``muon_labels`` calls ``"frozen"`` (the routing
  bias), which keep their value: plain ``optax.adamw`` would decay them (weight decay acts
  on a zero gradient too)."""
  labels = jax.tree.map(lambda label: "frozen" if label == "frozen" else "adamw", mc.muon_labels(params))
  return optax.partition({"adamw": optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1),
                          "frozen": optax.set_to_zero()}, labels)
