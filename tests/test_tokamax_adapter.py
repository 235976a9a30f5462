"""The private tokamax names muonclip_jax reads (nn/_impl/tokamax_adapter.py): fails if one moves."""

from __future__ import annotations

import dataclasses

import pytest

from muonclip_jax.nn._impl import tokamax_adapter

tokamax = pytest.importorskip("tokamax")


def test_private_names_are_where_the_adapter_reads_them():
  assert tokamax_adapter.version() == tokamax.__version__
  assert tokamax_adapter.version() in tokamax_adapter.TESTED_VERSIONS, (
      f"tokamax {tokamax_adapter.version()} is untested: re-read the adapter's modules")
  kernel, mask, base = tokamax_adapter.splash_modules("test")
  fields = {f.name for f in dataclasses.fields(kernel.SplashConfig)}
  assert {"block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
          "block_kv_dkv_compute", "attn_logits_soft_cap", "interpret", "use_base2_exp"} <= fields
  assert callable(kernel.make_splash_mha_single_device)
  for name in ("CausalMask", "LocalMask", "FullMask"):
    assert isinstance(getattr(mask, name), type)
  ids = base.SegmentIds(q=1, kv=2)  # keyword construction, as _impl.splash uses it
  assert (ids.q, ids.kv) == (1, 2)
  assert base.DEFAULT_MASK_VALUE < -1e37  # below _impl.residual_max.MASKED_AT
  ops = tokamax_adapter.attention_implementations("test")
  assert "xla" in ops
  assert getattr(ops["xla"], "use_stable_softmax", True) is not False
