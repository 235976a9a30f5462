"""The renamed ``muonclip_jax.nn`` arguments (CHANGELOG "Renamed"), and importing without tokamax.

``causal`` is now ``is_causal`` (the pure attention functions and the modules) and the
modules' ``attention_impl`` is now ``impl``. Each old spelling still works for one release:
it gives the same result, with one DeprecationWarning that names the new spelling and points
at the caller's line; passing both spellings with different values is a TypeError.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import muonclip_jax.nn as mnn

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout whose package the subprocesses import
Q = jnp.linspace(-1.0, 1.0, 2 * 6 * 4 * 8, dtype=jnp.float32).reshape(2, 6, 4, 8)
K = jnp.cos(jnp.arange(2 * 6 * 2 * 8, dtype=jnp.float32)).reshape(2, 6, 2, 8)
V = jnp.sin(jnp.arange(2 * 6 * 2 * 8, dtype=jnp.float32)).reshape(2, 6, 2, 8)
GQA = dict(num_heads=4, num_kv_heads=2, head_dim=8)
MLA = dict(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
X = jnp.linspace(-1.0, 1.0, 2 * 6 * 16, dtype=jnp.float32).reshape(2, 6, 16)


def _recorded(fn):
  """``(fn(), [DeprecationWarning records])`` with every warning recorded."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fn()
  return out, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def _assert_one_rename_warning(records, old, new):
  mine = [w for w in records if f"{old!r} is deprecated" in str(w.message)]
  assert len(mine) == 1, [str(w.message) for w in records]
  assert f"use {new!r}" in str(mine[0].message)
  assert mine[0].filename == __file__, mine[0].filename  # the caller's line, not the library's


FUNCTIONS = {
    "attention": lambda **kw: mnn.attention(Q, K, V, softmax_scale=0.3, impl="dense", **kw),
    "dense_attention": lambda **kw: mnn.dense_attention(Q, K, V, softmax_scale=0.3, **kw),
    "chunked_attention": lambda **kw: mnn.chunked_attention(Q, K, V, softmax_scale=0.3, block_size=4, **kw),
    "dpa_max_attention": lambda **kw: mnn.dpa_max_attention(Q, K, V, softmax_scale=0.3, block_size=4, **kw),
    "pallas_attention": lambda **kw: mnn.pallas_attention(Q, K, V, softmax_scale=0.3, **kw),
    "splash_attention": lambda **kw: mnn.splash_attention(Q, K, V, softmax_scale=0.3, **kw),
    "tokamax_gpu_attention": lambda **kw: mnn.tokamax_gpu_attention(Q, K, V, softmax_scale=0.3, **kw),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_take_causal_as_deprecated_is_causal(name):
  if name in ("splash_attention", "tokamax_gpu_attention"):
    pytest.importorskip("tokamax")
  call = FUNCTIONS[name]
  want_out, want_max = call(is_causal=True, return_max_logits=True)
  with pytest.warns(DeprecationWarning, match=rf"{name}\(\): 'causal' is deprecated.*use 'is_causal'"):
    out, got_max = call(causal=True, return_max_logits=True)
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_array_equal(got_max, want_max)
  _, records = _recorded(lambda: call(causal=True))
  _assert_one_rename_warning(records, "causal", "is_causal")
  with pytest.raises(TypeError, match="got both 'causal' .deprecated. and 'is_causal'"):
    call(causal=True, is_causal=True)


def test_the_new_names_are_in_the_signatures():
  import inspect

  for name in FUNCTIONS:
    params = inspect.signature(getattr(mnn, name)).parameters
    assert "is_causal" in params and "causal" not in params, name
  for cls in (mnn.GroupedQueryAttention, mnn.MultiHeadLatentAttention):
    fields = [f for f in cls.__dataclass_fields__ if f not in ("parent", "name")]
    assert "is_causal" in fields and "impl" in fields
    assert fields[-2:] == ["causal", "attention_impl"]  # deprecated: last, default None


LINEN = {"GroupedQueryAttention": (mnn.GroupedQueryAttention, GQA),
         "MultiHeadLatentAttention": (mnn.MultiHeadLatentAttention, MLA)}


def _linen_out(module):
  params = module.init(jax.random.key(0), X)
  return module.apply(params, X, mutable=["intermediates"])


@pytest.mark.parametrize("name", sorted(LINEN))
def test_linen_modules_take_the_old_field_names(name):
  cls, cfg = LINEN[name]
  want, want_state = _linen_out(cls(**cfg, is_causal=False, impl="chunked", block_size=4))
  module, records = _recorded(lambda: cls(**cfg, causal=False, attention_impl="chunked", block_size=4))
  _assert_one_rename_warning(records, "causal", "is_causal")
  _assert_one_rename_warning(records, "attention_impl", "impl")
  assert (module.is_causal, module.impl, module.causal, module.attention_impl) == (False, "chunked", None, None)
  (got, got_state), records = _recorded(lambda: _linen_out(module))
  assert records == []  # init, apply and their clones do not warn again
  np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, got_state, want_state)
  with pytest.raises(TypeError, match=rf"{name}: got both 'attention_impl' .deprecated. = 'dense' and 'impl' = 'chunked'"):
    cls(**cfg, impl="chunked", attention_impl="dense")
  with pytest.raises(TypeError, match="got both 'causal'"):
    cls(**cfg, is_causal=False, causal=True)
  with pytest.warns(DeprecationWarning, match="'causal' is deprecated"):  # both, equal: accepted
    assert cls(**cfg, is_causal=False, causal=False).is_causal is False


class _Stack(nn.Module):
  """Two layers of one given attention module under nn.scan: Flax clones ``layer`` into the scan."""

  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    body = lambda layer, carry, _: (carry + layer(carry), None)
    scan = nn.scan(body, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                   length=2, metadata_params={nn.PARTITION_NAME: "layers"})
    return scan(self.layer, x, None)[0]


def test_linen_warns_once_per_construction_under_scan_and_remat():
  """A module built once from the old names, then lifted (nn.remat), scanned, cloned and run."""
  (module, stack), records = _recorded(lambda: (
      m := nn.remat(mnn.GroupedQueryAttention)(**GQA, attention_impl="dense", causal=True), _Stack(m)))
  _assert_one_rename_warning(records, "attention_impl", "impl")
  _assert_one_rename_warning(records, "causal", "is_causal")
  (_, state), records = _recorded(lambda: stack.apply(stack.init(jax.random.key(0), X), X, mutable=["intermediates"]))
  assert records == [] and module.clone().impl == "dense"
  assert jax.tree.leaves(state)[0].shape == (2, GQA["num_heads"])  # the scanned layers sowed


NNX = {"GroupedQueryAttentionNNX": (mnn.GroupedQueryAttentionNNX, GQA),
       "MultiHeadLatentAttentionNNX": (mnn.MultiHeadLatentAttentionNNX, MLA)}


@pytest.mark.parametrize("name", sorted(NNX))
def test_nnx_modules_take_the_old_keywords(name):
  cls, cfg = NNX[name]
  new = cls(16, **cfg, is_causal=False, impl="chunked", block_size=4, rngs=nnx.Rngs(0))
  old, records = _recorded(lambda: cls(16, **cfg, causal=False, attention_impl="chunked", block_size=4,
                                       rngs=nnx.Rngs(0)))
  _assert_one_rename_warning(records, "causal", "is_causal")
  _assert_one_rename_warning(records, "attention_impl", "impl")
  assert (old.is_causal, old.impl) == (False, "chunked")
  want, want_max = nnx.capture(new, nnx.Intermediate)(X)
  got, got_max = nnx.capture(old, nnx.Intermediate)(X)
  np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(got_max), nnx.to_pure_dict(want_max))
  with pytest.raises(TypeError, match=rf"{name}: got both 'causal'"):
    cls(16, **cfg, is_causal=False, causal=True, rngs=nnx.Rngs(0))


CONFIG = {"hidden_size": 16, "num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 8,
          "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "rope_theta": 10000.0,
          "max_position_embeddings": 64}


def test_hf_config_overrides_take_the_old_field_name():
  module, records = _recorded(lambda: mnn.mla_from_hf_config(CONFIG, attention_impl="chunked"))
  _assert_one_rename_warning(records, "attention_impl", "impl")
  assert module.impl == "chunked"
  model, records = _recorded(lambda: mnn.mla_nnx_from_hf_config(CONFIG, attention_impl="chunked", rngs=nnx.Rngs(0)))
  _assert_one_rename_warning(records, "attention_impl", "impl")
  assert model.impl == "chunked"


def test_importing_nn_does_not_import_tokamax_and_works_without_it():
  code = """
import sys
sys.modules["tokamax"] = None  # as if not installed: importing it raises ImportError
import jax.numpy as jnp
import muonclip_jax.nn as mnn
assert not [m for m in sys.modules if m.startswith("tokamax.")]
q = jnp.ones((1, 4, 2, 8))
out, m = mnn.attention(q, q, q, softmax_scale=0.3, is_causal=True, return_max_logits=True)
print(out.shape, m.shape)
"""
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == "(1, 4, 2, 8) (2,)"
  code_plain = "import sys, muonclip_jax.nn; print(any(m == 'tokamax' or m.startswith('tokamax.') for m in sys.modules))"
  run = subprocess.run([sys.executable, "-c", code_plain], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr
