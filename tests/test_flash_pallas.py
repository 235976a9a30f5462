"""The fused Pallas flash kernel (``impl="pallas"``), in Pallas interpret mode on the CPU."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import chex

import _attention_cases as cases
from muonclip_jax import nn as mnn


@pytest.mark.parametrize(
    "kind,tq,tk",
    [
        ("causal", 37, 37),  # lengths not a multiple of the 16-token tile
        ("segments", 32, 32),  # a multiple of the tile
        ("padding", 37, 37),
        ("all", 20, 37),  # cross lengths, bottom-right causal alignment
        ("bidirectional_padding", 37, 20),
    ],
)
def test_matches_dense(kind, tq, tk):
  q, k, v = cases.qkv(tq, tk, seed=tq + tk)
  cases.assert_matches_dense(q, k, v, cases.masks(kind, tq, tk), "pallas")


def test_default_tiles_match_dense():
  """block_size 512 (the modules' default): forward tiles of 64, backward tiles of 32."""
  q, k, v = cases.qkv(70, h=2, hkv=1, d=16, dv=8, seed=7)
  cases.assert_matches_dense(q, k, v, cases.masks("padding", 70, 70), "pallas", block=512)


def test_mha_equal_widths_matches_dense():
  q, k, v = cases.qkv(21, h=2, hkv=2, d=16, dv=16)
  cases.assert_matches_dense(q, k, v, cases.masks("none", 21, 21), "pallas")


def test_bf16_matches_dense():
  q, k, v = cases.qkv(37, dtype=jnp.bfloat16, seed=1)
  cases.assert_matches_dense(q, k, v, cases.masks("all", 37, 37), "pallas")


def test_fully_masked_rows_and_heads():
  """Rows without keys give zeros and zero gradients; heads without pairs report -inf."""
  q, k, v = cases.qkv(20, 12)  # causal, Tq > Tk: the first 8 queries see no key
  kv_mask = jnp.zeros((cases.B, 12), bool).at[0, :5].set(True)  # batch 1 sees nothing
  (_, (out, m)), grads = cases.value_and_grad(q, k, v, dict(is_causal=True, kv_mask=kv_mask),
                                              "pallas")
  assert np.isfinite(np.asarray(out)).all()
  chex.assert_trees_all_equal(out[1], jnp.zeros_like(out[1]))
  chex.assert_trees_all_equal(out[0, :8], jnp.zeros_like(out[0, :8]))
  assert np.abs(np.asarray(out[0, 8:])).min() > 0.0
  assert np.isfinite(np.asarray(m)).all()
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  chex.assert_trees_all_equal(grads[0][1], jnp.zeros_like(grads[0][1]))
  chex.assert_trees_all_equal(grads[0][0, :8], jnp.zeros_like(grads[0][0, :8]))
  cases.assert_matches_dense(q, k, v, dict(is_causal=True, kv_mask=kv_mask), "pallas")

  nothing = jnp.zeros((cases.B, 12), bool)  # no head has an unmasked key
  (_, (out, m)), grads = cases.value_and_grad(q, k, v, dict(kv_mask=nothing), "pallas")
  chex.assert_trees_all_equal(m, jnp.full((cases.H,), -jnp.inf, jnp.float32))
  chex.assert_trees_all_equal(out, jnp.zeros_like(out))
  for g in grads:
    chex.assert_trees_all_equal(g, jnp.zeros_like(g))


def _dot_generals(jaxpr, *, into_pallas: bool) -> int:
  """Counts ``dot_general`` equations, recursing into sub-jaxprs (pallas_call optional)."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      count += 1
    if eqn.primitive.name == "pallas_call" and not into_pallas:
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _dot_generals(sub, into_pallas=into_pallas)
  return count


def _pallas_calls(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _pallas_calls(sub)
  return found


@pytest.mark.parametrize("impl", ["pallas", "dpa_max"])
def test_fused_path_makes_no_second_qk_pass(impl):
  """The traced forward: with capture, no Q K^T outside the one kernel (unlike dpa_max)."""
  q, k, v = cases.qkv(37)

  def jaxpr(capture):
    f = lambda q, k, v: mnn.attention(
        q, k, v, softmax_scale=cases.SCALE, impl=impl, block_size=cases.BLOCK, is_causal=True,
        return_max_logits=capture,
    )
    return jax.make_jaxpr(f)(q, k, v).jaxpr

  on, off = jaxpr(True), jaxpr(False)
  if impl == "pallas":
    assert _dot_generals(on, into_pallas=False) == 0
    (kernel,) = _pallas_calls(on)
    assert _dot_generals(kernel.params["jaxpr"], into_pallas=True) == 2  # Q K_j^T and P V_j
    assert _dot_generals(on, into_pallas=True) == _dot_generals(off, into_pallas=True)
    assert len(kernel.outvars) == 2  # out and the row maxima
    (kernel_off,) = _pallas_calls(off)
    assert len(kernel_off.outvars) == 1  # without capture: out only
  else:  # the counter sees a separate max pass where there is one
    assert _dot_generals(on, into_pallas=False) == _dot_generals(off, into_pallas=False) + 1


def test_capture_does_not_change_gradients():
  q, k, v = cases.qkv(37)

  def grads(capture):
    def loss(q, k, v):
      out, _ = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="pallas",
                             block_size=cases.BLOCK, is_causal=True, return_max_logits=capture)
      return jnp.sum(jnp.sin(out))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  chex.assert_trees_all_equal(grads(True), grads(False))


def test_validation():
  q, k, v = cases.qkv(8)
  with pytest.raises(ValueError, match="explicit boolean `mask`.*dense"):
    mnn.attention(q, k, v, softmax_scale=1.0, impl="pallas", mask=jnp.ones((1, 1, 8, 8), bool))
  with pytest.raises(ValueError, match="block_size"):
    mnn.pallas_attention(q, k, v, softmax_scale=1.0, block_size=0)
  with pytest.raises(ValueError, match="must divide"):
    mnn.pallas_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), softmax_scale=1.0)


def test_default_interpret_by_backend():
  """interpret=None: Triton on GPU, interpret mode on CPU, and no silent interpreting on TPU."""
  from muonclip_jax.nn._flash_pallas import _default_interpret

  assert _default_interpret("gpu") is False
  assert _default_interpret("cpu") is True
  for backend in ("tpu", "METAL"):
    with pytest.raises(ValueError, match=rf"no variant for the '{backend}' backend.*interpret=True "
                                         r"explicitly.*impl='chunked' or impl='dpa_max'"):
      _default_interpret(backend)


def _lower_for_cuda(shapes, dtype, kw, block_size):
  """Lowers fwd+bwd with capture through Pallas Triton (no GPU needed); returns the text."""
  from muonclip_jax.nn._flash_pallas import pallas_attention

  def f(q, k, v):
    def loss(q, k, v):
      out, m = pallas_attention(q, k, v, softmax_scale=0.1, return_max_logits=True,
                                block_size=block_size, interpret=False, **kw)
      return jnp.sum(out.astype(jnp.float32)), m
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  # Compiling the retired kernel for a GPU warns, pointing at the caller (here).
  with _abstract_gpu(), pytest.warns(DeprecationWarning, match=r"impl='pallas'\) rests on JAX's Pallas Triton"):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract_gpu():
  """A context naming an H100 as the lowering target when no GPU is present.

  JAX 0.12's Triton lowering asks the device for its compute capability and, with no GPU,
  wants an abstract one (``jax.sharding.AbstractDevice`` in an abstract mesh); JAX
  0.10.2 has no such API and lowers without it.
  """
  import contextlib

  if not hasattr(jax.sharding, "AbstractDevice") or jax.default_backend() == "gpu":
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize(
    "shapes,dtype,masked,block_size",
    [
        # Small shapes, every mask, cross lengths, padded tiles, widths 24/16, G = 3.
        (((2, 20, 6, 24), (2, 37, 2, 24), (2, 37, 2, 16)), jnp.float32, True, 16),
        # The benchmark's MLA and GQA shapes, bf16, causal, default tiles.
        (((1, 4096, 16, 192), (1, 4096, 16, 192), (1, 4096, 16, 128)), jnp.bfloat16, False, 512),
        (((1, 8192, 32, 128), (1, 8192, 8, 128), (1, 8192, 8, 128)), jnp.bfloat16, False, 512),
    ],
)
def test_lowers_to_triton_for_cuda(shapes, dtype, masked, block_size):
  """Pallas -> Triton IR lowering of all three kernels (the GPU compile itself is not run)."""
  pytest.importorskip("jax._src.lib.triton")
  b, tq, tk = shapes[0][0], shapes[0][1], shapes[1][1]
  kw = dict(is_causal=True)
  if masked:
    seg = lambda t: jnp.zeros((b, t), jnp.int32)
    kw.update(q_segment_ids=seg(tq), kv_segment_ids=seg(tk), q_mask=jnp.ones((b, tq), bool),
              kv_mask=jnp.ones((b, tk), bool))
  text = _lower_for_cuda(shapes, dtype, kw, block_size)
  assert text.count("xla.gpu.triton") == 3  # forward, dQ, dK/dV


# ----------------------------------------------------------------------------- modules

MLA = dict(num_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, block_size=cases.BLOCK)
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=cases.BLOCK)


class _Stack(nn.Module):
  """Two scanned GQA layers: the sown maxima are stacked per layer."""

  impl: str

  @nn.compact
  def __call__(self, x, *, segment_ids, padding_mask):
    impl = self.impl

    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        attn = mnn.GroupedQueryAttention(**GQA, impl=impl, name="attn")
        return x + attn(x, segment_ids=segment_ids, padding_mask=padding_mask), None

    scanned = nn.scan(Layer, variable_axes={"params": 0, "intermediates": 0},
                      split_rngs={"params": True}, length=2,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(name="layers")(x, None)[0]


@pytest.mark.parametrize("name", ["MLA", "GQA_scanned"])
def test_modules_sow_the_same_maxima_with_every_impl(name):
  b, t, dim = 2, 21, 32
  x = jnp.asarray(np.random.default_rng(0).standard_normal((b, t, dim)), jnp.float32)
  segment_ids = jnp.asarray((np.arange(t)[None] >= np.array([[t], [9]])).astype(np.int32))
  padding_mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 4]]))
  if name == "MLA":
    make = lambda impl: mnn.MultiHeadLatentAttention(**MLA, impl=impl)
  else:
    make = lambda impl: _Stack(impl)
  kw = dict(segment_ids=segment_ids, padding_mask=padding_mask)
  params = jax.jit(make("dense").init)(jax.random.key(0), x, **kw)

  def run(impl):
    def loss(params):
      y, state = make(impl).apply(params, x, mutable=["intermediates"], **kw)
      return jnp.sum(jnp.sin(y)), state["intermediates"]
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (l_d, inter_d), g_d = run("dense")
  maxima = jax.tree.leaves(inter_d)
  assert maxima and all(np.isfinite(np.asarray(m)).all() for m in maxima)
  for impl in ("pallas", "dpa_max"):  # "chunked": tests/test_mla.py, tests/test_gqa.py
    (l, inter), g = run(impl)
    if impl == "dpa_max":  # the max pass computes the very same products as dense
      chex.assert_trees_all_equal(inter, inter_d)
    else:  # the kernel sums each product over zero-padded widths in tiles: a few ulps
      chex.assert_trees_all_close(inter, inter_d, rtol=1e-6, atol=0)
    chex.assert_trees_all_close(l, l_d, rtol=1e-5)
    chex.assert_trees_all_close(nn.unbox(g), nn.unbox(g_d), rtol=1e-4, atol=2e-5)
