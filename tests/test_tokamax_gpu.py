"""impl="tokamax_gpu" (tokamax's op on the CPU: its XLA implementation), impl="auto",
and every residual-to-max conversion against NumPy."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import _attention_cases as cases
from muonclip_jax.nn._impl import auto
from muonclip_jax.nn._impl.masking import head_max
from muonclip_jax.nn._impl.residual_max import LOG2E, row_max_from_residual


def test_residual_conversions_match_numpy():
  """Scale, base 2, masked rows (every kernel's mask value, and -inf) -> -inf."""
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  k = rng.standard_normal((2, 6, 3, 8)).astype(np.float32)
  scale = 0.3
  s = scale * np.einsum("bqhd,bkhd->bhqk", q, k)
  allowed = rng.random((2, 3, 5, 6)) < 0.5
  allowed[1, 2] = False  # a head of batch 1 without any key
  want = np.where(allowed, s, -np.inf).max(-1)  # (B, H, Tq), -inf on empty rows
  assert np.isneginf(want).any() and np.isfinite(want).any()
  f32 = np.finfo(np.float32)
  for mask_value, log2 in ((f32.min, False), (f32.min, True), (-0.7 * f32.max, False),
                           (-0.7 * f32.max / LOG2E, False), (-np.inf, False), (-np.inf, True)):
    units = LOG2E if log2 else 1.0
    # what a kernel stores: max of (logit * units) with masked logits at mask_value
    resid = np.where(allowed, s * units, mask_value).max(-1).astype(np.float32)
    got = np.asarray(row_max_from_residual(jnp.asarray(resid), log2_units=log2))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)
  got_heads = np.asarray(head_max(row_max_from_residual(jnp.asarray(want)), head_axis=1))
  np.testing.assert_array_equal(got_heads, want.max(axis=(0, 2)))


def test_auto_resolution_and_fallback_logs(monkeypatch, caplog):
  q, k, v = cases.qkv(8, 6)
  has = lambda yes: monkeypatch.setattr(auto.tokamax_adapter, "version",
                                        lambda: "0.0.17" if yes else None)
  auto._log_fallback.cache_clear()
  has(True)
  assert auto.resolve_impl(q, k, v, backend="cpu") == "dense"
  assert auto.resolve_impl(q, k, v, backend="tpu") == "splash"
  assert auto.resolve_impl(q, k, v, backend="gpu") == "tokamax_gpu"
  with caplog.at_level(logging.WARNING, logger="muonclip_jax"):
    assert auto.resolve_impl(q, k, v, mask=jnp.ones((1, 1, 8, 6), bool), backend="tpu") == "chunked"
    assert auto.resolve_impl(q, k, v, is_causal=True, backend="tpu") == "chunked"  # Tq > Tk
    has(False)
    assert auto.resolve_impl(q, k, v, backend="tpu") == "chunked"
    assert auto.resolve_impl(q, k, v, backend="gpu") == "dpa_max"
    has(True)  # a soft cap: splash applies it, but only dense keeps the maxima before it
    assert auto.resolve_impl(q, k, v, backend="tpu", logits_soft_cap=50.0) == "splash"
    assert auto.resolve_impl(q, k, v, backend="tpu", logits_soft_cap=50.0, return_max_logits=True) == "dense"
    assert auto.resolve_impl(q, k, v, backend="gpu", logits_soft_cap=50.0) == "dense"
  assert auto.resolve_impl(q, k, v, backend="cpu", logits_soft_cap=50.0, return_max_logits=True) == "dense"
  text = caplog.text
  for reason in ("explicit (B, H, Tq, Tk) mask", "causal attention with Tq > Tk",
                 "tokamax is not installed", "logits_soft_cap"):
    assert reason in text
  assert text.count("impl='auto'") == 5


def test_default_gpu_kernel():
  from muonclip_jax.nn._impl.tokamax_gpu import default_implementation

  assert default_implementation("cpu") == "xla"
  assert default_implementation("gpu", "9.0") == "mosaic_gpu"
  assert default_implementation("gpu", "10.0") == "mosaic_gpu"
  assert default_implementation("gpu", "8.0") == "triton"
  with pytest.raises(ValueError, match="no GPU kernel for the 'tpu' backend"):
    default_implementation("tpu")


@pytest.mark.parametrize("kind,tq,tk", [("all", 13, 13), ("causal", 9, 20)])
def test_matches_dense(kind, tq, tk):
  """The op's residual maximum, via the same code path as on GPU, equals dense's maximum;
  outputs and gradients too (GQA, MLA widths, segments, padding, cross-length causal)."""
  pytest.importorskip("tokamax")
  q, k, v = cases.qkv(tq, tk, seed=tq + tk)
  cases.assert_matches_dense(q, k, v, cases.masks(kind, tq, tk), "tokamax_gpu")


def test_empty_rows_and_explicit_mask():
  pytest.importorskip("tokamax")
  from muonclip_jax import nn as mnn

  q, k, v = cases.qkv(8)
  mask = jnp.asarray(np.random.default_rng(1).random((cases.B, cases.H, 8, 8)) < 0.5)
  mask = mask.at[1].set(False)  # batch row 1 sees nothing
  out, m = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="tokamax_gpu", mask=mask,
                         return_max_logits=True)
  want, m_d = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="dense", mask=mask,
                            return_max_logits=True)
  np.testing.assert_allclose(out, want, atol=1e-5)
  np.testing.assert_array_equal(out[1], np.zeros_like(out[1]))
  np.testing.assert_allclose(m, m_d, rtol=1e-6)
  out, m = mnn.attention(q, k, v, softmax_scale=cases.SCALE, impl="tokamax_gpu",
                         mask=jnp.zeros((1, 1, 8, 8), bool), return_max_logits=True)
  np.testing.assert_array_equal(m, np.full((cases.H,), -np.inf, np.float32))
  np.testing.assert_array_equal(out, np.zeros_like(out))
