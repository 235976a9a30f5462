"""DeepSeek-V3 / Kimi K2 compatibility: interleaved RoPE, YaRN as the reference, HF configs and weights.

The reference here is a NumPy transcription of DeepSeek-V3's ``inference/model.py``
(``precompute_freqs_cis``, ``apply_rotary_emb`` through complex numbers, the naive MLA
forward with ``softmax_scale * mscale^2``), working on torch-layout ``(out, in)`` weights
as stored in a Hugging Face checkpoint. The checkpoints are written with numpy and
``safetensors`` (no torch), some tensors in bfloat16.
"""

from __future__ import annotations

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from muonclip_jax import nn as mnn

safetensors_numpy = pytest.importorskip("safetensors.numpy")

# ----------------------------------------------------------------------------- reference


def ref_freqs(dim, base, *, factor=1.0, original=4096, max_seq_len=4096, beta_fast=32.0,
              beta_slow=1.0, dtype=np.float32):
  """``precompute_freqs_cis``'s frequencies, line by line (float32 like torch by default)."""

  def find_correction_dim(num_rotations):
    return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

  low = math.floor(find_correction_dim(beta_fast))
  high = math.ceil(find_correction_dim(beta_slow))
  low, high = max(low, 0), min(high, dim - 1)
  freqs = 1.0 / (dtype(base) ** (np.arange(0, dim, 2, dtype=dtype) / dtype(dim)))
  if max_seq_len > original:
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=dtype) - low) / dtype(high - low), 0, 1)
    smooth = 1 - ramp
    freqs = freqs / dtype(factor) * (1 - smooth) + freqs * smooth
  return freqs


def ref_rotary(x, positions, freqs):
  """``apply_rotary_emb``: (x_2i + j x_2i+1) * exp(j p theta_i), x (B, T, H, D)."""
  xc = x[..., 0::2] + 1j * x[..., 1::2]
  angles = positions[:, :, None, None] * freqs[None, None, None, :]
  y = xc * np.exp(1j * angles)
  return np.stack([y.real, y.imag], axis=-1).reshape(x.shape)


def ref_rms_norm(x, weight, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def ref_mla(w, x, cfg, positions):
  """DeepSeek-V3 ``MLA.forward`` (attn_impl="naive", causal mask), float64, torch weights."""
  h, dn, dr, dv = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim",
                                    "qk_rope_head_dim", "v_head_dim"))
  r = cfg["kv_lora_rank"]
  rs = cfg.get("rope_scaling") or {}
  yarn_on = bool(rs) and cfg["max_position_embeddings"] > rs["original_max_position_embeddings"]
  freqs = ref_freqs(
      dr, cfg["rope_theta"], factor=rs.get("factor", 1.0),
      original=rs.get("original_max_position_embeddings", 0),
      max_seq_len=cfg["max_position_embeddings"], beta_fast=rs.get("beta_fast", 32),
      beta_slow=rs.get("beta_slow", 1), dtype=np.float64,
  ) if yarn_on else ref_freqs(dr, cfg["rope_theta"], dtype=np.float64)
  f = {k: np.asarray(v, np.float64) for k, v in w.items()}
  b, t, _ = x.shape
  if cfg["q_lora_rank"]:
    q = ref_rms_norm(x @ f["q_a_proj"].T, f["q_a_layernorm"]) @ f["q_b_proj"].T
  else:
    q = x @ f["q_proj"].T
  q = q.reshape(b, t, h, dn + dr)
  q_pe = ref_rotary(q[..., dn:], positions, freqs)
  kv = x @ f["kv_a_proj_with_mqa"].T
  kv, k_pe = kv[..., :r], kv[..., r:]
  k_pe = ref_rotary(k_pe[:, :, None, :], positions, freqs)
  kv = (ref_rms_norm(kv, f["kv_a_layernorm"]) @ f["kv_b_proj"].T).reshape(b, t, h, dn + dv)
  qh = np.concatenate([q[..., :dn], q_pe], axis=-1)
  kh = np.concatenate([kv[..., :dn], np.repeat(k_pe, h, axis=2)], axis=-1)
  scale = (dn + dr) ** -0.5
  if yarn_on:
    mscale = 0.1 * rs.get("mscale", 1.0) * math.log(rs["factor"]) + 1.0
    scale *= mscale * mscale
  scores = np.einsum("bshd,bthd->bsht", qh, kh) * scale
  scores = np.where(np.tril(np.ones((t, t), bool))[None, :, None, :], scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bsht,bthd->bshd", p, kv[..., dn:])
  return out.reshape(b, t, h * dv) @ f["o_proj"].T


# ----------------------------------------------------------------------------- fixtures

DIM, T, LAYERS = 32, 7, 3
CONFIG = {  # a tiny DeepSeek-V3-style config.json (DeepSeek-V2-style mscale 0.707)
    "hidden_size": DIM, "num_attention_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 12,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 6, "rope_theta": 10000.0,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_hidden_layers": LAYERS,
    "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
    },
}
CONFIG_NO_LORA = dict(CONFIG, q_lora_rank=None)
DEEPSEEK_V3 = {  # attention keys of deepseek-ai/DeepSeek-V3's config.json
    "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}
KIMI_K2 = dict(  # moonshotai/Kimi-K2-Instruct-0905: 64 heads, theta 5e4, equal betas
    DEEPSEEK_V3, num_attention_heads=64, rope_theta=50000.0, max_position_embeddings=262144,
    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                  "type": "yarn"},
)


def _hf_shapes(cfg):
  h, d = cfg["num_attention_heads"], cfg["hidden_size"]
  dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
  qr, r = cfg["q_lora_rank"], cfg["kv_lora_rank"]
  q = ({"q_a_proj": (qr, d), "q_a_layernorm": (qr,), "q_b_proj": (h * (dn + dr), qr)} if qr
       else {"q_proj": (h * (dn + dr), d)})
  return q | {"kv_a_proj_with_mqa": (r + dr, d), "kv_a_layernorm": (r,),
              "kv_b_proj": (h * (dn + dv), r), "o_proj": (d, h * dv)}


def _hf_weights(cfg, seed):
  """{layer: {short name: array}}: layer 1 in bfloat16, the others float32."""
  rng = np.random.default_rng(seed)
  out = {}
  for layer in range(LAYERS):
    dtype = ml_dtypes.bfloat16 if layer == 1 else np.float32
    w = {}
    for name, shape in _hf_shapes(cfg).items():
      if name.endswith("layernorm"):
        a = 1.0 + 0.1 * rng.standard_normal(shape)
      else:
        a = rng.standard_normal(shape) / math.sqrt(shape[1])
      w[name] = a.astype(dtype)
    out[layer] = w
  return out


def _write_checkpoint(tmp_path, cfg, seed=0):
  """Two safetensors shards with the attention tensors plus unrelated ones."""
  weights = _hf_weights(cfg, seed)
  shards = [{"model.embed_tokens.weight": np.ones((10, DIM), np.float32)}, {}]
  for layer, w in weights.items():
    for name, a in w.items():
      shards[layer % 2][f"model.layers.{layer}.self_attn.{name}.weight"] = a
    shards[1][f"model.layers.{layer}.mlp.gate_proj.weight"] = np.ones((3, DIM), np.float32)
  for i, shard in enumerate(shards):
    safetensors_numpy.save_file(shard, str(tmp_path / f"model-0000{i + 1}-of-00002.safetensors"))
  return weights


def _x(seed=1, b=2):
  return np.random.default_rng(seed).standard_normal((b, T, DIM)).astype(np.float32)


POSITIONS = np.stack([np.arange(T) + 100, np.arange(T) + 3000])  # (2, T), beyond the ramp


# ----------------------------------------------------------------------------- frequencies


@pytest.mark.parametrize("dim,original,betas", [
    (8, 8192, (32.0, 1.0)),  # ramp upper index past dim/2 - 1
    (64, 65536, (32.0, 1.0)),  # the same, at the full rope width
    (64, 4096, (32.0, 1.0)),  # DeepSeek-V3
    (64, 4096, (1.0, 1.0)),  # Kimi K2: equal betas
    (8, 8192, (2.0, 2.0)),  # equal betas, another ramp
])
def test_yarn_frequencies_equal_reference(dim, original, betas):
  yarn = mnn.YarnScaling(
      factor=40.0, original_max_position=original, beta_fast=betas[0], beta_slow=betas[1])
  got = mnn.rope_frequencies(dim, base=10000.0, yarn=yarn)
  kw = dict(factor=40.0, original=original, max_seq_len=original + 1,
            beta_fast=betas[0], beta_slow=betas[1])
  np.testing.assert_allclose(got, ref_freqs(dim, 10000.0, **kw), rtol=1e-6)  # torch float32
  np.testing.assert_allclose(got, ref_freqs(dim, 10000.0, **kw, dtype=np.float64), rtol=1e-13)


def test_clamped_configurations_differ_from_half_clamp():
  """The two configurations past ``dim/2 - 1`` do exercise the ``dim - 1`` clamp."""
  for dim, original in ((8, 8192), (64, 65536)):
    yarn = mnn.YarnScaling(factor=40.0, original_max_position=original)
    got = mnn.rope_frequencies(dim, yarn=yarn)
    c = dim * math.log(original / (2 * math.pi)) / (2 * math.log(10000.0))
    low = max(math.floor(dim * math.log(original / (64 * math.pi)) / (2 * math.log(1e4))), 0)
    high = min(math.ceil(c), dim // 2 - 1)  # the old, wrong clamp
    keep = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    plain = mnn.rope_frequencies(dim)
    old = plain / 40.0 * (1 - keep) + plain * keep
    assert np.max(np.abs(got / old - 1)) > 0.3


@settings(deadline=None, max_examples=60)
@given(
    half=st.integers(1, 64), log_base=st.floats(2.0, 14.0), log_orig=st.floats(0.0, 20.0),
    factor=st.floats(1.0, 100.0), beta_slow=st.floats(0.25, 8.0), ratio=st.floats(1.0, 64.0),
)
def test_property_yarn_frequencies_equal_reference(half, log_base, log_orig, factor, beta_slow,
                                                   ratio):
  dim, base, original = 2 * half, math.exp(log_base), max(int(math.exp(log_orig)), 1)
  beta_fast = beta_slow * ratio
  yarn = mnn.YarnScaling(factor, original, beta_fast=beta_fast, beta_slow=beta_slow)
  expected = ref_freqs(dim, base, factor=factor, original=original, max_seq_len=original + 1,
                       beta_fast=beta_fast, beta_slow=beta_slow, dtype=np.float64)
  np.testing.assert_allclose(mnn.rope_frequencies(dim, base=base, yarn=yarn), expected,
                             rtol=1e-12)


def test_yarn_equal_betas_accepted_and_reversed_refused():
  mnn.YarnScaling(32.0, 4096, beta_fast=1.0, beta_slow=1.0)
  with pytest.raises(ValueError, match="beta_fast >= beta_slow"):
    mnn.YarnScaling(32.0, 4096, beta_fast=1.0, beta_slow=2.0)


# ----------------------------------------------------------------------------- interleaved RoPE


def test_apply_rope_interleave_is_reference_rotation():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  pos = np.array([[0, 1, 2, 3, 4], [7, 3, 100, 0, 2]])
  yarn = mnn.YarnScaling(4.0, 8192)
  for kw, freqs in (
      ({}, ref_freqs(8, 10000.0, dtype=np.float64)),
      (dict(yarn=yarn), ref_freqs(8, 10000.0, factor=4.0, original=8192, max_seq_len=8193,
                                  dtype=np.float64)),
  ):
    y = mnn.apply_rope(jnp.asarray(x), jnp.asarray(pos), rope_interleave=True, **kw)
    chex.assert_trees_all_close(y, ref_rotary(x, pos, freqs).astype(np.float32), atol=1e-5)
  # Interleaved pairs = rotate-half on the columns reordered (evens, odds), then back.
  perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
  half = mnn.apply_rope(jnp.asarray(x[..., perm]), jnp.asarray(pos))
  inter = mnn.apply_rope(jnp.asarray(x), jnp.asarray(pos), rope_interleave=True)
  chex.assert_trees_all_close(inter[..., perm], half, atol=1e-6)
  assert not np.allclose(inter, mnn.apply_rope(jnp.asarray(x), jnp.asarray(pos)), atol=1e-3)


# ----------------------------------------------------------------------------- config


def test_config_constructor_deepseek_v3_and_kimi_k2():
  m = mnn.mla_from_hf_config(DEEPSEEK_V3)
  assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank) == (128, 1536, 512)
  assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (128, 64, 128)
  assert m.rope_theta == 10000.0 and m.rope_interleave is True
  assert m.yarn == mnn.YarnScaling(40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0)
  assert m.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
  k2 = mnn.mla_from_hf_config(KIMI_K2, impl="chunked")
  assert k2.num_heads == 64 and k2.rope_theta == 50000.0 and k2.impl == "chunked"
  assert k2.yarn == mnn.YarnScaling(64.0, 4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0)
  # YaRN as the reference switches it: only when max length > original length.
  short = dict(DEEPSEEK_V3, max_position_embeddings=4096)
  assert mnn.mla_from_hf_config(short).yarn is None
  assert mnn.mla_from_hf_config(dict(DEEPSEEK_V3, rope_scaling=None)).yarn is None
  no_lora = mnn.mla_from_hf_config(dict(DEEPSEEK_V3, q_lora_rank=None, rope_interleave=False))
  assert no_lora.q_lora_rank == 0 and no_lora.rope_interleave is False
  model = nnx.eval_shape(lambda: mnn.mla_nnx_from_hf_config(CONFIG, rngs=nnx.Rngs(0)))
  assert model.wq_b.kernel.shape == (16, 4 * 16) and model.rope_interleave and model.yarn == mnn.YarnScaling(
      4.0, 8192, beta_fast=32.0, beta_slow=1.0, mscale=0.707)


@pytest.mark.parametrize("key", [
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_theta", "max_position_embeddings",
])
def test_config_missing_key(key):
  cfg = {k: v for k, v in DEEPSEEK_V3.items() if k != key}
  with pytest.raises(ValueError, match=key):
    mnn.mla_from_hf_config(cfg)


def test_config_errors():
  def scaling(**kw):
    return dict(DEEPSEEK_V3, rope_scaling=kw)

  rs = DEEPSEEK_V3["rope_scaling"]
  with pytest.raises(ValueError, match="original_max_position_embeddings"):
    mnn.mla_from_hf_config(scaling(type="yarn", factor=40))
  with pytest.raises(ValueError, match="'factor'"):
    mnn.mla_from_hf_config(scaling(type="yarn", original_max_position_embeddings=4096))
  with pytest.raises(ValueError, match="'linear'"):
    mnn.mla_from_hf_config(scaling(**dict(rs, type="linear")))
  with pytest.raises(ValueError, match="mscale_all_dim"):
    mnn.mla_from_hf_config(scaling(**dict(rs, mscale=0.5)))
  with pytest.raises(ValueError, match="attention_bias"):
    mnn.mla_from_hf_config(dict(DEEPSEEK_V3, attention_bias=True))
  with pytest.raises(ValueError, match="hidden_size"):
    mnn.mla_nnx_from_hf_config({k: v for k, v in CONFIG.items() if k != "hidden_size"},
                               rngs=nnx.Rngs(0))
  # rope_type (new name) is read as well.
  k = dict(rs, rope_type="yarn")
  del k["type"]
  assert mnn.mla_from_hf_config(scaling(**k)).yarn is not None


def test_config_refuses_every_mscale_pair_hugging_face_applies_to_the_rotary_part():
  """Hugging Face scales rotary cos/sin unless mscale == mscale_all_dim, both set and nonzero."""
  from muonclip_jax.nn._deepseek import _hf_rotary_mscales

  rs = {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k not in ("mscale", "mscale_all_dim")}
  m40 = 0.1 * math.log(40) + 1.0
  assert _hf_rotary_mscales(40.0, 1.0, 1.0) == (1.0, 1.0)
  assert _hf_rotary_mscales(40.0, 0.707, 0.707) == (1.0, 1.0)
  assert _hf_rotary_mscales(40.0, None, None) == pytest.approx((m40, m40))
  assert _hf_rotary_mscales(40.0, 1.0, None) == pytest.approx((m40, m40))
  assert _hf_rotary_mscales(40.0, None, 1.0) == pytest.approx((1.0, m40))
  assert _hf_rotary_mscales(40.0, 0.0, None) == pytest.approx((1.0, m40))
  assert _hf_rotary_mscales(1.0, 0.5, None) == (1.0, 1.0)  # no YaRN temperature at factor 1
  assert _hf_rotary_mscales(40.0, 1.0, 1.0, attention_factor=2.0) == (1.0, 2.0)
  for keys in ({}, {"mscale": 1.0}, {"mscale_all_dim": 1.0}, {"mscale": 0.707},
               {"mscale_all_dim": 0.707}, {"mscale": 0.0}, {"mscale": 1.0, "mscale_all_dim": 0.0},
               {"mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.5}):
    with pytest.raises(ValueError, match=r"rotary cos/sin by .*mscale_all_dim|mscale=.*mscale_all_dim="):
      mnn.mla_from_hf_config(dict(DEEPSEEK_V3, rope_scaling=dict(rs, **keys)))
  for keys in ({"mscale": 1.0, "mscale_all_dim": 1.0}, {"mscale": 0.707, "mscale_all_dim": 0.707},
               {"mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.0}):
    m = mnn.mla_from_hf_config(dict(DEEPSEEK_V3, rope_scaling=dict(rs, **keys)))
    assert m.yarn.mscale == keys["mscale_all_dim"]
  # factor 1: no temperature anywhere, so a lone key is harmless
  assert mnn.mla_from_hf_config(dict(DEEPSEEK_V3, rope_scaling=dict(rs, factor=1.0, mscale=0.5))).yarn is not None


# ----------------------------------------------------------------------------- weights


def _apply(module, params, x, positions):
  return jax.jit(module.apply)({"params": params}, jnp.asarray(x),
                               positions=jnp.asarray(positions, jnp.int32))


@pytest.mark.parametrize("cfg", [CONFIG, CONFIG_NO_LORA], ids=["q_lora", "no_q_lora"])
def test_converted_weights_match_reference_forward(tmp_path, cfg):
  weights = _write_checkpoint(tmp_path, cfg)
  module = mnn.mla_from_hf_config(cfg)
  x = _x()
  for layer in (0, 1):  # float32 and bfloat16 tensors
    params = mnn.load_hf_mla_params(tmp_path, cfg, layers=layer)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))
    expected = ref_mla(weights[layer], x.astype(np.float64), cfg, POSITIONS)
    y = _apply(module, params, x, POSITIONS)
    chex.assert_trees_all_close(y, expected.astype(np.float32), rtol=1e-4, atol=1e-5)
  # The same weights in rotate-half pairing give another function (38% off when this was found).
  half = module.clone(rope_interleave=False)
  assert not np.allclose(_apply(half, params, x, POSITIONS), y, rtol=1e-2, atol=1e-3)


def test_stacked_weights_under_scan_and_nnx(tmp_path):
  weights = _write_checkpoint(tmp_path, CONFIG)
  files = sorted(tmp_path.glob("*.safetensors"))
  stacked = mnn.load_hf_mla_params(files, CONFIG, layers=range(LAYERS))
  assert stacked["wq_b"]["kernel"].shape == (LAYERS, 16, 4 * 16)

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
      return x + mnn.mla_from_hf_config(CONFIG, name="attn")(x, positions=positions), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
      scanned = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=nn.broadcast, length=LAYERS)
      return scanned(name="layers")(x, positions)[0]

  x, pos = _x(), jnp.asarray(POSITIONS, jnp.int32)
  y = jax.jit(Stack().apply)({"params": {"layers": {"attn": stacked}}}, jnp.asarray(x), pos)
  h = x.astype(np.float64)
  for layer in range(LAYERS):
    h = h + ref_mla(weights[layer], h, CONFIG, POSITIONS)
  chex.assert_trees_all_close(y, h.astype(np.float32), rtol=1e-4, atol=1e-4)

  # NNX: the same stack built with nnx.vmap, loaded with replace_by_pure_dict, run by nnx.scan.
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return mnn.mla_nnx_from_hf_config(CONFIG, rngs=rngs)

  model = create(nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, stacked)
  nnx.update(model, state)

  @nnx.jit
  def run(model, x, positions):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return x + layer(x, positions=positions)

    return body(x, model)

  chex.assert_trees_all_close(run(model, jnp.asarray(x), pos), y, rtol=1e-5, atol=1e-5)


def test_mapping_source_and_dtype():
  weights = _hf_weights(CONFIG, seed=4)
  state_dict = {f"model.layers.0.self_attn.{k}.weight": v for k, v in weights[1].items()}
  params = mnn.load_hf_mla_params(state_dict, CONFIG, layers=0, dtype=jnp.bfloat16)
  assert params["wo"]["kernel"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(params["wo"]["kernel"], weights[1]["o_proj"].T)
  assert set(params) == {"wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo"}


def test_weight_errors(tmp_path):
  weights = _hf_weights(CONFIG, seed=5)[0]
  good = {f"model.layers.0.self_attn.{k}.weight": v for k, v in weights.items()}
  bad = dict(good, **{"model.layers.0.self_attn.kv_b_proj.weight": np.zeros((56, 11))})
  name = r"model\.layers\.0\.self_attn\.kv_b_proj\.weight"
  with pytest.raises(ValueError, match=name + r".*expected shape \(56, 12\).*\(56, 11\)"):
    mnn.load_hf_mla_params(bad, CONFIG, layers=0)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_a_proj\.weight.*\(16, 32\)"):
    mnn.load_hf_mla_params(good, CONFIG, layers=[0, 1])
  fp8 = dict(good, **{"model.layers.0.self_attn.o_proj.weight":
                      weights["o_proj"].astype(ml_dtypes.float8_e4m3fn)})
  safetensors_numpy.save_file(fp8, str(tmp_path / "fp8.safetensors"))
  for source in (fp8, tmp_path / "fp8.safetensors"):
    with pytest.raises(ValueError, match=r"o_proj\.weight.*FP8"):
      mnn.load_hf_mla_params(source, CONFIG, layers=0)
  with pytest.raises(ValueError, match="layers"):
    mnn.load_hf_mla_params(good, CONFIG, layers=[])
  with pytest.raises(ValueError, match="not a file"):
    mnn.load_hf_mla_params(tmp_path / "missing.safetensors", CONFIG, layers=0)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no .safetensors"):
    mnn.load_hf_mla_params(tmp_path / "empty", CONFIG, layers=0)
