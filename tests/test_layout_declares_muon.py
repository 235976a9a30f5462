"""The layout as Muon's one declaration: ``muonclip(layout=L)`` without ``matrix_axes``, the order of
``matrix_axes`` entries, the layout and the other rules, bad ``muon_blocks``/layouts, and the
DeepSeek-V4 preset.

The recipes' reference is today's ``matrix_axes=attention_matrix_axes(L, ...)`` (MaxText's:
its logical names; the demo's: ``MATRIX_AXES``), written down here as the ``(batch, fan-in,
fan-out)`` axes it gave each attention kernel of the first layer before the layout became
Muon's declaration.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import muonclip_jax as mc
from muonclip_jax._muon import muon_blocks_lookup
from muonclip_jax._util import is_box, leaf_shape, path_str
from _exactness import assert_same_math

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

# (batch, fan_in, fan_out) of each attention kernel ("{i}": of both layers), as today's matrix_axes gave them.
DG_Q, DG_OUT = ((), (0,), (1, 2)), ((), (0, 1), (2,))
QKVO = ("query", "key", "value", "out")
GOLDEN = {
    "linen_gpt": {f"block_{{i}}/attn/{n}/kernel": DG_OUT if n == "out" else DG_Q for n in QKVO},
    "linen_gpt_scan": {f"layers/attn/{n}/kernel": ((0,), (1, 2), (3,)) if n == "out" else ((0,), (1,), (2, 3))
                       for n in QKVO},
    "nnx_gpt": {f"blocks/{{i}}/attn/{n}/kernel": DG_OUT if n == "out" else DG_Q for n in QKVO},
    "llama_gqa": {f"layers_{{i}}/self_attn/{n}/kernel": ((), (0,), (1,)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "gpt2_fused": {"h_{i}/attn/c_attn/kernel": ((), (0,), (1,)), "h_{i}/attn/c_proj/kernel": ((), (0,), (1,))},
    "maxtext": {"layers/self_attention/query/kernel": ((1,), (0,), (2, 3)),
                "layers/self_attention/key/kernel": ((1,), (0,), (2, 3)),
                "layers/self_attention/value/kernel": ((1,), (0,), (2, 3)),
                "layers/self_attention/out/kernel": ((1,), (0, 2), (3,))},
    "gemma": {"layer_{i}/attn/q_einsum/w": ((), (1,), (0, 2)), "layer_{i}/attn/kv_einsum/w": ((), (2,), (0, 1, 3)),
              "layer_{i}/attn/attn_vec_einsum/w": ((), (0, 1), (2,))},
    "hf_gpt2": {"transformer/h/{i}/attn/c_attn/kernel": ((), (1,), (0,)),  # declared torch-style (out, in)
                "transformer/h/{i}/attn/c_proj/kernel": ((), (1,), (0,))},
    "hf_llama": {f"model/layers/{{i}}/self_attn/{n}/kernel": ((), (0,), (1,))
                 for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "mla_lm": {f"layers/attn/{n}/kernel": ((0,), (1,), (2,)) for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")},
    "mla_lm_gqa": {f"layers/attn/{n}/kernel": ((0,), (1,), (2,)) for n in ("wq", "wk", "wv", "wo")},
}
GOLDEN = {name: {p.format(i=i): axes for p, axes in table.items() for i in (0, 1)} for name, table in GOLDEN.items()}


def _linen(model, cfg):
  tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)
  with jax.numpy_rank_promotion("allow"):  # gemma's norms broadcast (B, T, D) * (D,)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])


def _recipe(name):
  """(params, layout, the matrix_axes the recipe needs besides its layout)."""
  if name.startswith("linen_gpt"):
    import recipe_linen_gpt as mod
    cfg = mod.Config(scan=name.endswith("scan"))
    return _linen(mod.GPT(cfg), cfg), cfg.layout, None
  if name == "nnx_gpt":
    import recipe_nnx_gpt as mod
    cfg = mod.Config()
    return nnx.state(mod.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param), cfg.layout, None
  if name in ("llama_gqa", "gpt2_fused", "maxtext", "gemma"):
    mod = __import__({"llama_gqa": "recipe_llama_gqa", "gpt2_fused": "recipe_gpt2_fused",
                      "maxtext": "recipe_maxtext_scanned", "gemma": "recipe_gemma"}[name])
    model = {"llama_gqa": "Llama", "gpt2_fused": "GPT2", "maxtext": "Transformer", "gemma": "Gemma"}[name]
    cfg = mod.Config()
    return _linen(getattr(mod, model)(cfg), cfg), cfg.layout, None
  if name.startswith("hf_"):
    pytest.importorskip("transformers")
    mod = __import__(f"recipe_{name}")
    cfg = mod.Config()
    cls = mod.hf_gpt2.FlaxGPT2LMHeadModel if name == "hf_gpt2" else mod.hf_llama.FlaxLlamaForCausalLM
    with jax.numpy_rank_promotion("allow"):  # Hugging Face's Flax code broadcasts by rank
      model = cls(cfg.hf_config, _do_init=False)  # the recipe's model_and_params, shapes only
      return jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, cfg.seq_len))), cfg.layout, None
  from mla_lm import MATRIX_AXES, LMConfig, init_params
  cfg = LMConfig(dim=32, num_layers=2, num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=8, mlp_dim=64, attention="gqa" if name.endswith("gqa") else "mla",
                 num_kv_heads=1, head_dim=16)
  return jax.eval_shape(lambda: init_params(cfg, 0)), cfg.layout, MATRIX_AXES


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_layout_gives_every_recipe_todays_matrices(name):
  params, layout, rest = _recipe(name)
  with_layout = muon_blocks_lookup(rest, layout, "matrix", params)
  without = muon_blocks_lookup(rest, None, "matrix", params)
  labels = {path_str(p): label for p, label in jax.tree_util.tree_flatten_with_path(mc.muon_labels(params))[0]}
  seen = set()
  for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
    path, shape = path_str(p), leaf_shape(x)
    if labels[path] != "muon":
      continue
    blocks = with_layout(path, shape)
    assert blocks.is_whole, path
    got = blocks.axes[0].resolve(path, shape)
    if path in GOLDEN[name]:
      assert got == GOLDEN[name][path], path
      seen.add(path)
    else:  # the other leaves: exactly as without the layout
      assert got == without(path, shape).axes[0].resolve(path, shape), path
  assert seen == set(GOLDEN[name])


def test_muonclip_with_the_layout_alone_updates_as_with_attention_matrix_axes():
  """Gemma's recipe used to repeat its declarations as ``matrix_axes=attention_matrix_axes(...)``."""
  import recipe_gemma as mod
  cfg = mod.Config()
  params = _linen(mod.Gemma(cfg), cfg)
  params = jax.tree.map(lambda s: jnp.cos(jnp.arange(np.prod(s.shape), dtype=jnp.float32)).reshape(s.shape), params)
  grads = jax.tree.map(jnp.sin, params)
  out = mc.Projection("attn_vec_einsum", leaf="w", axes=("in", "in", "out"))
  layout = dataclasses.replace(cfg.layout, out=out)
  new = mc.muon_adamw(1e-2, layout=layout)
  old = mc.muon_adamw(1e-2, matrix_axes=mc.attention_matrix_axes(cfg.layout, out=out))
  assert_same_math(jax.jit(new.update)(grads, new.init(params), params)[0],
                              jax.jit(old.update)(grads, old.init(params), params)[0])
  with pytest.raises(ValueError, match="layer_0/attn/attn_vec_einsum/w: Muon needs to know which axes"):
    mc.muon_adamw(1e-2).init(params)  # without either


# ----------------------------------------------------------------------------- precedence

def test_explicit_entries_override_the_layout_and_one_matrix_axes_covers_the_rest():
  lay = mc.GQALayout(2, 2, 4, value=None, out=None)
  params = {"attn": {"wq": {"kernel": jnp.ones((6, 8))}, "wk": {"kernel": jnp.ones((6, 8))}},
            "mlp": {"kernel": jnp.ones((3, 6, 12))}}
  stack = mc.MatrixAxes((-2,), (-1,))
  lookup = muon_blocks_lookup(stack, lay, "head", params)
  assert not lookup("attn/wq/kernel", (6, 8)).is_whole  # the layout wins over one MatrixAxes for all leaves
  assert lookup("mlp/kernel", (3, 6, 12)).axes == (stack,)
  tree = {"attn": {"wq": {"kernel": mc.MatrixAxes((0,), (1,))}, "wk": {"kernel": None}}, "mlp": {"kernel": stack}}
  lookup = muon_blocks_lookup(tree, lay, "head", params)
  assert lookup("attn/wq/kernel", (6, 8)).is_whole  # an explicit entry wins over the layout
  assert not lookup("attn/wk/kernel", (6, 8)).is_whole  # a None entry leaves it to the layout
  lookup = muon_blocks_lookup(lambda p: tree, lay, "head", params)  # a callable's result alike
  assert lookup("attn/wq/kernel", (6, 8)).is_whole and not lookup("attn/wk/kernel", (6, 8)).is_whole


def test_per_head_muon_without_the_clip_on_heads_nothing_clips():
  """A linear-attention layer (no softmax, nothing for QK-Clip) described by a layout: muon_adamw
  takes the layout, orthogonalizes its heads one by one, and needs no max_logits."""
  lay = mc.GQALayout(2, 2, 4, value="wv", out="wo")
  rng = np.random.default_rng(0)
  params = {"linear_attn": {n: {"kernel": jnp.asarray(rng.standard_normal(s), jnp.float32)}
                            for n, s in (("wq", (6, 8)), ("wk", (6, 8)), ("wv", (6, 8)), ("wo", (8, 6)))}}
  grads = {"linear_attn": {n: {"kernel": jnp.asarray(rng.standard_normal(s), jnp.float32)}
                           for n, s in (("wq", (6, 8)), ("wk", (6, 8)), ("wv", (6, 8)), ("wo", (8, 6)))}}
  opt = mc.muon_adamw(1.0, weight_decay=0.0, layout=lay, muon_blocks="head")
  u = jax.jit(opt.update)(grads, opt.init(params), params)[0]["linear_attn"]
  ref = mc.scale_by_muon(layout=lay, muon_blocks="head")
  want = jax.jit(ref.update)(grads, ref.init(params))[0]["linear_attn"]
  for n in ("wq", "wk", "wv", "wo"):  # two programs: the suite's rule (_exactness)
    assert_same_math(u[n]["kernel"], -want[n]["kernel"], err_msg=n)


# ----------------------------------------------------------------------------- bad input

def test_value_and_output_heads_of_another_width_are_told_the_remedy_that_works():
  """A GQA value projection whose heads are not head_dim wide used to be refused with advice to
  declare axes=, which cannot fix it. Where no reading of its sizes holds the heads, the error
  says so and gives value=None (out=None for the output projection), which works."""
  lay = mc.GQALayout(4, 2, 8)  # value heads of 12 columns below, not 8
  params = {"attn": {"wq": {"kernel": jnp.ones((20, 32))}, "wk": {"kernel": jnp.ones((20, 16))},
                     "value": {"kernel": jnp.ones((20, 24))}, "out": {"kernel": jnp.ones((48, 20))}}}
  with pytest.raises(ValueError, match=r"attn/value/kernel has shape \(20, 24\).*so no axes= can declare it.*"
                                       r"GQALayout\(\.\.\., value=None\).*or use muon_blocks='matrix'") as err:
    mc.scale_by_muon(layout=lay, muon_blocks="head").init(params)
  assert "Projection(" not in str(err.value)
  mc.scale_by_muon(layout=dataclasses.replace(lay, value=None), muon_blocks="head").init(params)
  fitting = {"attn": {**params["attn"], "value": {"kernel": jnp.ones((20, 16))}}}
  with pytest.raises(ValueError, match=r"attn/out/kernel has shape \(48, 20\).*so no axes= can declare it.*"
                                       r"GQALayout\(\.\.\., out=None\).*muon_blocks='head'"):
    mc.scale_by_muon(layout=lay, muon_blocks="head+out").init(fitting)
  mc.scale_by_muon(layout=dataclasses.replace(lay, out=None), muon_blocks="head+out").init(fitting)
  # sizes that another storage could hold (16 = 2 heads of 8, read (out, in)): both remedies are named
  with pytest.raises(ValueError, match=r"declare its storage with muonclip_jax.Projection\('value', leaf='kernel', axes=...\).*"
                                       r"if its heads are not 8 wide, keep it one matrix"):
    mc.scale_by_muon(layout=lay, muon_blocks="head").init({"attn": {**params["attn"],
                                                                    "value": {"kernel": jnp.ones((16, 24))}}})


def test_bad_muon_blocks_and_layouts_name_the_argument_and_the_path():
  params = {"attn": {"wq": {"kernel": jnp.ones((12, 24))}, "wk": {"kernel": jnp.ones((12, 24))}}}
  for bad in ("heads", "group:0", "group:02", "group:", "group:kv+in", "head+out+out", 2):
    with pytest.raises(ValueError, match=r"muon_blocks must be one of \('matrix', 'part', 'head', 'head\+out', "
                                         rf"'group:<k>', 'group:kv', .*got {re.escape(repr(bad))}"):
      mc.scale_by_muon(layout=mc.GQALayout(3, 3, 8), muon_blocks=bad)
  for make in (mc.scale_by_muon, lambda **kw: mc.muon_adamw(0.1, **kw), lambda **kw: mc.muon(0.1, **kw)):
    with pytest.raises(ValueError, match=r"muon_blocks='head' needs layout="):
      make(muon_blocks="head")
  with pytest.raises(ValueError, match=r"muonclip: muon_blocks='part' needs layout=|muon_blocks must be"):
    mc.muonclip(0.1, layout=mc.GQALayout(3, 3, 8), muon_blocks="rows")
  # heads that do not divide a kernel: 4 heads of 8 columns in a kernel of 24 columns
  opt = mc.scale_by_muon(layout=mc.GQALayout(4, 4, 8, value=None), muon_blocks="head")
  with pytest.raises(ValueError, match=r"layout \(muon_blocks='head'\): attn/wq/kernel has shape \(12, 24\).*"
                                       r"expected 4 heads \(32 columns\)"):
    opt.init(params)
  # the value projection per head needs the layout to name it; the output projection with "head+out"
  opt = mc.scale_by_muon(layout=mc.GQALayout(3, 3, 8), muon_blocks="head")
  with pytest.raises(ValueError, match=r"'attn' has no value projection 'attn/value/kernel' \(GQALayout value='value'\)"):
    opt.init(params)
  opt = mc.scale_by_muon(layout=mc.GQALayout(3, 3, 8, value=None, out="wo"), muon_blocks="head+out")
  with pytest.raises(ValueError, match=r"attn/wo/kernel has shape \(20, 12\), which does not hold the layout's 3 "
                                       r"heads of 8 columns"):
    opt.init({"attn": {**params["attn"], "wo": {"kernel": jnp.ones((20, 12))}}})
  with pytest.raises(ValueError, match="no attention module of the layout"):
    mc.scale_by_muon(layout=mc.GQALayout(3, 3, 8), muon_blocks="part").init({"w": jnp.ones((4, 4))})
  with pytest.raises(ValueError, match="GQALayout: key and value must be different projections"):
    mc.GQALayout(2, 2, 4, key="wk", value="wk")
  with pytest.raises(ValueError, match="an output projection declares its heads side"):
    mc.scale_by_muon(layout=mc.GQALayout(3, 3, 8, value=None, out=mc.Projection("wo", axes=("heads", "head_dim", "in"))),
                     muon_blocks="head+out").init({"attn": {**params["attn"], "wo": {"kernel": jnp.ones((3, 8, 12))}}})


# ----------------------------------------------------------------------------- DeepSeek-V4's preset

def test_deepseek_v4_preset_is_eight_keller_steps_then_two_finishing_steps():
  x = jax.random.normal(jax.random.key(0), (3, 24, 40))
  table = [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2
  want = mc.newton_schulz(x, coeffs=np.asarray(table), steps=10, method="standard")
  got = mc.newton_schulz(x, coeffs="deepseek_v4", steps=None, method="standard")
  assert_same_math(got, want)  # another program: the table is a (10, 3) constant, the preset's (9, 3)
  s = np.linalg.svd(np.asarray(got, np.float64), compute_uv=False)
  assert 0.99 < s.min() and s.max() < 1.01  # the finishing steps pull Keller's [0.7, 1.2] band onto 1
  opt = mc.muon(0.1, weight_decay=0.0, ns_coeffs="deepseek_v4", rms_scale=0.18)
  u, _ = opt.update({"w": x[0]}, opt.init({"w": x[0]}), {"w": x[0]})
  assert abs(float(jnp.sqrt(jnp.mean(u["w"] ** 2))) - 0.1 * 0.18) < 1e-3  # learning rate times the update RMS 0.18
