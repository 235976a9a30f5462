"""GroupedQueryAttention (GQA/MHA, Linen) and its NNX twin: parameters, max logits, QK-Clip."""

from __future__ import annotations

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import _nn_reference as ref
from _jitted_init import jitted_init
from muonclip_jax import GQALayout, qk_clip
from muonclip_jax import nn as mnn
from _exactness import assert_same_math

DIM, T = 32, 7
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=8)
MHA = dict(num_heads=4, num_kv_heads=4, head_dim=8)


def _x(b=2, t=T, seed=0, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal((b, t, DIM)), jnp.float32)


def _init(module, x=None, seed=0):
  variables = jitted_init(module)(jax.random.key(seed), _x() if x is None else x)
  # Non-zero biases, so that the reference and QK-Clip see them.
  def shift_bias(p):
    if isinstance(p, nn.Partitioned) and p.unbox().ndim == 1:
      return p.replace_boxed(p.unbox() + 0.3)
    return p

  return jax.tree.map(shift_bias, variables, is_leaf=lambda p: isinstance(p, nn.Partitioned))


def _np_params(variables):
  return jax.tree.map(np.asarray, nn.unbox(variables)["params"])


def _apply_fn(module):
  @jax.jit
  def f(variables, x, kw):
    y, state = module.apply(variables, x, mutable=["intermediates"], **kw)
    return y, state["intermediates"]

  return lambda variables, x, **kw: f(variables, x, kw)


def _loss_grad(module, capture):
  def loss(params, x):
    if capture:
      y, state = module.apply({"params": params}, x, mutable=["intermediates"])
      return jnp.sum(jnp.sin(y)), state["intermediates"]["max_logits"]
    return jnp.sum(jnp.sin(module.apply({"params": params}, x))), jnp.zeros(())

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize("bias", [False, True])
def test_param_tree_and_logical_axes(bias):
  module = mnn.GroupedQueryAttention(**GQA, qkv_bias=bias)
  variables = _init(module)
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables)["params"])
  specs = nn.get_partition_spec(variables)["params"]
  expected = {
      "wq": ((DIM, 32), ("embed", "heads")),
      "wk": ((DIM, 16), ("embed", "kv_heads")),
      "wv": ((DIM, 16), ("embed", "kv_heads")),
      "wo": ((32, DIM), ("heads", "embed")),
  }
  assert set(shapes) == set(expected)
  for name, (shape, axes) in expected.items():
    assert shapes[name]["kernel"] == shape and tuple(specs[name]["kernel"]) == axes
    if bias and name != "wo":
      assert shapes[name]["bias"] == (shape[1],) and tuple(specs[name]["bias"]) == axes[1:]
    else:
      assert "bias" not in shapes[name]
  assert module.layout == GQALayout(4, 2, 8, value="wv", out="wo")
  assert mnn.GroupedQueryAttention(**GQA, clip_mode="query").layout.clip_mode == "query"


CASES = {
    "gqa_causal": (GQA, "causal"),
    "gqa_bias_padding": (dict(GQA, qkv_bias=True), "padding"),
    "mha_segments": (MHA, "segments"),
    "mha_norope_headmask": (dict(MHA, use_rope=False, is_causal=False), "head_mask"),
    "gqa_yarn": (dict(GQA, yarn=mnn.YarnScaling(4.0, 4)), "causal"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
  fields, kind = CASES[case]
  module = mnn.GroupedQueryAttention(**fields)
  x = _x(scale=2.0)
  variables = _init(module, x)
  positions = np.broadcast_to(np.arange(T), (2, T))
  call_kw, mask_kw = {}, dict(is_causal=True)
  if kind == "padding":
    pad = np.arange(T)[None, :] < np.array([[T], [T - 3]])
    call_kw = dict(padding_mask=jnp.asarray(pad))
    mask_kw = dict(is_causal=True, q_mask=pad, kv_mask=pad)
  elif kind == "segments":
    seg = (np.arange(T)[None, :] >= np.array([[2], [T]])).astype(np.int32)
    call_kw = dict(segment_ids=jnp.asarray(seg))
    mask_kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  elif kind == "head_mask":
    mask = np.ones((1, 4, T, T), bool)
    mask[0, 3] = False  # head 3 attends nowhere: -inf, zero output
    mask[0, 0, :, 0] = False
    call_kw, mask_kw = dict(mask=jnp.asarray(mask)), dict(mask=mask)
  y, inter = _apply_fn(module)(variables, x, **call_kw)
  yarn = None if fields.get("yarn") is None else dict(factor=4.0, original_max_position=4)
  allowed = ref.allowed_pairs(2, 4, T, T, **mask_kw)
  ref_y, ref_max = ref.gqa_forward(
      _np_params(variables), np.asarray(x), dict(fields, yarn=yarn), positions, allowed
  )
  assert inter["max_logits"].dtype == jnp.float32 and inter["max_logits"].shape == (4,)
  chex.assert_trees_all_close(inter["max_logits"], ref_max.astype(np.float32), rtol=2e-5, atol=2e-5)
  chex.assert_trees_all_close(y, ref_y.astype(np.float32), rtol=1e-4, atol=1e-5)
  if kind == "head_mask":
    assert inter["max_logits"][3] == -jnp.inf


@pytest.mark.parametrize("t", [5, 21])
def test_dense_and_chunked_agree(t):
  x = _x(t=t, seed=t)
  dense = mnn.GroupedQueryAttention(**GQA, qkv_bias=True)
  chunked = mnn.GroupedQueryAttention(**GQA, qkv_bias=True, impl="chunked", block_size=8)
  params = _init(dense, x)["params"]
  (l_d, m_d), g_d = _loss_grad(dense, True)(params, x)
  (l_c, m_c), g_c = _loss_grad(chunked, True)(params, x)
  chex.assert_trees_all_close(l_c, l_d, rtol=1e-5)
  chex.assert_trees_all_close(nn.unbox(g_c), nn.unbox(g_d), rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(m_c, m_d, rtol=1e-6)
  (l_off, _), g_off = _loss_grad(chunked, False)(params, x)
  assert_same_math((l_off, g_off), (l_c, g_c))  # capture does not change gradients


class _Stack(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return x + mnn.GroupedQueryAttention(**GQA, name="attn")(x), None

    layer = nn.remat(Layer) if self.remat else Layer
    scanned = nn.scan(
        layer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
        length=2, metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(name="layers")(x, None)[0]


def test_scan_and_remat():
  x = _x()
  variables = _init(_Stack(), x)
  def maxima(stack):
    run = jax.jit(functools.partial(stack.apply, mutable=["intermediates"]))
    return run(variables, x)[1]["intermediates"]["layers"]["attn"]["max_logits"]

  stacked = maxima(_Stack())
  assert stacked.shape == (2, 4)
  chex.assert_trees_all_close(maxima(_Stack(remat=True)), stacked, rtol=1e-6)
  layer0 = jax.tree.map(lambda a: a[0], nn.unbox(variables)["params"]["layers"]["attn"])
  first = _apply_fn(mnn.GroupedQueryAttention(**GQA))({"params": layer0}, x)[1]
  chex.assert_trees_all_close(stacked[0], first["max_logits"], rtol=1e-6)


def test_bf16_compute_reports_float32():
  x = _x()
  variables = _init(mnn.GroupedQueryAttention(**GQA), x)
  y, inter = _apply_fn(mnn.GroupedQueryAttention(**GQA, dtype=jnp.bfloat16))(variables, x)
  _, inter32 = _apply_fn(mnn.GroupedQueryAttention(**GQA))(variables, x)
  assert y.dtype == jnp.bfloat16 and inter["max_logits"].dtype == jnp.float32
  chex.assert_trees_all_close(inter["max_logits"], inter32["max_logits"], rtol=5e-2, atol=5e-2)


def test_validation():
  bad = [
      (dict(num_kv_heads=3), "divide"),
      (dict(num_heads=0), "num_heads"),
      (dict(head_dim=7), "even"),
      (dict(impl="flash"), "impl"),
      (dict(block_size=-1), "block_size"),
      (dict(clip_mode="key"), "clip_mode"),
  ]
  for change, match in bad:
    with pytest.raises(ValueError, match=match):
      mnn.GroupedQueryAttention(**dict(GQA, **change))
    with pytest.raises(ValueError, match=match):
      mnn.GroupedQueryAttentionNNX(DIM, **dict(GQA, **change), rngs=nnx.Rngs(0))
  mnn.GroupedQueryAttention(**dict(GQA, head_dim=7, use_rope=False))  # odd is fine without RoPE


def _nnx_twin(fields, variables):
  model = mnn.GroupedQueryAttentionNNX(DIM, **fields, rngs=nnx.Rngs(1))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nn.unbox(variables)["params"])
  nnx.update(model, state)
  return model


@nnx.jit
def _nnx_capture(model, x):
  return nnx.capture(model, nnx.Intermediate)(x)


@pytest.mark.parametrize("fields", [dict(GQA, qkv_bias=True), MHA], ids=["gqa_bias", "mha"])
def test_nnx_twin_matches_linen(fields):
  module = mnn.GroupedQueryAttention(**fields)
  x = _x()
  variables = _init(module, x)
  model = _nnx_twin(fields, variables)
  y, inter = _apply_fn(module)(variables, x)
  y_nnx, inter_nnx = _nnx_capture(model, x)
  chex.assert_trees_all_close(y_nnx, y, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(nnx.to_pure_dict(inter_nnx), inter, rtol=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    chex.assert_trees_all_close(model(x), y, rtol=1e-6, atol=1e-6)
  assert model.layout == module.layout
  metadata = nnx.state(model, nnx.Param)["wk"]["kernel"].get_metadata()
  assert metadata["out_sharding"] == ("embed", "kv_heads")


@pytest.mark.parametrize(
    "fields",
    [dict(GQA, qkv_bias=True, clip_mode="query"), dict(MHA, qkv_bias=True)],
    ids=["gqa_query_mode", "mha_split_mode"],
)
def test_qk_clip_end_to_end(fields):
  module = mnn.GroupedQueryAttention(**fields)
  x = _x(scale=3.0)
  variables = _init(module, x)
  apply = _apply_fn(module)
  _, inter = apply(variables, x)
  before = np.asarray(inter["max_logits"])
  tau = float(np.median(before))
  clipped = before > tau
  assert clipped.any() and (~clipped).any()
  new_params = qk_clip(variables["params"], inter, qk_clip_threshold=tau, layout=module.layout)
  _, inter2 = apply({"params": new_params}, x)
  after = np.asarray(inter2["max_logits"])
  np.testing.assert_allclose(after[clipped], tau, rtol=1e-5)
  np.testing.assert_allclose(after[~clipped], before[~clipped], rtol=1e-6)


def test_qk_clip_end_to_end_nnx():
  model = mnn.GroupedQueryAttentionNNX(DIM, **GQA, clip_mode="query", rngs=nnx.Rngs(0))
  x = _x(scale=3.0)
  _, inter = _nnx_capture(model, x)
  before = np.asarray(nnx.to_pure_dict(inter)["max_logits"])
  tau = float(np.median(before))
  new_state = qk_clip(nnx.state(model, nnx.Param), inter, qk_clip_threshold=tau, layout=model.layout)
  nnx.update(model, new_state)
  after = np.asarray(nnx.to_pure_dict(_nnx_capture(model, x)[1])["max_logits"])
  clipped = before > tau
  np.testing.assert_allclose(after[clipped], tau, rtol=1e-5)
  np.testing.assert_allclose(after[~clipped], before[~clipped], rtol=1e-6)
