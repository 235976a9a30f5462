"""Tests for QK-Clip (Kimi K2, arXiv 2507.20534, section 2.1): logits recomputed in NumPy."""

from __future__ import annotations

import math
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import np_gqa_logits, np_max_logits, np_mla_logits
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import GQALayout, MLALayout, qk_clip, qk_clip_stats
from _exactness import assert_same_math

# Threshold as a fraction of the largest S_max: 1.0 puts tau exactly on a head's maximum.
_FRACTIONS = st.sampled_from([0.05, 0.3, 0.6, 0.9, 1.0, 1.5])
_TOL = 1e-5


# ----------------------------------------------------------------------------- cases


def _mla_case(seed, lay, *, batch=2, seq=4, q_in=6, kv_rank=5, bias=False, query="wq_b"):
  """Random MLA params {"attn": ...} (float32) and the inputs of np_mla_logits."""
  rng = np.random.default_rng(seed)
  h, nope, rope, v = lay.num_heads, lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim
  scales = rng.uniform(0.2, 3.0, size=2)  # spread the head maxima
  f32 = lambda *s, scale=1.0: (rng.normal(size=s) * scale).astype(np.float32)
  attn = {
      query: {"kernel": f32(q_in, h * (nope + rope), scale=scales[0])},
      "wkv_b": {"kernel": f32(kv_rank, h * (nope + v), scale=scales[1])},
      "wkv_a": {"kernel": f32(7, kv_rank + rope)},
      "wo": {"kernel": f32(h * v, 7)},
  }
  if bias:
    attn[query]["bias"] = f32(h * (nope + rope))
    attn["wkv_b"]["bias"] = f32(h * (nope + v))
  inputs = (f32(batch, seq, q_in), f32(batch, seq, kv_rank), f32(batch, seq, rope, scale=2.0))
  return {"attn": attn}, inputs


def _mla_logits(attn, inputs, lay):
  query = "wq_b" if "wq_b" in attn else "wq"
  return np_mla_logits(
      *inputs,
      wq=attn[query]["kernel"],
      wkv_b=attn["wkv_b"]["kernel"],
      wq_bias=attn[query].get("bias"),
      wkv_b_bias=attn["wkv_b"].get("bias"),
      num_heads=lay.num_heads,
      qk_nope_head_dim=lay.qk_nope_head_dim,
      qk_rope_head_dim=lay.qk_rope_head_dim,
      v_head_dim=lay.v_head_dim,
  )


def _gqa_case(seed, lay, *, batch=2, seq=4, d=6, bias=False):
  rng = np.random.default_rng(seed)
  h, kv, hd = lay.num_heads, lay.num_kv_heads, lay.head_dim
  scale = rng.uniform(0.3, 3.0)
  f32 = lambda *s, scale=1.0: (rng.normal(size=s) * scale).astype(np.float32)
  attn = {
      "wq": {"kernel": f32(d, h * hd, scale=scale)},
      "wk": {"kernel": f32(d, kv * hd, scale=scale)},
      "wv": {"kernel": f32(d, kv * hd)},
      "wo": {"kernel": f32(h * hd, d)},
  }
  if bias:
    attn["wq"]["bias"] = f32(h * hd)
    attn["wk"]["bias"] = f32(kv * hd)
  return {"attn": attn}, (f32(batch, seq, d),)


def _gqa_logits(attn, inputs, lay):
  return np_gqa_logits(
      *inputs,
      wq=attn["wq"]["kernel"],
      wk=attn["wk"]["kernel"],
      wq_bias=attn["wq"].get("bias"),
      wk_bias=attn["wk"].get("bias"),
      num_heads=lay.num_heads,
      num_kv_heads=lay.num_kv_heads,
      head_dim=lay.head_dim,
      rope_theta=10000.0 if lay.head_dim % 2 == 0 else None,
  )


def _logits(attn, inputs, lay):
  fn = _mla_logits if isinstance(lay, MLALayout) else _gqa_logits
  return fn(jax.tree.map(np.asarray, attn), inputs, lay)


def _threshold(s, fraction):
  top = float(np.max(s))
  return np.float32(fraction * top) if top > 0 else np.float32(1.0)


def _gammas(s32, tau):
  s = s32.astype(np.float64)
  clipped = np.isfinite(s) & (s > tau)
  return clipped, np.where(clipped, float(tau) / np.where(clipped, s, 1.0), 1.0)


def _assert_scaled(after, before, factors, exact):
  """after[:, h] == factors[h] * before[:, h]; bit-for-bit where exact[h]."""
  for h, factor in enumerate(factors):
    if exact[h]:
      np.testing.assert_array_equal(after[:, h], before[:, h], err_msg=f"head {h}")
    else:
      finite = before[:, h][np.isfinite(before[:, h])]
      atol = _TOL * (np.max(np.abs(finite)) if finite.size else 1.0)
      np.testing.assert_allclose(
          after[:, h], factor * before[:, h], rtol=_TOL, atol=atol, err_msg=f"head {h}"
      )


@st.composite
def _mla_layouts(draw):
  nope = draw(st.integers(0, 5))
  rope = draw(st.sampled_from([0, 2, 4]) if nope else st.sampled_from([2, 4]))
  return MLALayout(draw(st.integers(1, 4)), nope, rope, draw(st.integers(1, 4)))


@st.composite
def _gqa_layouts(draw, mode=None):
  kv = draw(st.integers(1, 3))
  group = draw(st.integers(1, 3))
  mode = mode or draw(st.sampled_from(["split", "query"]))
  return GQALayout(kv * group, kv, draw(st.integers(1, 4)), clip_mode=mode)


# ----------------------------------------------------------------------------- properties


@settings(max_examples=30)
@given(
    lay=_mla_layouts(),
    seed=st.integers(0, 2**31),
    fraction=_FRACTIONS,
    bias=st.booleans(),
    query=st.sampled_from(["wq_b", "wq"]),
)
def test_mla_scales_each_head_by_exactly_gamma(lay, seed, fraction, bias, query):
  params, inputs = _mla_case(seed, lay, bias=bias, query=query)
  before = _logits(params["attn"], inputs, lay)
  s = np_max_logits(before).astype(np.float32)
  tau = _threshold(s, fraction)
  out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)
  after = _logits(out["attn"], inputs, lay)
  clipped, gamma = _gammas(s, tau)
  _assert_scaled(after, before, gamma, exact=~clipped)
  assert np.all(np_max_logits(after) <= tau * (1 + _TOL))
  # k^R (wkv_a), v columns and wo are untouched, dtypes kept.
  for name in ("wkv_a", "wo"):
    assert out["attn"][name]["kernel"] is params["attn"][name]["kernel"]
  nope, v = lay.qk_nope_head_dim, lay.v_head_dim
  v_cols = np.arange(lay.num_heads * (nope + v)).reshape(lay.num_heads, nope + v)[:, nope:].ravel()
  np.testing.assert_array_equal(
      np.asarray(out["attn"]["wkv_b"]["kernel"])[:, v_cols], params["attn"]["wkv_b"]["kernel"][:, v_cols]
  )
  chex.assert_trees_all_equal_dtypes(out, params)
  chex.assert_trees_all_equal_shapes(out, params)


@settings(max_examples=30)
@given(lay=_gqa_layouts(), seed=st.integers(0, 2**31), fraction=_FRACTIONS, bias=st.booleans())
def test_gqa(lay, seed, fraction, bias):
  params, inputs = _gqa_case(seed, lay, bias=bias)
  before = _logits(params["attn"], inputs, lay)
  s = np_max_logits(before).astype(np.float32)
  tau = _threshold(s, fraction)
  out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)
  after = _logits(out["attn"], inputs, lay)
  clipped, gamma = _gammas(s, tau)
  assert np.all(np_max_logits(after) <= tau * (1 + _TOL))
  if lay.clip_mode == "query" or lay.group_size == 1:
    # "query": exactly gamma_h. MHA "split": sqrt(gamma_h)^2 = gamma_h.
    _assert_scaled(after, before, gamma, exact=~clipped)
  else:
    # "split": head h by sqrt(gamma_h * min_group gamma); a group with no clip is untouched.
    group_min = gamma.reshape(lay.num_kv_heads, lay.group_size).min(-1)
    group_clipped = clipped.reshape(lay.num_kv_heads, lay.group_size).any(-1)
    factors = np.sqrt(gamma * np.repeat(group_min, lay.group_size))
    _assert_scaled(after, before, factors, exact=~np.repeat(group_clipped, lay.group_size))
  if lay.clip_mode == "query":
    assert out["attn"]["wk"]["kernel"] is params["attn"]["wk"]["kernel"]
  assert out["attn"]["wv"]["kernel"] is params["attn"]["wv"]["kernel"]
  chex.assert_trees_all_equal_dtypes(out, params)


@settings(max_examples=15)
@given(
    lay=_mla_layouts() | _gqa_layouts(),
    seed=st.integers(0, 2**31),
    fraction=_FRACTIONS,
    bias=st.booleans(),
)
def test_idempotent(lay, seed, fraction, bias):
  """A second clip with recomputed maxima changes nothing (up to 1-2 ulp rounding at tau)."""
  case = _mla_case if isinstance(lay, MLALayout) else _gqa_case
  params, inputs = case(seed, lay, bias=bias)
  s = np_max_logits(_logits(params["attn"], inputs, lay)).astype(np.float32)
  tau = _threshold(s, fraction)
  once = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)
  s2 = np_max_logits(_logits(once["attn"], inputs, lay)).astype(np.float32)
  twice = qk_clip(once, {"attn": {"max_logits": s2}}, qk_clip_threshold=tau, layout=lay)
  chex.assert_trees_all_close(twice, once, rtol=1e-6, atol=0)
  if np.all(s2 <= tau):
    chex.assert_trees_all_equal(twice, once)


def _by_kv_group(q, k, v, lay):
  """Separate ``(..., in, heads * D)`` q, k, v as one fused kernel grouped by key/value head
  (Bloom, GPT-NeoX): per key/value head its query heads, its key, its value."""
  cols = lambda x, n: x.reshape(*x.shape[:-1], lay.num_kv_heads, n * lay.head_dim)  # noqa: E731
  fused = np.concatenate([cols(q, lay.group_size), cols(k, 1), cols(v, 1)], axis=-1)
  return fused.reshape(*fused.shape[:-2], -1)


@settings(max_examples=20)
@given(lay=_gqa_layouts(), seed=st.integers(0, 2**31), fraction=_FRACTIONS, bias=st.booleans(),
       storage=st.sampled_from(["in_out", "out_in", "stacked"]))
def test_qkv_grouped_by_kv_head_clips_as_separate_projections(lay, seed, fraction, bias, storage):
  """``Projection(qkv, grouped=True)``: the columns of every query and key head get exactly the factors
  that separate projections get (kernel and bias), the value columns none."""
  params, inputs = _gqa_case(seed, lay, bias=bias)
  attn = params["attn"]
  s = np_max_logits(_logits(attn, inputs, lay)).astype(np.float32)
  tau = _threshold(s, fraction)
  want = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)["attn"]
  wv_bias = np.zeros(attn["wv"]["kernel"].shape[-1], np.float32) + 3.0
  fused = {"kernel": _by_kv_group(*(attn[n]["kernel"] for n in ("wq", "wk", "wv")), lay)}
  if bias:
    fused["bias"] = _by_kv_group(attn["wq"]["bias"], attn["wk"]["bias"], wv_bias, lay)
  axes, maxima = ("in", "out"), s
  if storage == "out_in":
    fused["kernel"], axes = fused["kernel"].T, ("out", "in")
  elif storage == "stacked":  # two layers, the second with other maxima
    fused = {n: np.stack([x, 2 * x]) for n, x in fused.items()}
    axes, maxima = ("layers", "in", "out"), np.stack([s, s / 4])
  grouped = GQALayout(lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.clip_mode,
                      qkv=mc.Projection("qkv", axes=None if storage == "in_out" else axes, grouped=True))
  got = qk_clip({"attn": {"qkv": fused}}, {"attn": {"max_logits": maxima}}, qk_clip_threshold=tau,
                layout=grouped)["attn"]["qkv"]
  kernel = np.asarray(got["kernel"])
  kernel = kernel.T if storage == "out_in" else kernel[0] if storage == "stacked" else kernel
  np.testing.assert_allclose(kernel, _by_kv_group(*(np.asarray(want[n]["kernel"]) for n in ("wq", "wk", "wv")), lay),
                             rtol=1e-6, atol=0)
  if bias:
    b = np.asarray(got["bias"])[0] if storage == "stacked" else np.asarray(got["bias"])
    np.testing.assert_allclose(b, _by_kv_group(np.asarray(want["wq"]["bias"]), np.asarray(want["wk"]["bias"]),
                                               wv_bias, lay), rtol=1e-6, atol=0)
  if storage == "stacked":  # the second layer by its own maxima
    want2 = qk_clip(params, {"attn": {"max_logits": s / 4}}, qk_clip_threshold=tau, layout=lay)["attn"]
    np.testing.assert_allclose(np.asarray(got["kernel"])[1], 2 * _by_kv_group(
        *(np.asarray(want2[n]["kernel"]) for n in ("wq", "wk", "wv")), lay), rtol=1e-6, atol=0)


def test_grouped_is_declared_only_for_a_fused_qkv_with_flattened_columns():
  with pytest.raises(ValueError, match=r"key=Projection\(name='wk'.*grouped=True orders the columns of a fused "
                                       r"q\|k\|v projection, which is declared as qkv="):
    GQALayout(4, 2, 3, key=mc.Projection("wk", grouped=True))
  with pytest.raises(ValueError, match=r"grouped=True orders flattened columns, so its axes need an 'out' axis and "
                                       r"no 'parts' axis, got axes=\('in', 'parts', 'heads', 'head_dim'\)"):
    mc.Projection("qkv", axes=("in", "parts", "heads", "head_dim"), grouped=True)
  with pytest.raises(TypeError, match=r"Projection\('qkv'\): grouped must be a bool"):
    mc.Projection("qkv", grouped="yes")
  # (in, 3, H, D) fits the block-ordered layout, never a grouped one: a ValueError, not a guess
  lay = GQALayout(2, 2, 3, qkv=mc.Projection("qkv", grouped=True))
  with pytest.raises(ValueError, match=r"attn/qkv/kernel has shape \(5, 3, 2, 3\).*fits no kernel form"):
    qk_clip({"attn": {"qkv": {"kernel": jnp.ones((5, 3, 2, 3))}}}, {"attn": {"max_logits": jnp.ones(2)}},
            qk_clip_threshold=0.5, layout=lay)
  boxed = nn.Partitioned(jnp.ones((5, 3, 2, 3)), names=("embed", "qkv", "heads", "kv"))  # names say: a parts axis
  with pytest.raises(ValueError, match=r"attn/qkv/kernel: the axes \('in', 'parts', 'heads', 'head_dim'\) read from "
                                       r"its logical names \('embed', 'qkv', 'heads', 'kv'\): .*grouped=True"):
    qk_clip({"attn": {"qkv": {"kernel": boxed}}}, {"attn": {"max_logits": jnp.ones(2)}}, qk_clip_threshold=0.5,
            layout=lay)


# ----------------------------------------------------------------------------- exactness


def test_unclipped_heads_bit_for_bit():
  lay = MLALayout(4, 3, 2, 2)
  params, _ = _mla_case(0, lay, bias=True)
  s = np.array([1.0, 50.0, 2.0, 3.0], np.float32)  # only head 1 clipped at tau = 3
  out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=3.0, layout=lay)
  q_in, q_out = params["attn"]["wq_b"]["kernel"], np.asarray(out["attn"]["wq_b"]["kernel"])
  q_heads = lambda w: w.reshape(w.shape[0], 4, 5)
  for h in (0, 2, 3):
    np.testing.assert_array_equal(q_heads(q_out)[:, h], q_heads(q_in)[:, h])
  np.testing.assert_allclose(q_heads(q_out)[:, 1, :3], q_heads(q_in)[:, 1, :3] * np.sqrt(3 / 50), rtol=1e-6)
  np.testing.assert_allclose(q_heads(q_out)[:, 1, 3:], q_heads(q_in)[:, 1, 3:] * (3 / 50), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtype_kept(dtype):
  lay = GQALayout(4, 2, 3)
  params, _ = _gqa_case(1, lay, bias=True)
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  s = jnp.array([1.0, 9.0, 0.5, 2.0], jnp.bfloat16)
  out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=2.0, layout=lay)
  chex.assert_trees_all_equal_dtypes(out, params)
  wq, wq_new = (np.asarray(t["attn"]["wq"]["kernel"], np.float32).reshape(6, 4, 3) for t in (params, out))
  np.testing.assert_array_equal(wq_new[:, [0, 3]], wq[:, [0, 3]])  # group 1 unclipped
  expected = (wq[:, 1] * np.float32(np.sqrt(2 / 9))).astype(dtype).astype(np.float32)
  np.testing.assert_array_equal(wq_new[:, 1], expected)


def test_nonfinite_and_nonpositive_maxima_leave_heads_alone():
  lay = MLALayout(6, 2, 2, 1)
  params, _ = _mla_case(2, lay, bias=True)
  s = np.array([np.nan, np.inf, -np.inf, -5.0, 0.0, 40.0], np.float32)
  out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=4.0, layout=lay)
  for name, width in (("wq_b", 4), ("wkv_b", 3)):
    old = params["attn"][name]["kernel"].reshape(-1, 6, width)
    new = np.asarray(out["attn"][name]["kernel"]).reshape(-1, 6, width)
    np.testing.assert_array_equal(new[:, :5], old[:, :5])
    assert np.all(np.isfinite(new))
    assert not np.allclose(new[:, 5, :2], old[:, 5, :2])
  stats = qk_clip_stats({"attn": {"max_logits": s}}, qk_clip_threshold=4.0)["attn"]
  assert int(stats["num_nonfinite"]) == 3 and int(stats["num_clipped"]) == 1


@pytest.mark.parametrize("threshold", [None, float("inf"), np.float32(np.inf)])
def test_no_threshold_returns_params_unchanged(threshold):
  lay = GQALayout(2, 2, 2)
  params, _ = _gqa_case(0, lay)
  ml = {"attn": {"max_logits": np.full(2, 1e9)}}
  assert qk_clip(params, ml, qk_clip_threshold=threshold, layout=lay) is params
  assert qk_clip(params, None, qk_clip_threshold=threshold, layout=lay) is params  # maxima not read


def test_per_head_factors_in_the_report():
  s = jnp.array([[1.0, 4.0, jnp.nan, -1.0], [8.0, 2.0, jnp.inf, 0.0]])
  gamma = lambda tau: qk_clip_stats({"attn": {"max_logits": s}}, qk_clip_threshold=tau)["attn"]["gamma"]
  chex.assert_trees_all_close(gamma(2.0), jnp.array([[1.0, 0.5, 1.0, 1.0], [0.25, 1.0, 1.0, 1.0]]))
  chex.assert_trees_all_equal(gamma(None), jnp.ones((2, 4)))


# ----------------------------------------------------------------------------- jit, tracing


@pytest.mark.parametrize(
    "lay",
    [MLALayout(3, 2, 2, 2), GQALayout(6, 2, 3), GQALayout(6, 3, 2, clip_mode="query")],
    ids=["mla", "gqa-split", "gqa-query"],
)
def test_jit_matches_eager_and_traced_threshold(lay):
  case = _mla_case if isinstance(lay, MLALayout) else _gqa_case
  params, inputs = case(3, lay, bias=True)
  s = np_max_logits(_logits(params["attn"], inputs, lay)).astype(np.float32)
  ml = {"intermediates": {"attn": {"max_logits": (s,)}}}  # mutable-apply dict, default-sow tuple
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def clip(p, m, tau):
    return qk_clip(p, m, qk_clip_threshold=tau, layout=lay)

  for fraction in (0.3, 0.8, 2.0):
    tau = _threshold(s, fraction)
    eager = qk_clip(params, ml, qk_clip_threshold=tau, layout=lay)
    assert_same_math(clip(params, ml, tau), eager)
    static = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))(params, ml)
    assert_same_math(static, eager)
  # Traced thresholds that are NaN, infinite or <= 0 clip nothing.
  for bad in (np.nan, np.inf, 0.0, -3.0):
    chex.assert_trees_all_equal(clip(params, ml, np.float32(bad)), params)


def test_stats():
  s = jnp.array([[1.0, 5.0, jnp.nan, 3.0], [2.0, 2.0, -jnp.inf, 200.0]])
  ml = {"intermediates": {"layers": {"attn": {"max_logits": s}}, "head": {"max_logits": s[1]}}}
  stats = jax.jit(lambda m, t: qk_clip_stats(m, qk_clip_threshold=t))(ml, 2.5)
  assert set(stats) == {"layers/attn", "head"}
  st_ = stats["layers/attn"]
  chex.assert_trees_all_equal(
      {k: st_[k] for k in ("num_clipped", "num_heads", "num_nonfinite")},
      {
          "num_clipped": jnp.array([2, 1], jnp.int32),
          "num_heads": jnp.array([4, 4], jnp.int32),
          "num_nonfinite": jnp.array([1, 1], jnp.int32),
      },
  )
  chex.assert_trees_all_close(st_["min_gamma"], jnp.array([0.5, 2.5 / 200]))
  assert np.isnan(st_["max_logit"][0]) and st_["max_logit"][1] == 200.0
  assert st_["min_gamma"].dtype == jnp.float32 and st_["max_logit"].dtype == jnp.float32
  chex.assert_shape([v for k, v in stats["head"].items() if k != "gamma"], ())
  chex.assert_shape(stats["head"]["gamma"], (4,))  # per head
  chex.assert_trees_all_close(st_["gamma"], jnp.array([[1.0, 0.5, 1.0, 2.5 / 3], [1.0, 1.0, 1.0, 2.5 / 200]]))
  off = qk_clip_stats(ml, qk_clip_threshold=None)["layers/attn"]
  chex.assert_trees_all_equal((off["num_clipped"], off["min_gamma"]), (jnp.zeros(2, jnp.int32), jnp.ones(2)))


# ----------------------------------------------------------------------------- stacked layers


@pytest.mark.parametrize("stack", [(3,), (2, 2)])
@pytest.mark.parametrize(
    "lay", [MLALayout(2, 3, 2, 2), GQALayout(4, 2, 2)], ids=["mla", "gqa-split"]
)
def test_stacked_layers_match_per_layer(stack, lay):
  case = _mla_case if isinstance(lay, MLALayout) else _gqa_case
  n = int(np.prod(stack))
  layers = [case(i, lay, bias=True) for i in range(n)]
  maxima = [np_max_logits(_logits(p["attn"], x, lay)).astype(np.float32) for p, x in layers]
  tau = np.float32(np.median(np.concatenate(maxima)))
  per_layer = [
      qk_clip(p, {"attn": {"max_logits": m}}, qk_clip_threshold=tau, layout=lay)
      for (p, _), m in zip(layers, maxima)
  ]
  stack_tree = lambda trees: jax.tree.map(
      lambda *xs: np.stack([np.asarray(x) for x in xs]).reshape(*stack, *np.shape(xs[0])), *trees
  )
  stacked = qk_clip(
      stack_tree([p for p, _ in layers]),
      {"attn": {"max_logits": np.stack(maxima).reshape(*stack, -1)}},
      qk_clip_threshold=tau,
      layout=lay,
  )
  assert_same_math(stacked, stack_tree(per_layer))


# ----------------------------------------------------------------------------- sharding


def _assert_no_weight_gather(hlo, min_weight_size):
  """No all-gather in compiled HLO whose result (any tuple element) has >= min_weight_size elements."""
  big = []
  for line in hlo.splitlines():
    match = re.search(r"=\s*(.+?)\s+all-gather(?:-start)?\(", line)
    if match:
      shapes = re.findall(r"\[([\d,]*)\]", match.group(1))
      sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in shapes]
      if any(size >= min_weight_size for size in sizes):
        big.append(line.strip())
  assert not big, "weight-sized all-gather in compiled HLO:\n" + "\n".join(big)


def test_weight_gather_check_detects_a_gather():
  """Negative control for _assert_no_weight_gather: replicating a column-sharded kernel gathers it."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  kernel = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P(None, "model")))
  gather = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P())))
  with pytest.raises(AssertionError, match="weight-sized all-gather"):
    _assert_no_weight_gather(gather.lower(kernel).compile().as_text(), kernel.size // 4)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
@pytest.mark.parametrize(
    "lay", [MLALayout(4, 2, 2, 2), GQALayout(8, 4, 2)], ids=["mla", "gqa-split"]
)
def test_head_sharded_kernels_on_mesh(lay, axis_type):
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  if isinstance(lay, MLALayout):
    layers = [_mla_case(i, lay, bias=True, q_in=8, kv_rank=8) for i in range(2)]
  else:
    layers = [_gqa_case(i, lay, bias=True, d=8) for i in range(2)]
  params = jax.tree.map(lambda *xs: np.stack(xs), *[p for p, _ in layers])
  maxima = np.stack([np_max_logits(_logits(p["attn"], x, lay)) for p, x in layers]).astype(np.float32)
  ml = {"attn": {"max_logits": maxima}}
  tau = np.float32(np.median(maxima))
  expected = qk_clip(params, ml, qk_clip_threshold=tau, layout=lay)

  def shard(path, x):  # head-sharded columns of the clipped projections, the rest replicated
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    clipped = any(p in name for p in ("wq", "wk/", "wkv_b"))
    spec = P(*([None] * (x.ndim - 1)), "model") if clipped else P()
    return jax.device_put(x, NamedSharding(mesh, spec))

  sharded = jax.tree_util.tree_map_with_path(shard, params)
  ml_sharded = jax.device_put(ml, NamedSharding(mesh, P()))
  fn = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))
  with jax.set_mesh(mesh):
    out = fn(sharded, ml_sharded)
    eager = qk_clip(sharded, ml_sharded, qk_clip_threshold=tau, layout=lay)
    hlo = fn.lower(sharded, ml_sharded).compile().as_text()
  for result in (out, eager):
    assert_same_math(result, expected)
    jax.tree.map(lambda a, b: _assert_same_sharding(a, b), result, sharded)
  _assert_no_weight_gather(hlo, min(x.size // 4 for x in jax.tree.leaves(params) if x.ndim == 3))


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
@pytest.mark.parametrize(
    "lay", [MLALayout(4, 2, 2, 2), GQALayout(8, 4, 2)], ids=["mla", "gqa-split"]
)
def test_dense_general_kernels_sharded_over_heads(lay, axis_type):
  """DenseGeneral (L, in, heads, width) kernels sharded over the heads axis: no gather, same values."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  if isinstance(lay, MLALayout):
    layers = [_mla_case(i, lay, bias=True, q_in=8, kv_rank=8) for i in range(2)]
    widths = {"wq_b": lay.qk_head_dim, "wkv_b": lay.qk_nope_head_dim + lay.v_head_dim}
  else:
    layers = [_gqa_case(i, lay, bias=True, d=8) for i in range(2)]
    widths = {"wq": lay.head_dim, "wk": lay.head_dim}
  flat = jax.tree.map(lambda *xs: np.stack(xs), *[p for p, _ in layers])
  maxima = np.stack([np_max_logits(_logits(p["attn"], x, lay)) for p, x in layers]).astype(np.float32)
  ml = {"attn": {"max_logits": maxima}}
  tau = np.float32(np.median(maxima))

  def dense_general(path, x):  # (L, in, H*W) -> (L, in, H, W); bias (L, H*W) -> (L, H, W)
    names = [str(k.key) for k in path]
    width = widths.get(names[1])
    return x if width is None else np.asarray(x).reshape(*x.shape[:-1], -1, width)

  params = jax.tree_util.tree_map_with_path(dense_general, flat)
  expected = jax.tree_util.tree_map_with_path(dense_general, qk_clip(flat, ml, qk_clip_threshold=tau, layout=lay))

  def shard(path, x):
    heads = [str(k.key) for k in path][1] in widths
    spec = P(*([None] * (x.ndim - 2)), "model", None) if heads else P()
    return jax.device_put(x, NamedSharding(mesh, spec))

  sharded = jax.tree_util.tree_map_with_path(shard, params)
  fn = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))
  with jax.set_mesh(mesh):
    ml_sharded = jax.device_put(ml, NamedSharding(mesh, P()))
    out = fn(sharded, ml_sharded)
    hlo = fn.lower(sharded, ml_sharded).compile().as_text()
  assert_same_math(out, expected)
  jax.tree.map(_assert_same_sharding, out, sharded)
  for name in widths:
    assert params["attn"][name]["kernel"].ndim == 4 and params["attn"][name]["bias"].ndim == 3
  assert not np.array_equal(expected["attn"]["wq" if "wq" in widths else "wq_b"]["kernel"],
                            params["attn"]["wq" if "wq" in widths else "wq_b"]["kernel"])  # it clipped
  _assert_no_weight_gather(hlo, min(x.size // 4 for x in jax.tree.leaves(params) if x.ndim == 4))


def _assert_same_sharding(a, b):
  assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


# ----------------------------------------------------------------------------- Flax params


class _ToyAttention(nn.Module):
  """Causal MHA/GQA with logically partitioned, biased wq/wk/wv/wo; sows per-head max logits."""

  num_heads: int
  num_kv_heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x):
    h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
    b, t, e = x.shape

    def dense(features, name, axis):
      init = nn.initializers.normal(1.5)
      return nn.Dense(
          features,
          name=name,
          kernel_init=nn.with_logical_partitioning(init, ("embed", axis)),
          bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.5), (axis,)),
      )

    q = dense(h * d, "wq", "heads")(x).reshape(b, t, h, d)
    k = jnp.repeat(dense(kv * d, "wk", "kv_heads")(x).reshape(b, t, kv, d), h // kv, axis=2)
    v = jnp.repeat(dense(kv * d, "wv", "kv_heads")(x).reshape(b, t, kv, d), h // kv, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    self.sow(
        "intermediates",
        "max_logits",
        logits.max(axis=(0, 2, 3)),
        init_fn=lambda: jnp.full((h,), -jnp.inf, jnp.float32),
        reduce_fn=jnp.maximum,
    )
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v).reshape(b, t, h * d)
    return x + dense(e, "wo", "embed")(out)


class _Block(nn.Module):
  num_heads: int
  num_kv_heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x, _):
    return _ToyAttention(self.num_heads, self.num_kv_heads, self.head_dim, name="attn")(x), None


class _ScannedModel(nn.Module):
  num_layers: int
  lay: GQALayout

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(
        _Block,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        length=self.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = blocks(self.lay.num_heads, self.lay.num_kv_heads, self.lay.head_dim, name="layers")(x, None)
    return _ToyAttention(self.lay.num_heads, self.lay.num_kv_heads, self.lay.head_dim, name="top")(x)


@pytest.mark.parametrize("mode", ["split", "query"])
def test_linen_scanned_boxed_params(mode):
  """nn.scan-stacked layers plus one unstacked module, nn.Partitioned params, real sow."""
  lay = GQALayout(4, 2 if mode == "query" else 4, 4, clip_mode=mode)
  model = _ScannedModel(num_layers=3, lay=lay)
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  params = jax.jit(model.init)(jax.random.key(1), x)["params"]
  assert isinstance(params["layers"]["attn"]["wq"]["kernel"], nn.Partitioned)
  apply = jax.jit(lambda p: model.apply({"params": p}, x, mutable=["intermediates"])[1])
  inter = apply(params)
  old = {"layers/attn": inter["intermediates"]["layers"]["attn"]["max_logits"],
         "top": inter["intermediates"]["top"]["max_logits"]}
  chex.assert_shape([old["layers/attn"], old["top"]], [(3, 4), (4,)])
  tau = float(jnp.median(old["layers/attn"]))
  clip = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))
  out = clip(params, inter)
  # Same boxes (logical names included), values as for unboxed params.
  assert jax.tree.structure(out) == jax.tree.structure(params)
  plain = clip(nn.unbox(params), inter["intermediates"])
  assert_same_math(nn.unbox(out), plain)
  inter2 = apply(out)
  new = {"layers/attn": inter2["intermediates"]["layers"]["attn"]["max_logits"],
         "top": inter2["intermediates"]["top"]["max_logits"]}
  stats = jax.jit(lambda m: qk_clip_stats(m, qk_clip_threshold=tau))(inter)
  assert set(stats) == set(old)
  for module in old:
    o, n = np.asarray(old[module]), np.asarray(new[module])
    assert np.all(n <= tau * (1 + _TOL))
    np.testing.assert_array_equal(n[o <= tau], o[o <= tau])  # MHA split / GQA query: exact
    np.testing.assert_array_equal(stats[module]["num_clipped"], (o > tau).sum(-1))


class _NNXAttention(nnx.Module):
  def __init__(self, lay, d, rngs):
    self.lay = lay
    init = nnx.initializers.normal(1.5)
    self.wq = nnx.Linear(d, lay.num_heads * lay.head_dim, kernel_init=init, bias_init=init, rngs=rngs)
    self.wk = nnx.Linear(d, lay.num_kv_heads * lay.head_dim, kernel_init=init, bias_init=init, rngs=rngs)

  def __call__(self, x):
    lay = self.lay
    logits = np_gqa_logits(
        np.asarray(x),
        wq=self.wq.kernel[...],
        wk=self.wk.kernel[...],
        wq_bias=self.wq.bias[...],
        wk_bias=self.wk.bias[...],
        num_heads=lay.num_heads,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
    )
    value = jnp.asarray(np_max_logits(logits), jnp.float32)
    self.sow(nnx.Intermediate, "max_logits", value, reduce_fn=jnp.maximum,
             init_fn=lambda: jnp.full((lay.num_heads,), -jnp.inf, jnp.float32))
    return value


class _NNXModel(nnx.Module):
  def __init__(self, lay, d, rngs):
    self.attn = _NNXAttention(lay, d, rngs)

  def __call__(self, x):
    return self.attn(x)


def test_nnx_state():
  lay = GQALayout(4, 2, 3, clip_mode="query")
  model = _NNXModel(lay, 6, nnx.Rngs(0))
  x = np.random.default_rng(0).normal(size=(2, 5, 6)).astype(np.float32)
  _, inter = nnx.capture(model, nnx.Intermediate)(x)
  s = np.asarray(inter["attn"]["max_logits"][...])
  tau = float(np.median(s))
  state = nnx.state(model, nnx.Param)
  out = qk_clip(state, inter, qk_clip_threshold=tau, layout=lay)
  assert isinstance(out, nnx.State)
  assert jax.tree.structure(out) == jax.tree.structure(state)
  assert isinstance(out["attn"]["wq"]["kernel"], nnx.Param)
  plain = qk_clip(nnx.to_pure_dict(state), {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)
  assert_same_math(nnx.to_pure_dict(out), plain)
  nnx.update(model, out)
  new = np.asarray(nnx.capture(model, nnx.Intermediate)(x)[0])
  assert np.all(new <= tau * (1 + _TOL))
  np.testing.assert_allclose(new, np.minimum(s, tau), rtol=_TOL)


# ----------------------------------------------------------------------------- layouts by path


def test_layout_mapping():
  mla, gqa = MLALayout(2, 2, 2, 2), GQALayout(4, 2, 2)
  (p_mla, _), (p_gqa, _) = _mla_case(0, mla), _gqa_case(0, gqa)
  params = {"dec": {"l0": p_mla, "l1": p_gqa}}
  ml = {"dec": {"l0": {"attn": {"max_logits": np.array([1.0, 9.0])}},
                "l1": {"attn": {"max_logits": np.array([9.0, 1.0, 1.0, 1.0])}}}}
  out = qk_clip(params, ml, qk_clip_threshold=3.0, layout={"dec/l0/*": mla, "*/l1/attn": gqa})
  assert_same_math(
      out["dec"]["l0"],
      qk_clip(p_mla, {"attn": {"max_logits": np.array([1.0, 9.0])}}, qk_clip_threshold=3.0, layout=mla),
  )
  assert_same_math(
      out["dec"]["l1"],
      qk_clip(p_gqa, {"attn": {"max_logits": np.array([9.0, 1.0, 1.0, 1.0])}}, qk_clip_threshold=3.0, layout=gqa),
  )
  with pytest.raises(ValueError, match=r"no pattern .* 'dec/l1/attn'"):
    qk_clip(params, ml, qk_clip_threshold=3.0, layout={"dec/l0/*": mla})
  with pytest.raises(ValueError, match=r"2 patterns .* 'dec/l0/attn'"):
    qk_clip(params, ml, qk_clip_threshold=3.0, layout={"dec/*": mla, "*/l0/attn": mla, "*/l1/*": gqa})


def test_attention_module_without_maxima_raises():
  """An attention module that sowed no max_logits is an error, never a silently skipped clip."""
  lay = GQALayout(4, 2, 2)
  (p0, _), (p1, _) = _gqa_case(0, lay), _gqa_case(1, lay)
  params = {"l0": p0, "l1": p1}
  ml = {"l0": {"attn": {"max_logits": np.array([9.0, 1.0, 1.0, 1.0], np.float32)}}}
  with pytest.raises(ValueError, match=r"\['l1/attn'\] have the query/key projections .* sow_weights=True"):
    qk_clip(params, ml, qk_clip_threshold=3.0, layout=lay)
  both = {**ml, "l1": {"attn": {"max_logits": np.ones(4, np.float32)}}}
  out = qk_clip(params, both, qk_clip_threshold=3.0, layout=lay)
  chex.assert_trees_all_equal(out["l1"], p1)


def test_an_additive_bias_counts_in_the_maxima_but_is_not_scaled():
  """The drop-in attention's maxima include an additive bias ``b`` (the softmax sees it); the clip
  scales ``q.k`` only, so a clipped head ends at ``tau + b (1 - gamma_h)`` (docs/your-model.md)."""
  from muonclip_jax import nn as mnn

  class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
      q, k, v = (nn.DenseGeneral((2, 4), name=n)(x) for n in ("query", "key", "value"))
      return mnn.dot_product_attention(q, k, v, bias=jnp.full((1, 2, 5, 5), 1.5))

  x = 2.0 * jax.random.normal(jax.random.key(0), (2, 5, 8))
  params = Attn().init(jax.random.key(1), x)["params"]
  maxima = lambda p: np.asarray(Attn().apply({"params": p}, x, mutable=["intermediates"])[1][  # noqa: E731
      "intermediates"]["max_logits"], np.float64)
  s, tau = maxima(params), 2.5
  assert np.all(s > tau), s
  after = maxima(qk_clip(params, {"max_logits": s}, qk_clip_threshold=tau,
                        layout=GQALayout(2, 2, 4, query="query", key="key")))
  np.testing.assert_allclose(after, tau + 1.5 * (1 - tau / s), rtol=1e-5)


@pytest.mark.parametrize("form", ["dotted", "tuple", "slash"])
def test_flat_keyed_maxima_and_params_clip_as_their_nested_form(form):
  """Maxima flattened as the parameters may be (safetensors' dotted keys, ``flatten_dict``'s tuples,
  ``/``-joined keys) are read by their components, as the parameters' keys are."""
  from flax import traverse_util
  lay = GQALayout(4, 2, 2)
  params, _ = _gqa_case(0, lay)
  ml = {"attn": {"max_logits": np.array([9.0, 1.0, 4.0, 1.0], np.float32)}}
  flat = lambda tree: {{"dotted": ".".join(k), "slash": "/".join(k)}.get(form, k): v  # noqa: E731
                       for k, v in traverse_util.flatten_dict(tree).items()}
  got = qk_clip(flat(params), flat(ml), qk_clip_threshold=3.0, layout=lay)
  want = flat(qk_clip(params, ml, qk_clip_threshold=3.0, layout=lay))
  assert got.keys() == want.keys()
  assert_same_math(got, want)
  wq = next(k for k in got if "wq" in str(k) and "kernel" in str(k))
  assert not np.allclose(got[wq], flat(params)[wq])  # head 0 is clipped


def test_root_module():
  lay = GQALayout(2, 2, 2)
  params, _ = _gqa_case(0, lay)
  out = qk_clip(params["attn"], {"max_logits": np.array([9.0, 1.0])}, qk_clip_threshold=3.0, layout=lay)
  assert_same_math(
      out, qk_clip(params, {"attn": {"max_logits": np.array([9.0, 1.0])}}, qk_clip_threshold=3.0, layout=lay)["attn"]
  )


def test_raw_square_arrays_of_an_unknown_equinox_module_are_refused_or_exact():
  """A custom eqx.Module holding its q/k projections as raw (heads * head_dim, width) arrays,
  used as x @ w.T like eqx.nn.Linear. Undeclared and square, (in, out) and (out, in) both fit: refused,
  whatever the leaf's name (the clip scaled input columns: maxima [42.2, 15.6] -> [33.6, 13.5], not tau).
  Declared (out, in): exact. The same arrays in a plain dict keep Flax's (in, out) convention."""
  eqx = pytest.importorskip("equinox")

  class RawAttention(eqx.Module):
    wq: jax.Array
    wk: jax.Array

  rng = np.random.default_rng(0)
  attn = RawAttention(*(jnp.asarray(rng.standard_normal((8, 8)), jnp.float32) for _ in range(2)))
  x = rng.standard_normal((5, 8))

  def maxima(a):  # 2 heads of 4: q = x @ wq.T (Equinox's convention)
    q, k = (np.asarray(x @ np.asarray(w, np.float64).T).reshape(5, 2, 4) for w in (a.wq, a.wk))
    return np.einsum("qhd,khd->hqk", q, k).max(axis=(1, 2)) / 2.0

  s = maxima(attn)
  tau = 0.5 * float(s.min())
  intermediates = {"max_logits": jnp.asarray(s, jnp.float32)}
  params = {"attn": attn}
  undeclared = GQALayout(2, 2, 4, query=mc.Projection("attn", leaf="wq"), key=mc.Projection("attn", leaf="wk"),
                         value=None, out=None)
  with pytest.raises(ValueError, match=r"attn/wq is a square kernel of shape \(8, 8\) held by the Equinox module "
                                       r"RawAttention.*Projection\('attn', leaf='wq', axes=\('out', 'in'\)\)"):
    qk_clip(params, intermediates, qk_clip_threshold=tau, layout=undeclared)
  with pytest.raises(ValueError, match="held by the Equinox module RawAttention"):
    mc.init_max_logits(params, undeclared)
  with pytest.raises(ValueError, match="held by the Equinox module RawAttention"):
    mc.scale_by_muon(layout=undeclared, muon_blocks="head").init(params)
  declared = GQALayout(2, 2, 4, query=mc.Projection("attn", leaf="wq", axes=("out", "in")),
                       key=mc.Projection("attn", leaf="wk", axes=("out", "in")), value=None, out=None)
  clipped = qk_clip(params, intermediates, qk_clip_threshold=tau, layout=declared)["attn"]
  np.testing.assert_allclose(maxima(clipped), tau, rtol=1e-5)  # every head was above tau: now on it
  # a non-square raw array fits only one way: refused with the declaration to write
  tall = {"attn": RawAttention(jnp.ones((8, 6)), jnp.ones((8, 6)))}
  with pytest.raises(ValueError, match=r"attn/wq has shape \(8, 6\).*held by an Equinox module is \(out, in\)"):
    qk_clip(tall, intermediates, qk_clip_threshold=tau, layout=undeclared)
  # a plain dict: the documented Flax convention, (in, out) (a leaf named 'weight' would be refused)
  plain = {"attn": {"wq": attn.wq, "wk": attn.wk}}
  got = qk_clip(plain, intermediates, qk_clip_threshold=tau, layout=undeclared)["attn"]["wq"]
  np.testing.assert_allclose(got[:, :4], attn.wq[:, :4] * np.sqrt(tau / s[0]), rtol=1e-6)  # head 0's columns


# ----------------------------------------------------------------------------- errors


def _clip(params, s, *, qk_clip_threshold=3.0, layout, module="attn"):
  ml = {module: {"max_logits": np.asarray(s, np.float32)}}
  return qk_clip(params, ml, qk_clip_threshold=qk_clip_threshold, layout=layout)


@pytest.mark.parametrize("threshold", [float("nan"), 0.0, -1.0, np.float32(-2.0), jnp.float32(jnp.nan)])
def test_bad_threshold(threshold):
  params, _ = _gqa_case(0, GQALayout(2, 2, 2))
  with pytest.raises(ValueError, match="qk_clip_threshold must be > 0"):
    _clip(params, [1.0, 2.0], qk_clip_threshold=threshold, layout=GQALayout(2, 2, 2))
  with pytest.raises(ValueError, match="qk_clip_threshold must be > 0"):
    qk_clip_stats({"attn": {"max_logits": np.ones(2)}}, qk_clip_threshold=threshold)


@pytest.mark.parametrize("threshold", [True, np.bool_(True), "10", 10j, [10.0]])
def test_threshold_takes_the_types_muonclip_takes(threshold):
  """qk_clip and qk_clip_stats refuse what muonclip(qk_clip_threshold=...) refuses (True was
  taken as 1.0, "10" as 10.0), and take NumPy/JAX scalars and inf like it does."""
  lay = GQALayout(2, 2, 2)
  params, _ = _gqa_case(0, lay)
  with pytest.raises(TypeError, match=r"qk_clip: qk_clip_threshold must be a real number"):
    _clip(params, [1.0, 2.0], qk_clip_threshold=threshold, layout=lay)
  with pytest.raises(TypeError, match=r"qk_clip: qk_clip_threshold must be a real number"):
    qk_clip_stats({"attn": {"max_logits": np.ones(2)}}, qk_clip_threshold=threshold)
  with pytest.raises(TypeError, match=r"qk_clip_threshold must be a real number"):
    mc.muonclip(0.1, layout=lay, qk_clip_threshold=threshold)
  for ok in (np.float32(1.5), jnp.asarray(1.5), 1, float("inf")):
    _clip(params, [1.0, 2.0], qk_clip_threshold=ok, layout=lay)
    mc.muonclip(0.1, layout=lay, qk_clip_threshold=ok)


def test_errors():
  gqa = GQALayout(4, 2, 3)
  params, _ = _gqa_case(0, gqa)
  with pytest.raises(ValueError, match=r"'other/wq/kernel'"):
    _clip(params, np.ones(4), layout=gqa, module="other")
  with pytest.raises(ValueError, match=r"no leaf named 'max_logits'"):
    qk_clip(params, {"attn": {"logits": np.ones(4)}}, qk_clip_threshold=3.0, layout=gqa)
  with pytest.raises(ValueError, match=r"attn/max_logits has shape \(5,\) \(5 heads\).*num_heads=4"):
    _clip(params, np.ones(5), layout=gqa)
  with pytest.raises(ValueError, match=r"attn/wq/kernel has shape \(6, 12\), i\.e\. 6 heads of 2 columns"):
    _clip(params, np.ones(4), layout=GQALayout(4, 2, 2))
  with pytest.raises(ValueError, match=r"wq/kernel has shape \(6, 12\): 12 columns .* per-head width 5"):
    _clip(params, np.ones(4), layout=GQALayout(4, 2, 5))
  with pytest.raises(ValueError, match=r"attn/wk/kernel has shape \(6, 6\), i\.e\. 2 heads .* expected 4 heads"):
    _clip(params, np.ones(4), layout=GQALayout(4, 4, 3))
  with pytest.raises(ValueError, match=r"attn/wq/kernel has shape \(6, 12\); expected \(3, 'in', 12\)"):
    _clip(params, np.ones((3, 4)), layout=gqa)
  stacked = jax.tree.map(lambda x: np.stack([x] * 3), params)
  with pytest.raises(ValueError, match=r"attn/wq/kernel has shape \(3, 6, 12\); expected \(2, 'in', 12\)"):
    _clip(stacked, np.ones((2, 4)), layout=gqa)
  bad_bias = jax.tree.map(lambda x: x, params)
  bad_bias["attn"]["wk"]["bias"] = np.ones(5, np.float32)
  with pytest.raises(ValueError, match=r"attn/wk/bias has shape \(5,\)"):
    _clip(bad_bias, np.ones(4), layout=gqa)
  # MLA: missing wkv_b, both wq and wq_b, GQA params under an MLA layout.
  mla = MLALayout(2, 2, 2, 2)
  p_mla, _ = _mla_case(0, mla)
  with pytest.raises(ValueError, match=r"both wq/kernel and wq_b/kernel"):
    both = {"attn": {**p_mla["attn"], "wq": p_mla["attn"]["wq_b"]}}
    _clip(both, np.ones(2), layout=mla)
  with pytest.raises(ValueError, match=r"'attn/wkv_b/kernel' for MLALayout"):
    _clip({"attn": {"wq_b": p_mla["attn"]["wq_b"]}}, np.ones(2), layout=mla)
  with pytest.raises(ValueError, match=r"'attn/wq/kernel' for GQALayout"):
    _clip(p_mla, np.ones(2), layout=GQALayout(2, 2, 2))
  with pytest.raises(TypeError, match="layout must be"):
    _clip(params, np.ones(4), layout=(4, 2, 3))
