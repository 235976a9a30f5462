"""MultiHeadLatentAttention (Linen) and its NNX twin: params, max logits, transforms, QK-Clip."""

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
from muonclip_jax import MLALayout, qk_clip
from muonclip_jax import nn as mnn
from _exactness import assert_same_math

DIM, T = 32, 7
CFG = dict(
    num_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=6,
)
CFG_NO_LORA = dict(CFG, q_lora_rank=0)


def _x(b=2, t=T, seed=0, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal((b, t, DIM)), jnp.float32)


def _init(module, x=None, seed=0):
  return jitted_init(module)(jax.random.key(seed), _x() if x is None else x)


def _np_params(variables):
  return jax.tree.map(np.asarray, nn.unbox(variables)["params"])


def _apply_fn(module, **call_kw):
  """jit(variables, x) -> (y, intermediates)."""

  @jax.jit
  def f(variables, x, kw):
    y, state = module.apply(variables, x, mutable=["intermediates"], **kw, **call_kw)
    return y, state["intermediates"]

  return lambda variables, x, **kw: f(variables, x, kw)


def _loss_grad(module, capture):
  def loss(params, x):
    if capture:
      y, state = module.apply({"params": params}, x, mutable=["intermediates"])
      return jnp.sum(jnp.sin(y)), state["intermediates"]["max_logits"]
    return jnp.sum(jnp.sin(module.apply({"params": params}, x))), jnp.zeros(())

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("lora", [True, False])
def test_param_tree_and_logical_axes(lora):
  module = mnn.MultiHeadLatentAttention(**(CFG if lora else CFG_NO_LORA))
  variables = _init(module)
  assert set(variables) == {"params"}  # init sows nothing
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables)["params"])
  specs = nn.get_partition_spec(variables)["params"]
  h, dn, dr, dv, r = 4, 8, 4, 6, 12
  expected = {
      "wkv_a": ((DIM, r + dr), ("embed", "kv_lora")),
      "kv_norm": ((r,), ("norm",)),
      "wkv_b": ((r, h * (dn + dv)), ("kv_lora", "heads")),
      "wo": ((h * dv, DIM), ("heads", "embed")),
  }
  if lora:
    expected |= {
        "wq_a": ((DIM, 16), ("embed", "q_lora")),
        "q_norm": ((16,), ("norm",)),
        "wq_b": ((16, h * (dn + dr)), ("q_lora", "heads")),
    }
  else:
    expected["wq"] = ((DIM, h * (dn + dr)), ("embed", "heads"))
  assert set(shapes) == set(expected)
  for name, (shape, axes) in expected.items():
    leaf = "kernel" if name.startswith("w") else "scale"
    assert shapes[name] == {leaf: shape}, name
    assert tuple(specs[name][leaf]) == axes, name
  assert module.layout == MLALayout(4, 8, 4, 6, out="wo")


def test_default_fields_are_deepseek_v3():
  module = mnn.MultiHeadLatentAttention(num_heads=2)
  variables = jax.eval_shape(module.init, jax.random.key(0), jnp.ones((1, 3, 64)))
  shapes = jax.tree.map(jnp.shape, nn.unbox(variables))
  assert shapes["params"]["wq_b"]["kernel"] == (1536, 2 * 192)
  assert shapes["params"]["wkv_a"]["kernel"] == (64, 512 + 64)
  assert shapes["params"]["wkv_b"]["kernel"] == (512, 2 * 256)
  assert module.softmax_scale == pytest.approx(192**-0.5)


# ----------------------------------------------------------------------------- vs NumPy


CASES = {
    "lora_causal": (CFG, "causal"),
    "nolora_causal": (CFG_NO_LORA, "causal"),
    "lora_padding": (CFG, "padding"),
    "nolora_segments_positions": (CFG_NO_LORA, "segments"),
    "lora_yarn_bidirectional": (
        dict(CFG, is_causal=False, yarn=mnn.YarnScaling(8.0, 4)), "bidirectional"
    ),
}


def _call_masks(kind, b, t):
  """(module keyword arguments, reference positions, reference allowed-pair kwargs)."""
  positions = np.broadcast_to(np.arange(t), (b, t))
  if kind == "padding":
    pad = np.arange(t)[None, :] < np.array([[t], [t - 3]])
    mask_kw = dict(is_causal=True, q_mask=pad, kv_mask=pad)
    return dict(padding_mask=jnp.asarray(pad)), positions, mask_kw
  if kind == "segments":
    seg = (np.arange(t)[None, :] >= np.array([[3], [t]])).astype(np.int32)
    pos = np.where(seg == 1, np.arange(t) - 3, np.arange(t))  # positions restart per segment
    kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos, jnp.int32))
    return kw, pos, dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  return {}, positions, dict(is_causal=kind == "causal")


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_reference(case):
  fields, kind = CASES[case]
  module = mnn.MultiHeadLatentAttention(**fields)
  x = _x(scale=2.0)
  variables = _init(module, x)
  call_kw, positions, mask_kw = _call_masks(kind, 2, T)
  y, inter = _apply_fn(module)(variables, x, **call_kw)
  yarn = None if fields.get("yarn") is None else dict(factor=8.0, original_max_position=4)
  cfg = dict(fields, yarn=yarn)
  allowed = ref.allowed_pairs(2, 4, T, T, **mask_kw)
  ref_y, ref_max = ref.mla_forward(_np_params(variables), np.asarray(x), cfg, positions, allowed)
  assert inter["max_logits"].dtype == jnp.float32 and inter["max_logits"].shape == (4,)
  chex.assert_trees_all_close(inter["max_logits"], ref_max.astype(np.float32), rtol=2e-5, atol=2e-5)
  chex.assert_trees_all_close(y, ref_y.astype(np.float32), rtol=1e-4, atol=1e-5)


def test_masked_positions_never_count():
  """A huge token hidden by the padding mask changes neither the maxima nor real outputs."""
  module = mnn.MultiHeadLatentAttention(**CFG)
  x = _x()
  variables = _init(module, x)
  pad = jnp.arange(T)[None, :] < jnp.array([[T], [T - 2]])
  apply = _apply_fn(module)
  y1, i1 = apply(variables, x, padding_mask=pad)
  y2, i2 = apply(variables, x.at[1, -1].set(1e3), padding_mask=pad)
  chex.assert_trees_all_equal(i1, i2)
  chex.assert_trees_all_close(y1[:, :-2], y2[:, :-2], rtol=1e-6)
  none = jnp.zeros((2, T), bool)
  y3, i3 = apply(variables, x, padding_mask=none)
  assert np.all(np.asarray(i3["max_logits"]) == -np.inf)
  assert np.isfinite(np.asarray(y3)).all()


# ----------------------------------------------------------------------------- implementations


@pytest.mark.parametrize("t", [16, 21])  # a multiple of the block, and one with padded keys
def test_dense_and_chunked_agree(t):
  x = _x(t=t, seed=t)
  dense = mnn.MultiHeadLatentAttention(**CFG)
  chunked = mnn.MultiHeadLatentAttention(**CFG, impl="chunked", block_size=8)
  params = _init(dense, x)["params"]
  (l_d, m_d), g_d = _loss_grad(dense, True)(params, x)
  (l_c, m_c), g_c = _loss_grad(chunked, True)(params, x)
  chex.assert_trees_all_close(l_c, l_d, rtol=1e-5)
  # Gradients reach |g| ~ 12 here; float32 rounding of a different summation order is then
  # ~|g| * 1.2e-7 = 1.5e-6 in absolute terms, which an element near zero sees as a large rtol.
  chex.assert_trees_all_close(nn.unbox(g_c), nn.unbox(g_d), rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(m_c, m_d, rtol=1e-6)


def test_capture_does_not_change_gradients():
  # The chunked kernel: tests/test_gqa.py and tests/test_attention.py.
  module = mnn.MultiHeadLatentAttention(**CFG)
  x = _x()
  params = _init(module, x)["params"]
  (l_on, m_on), g_on = _loss_grad(module, True)(params, x)
  (l_off, _), g_off = _loss_grad(module, False)(params, x)
  assert_same_math((l_on, g_on), (l_off, g_off))
  assert m_on.shape == (4,)


def _count_reduce_max(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("reduce_max")


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_nothing_computed_when_not_mutable(impl):
  module = mnn.MultiHeadLatentAttention(**CFG, impl=impl, block_size=4)
  x = _x()
  variables = _init(module, x)
  out = jax.eval_shape(module.apply, variables, x)
  assert isinstance(out, jax.ShapeDtypeStruct)  # no state returned, nothing sown
  off = _count_reduce_max(lambda v, x: module.apply(v, x), variables, x)
  on = _count_reduce_max(lambda v, x: module.apply(v, x, mutable=["intermediates"]), variables, x)
  assert on == off + 1  # the only extra work is one (B, H, Tq) -> (H,) reduction
  _, other = jax.eval_shape(functools.partial(module.apply, mutable=["batch_stats"]), variables, x)
  assert "intermediates" not in other


class _Twice(nn.Module):
  @nn.compact
  def __call__(self, x):
    attn = mnn.MultiHeadLatentAttention(**CFG, name="attn")
    return attn(x) + attn(3.0 * x)


def test_repeated_calls_keep_running_max():
  x = _x()
  twice = _Twice()
  variables = _init(twice, x)
  _, state = jax.jit(functools.partial(twice.apply, mutable=["intermediates"]))(variables, x)
  single = mnn.MultiHeadLatentAttention(**CFG)
  sub = {"params": variables["params"]["attn"]}
  apply = _apply_fn(single)
  m1 = apply(sub, x)[1]["max_logits"]
  m3 = apply(sub, 3.0 * x)[1]["max_logits"]
  running = state["intermediates"]["attn"]["max_logits"]
  chex.assert_trees_all_close(running, jnp.maximum(m1, m3), rtol=1e-6)
  assert not np.allclose(m1, m3)


class _Layer(nn.Module):
  impl: str = "dense"

  @nn.compact
  def __call__(self, x, _):
    attn = mnn.MultiHeadLatentAttention(**CFG, impl=self.impl, block_size=4, name="attn")
    return x + attn(x), None


class _Stack(nn.Module):
  num_layers: int = 3
  remat: bool = False
  impl: str = "dense"

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(_Layer) if self.remat else _Layer
    scanned = nn.scan(
        layer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
        length=self.num_layers, metadata_params={nn.PARTITION_NAME: "layers"},
    )
    return scanned(impl=self.impl, name="layers")(x, None)[0]


def test_scan_stacks_maxima_and_remat_keeps_them():
  x = _x()
  stack = _Stack()
  variables = _init(stack, x)
  run = jax.jit(functools.partial(stack.apply, mutable=["intermediates"]))
  y, state = run(variables, x)
  stacked = state["intermediates"]["layers"]["attn"]["max_logits"]
  assert stacked.shape == (3, 4) and stacked.dtype == jnp.float32
  # Unrolled: each layer's maxima from its own slice of the stacked parameters.
  single = _apply_fn(mnn.MultiHeadLatentAttention(**CFG))
  params = nn.unbox(variables)["params"]["layers"]["attn"]
  h = x
  for layer in range(3):
    out, inter = single({"params": jax.tree.map(lambda a, i=layer: a[i], params)}, h)
    chex.assert_trees_all_close(stacked[layer], inter["max_logits"], rtol=1e-5)
    h = h + out
  chex.assert_trees_all_close(y, h, rtol=1e-5, atol=1e-6)
  # Remat (with the chunked kernel's custom VJP under it) and the gradient pass change nothing.
  module = _Stack(remat=True, impl="chunked")

  def loss(params, x):
    y, state = module.apply({"params": params}, x, mutable=["intermediates"])
    return jnp.sum(y), state["intermediates"]["layers"]["attn"]["max_logits"]

  (_, maxima), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"], x)
  chex.assert_trees_all_close(maxima, stacked, rtol=1e-6)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(nn.unbox(grads)))


def test_bf16_compute_reports_float32():
  x = _x()
  f32 = mnn.MultiHeadLatentAttention(**CFG)
  bf16 = mnn.MultiHeadLatentAttention(**CFG, dtype=jnp.bfloat16)
  variables = _init(f32, x)
  y, inter = _apply_fn(bf16)(variables, x)
  _, inter32 = _apply_fn(f32)(variables, x)
  assert y.dtype == jnp.bfloat16
  assert inter["max_logits"].dtype == jnp.float32 and inter["max_logits"].shape == (4,)
  chex.assert_trees_all_close(inter["max_logits"], inter32["max_logits"], rtol=5e-2, atol=5e-2)


def test_validation():
  bad = [
      (dict(num_heads=0), "num_heads"),
      (dict(q_lora_rank=-1), "q_lora_rank"),
      (dict(kv_lora_rank=0), "kv_lora_rank"),
      (dict(qk_rope_head_dim=3), "even"),
      (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "qk_nope_head_dim"),
      (dict(impl="flash"), "impl"),
      (dict(block_size=0), "block_size"),
      (dict(rope_theta=1.0), "rope_theta"),
      (dict(yarn=(4.0, 4096)), "yarn"),
  ]
  for change, match in bad:
    with pytest.raises(ValueError, match=match):
      mnn.MultiHeadLatentAttention(**dict(CFG, **change))
    with pytest.raises(ValueError, match=match):
      mnn.MultiHeadLatentAttentionNNX(DIM, **dict(CFG, **change), rngs=nnx.Rngs(0))
  module = mnn.MultiHeadLatentAttention(**CFG)
  variables = _init(module)
  with pytest.raises(ValueError, match="batch, seq, dim"):
    module.apply(variables, jnp.ones((T, DIM)))
  with pytest.raises(ValueError, match="positions"):
    module.apply(variables, _x(), positions=jnp.zeros((2, T + 1), jnp.int32))


# ----------------------------------------------------------------------------- NNX


def _nnx_twin(fields, variables):
  model = mnn.MultiHeadLatentAttentionNNX(DIM, **fields, rngs=nnx.Rngs(1))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, nn.unbox(variables)["params"])
  nnx.update(model, state)
  return model


@nnx.jit
def _nnx_capture(model, x):
  return nnx.capture(model, nnx.Intermediate)(x)


@pytest.mark.parametrize("fields", [CFG, CFG_NO_LORA], ids=["lora", "nolora"])
def test_nnx_twin_matches_linen(fields):
  module = mnn.MultiHeadLatentAttention(**fields)
  x = _x()
  variables = _init(module, x)
  model = _nnx_twin(fields, variables)
  assert jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model, nnx.Param))) == jax.tree.map(
      jnp.shape, nn.unbox(variables)["params"])
  y, inter = _apply_fn(module)(variables, x)
  y_nnx, inter_nnx = _nnx_capture(model, x)
  chex.assert_trees_all_close(y_nnx, y, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(nnx.to_pure_dict(inter_nnx), inter, rtol=1e-6)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no sow (and no deprecation warning) outside nnx.capture
    y_plain = nnx.jit(lambda m, x: m(x))(model, x)
  chex.assert_trees_all_close(y_plain, y, rtol=1e-6, atol=1e-6)
  assert not hasattr(model, "max_logits")
  assert model.layout == module.layout
  metadata = nnx.state(model, nnx.Param)["wkv_b"]["kernel"].get_metadata()
  assert metadata["out_sharding"] == ("kv_lora", "heads")


def test_nnx_running_max_inside_one_capture():
  model = mnn.MultiHeadLatentAttentionNNX(DIM, **CFG, rngs=nnx.Rngs(0))
  x = _x()

  def twice(model, x):
    return model(x) + model(3.0 * x)

  _, inter = nnx.jit(lambda m, x: nnx.capture(twice, nnx.Intermediate)(m, x))(model, x)
  m1 = nnx.to_pure_dict(_nnx_capture(model, x)[1])["max_logits"]
  m3 = nnx.to_pure_dict(_nnx_capture(model, 3.0 * x)[1])["max_logits"]
  chex.assert_trees_all_close(nnx.to_pure_dict(inter)["max_logits"], jnp.maximum(m1, m3), rtol=1e-6)


# ----------------------------------------------------------------------------- QK-Clip


def _check_clipped(before, after, tau):
  before, after = np.asarray(before), np.asarray(after)
  clipped = before > tau
  assert clipped.any() and (~clipped).any()
  np.testing.assert_allclose(after[clipped], tau, rtol=1e-5)
  np.testing.assert_allclose(after[~clipped], before[~clipped], rtol=1e-6)


@pytest.mark.parametrize("fields", [CFG, CFG_NO_LORA], ids=["lora", "nolora"])
def test_qk_clip_end_to_end(fields):
  module = mnn.MultiHeadLatentAttention(**fields)
  x = _x(scale=3.0)
  variables = _init(module, x)
  apply = _apply_fn(module)
  _, inter = apply(variables, x)
  before = np.asarray(inter["max_logits"])
  tau = float(np.median(before))
  new_params = qk_clip(variables["params"], inter, qk_clip_threshold=tau, layout=module.layout)
  assert jax.tree.structure(new_params) == jax.tree.structure(variables["params"])  # boxes kept
  _, inter2 = apply({"params": new_params}, x)
  _check_clipped(before, inter2["max_logits"], tau)


def test_qk_clip_end_to_end_nnx():
  model = mnn.MultiHeadLatentAttentionNNX(DIM, **CFG, rngs=nnx.Rngs(0))
  x = _x(scale=3.0)
  _, inter = _nnx_capture(model, x)
  before = nnx.to_pure_dict(inter)["max_logits"]
  tau = float(np.median(np.asarray(before)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  new_params = qk_clip(params, nnx.to_pure_dict(inter), qk_clip_threshold=tau, layout=model.layout)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, new_params)
  nnx.update(model, state)
  _, inter2 = _nnx_capture(model, x)
  _check_clipped(before, nnx.to_pure_dict(inter2)["max_logits"], tau)
