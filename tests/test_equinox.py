"""Equinox models: roles read from the layer types, ``equinox_attention``, ``GQALayout.from_equinox``,
and square torch-style kernels that nothing declares.

The adapter (``muonclip_jax/_clip/equinox.py``) was read from equinox 0.13.8; these tests fail if the
parts of Equinox it relies on move (the ``eqx.nn`` classes and their fields, and
``MultiheadAttention``'s ``process_heads`` seeing the heads that enter its attention).
"""

import os
import subprocess
import sys

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc
from muonclip_jax import nn as mnn
from muonclip_jax._clip import EMBEDDING, GAIN, MATRIX, VECTOR, leaf_roles
from muonclip_jax._util import path_str
from _child_env import child_env
from _exactness import assert_same_math

KEY = jax.random.key(0)


def test_the_library_imports_without_equinox():
  code = ("import sys, muonclip_jax, muonclip_jax.nn, muonclip_jax.training, muonclip_jax.sharding; "
          "assert 'equinox' not in sys.modules, 'muonclip_jax imported equinox'")
  out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
  assert out.returncode == 0, out.stderr


class Mixed(eqx.Module):
  linear: eqx.nn.Linear
  embed: eqx.nn.Embedding
  layer_norm: eqx.nn.LayerNorm
  rms_norm: eqx.nn.RMSNorm
  group_norm: eqx.nn.GroupNorm
  custom: eqx.Module  # a Linear subclass: its storage is not assumed
  conv: eqx.nn.Conv1d  # a type the adapter does not know

  def __init__(self, key):
    k = jax.random.split(key, 4)
    self.linear = eqx.nn.Linear(8, 12, key=k[0])
    self.embed = eqx.nn.Embedding(20, 8, key=k[1])
    self.layer_norm, self.rms_norm, self.group_norm = eqx.nn.LayerNorm(8), eqx.nn.RMSNorm(8), eqx.nn.GroupNorm(2, 8)
    self.custom = MyLinear(8, 4, key=k[2])
    self.conv = eqx.nn.Conv1d(4, 6, 3, use_bias=False, key=k[3])


class MyLinear(eqx.nn.Linear):
  pass


def test_roles_come_from_the_layer_types_stacked_or_not():
  single = eqx.filter_eval_shape(lambda k: eqx.filter(Mixed(k), eqx.is_array), KEY)  # shapes are all it reads
  stacked = eqx.filter_eval_shape(lambda k: eqx.filter(eqx.filter_vmap(Mixed)(k), eqx.is_array),
                                  jax.random.split(KEY, 3))
  expected = {"linear/weight": MATRIX, "linear/bias": VECTOR, "embed/weight": EMBEDDING,
              "layer_norm/weight": GAIN, "layer_norm/bias": GAIN, "rms_norm/weight": GAIN, "rms_norm/bias": GAIN,
              "group_norm/weight": GAIN, "group_norm/bias": GAIN}
  for params, lead in ((single, ()), (stacked, ("layers",))):
    roles = leaf_roles(params)
    assert {p: r.kind for p, r in roles.items()} == expected  # custom/* and conv/* are not typed
    assert roles["linear/weight"].axes == (*lead, "out", "in") and roles["linear/weight"].layer == "Linear"
    labels = {path_str(p): l for p, l in jax.tree_util.tree_flatten_with_path(mc.muon_labels(params))[0]}
    assert {p for p, l in labels.items() if l == "muon"} == {"linear/weight", "custom/weight", "conv/weight"}
  # Muon batches the stacked layers of a Linear weight (3, out, in): each layer's (out, in) matrix alone
  opt = mc.scale_by_muon()
  tree = eqx.filter(eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 12, use_bias=False, key=k))(jax.random.split(KEY, 3)),
                    eqx.is_array)
  alone = {str(i): w for i, w in enumerate(tree.weight)}  # (12, 8) each: Muon's result does not depend on
  got, ref = jax.jit(lambda t, a: (opt.update(t, opt.init(t))[0].weight, opt.update(a, opt.init(a))[0]))(tree, alone)
  assert got.shape == (3, 12, 8)  # which side is the fan-in (test below)
  for i in range(3):  # the same math; a batched call may round apart from the single ones (XLA fuses them apart)
    assert_same_math(got[i], ref[str(i)])


def test_whole_matrix_muon_does_not_depend_on_the_orientation_except_keller():
  """An undeclared 2-D leaf is read (in, out); Moonlight's matching gives the same update for (out, in)."""
  w = jax.random.normal(KEY, (12, 8))  # torch-style (out, in)
  torch = mc.MatrixAxes(fan_in=(1,), fan_out=(0,))
  for rms_match in ("moonlight", None):
    default, declared = mc.scale_by_muon(rms_match=rms_match), mc.scale_by_muon(rms_match=rms_match, matrix_axes=torch)
    a = default.update({"weight": w}, default.init({"weight": w}))[0]["weight"]
    b = declared.update({"weight": w}, declared.init({"weight": w}))[0]["weight"]
    # the same iteration on the transpose: equal to rounding, which Newton–Schulz amplifies
    # (an element 2.8e-6 apart, at 0.04, in one CI run), against the matrix's largest entry
    assert_same_math(a, b)
  with pytest.raises(ValueError, match=r"weight: a 12x8 leaf named 'weight'.*keller.*MatrixAxes\(fan_in=\(1,\)"):
    mc.scale_by_muon(rms_match="keller").init({"weight": w})
  mc.scale_by_muon(rms_match="keller", matrix_axes=torch).init({"weight": w})  # declared: fine
  lin = eqx.filter(eqx.nn.Linear(8, 12, use_bias=False, key=KEY), eqx.is_array)
  mc.scale_by_muon(rms_match="keller").init(lin)  # read from its type: fine


def np_max_logits(q, k, mask):
  """Per-head max over queries and allowed keys of q.k / sqrt(d) (float64); q (T, H, d), k (S, H, d)."""
  s = np.einsum("qhd,khd->hqk", np.float64(q), np.float64(k)) / np.sqrt(q.shape[-1])
  return np.where(np.broadcast_to(mask, s.shape), s, -np.inf).max(axis=(1, 2))


def test_equinox_attention_is_the_module_with_its_maxima():
  mha = eqx.nn.MultiheadAttention(2, 12, key_size=10, value_size=6, qk_size=5, vo_size=3, use_query_bias=True,
                                  use_key_bias=True, dropout_p=0.5, key=KEY)
  kq, kk, kv, kd = jax.random.split(jax.random.key(1), 4)
  query, key_, value = (jax.random.normal(kq, (5, 12)), jax.random.normal(kk, (7, 10)),
                        jax.random.normal(kv, (7, 6)))
  causal = jnp.tril(jnp.ones((5, 7), bool))
  per_head = jnp.stack([causal, causal.at[2].set(False)])  # head 1: query row 2 sees no key
  double_q = lambda q, k, v: (2.0 * q, k, v)  # noqa: E731

  def cases(mha, query, key_, value, causal, per_head, dropout_key):
    out = {}
    for name, mask, ph in (("none", None, None), ("causal", causal, None), ("per_head", per_head, None),
                           ("process_heads", causal, double_q)):
      ours = mnn.equinox_attention(mha, query, key_, value, mask, inference=True, process_heads=ph)
      out[name] = ours + (mha(query, key_, value, mask, inference=True, process_heads=ph),)
    ours = mnn.equinox_attention(mha, query, key_, value, causal, key=dropout_key, inference=False)
    out["dropout"] = ours + (mha(query, key_, value, causal, key=dropout_key, inference=False),)
    return out

  results = eqx.filter_jit(cases)(mha, query, key_, value, causal, per_head, kd)
  q = np.asarray(jax.vmap(mha.query_proj)(query)).reshape(5, 2, 5)
  k = np.asarray(jax.vmap(mha.key_proj)(key_)).reshape(7, 2, 5)
  full = np.ones((5, 7), bool)
  expected = {"none": np_max_logits(q, k, full), "causal": np_max_logits(q, k, causal),
              "per_head": np_max_logits(q, k, per_head), "process_heads": np_max_logits(2 * q, k, causal),
              "dropout": np_max_logits(q, k, causal)}
  for name, (out, max_logits, module_out) in results.items():
    assert_same_math(out, module_out, err_msg=name)  # the module's own output
    assert max_logits.shape == (2,) and max_logits.dtype == jnp.float32
    np.testing.assert_allclose(max_logits, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert not np.array_equal(results["dropout"][0], results["causal"][0])  # dropout did act
  with pytest.raises(TypeError, match="equinox.nn.MultiheadAttention"):
    mnn.equinox_attention(mha.query_proj, query, key_, value)


def test_layout_from_an_equinox_attention_single_or_stacked():
  mha = eqx.nn.MultiheadAttention(4, 16, qk_size=3, key=KEY)
  layout = mc.GQALayout.from_equinox(mha, clip_mode="query")
  assert (layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.clip_mode) == (4, 4, 3, "query")
  assert layout.query == mc.Projection("query_proj", leaf="weight", axes=("out", "in"))
  assert layout.key == mc.Projection("key_proj", leaf="weight", axes=("out", "in"))
  stacked = eqx.filter_vmap(lambda k: eqx.nn.MultiheadAttention(4, 16, key=k))(jax.random.split(KEY, 2))
  assert mc.GQALayout.from_equinox(stacked).query.axes == ("layers", "out", "in")
  with pytest.raises(TypeError, match="GQALayout.from_equinox: expected an equinox.nn.MultiheadAttention"):
    mc.GQALayout.from_equinox(mha.query_proj)


@pytest.fixture(scope="module")
def square():
  """One Equinox attention with square (out, in) = (16, 16) q/k kernels, its maxima on a batch, and tau."""
  mha = eqx.nn.MultiheadAttention(4, 16, use_query_bias=True, use_key_bias=True, key=jax.random.key(3))
  x = 3.0 * jax.random.normal(jax.random.key(4), (2, 6, 16))
  mask = jnp.tril(jnp.ones((6, 6), bool))

  @eqx.filter_jit
  def maxima(params):
    attn = eqx.combine(params, eqx.filter(mha, eqx.is_array, inverse=True))
    return jax.vmap(lambda xb: mnn.equinox_attention(attn, xb, xb, xb, mask)[1])(x).max(axis=0)

  params = {"attn": eqx.filter(mha, eqx.is_array)}
  s = maxima(params["attn"])
  return params, s, 0.5 * float(jnp.min(s)), maxima  # every head above tau


def test_square_out_in_kernels_with_nothing_declared_are_exact_or_refused(square):
  """The issue's case: a square torch-style kernel read as (in, out) was reported clipped but not bounded."""
  params, s, tau, maxima = square
  intermediates = {"attn": {"max_logits": s}}
  assert int(mc.qk_clip_stats(intermediates, qk_clip_threshold=tau)["attn"]["num_clipped"]) == 4
  undeclared = mc.GQALayout(4, 4, 4, query=mc.Projection("query_proj", leaf="weight"),
                            key=mc.Projection("key_proj", leaf="weight"))
  declared = mc.GQALayout(4, 4, 4, query=mc.Projection("query_proj", leaf="weight", axes=("out", "in")),
                          key=mc.Projection("key_proj", leaf="weight", axes=("out", "in")))
  wrong = mc.GQALayout(4, 4, 4, query=mc.Projection("query_proj", leaf="weight", axes=("in", "out")),
                       key=mc.Projection("key_proj", leaf="weight", axes=("in", "out")))
  # Equinox params: the Linear type tells (out, in); exactly what declaring it gives, and bounded
  by_type = mc.qk_clip(params, intermediates, qk_clip_threshold=tau, layout=undeclared)
  by_axes = mc.qk_clip(params, intermediates, qk_clip_threshold=tau, layout=declared)
  assert_same_math(by_type, by_axes)
  assert (maxima(by_type["attn"]) <= tau * (1 + 1e-5)).all()
  # the wrong reading reports 4 heads clipped and leaves some above tau: what the refusal prevents
  misread = maxima(mc.qk_clip(params, intermediates, qk_clip_threshold=tau, layout=wrong)["attn"])
  assert (misread > tau * (1 + 1e-3)).any()
  # the same arrays as a plain dict: nothing tells the axes, so the clip (and the optimizer) refuse
  plain = {"attn": {n: {"weight": getattr(params["attn"], n).weight, "bias": getattr(params["attn"], n).bias}
                    for n in ("query_proj", "key_proj")}}
  with pytest.raises(ValueError, match=r"attn/query_proj/weight is a square kernel of shape \(16, 16\) named "
                                       r"'weight'.*axes=\('out', 'in'\)"):
    mc.qk_clip(plain, intermediates, qk_clip_threshold=tau, layout=undeclared)
  opt = mc.qk_clip_transform(tau, layout=undeclared)
  with pytest.raises(ValueError, match="square kernel"):
    opt.update(jax.tree.map(jnp.zeros_like, plain), opt.init(plain), plain, max_logits=intermediates)
  with pytest.raises(ValueError, match="square kernel"):
    mc.init_max_logits(plain, undeclared)
  # a non-square torch-style weight fits only (out, in): refused, with the declaration to write
  tall = {"attn": {"query_proj": {"weight": jnp.ones((16, 12))}, "key_proj": {"weight": jnp.ones((16, 12))}}}
  with pytest.raises(ValueError, match=r"query_proj/weight has shape \(16, 12\).*torch ports and Equinox: "
                                       r"Projection\('query_proj', leaf='weight', axes=\('out', 'in'\)\)"):
    mc.qk_clip(tall, intermediates, qk_clip_threshold=tau, layout=undeclared)


def test_the_example_of_from_equinox_runs():
  import doctest

  tests = doctest.DocTestFinder(recurse=False).find(mc.GQALayout.from_equinox, "from_equinox", globs={})
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for t in tests:
    runner.run(t)
  assert tests and runner.summarize(verbose=False).failed == 0


def test_multi_steps_and_qk_clip_take_an_equinox_stack_and_its_maxima_tree():
  """A filter_vmap stack of 3 attention layers, maxima (layers, heads) keyed like the params; two
  micro-steps whose running maximum clips once, as qk_clip with the maximum does."""
  stack = eqx.filter_vmap(lambda k: eqx.nn.MultiheadAttention(2, 8, use_query_bias=True, key=k))(
      jax.random.split(KEY, 3))
  params = {"blocks": {"attn": eqx.filter(stack, eqx.is_array)}}
  layout = mc.GQALayout.from_equinox(stack)
  first = jnp.array([[400.0, 50.0], [50.0, 50.0], [50.0, 900.0]])
  second = jnp.array([[50.0, 50.0], [200.0, 50.0], [50.0, 50.0]])
  opt = mc.multi_steps(optax.chain(optax.sgd(0.0), mc.qk_clip_transform(100.0, layout=layout)), 2, layout=layout)
  state = opt.init(params)
  assert jax.tree.map(jnp.shape, state.max_logits) == {"blocks": {"attn": {"max_logits": (3, 2)}}}
  new, update = params, jax.jit(opt.update)
  for maxima in (first, second):
    updates, state = update(jax.tree.map(jnp.zeros_like, new), state, new,
                            max_logits={"blocks": {"attn": {"max_logits": maxima}}})
    new = optax.apply_updates(new, updates)
  want = jax.jit(mc.qk_clip, static_argnames=("layout",))(
      params, {"blocks": {"attn": {"max_logits": jnp.maximum(first, second)}}}, qk_clip_threshold=100.0, layout=layout)
  chex.assert_trees_all_close(new, want, rtol=1e-6)
  w, w0 = new["blocks"]["attn"].query_proj.weight, params["blocks"]["attn"].query_proj.weight
  np.testing.assert_allclose(w[0, :4] / w0[0, :4], 0.5, rtol=1e-6)  # layer 0, head 0's rows: sqrt(100 / 400)
  np.testing.assert_allclose(w[2, 4:] / w0[2, 4:], 1 / 3, rtol=1e-6)  # layer 2, head 1's rows: sqrt(100 / 900)
  np.testing.assert_array_equal(w[0, 4:], w0[0, 4:])  # layer 0, head 1 untouched


def test_maxima_that_keep_the_batch_axis_are_refused_with_the_fix(square):
  params, s, tau, _ = square
  layout = mc.GQALayout.from_equinox(eqx.nn.MultiheadAttention(4, 16, key=KEY))
  with pytest.raises(ValueError, match=r"stacked-layer shape \(2,\).*keep its batch axis: pass their maximum"):
    mc.qk_clip(params, {"attn": {"max_logits": jnp.stack([s, s])}}, qk_clip_threshold=tau, layout=layout)


# ----------------------------------------------------------------------------- value and output projections

H4, D4, W16 = 4, 4, 16  # square (16, 16) Linear weights: (out, in) and (in, out) both fit


class MHA(eqx.Module):
  """eqx.nn.MultiheadAttention's shape, hand-written: four square Linear projections."""

  wq: eqx.nn.Linear
  wk: eqx.nn.Linear
  wv: eqx.nn.Linear
  wo: eqx.nn.Linear

  def __init__(self, key):
    kq, kk, kv, ko = jax.random.split(key, 4)
    self.wq, self.wk, self.wv = (eqx.nn.Linear(W16, H4 * D4, use_bias=False, key=k) for k in (kq, kk, kv))
    self.wo = eqx.nn.Linear(H4 * D4, W16, use_bias=False, key=ko)


def _ns_scaled(blocks):
  """``newton_schulz`` of by-hand blocks ``(n, rows, cols)`` with scale_by_muon's defaults, each by
  Moonlight's 0.2 sqrt(max(rows, cols)) of its own shape. Blocks 4 x 16 run Gram Newton–Schulz, whose
  rounding depends on its input's memory layout (``test_per_head_muon``): compared to 2e-5."""
  ns = mc.newton_schulz(blocks, steps=None, coeffs="polar_express_4", method="auto")
  return ns * 0.2 * np.sqrt(max(blocks.shape[-2:]))


def _cut(d, axis, k):
  """(..., out, in) cut into blocks of k heads along ``axis`` (-2: rows, -1: columns), each orthogonalized."""
  n = d.shape[axis] // (k * D4)
  blocks = [jax.lax.slice_in_dim(d, g * k * D4, (g + 1) * k * D4, axis=d.ndim + axis) for g in range(n)]
  lead = d.shape[:-2]
  stacked = jnp.stack(blocks, axis=0).reshape(-1, *blocks[0].shape[-2:])
  out = _ns_scaled(stacked).reshape(n, *lead, *blocks[0].shape[-2:])
  return jnp.concatenate(list(out), axis=d.ndim + axis)


@pytest.fixture(scope="module")
def eqx_attention():
  """One attention and a filter_vmap stack of 2, in one tree; their grads; a layout naming modules alone."""
  params = {"single": eqx.filter(MHA(KEY), eqx.is_array),
            "stacked": eqx.filter(eqx.filter_vmap(MHA)(jax.random.split(jax.random.key(1), 2)), eqx.is_array)}
  grads = jax.tree.map(lambda x: jnp.cos(7 * x) + x, params)
  layout = mc.GQALayout(H4, H4, D4, query="wq", key="wk", value="wv", out="wo")  # Linear modules named alone
  return params, grads, layout


def test_value_and_output_linears_are_cut_into_their_true_heads(eqx_attention):
  """wv's heads are ROWS of its (out, in) weight, wo's heads its COLUMNS; the wrong cut is 0.1+ away."""
  params, grads, layout = eqx_attention
  leaf = mc.GQALayout(H4, H4, D4, query=mc.Projection("wq", leaf="weight"), key=mc.Projection("wk", leaf="weight"),
                      value=mc.Projection("wv", leaf="weight"), out=mc.Projection("wo", leaf="weight"))
  for blocks in ("head", "head+out"):
    updates = {}
    for name, lay in (("module", layout), ("leaf", leaf)):
      opt = mc.scale_by_muon(layout=lay, muon_blocks=blocks)
      updates[name] = jax.jit(opt.update)(grads, opt.init(params))[0]
    assert_same_math(updates["module"], updates["leaf"])
    for tree in ("single", "stacked"):
      got, g = updates["module"][tree], grads[tree]
      d = {n: 1.95 * getattr(g, n).weight for n in ("wq", "wk", "wv", "wo")}  # first Nesterov step: (1 + beta) g
      for n in ("wq", "wk", "wv"):  # projections to heads: head h is rows [h D, (h + 1) D) of (out, in)
        want, wrong = _cut(d[n], -2, 1), _cut(d[n], -1, 1)
        np.testing.assert_allclose(getattr(got, n).weight, want, rtol=0, atol=2e-5, err_msg=f"{tree}/{n}")
        assert np.abs(getattr(got, n).weight - wrong).max() > 0.1
      wo = got.wo.weight
      if blocks == "head+out":  # the output projection: head h is columns [h D, (h + 1) D) of (out, in)
        np.testing.assert_allclose(wo, _cut(d["wo"], -1, 1), rtol=0, atol=2e-5, err_msg=f"{tree}/wo")
        assert np.abs(wo - _cut(d["wo"], -2, 1)).max() > 0.1
      else:
        np.testing.assert_allclose(wo, _cut(d["wo"], -1, H4), rtol=0, atol=2e-5, err_msg=f"{tree}/wo whole")


def test_every_reader_takes_linears_named_by_module(eqx_attention):
  """muonclip, muon_adamw, qk_clip, init_max_logits and attention_matrix_axes read the Linear type
  through a layout that names the modules alone, as through declared axes."""
  params, grads, layout = eqx_attention
  axes = {"single": ("out", "in"), "stacked": ("layers", "out", "in")}
  by_axes = {t: mc.GQALayout(H4, H4, D4, **{f: mc.Projection(n, leaf="weight", axes=a)
                                           for f, n in (("query", "wq"), ("key", "wk"), ("value", "wv"), ("out", "wo"))})
             for t, a in axes.items()}
  maxima = mc.init_max_logits(params, layout)
  assert jax.tree.map(jnp.shape, maxima) == {"single": {"max_logits": (4,)}, "stacked": {"max_logits": (2, 4)}}
  maxima = {"single": {"max_logits": jnp.array([9.0, 1.0, 1.0, 4.0])},
            "stacked": {"max_logits": jnp.array([[1.0, 9.0, 1.0, 1.0], [1.0, 1.0, 1.0, 16.0]])}}
  assert_same_math(mc.qk_clip(params, maxima, qk_clip_threshold=2.0, layout=layout),
                              mc.qk_clip(params, maxima, qk_clip_threshold=2.0, layout=by_axes))
  got = mc.attention_matrix_axes(layout)(params)
  want = mc.attention_matrix_axes(by_axes)(params)
  assert got == want and got["single"].wv.weight == mc.MatrixAxes((1,), (0,))
  assert got["stacked"].wo.weight == mc.MatrixAxes((2,), (1,))
  for make in (lambda lay: mc.muonclip(0.1, layout=lay, qk_clip_threshold=2.0, muon_blocks="head+out"),
               lambda lay: mc.muon_adamw(0.1, layout=lay, muon_blocks="head+out")):
    a, b = make(layout), make(by_axes)
    extra = {"max_logits": maxima}
    ua = jax.jit(a.update)(grads, a.init(params), params, **extra)[0]
    ub = jax.jit(b.update)(grads, b.init(params), params, **extra)[0]
    assert_same_math(ua, ub)


def test_square_value_and_output_weights_in_a_plain_dict_are_refused():
  """The same square torch-style weights in a plain dict: nothing tells (out, in) from (in, out)."""
  rng = np.random.default_rng(0)
  plain = {n: {"weight": jnp.asarray(rng.standard_normal((W16, W16)), jnp.float32)} for n in ("q", "k", "v", "o")}
  qk = dict(query=mc.Projection("q", leaf="weight", axes=("out", "in")),
            key=mc.Projection("k", leaf="weight", axes=("out", "in")))
  for field, name in (("value", "v"), ("out", "o")):
    lay = mc.GQALayout(H4, H4, D4, **qk, **{field: mc.Projection(name, leaf="weight")},
                       **{f: None for f in ("value", "out") if f != field})
    for blocks in ("head+out", "matrix"):
      with pytest.raises(ValueError, match=rf"{name}/weight is a square kernel of shape \(16, 16\) named 'weight'.*"
                                           rf"Projection\('{name}', leaf='weight', axes=\('out', 'in'\)\)"):
        mc.scale_by_muon(layout=lay, muon_blocks=blocks).init(plain)
    declared = mc.GQALayout(H4, H4, D4, **qk, **{field: mc.Projection(name, leaf="weight", axes=("out", "in"))},
                            **{f: None for f in ("value", "out") if f != field})
    opt = mc.scale_by_muon(layout=declared, muon_blocks="head+out")
    got = opt.update(plain, opt.init(plain))[0][name]["weight"]
    want = _cut(1.95 * plain[name]["weight"], -2 if field == "value" else -1, 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
