"""Tiny models of the installed Tunix (``google-tunix`` 0.1.7), their batches, and NumPy's maxima.

The reference records the q and k that reach each attention: it runs the model with the
model module's ``jnp`` replaced (pytest's ``monkeypatch``) by ``jax.numpy`` whose ``einsum``
keeps the operands of the logits einsum, then computes the scaled, masked logits in NumPy.
Llama 3 and Qwen 3 scale the einsum's result by head_dim ** -0.5; Gemma and Gemma 3 scale the
query before it (head_dim ** -0.5, or Gemma 3's ``query_pre_attn_scalar``), so their recorded
query already carries the model's own scale. The mask is Tunix's causal and padding mask and,
on a local layer, the sliding window built as each model builds it (``_window``).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, T = 32, 6
WINDOW = 2  # the sliding window of Gemma's and Gemma 3's local layer (T = 6: it hides most keys)
# The einsum of the logits -> how its operands are laid out and whether the query arrives scaled.
LOGITS = {
    "BTHGD,BSHD->BHGTS": "llama",  # Llama 3, Qwen 3: q (B, T, K, G, D), k (B, S, K, D); scaled after
    "BTKGH,BSKH->BTKGS": "gemma-gqa",  # Gemma, Gemma 3 (1 < kv heads < heads): q already scaled
    "BTNH,BSNH->BTNS": "gemma",  # Gemma, Gemma 3 (kv heads = heads, or 1, broadcast): q already scaled
}


def tiny(family: str, *, experts: bool = False, kv_heads: int = 2, seed: int = 0) -> nnx.Module:
  """A 2-layer Llama 3, Qwen 3 (GQA 4/2; with ``experts``: Qwen3-MoE, 4 experts top-2), Gemma or
  Gemma 3 (4 heads, ``kv_heads`` of them: 4 gives ``qkv_einsum``, fewer ``q_einsum``/``kv_einsum``),
  the Gemmas with a local sliding-window layer (window ``WINDOW``) then a global one."""
  if family in ("gemma", "gemma3"):
    return _tiny_gemma(family, kv_heads, seed)
  if family == "llama3":
    from tunix.models.llama3 import model as m
    config = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8,
                           num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6)
    return m.Llama3(config, rngs=nnx.Rngs(seed))
  from tunix.models.qwen3 import model as m
  moe = dict(num_experts=4, num_experts_per_tok=2) if experts else {}
  config = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8,
                         num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6, **moe)
  return m.Qwen3(config, rngs=nnx.Rngs(seed))


def _tiny_gemma(family: str, kv_heads: int, seed: int) -> nnx.Module:
  dims = dict(num_layers=2, num_embed=VOCAB, embed_dim=16, hidden_dim=32, num_heads=4, head_dim=8,
              num_kv_heads=kv_heads, sliding_window_size=WINDOW)
  if family == "gemma":
    from tunix.models.gemma import model as m
    config = m.ModelConfig(**dims, final_logit_softcap=None, use_post_attn_norm=False, use_post_ffw_norm=False,
                           attention_types=(m.AttentionType.LOCAL_SLIDING, m.AttentionType.GLOBAL))
    model = m.Gemma(config, rngs=nnx.Rngs(seed))
    for layer in model.layers:  # Tunix initializes kernels with stddev 0.01 (logits ~3e-3): make them O(1)
      for name in ("qkv_einsum", "q_einsum", "kv_einsum"):
        einsum = getattr(layer.attn, name, None)
        if einsum is not None:
          einsum.w[...] = einsum.w[...] * 30.0
    return model
  from tunix.models.gemma3 import model as m
  # Query scale 1/sqrt(embed_dim / heads) = 1/2, not 1/sqrt(head_dim) (the recorded query carries it).
  config = m.ModelConfig(**dims, param_dtype=jnp.float32,
                         query_pre_attn_norm=m.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS)
  local, global_ = m.AttentionType.LOCAL_SLIDING, m.AttentionType.GLOBAL
  with mock.patch.object(m, "GEMMA3_ATTENTION_PATTERN", (local, global_)):  # Tunix's is 5 local, then 1 global
    model = m.Gemma3(config, rngs=nnx.Rngs(seed))
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(model.layers)))
  for layer in model.layers:  # QK-norm scales start at 0 (x * (1 + 0)): give them some spread
    for norm in (layer.attn._query_norm, layer.attn._key_norm):  # noqa: SLF001
      norm.scale[...] = jax.random.uniform(next(keys), norm.scale[...].shape, minval=0.0, maxval=1.5)
  return model


def batch(seed: int, *, pad: int = 2) -> dict[str, np.ndarray]:
  """Tokens ``(2, T)``; the second row's last ``pad`` positions are padding."""
  rng = np.random.default_rng(seed)
  mask = np.ones((2, T), bool)
  if pad:
    mask[1, -pad:] = False
  return dict(input_tokens=rng.integers(0, VOCAB, (2, T)).astype(np.int32), input_mask=mask)


def model_inputs(x: dict) -> dict:
  """Tunix's model inputs for a batch (the ``gen_model_input_fn`` of the recipe): causal and padding mask."""
  from tunix.sft import utils
  mask = jnp.asarray(x["input_mask"])
  return dict(input_tokens=jnp.asarray(x["input_tokens"]), input_mask=mask,
              positions=utils.build_positions_from_mask(mask), attention_mask=utils.make_causal_attn_mask(mask))


class _RecordingNumpy:
  def __init__(self, seen: list):
    self.seen = seen

  def __getattr__(self, name):
    return getattr(jnp, name)

  def einsum(self, spec, *ops, **kw):
    if spec in LOGITS:
      self.seen.append((LOGITS[spec], *(np.asarray(o, np.float64) for o in ops)))
    return jnp.einsum(spec, *ops, **kw)


def _logits(kind: str, q: np.ndarray, k: np.ndarray) -> np.ndarray:
  """``(B, heads, T, S)`` scaled logits from the recorded operands, heads in the query projection's order."""
  if kind == "llama":  # q (B, T, K, G, D), k (B, S, K, D); Tunix multiplies the einsum by head_dim ** -0.5
    b, t, kh, g, d = q.shape
    return (np.einsum("btkgd,bskd->bkgts", q, k) * d ** -0.5).reshape(b, kh * g, t, -1)
  if kind == "gemma-gqa":  # q (B, T, K, G, H) already scaled (head_dim ** -0.5 or query_pre_attn_scalar)
    b, t, kh, g, _ = q.shape
    return np.einsum("btkgh,bskh->bkgts", q, k).reshape(b, kh * g, t, -1)
  # q (B, T, N, H) already scaled; k (B, S, N, H), or (B, S, 1, H) broadcast over the heads (one kv head)
  return np.einsum("btnh,bsnh->bnts", q, np.broadcast_to(k, k.shape[:2] + q.shape[2:]))


def _window(model: nnx.Module, layer: int, positions: np.ndarray, shape: tuple) -> np.ndarray:
  """``(B, T, S)``: the keys a local sliding-window layer may see (all for a global one), as Tunix builds it:
  Gemma from the query's position, Gemma 3 (a full sequence) from its index: |key - query| < window."""
  attn = model.layers[layer].attn
  if "gemma" not in type(model).__module__ or attn.attn_type.name != "LOCAL_SLIDING":
    return np.ones(shape, bool)
  b, t, s = shape
  query = positions[:, :, None] if type(model).__module__.endswith("gemma.model") else np.arange(t)[None, :, None]
  return np.abs(np.arange(s)[None, None, :] - query) < attn.sliding_window_size


def numpy_maxima(model: nnx.Module, x: dict, monkeypatch, *, window: bool = True) -> list[np.ndarray]:
  """Per layer, NumPy's ``(heads,)`` maxima of the scaled logits of the q and k reaching attention,
  over the keys the causal and padding mask allows (and a local layer's sliding window, unless
  ``window=False``); heads in the query projection's order."""
  inputs = model_inputs(x)
  seen: list = []
  module = __import__(type(model).__module__, fromlist=["_"])
  with monkeypatch.context() as mp:
    mp.setattr(module, "jnp", _RecordingNumpy(seen))
    model(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
  mask = np.asarray(inputs["attention_mask"], bool)  # (B, T, S)
  positions = np.asarray(inputs["positions"])
  out = []
  for layer, (kind, q, k) in enumerate(seen):
    allowed = mask & _window(model, layer, positions, mask.shape) if window else mask
    logits = np.where(allowed[:, None], _logits(kind, q, k), -np.inf)
    out.append(logits.max(axis=(0, 2, 3)))
  return out


def params_of(model: nnx.Module) -> dict:
  """The model's parameters as a pure dict of NumPy arrays."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _load(model: nnx.Module, params: dict) -> None:
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  nnx.update(model, state)


def maxima_on_inputs_before(model: nnx.Module, before: dict, x: dict, monkeypatch) -> list[np.ndarray]:
  """Per layer, NumPy's maxima (``numpy_maxima``) with that layer's attention as ``model`` has it and
  every other parameter as in ``before`` (``params_of`` before a step): each attention sees the very
  inputs it saw before the step. The clip bounds a head's logits on the batch it was measured on; on
  the new model a later layer's inputs move with the earlier layers' clip (by ~1% here)."""
  after = params_of(model)
  out = []
  try:
    for layer in range(len(model.layers)):
      mixed = jax.tree.map(lambda a: a, before)  # a new tree of the same arrays
      mixed["layers"][layer]["attn"] = after["layers"][layer]["attn"]
      _load(model, mixed)
      out.append(numpy_maxima(model, x, monkeypatch)[layer])
  finally:
    _load(model, after)
  return out


def expert_matrix_axes(params):
  """Each expert kernel ``(experts, in, out)`` its own Muon matrix, declared per leaf (Tunix's ``nnx.Param``
  metadata name mesh axes, ``("fsdp", None, "tp")``, not logical ones); every other leaf left to the layout."""
  import muonclip_jax as mc

  def axes(path, x):
    names = [n for n in (getattr(p, "key", getattr(p, "name", None)) for p in path) if n != "value"]  # NNX boxes
    expert = names[-1] in ("gate_proj", "up_proj", "down_proj") and getattr(x, "ndim", 0) == 3
    return mc.MatrixAxes((-2,), (-1,)) if expert else None

  return jax.tree_util.tree_map_with_path(axes, params)
