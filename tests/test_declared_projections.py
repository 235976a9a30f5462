"""Declared kernel storage (``mc.Projection``) and layouts read from logical axis names.

Each case stores the same weights twice: in a canonical form that ``qk_clip`` already
handles (DenseGeneral ``(*stack, in, heads, width)`` or 2-D head-major, leading stack), and
in a third-party storage order declared with ``Projection(axes=...)`` (Gemma's head-first
einsums with fused k|v, torch-style ``(out, in)``, MaxText's layer axis 1). The clip of the
declared storage, read back into canonical order, must equal the clip of the canonical one
(``_exactness.assert_same_math``: another program), and the value part of a fused kernel must not change.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muonclip_jax as mc
from muonclip_jax import GQALayout, MLALayout, Projection, qk_clip
from _exactness import assert_same_math

RNG = np.random.default_rng(0)


def _normal(*shape):
  return np.asarray(RNG.normal(size=shape), np.float32)


def _maxima(*shape):
  return np.asarray(RNG.uniform(1.0, 6.0, size=shape), np.float32)


def _close(a, b):
  assert_same_math(np.asarray(a), np.asarray(b))


def test_gemma_head_first_einsums_with_fused_kv_clip_like_dense_general():
  h, hkv, d, hd, layers = 4, 2, 6, 8, 2
  q = _normal(layers, d, h, hd)  # canonical (layers, in, heads, head_dim)
  k, v = _normal(layers, d, hkv, hd), _normal(layers, d, hkv, hd)
  s = _maxima(layers, h)
  tau = 3.0
  canon = {"attn": {"query": {"kernel": q}, "key": {"kernel": k}}}
  want = qk_clip(canon, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=GQALayout(h, hkv, hd, query="query", key="key"))
  # Gemma: q_einsum/w (heads, embed, head_dim), kv_einsum/w (2, kv_heads, embed, head_dim),
  # stacked on a leading layer axis; the projections sit one module deeper ("attn/...").
  gemma = {"block": {"attn": {
      "q_einsum": {"w": q.transpose(0, 2, 1, 3)},
      "kv_einsum": {"w": np.stack([k, v], 1).transpose(0, 1, 3, 2, 4)},
  }}}
  lay = GQALayout(
      h, hkv, hd,
      query=Projection("attn/q_einsum", leaf="w", axes=("layers", "heads", "in", "head_dim")),
      key=Projection("attn/kv_einsum", leaf="w", axes=("layers", "parts", "heads", "in", "head_dim"), parts=("k", "v")),
  )
  got = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))(gemma, {"block": {"max_logits": s}})
  _close(got["block"]["attn"]["q_einsum"]["w"].transpose(0, 2, 1, 3), want["attn"]["query"]["kernel"])
  kv = np.asarray(got["block"]["attn"]["kv_einsum"]["w"]).transpose(0, 1, 3, 2, 4)
  _close(kv[:, 0], want["attn"]["key"]["kernel"])
  _close(kv[:, 1], v)  # value part untouched
  assert not np.array_equal(kv[:, 0], k)  # something was clipped
  # init_max_logits reads the stack off the declared "layers" axis.
  ml = mc.init_max_logits(gemma, lay)
  assert ml["block"]["max_logits"].shape == (layers, h)
  # The same declaration gives Muon the matrices: layers batched, in fan-in, the rest fan-out.
  spec = mc.attention_matrix_axes(lay)(gemma)["block"]["attn"]
  assert spec["q_einsum"]["w"] == mc.MatrixAxes((2,), (1, 3))
  assert spec["kv_einsum"]["w"] == mc.MatrixAxes((3,), (1, 2, 4))


def test_torch_style_fused_qkv_with_bias_clips_like_head_major():
  h, hkv, hd, d = 4, 2, 4, 6
  cols = (h + 2 * hkv) * hd
  w, b = _normal(d, cols), _normal(cols)
  s = _maxima(h)
  want = qk_clip({"c_attn": {"kernel": w, "bias": b}}, {"max_logits": s}, qk_clip_threshold=2.5,
                 layout=GQALayout(h, hkv, hd, qkv="c_attn"))
  lay = GQALayout(h, hkv, hd, qkv=Projection("c_attn", axes=("out", "in")))
  got = qk_clip({"c_attn": {"kernel": w.T, "bias": b}}, {"max_logits": s}, qk_clip_threshold=2.5, layout=lay)
  _close(np.asarray(got["c_attn"]["kernel"]).T, want["c_attn"]["kernel"])
  _close(got["c_attn"]["bias"], want["c_attn"]["bias"])
  _close(np.asarray(got["c_attn"]["kernel"]).T[:, (h + hkv) * hd:], w[:, (h + hkv) * hd:])


def _maxtext_mla(boxed: bool):
  """MaxText MLA, scanned with param_scan_axis=1: wq_b (q_lora, layers, heads, nope+rope)."""
  h, nope, rope, v, ql, kvl, layers = 2, 4, 2, 4, 6, 5, 3
  rng = np.random.default_rng(1)
  wq_b = np.asarray(rng.normal(size=(ql, layers, h, nope + rope)), np.float32)
  wkv_b = np.asarray(rng.normal(size=(kvl, layers, h, nope + v)), np.float32)
  names = {"wq_b": ("q_lora", "layers", "q_heads", "kv"), "wkv_b": ("kv_lora", "layers", "kv_heads", "kv_head_dim")}
  box = (lambda x, n: nn.Partitioned(jnp.asarray(x), names=n)) if boxed else (lambda x, n: x)
  params = {"decoder": {"layers": {"self_attention": {
      "wq_b": {"kernel": box(wq_b, names["wq_b"])}, "wkv_b": {"kernel": box(wkv_b, names["wkv_b"])}}}}}
  return params, MLALayout(h, nope, rope, v), (wq_b, wkv_b)


def test_maxtext_layer_axis_1_declared_or_read_from_logical_names():
  params, lay, (wq_b, wkv_b) = _maxtext_mla(boxed=False)
  s = _maxima(3, 2)
  ml = {"decoder": {"layers": {"self_attention": {"max_logits": s}}}}
  canon = {"wq_b": {"kernel": wq_b.transpose(1, 0, 2, 3)}, "wkv_b": {"kernel": wkv_b.transpose(1, 0, 2, 3)}}
  want = qk_clip(canon, {"max_logits": s}, qk_clip_threshold=2.0, layout=lay)
  with pytest.raises(ValueError, match=r"wq_b/kernel has shape \(6, 3, 2, 6\).*Projection\(name, axes=\.\.\.\)"):
    qk_clip(params, ml, qk_clip_threshold=2.0, layout=lay)  # undeclared: the layer axis is not leading
  axes = ("in", "layers", "heads", "head_dim")
  declared = MLALayout(2, 4, 2, 4, query=Projection("wq_b", axes=axes), key_value=Projection("wkv_b", axes=axes))
  got = qk_clip(params, ml, qk_clip_threshold=2.0, layout=declared)
  attn = got["decoder"]["layers"]["self_attention"]
  _close(np.asarray(attn["wq_b"]["kernel"]).transpose(1, 0, 2, 3), want["wq_b"]["kernel"])
  _close(np.asarray(attn["wkv_b"]["kernel"]).transpose(1, 0, 2, 3), want["wkv_b"]["kernel"])
  # Logical names (Linen boxes): the plain layout needs no axes.
  boxed, _, _ = _maxtext_mla(boxed=True)
  got_boxed = qk_clip(boxed, ml, qk_clip_threshold=2.0, layout=lay)
  kernel = got_boxed["decoder"]["layers"]["self_attention"]["wq_b"]["kernel"]
  assert isinstance(kernel, nn.Partitioned)
  _close(kernel.value, attn["wq_b"]["kernel"])
  assert mc.init_max_logits(boxed, lay)["decoder"]["layers"]["self_attention"]["max_logits"].shape == (3, 2)
  # Muon's matrices from the same names: layers batched, q_lora fan-in.
  lookup = mc.logical_matrix_axes(boxed)["decoder"]["layers"]["self_attention"]["wq_b"]["kernel"]
  assert jax.tree.leaves(lookup, is_leaf=lambda x: isinstance(x, mc.MatrixAxes))[0] == mc.MatrixAxes((0,), (2, 3))


@pytest.mark.parametrize("heads", [2, 3])  # 3: as many heads as layers, so the bias's shape cannot tell
def test_layer_axis_1_biases_are_clipped_where_nn_scan_stores_them(heads):
  """``nn.scan(param_scan_axis=1)`` puts the layer axis at index 1 of every parameter: the kernel
  ``(embed, layers, heads, kv)``, the bias ``(heads, layers, kv)``. Each layer's clip equals the
  unscanned layer's, whether its names or its declared axes say where the layer axis is."""
  layers, d, hd, tau = 3, 6, 4, 2.0

  class Attn(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      def proj(name):
        return nn.DenseGeneral((heads, hd), name=name, bias_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("heads", "kv")), kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "heads", "kv")))(x)
      return x + proj("query").sum(-1) @ jnp.ones((heads, d)) + proj("key").sum(-1) @ jnp.ones((heads, d)), None

  scan = nn.scan(Attn, variable_axes={"params": 1}, split_rngs={"params": True}, length=layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})
  boxed = scan(name="attn").init(jax.random.key(0), jnp.ones((1, d)), None)["params"]
  assert boxed["query"]["bias"].names == ("heads", "layers", "kv")
  s = _maxima(layers, heads) * np.float32(2.0)
  lay = GQALayout(heads, heads, hd, query="query", key="key")
  declared = GQALayout(heads, heads, hd, query=Projection("query", axes=("in", "layers", "heads", "head_dim")),
                       key=Projection("key", axes=("in", "layers", "heads", "head_dim")))
  raw = jax.tree.map(np.asarray, nn.unbox(boxed))
  for params, layout in ((boxed, lay), (raw, declared)):
    got = nn.unbox(qk_clip({"attn": params}, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=layout))
    for i in range(layers):
      one = jax.tree.map(lambda a: np.take(a, i, axis=1), raw)
      want = qk_clip(one, {"max_logits": s[i]}, qk_clip_threshold=tau, layout=lay)
      for leaf in ("query/kernel", "query/bias", "key/kernel", "key/bias"):
        module, name = leaf.split("/")
        _close(np.take(np.asarray(got["attn"][module][name]), i, axis=1), want[module][name])
  # the layer axis first in the bias (the kernel's axes less 'in') is read too, where the shape tells
  if heads != layers:
    first = {m: {"kernel": raw[m]["kernel"], "bias": np.swapaxes(raw[m]["bias"], 0, 1)} for m in raw}
    got = qk_clip({"attn": first}, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=declared)
    want = qk_clip({"attn": raw}, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=declared)
    _close(np.swapaxes(got["attn"]["key"]["bias"], 0, 1), want["attn"]["key"]["bias"])
    # a layer axis under a name the library does not read ("layer"): the shape decides
    unread = nn.Partitioned(raw["key"]["bias"], names=("heads", "layer", "kv"))
    other = dict(boxed, key=dict(boxed["key"], bias=unread))
    got = qk_clip({"attn": other}, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=declared)
    _close(nn.unbox(got)["attn"]["key"]["bias"], want["attn"]["key"]["bias"])
    bad = dict(boxed, key=dict(boxed["key"], bias=nn.Partitioned(raw["key"]["bias"], names=("heads", "kv", "layers"))))
    with pytest.raises(ValueError, match=r"attn/key/bias has shape \(2, 3, 4\) and logical names \('heads', 'kv', "
                                         r"'layers'\); expected \(2, 3, 4\) or \(3, 2, 4\)"):
      qk_clip({"attn": bad}, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)


def test_declared_shape_mismatch_names_path_axes_and_shape():
  q = _normal(4, 6, 8)
  lay = GQALayout(4, 4, 8, query=Projection("q", leaf="w", axes=("heads", "in", "head_dim")),
                  key=Projection("k", leaf="w", axes=("in", "heads", "head_dim")))
  params = {"attn": {"q": {"w": q}, "k": {"w": q}}}  # k stored head-first, declared DenseGeneral
  with pytest.raises(ValueError, match=r"attn/k/w has shape \(4, 6, 8\), which does not match its declared axes "
                                       r"\('in', 'heads', 'head_dim'\).*expected \(4, 4, 8\)"):
    qk_clip(params, {"attn": {"max_logits": _maxima(4)}}, qk_clip_threshold=2.0, layout=lay)
  params["attn"]["k"] = {"w": q, "bias": np.zeros((6, 8), np.float32)}
  params["attn"]["k"]["w"] = q.transpose(1, 0, 2)
  with pytest.raises(ValueError, match=r"attn/k/bias has shape \(6, 8\); expected \(4, 8\)"):
    qk_clip(params, {"attn": {"max_logits": _maxima(4)}}, qk_clip_threshold=2.0, layout=lay)
  with pytest.raises(ValueError, match=r"attention_matrix_axes: attn/q/w has shape \(6, 8\), which does not match "
                                       r"its declared axes"):
    mc.attention_matrix_axes(lay)({"attn": {"q": {"w": q[0]}, "k": {"w": q.transpose(1, 0, 2)}}})


@pytest.mark.parametrize("kwargs, match", [
    ({"name": ""}, "name must be a sub-module path"),
    ({"name": "a//b"}, "name must be a sub-module path"),
    ({"name": "q", "leaf": "a/b"}, "leaf must be"),
    ({"name": "q", "axes": ("in", "rows")}, "unknown axis names"),
    ({"name": "q", "axes": ("heads", "in")}, "'heads' and 'head_dim' once each"),
    ({"name": "q", "axes": ("out", "heads", "head_dim", "in")}, "both 'out'"),
    ({"name": "q", "axes": ("heads", "head_dim")}, "needs an 'in'"),
    ({"name": "q", "parts": ("k", "k")}, "distinct"),
])
def test_projection_is_validated(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Projection(**kwargs)


def test_layouts_check_projection_roles():
  with pytest.raises(ValueError, match=r"GQALayout: query=.*parts must be one of"):
    GQALayout(2, 2, 4, query=Projection("q", parts=("q", "k")))
  with pytest.raises(ValueError, match="exactly one 'in' axis"):
    GQALayout(2, 2, 4, query=Projection("q", axes=("in", "in", "out")))
  with pytest.raises(ValueError, match="query and key must differ"):
    GQALayout(2, 2, 4, query=Projection("x"), key="x")
  with pytest.raises(ValueError, match="not a fused projection"):
    MLALayout(2, 2, 2, 2, query=Projection("wq", parts=("q",)))
  GQALayout(2, 2, 4, key=Projection("kv", parts=("k", "v")))


def test_nnx_sharding_metadata_gives_the_axes_and_optimizer_keeps_them():
  from flax import nnx

  class Attn(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.normal(1.0)
      meta = lambda *names: {"out_sharding": names, "eager_sharding": False}  # noqa: E731
      self.q = nnx.Einsum("btd,hde->bthe", (4, 6, 8), kernel_init=init, rngs=rngs,
                          kernel_metadata=meta("q_heads", "embed", "kv"))
      self.k = nnx.Einsum("btd,hde->bthe", (2, 6, 8), kernel_init=init, rngs=rngs,
                          kernel_metadata=meta("kv_heads", "embed", "kv_head_dim"))

  model = Attn(nnx.Rngs(0))
  lay = GQALayout(4, 2, 8, "query", query="q", key="k")
  s = jnp.asarray([1.0, 5.0, 2.0, 6.0])
  state = nnx.state(model, nnx.Param)
  got = qk_clip(state, {"max_logits": s}, qk_clip_threshold=3.0, layout=lay)
  gamma = np.where(s > 3.0, 3.0 / s, 1.0)
  want = np.asarray(model.q.kernel[...]) * gamma[:, None, None]
  np.testing.assert_allclose(np.asarray(nnx.to_pure_dict(got)["q"]["kernel"]), want, rtol=1e-6)
  # An optimizer that sees boxed params at init and bare arrays at update (nnx.Optimizer) clips the same.
  tx = mc.qk_clip_transform(3.0, layout=lay)
  tx_state = tx.init(state)
  bare = nnx.to_pure_dict(state)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, bare), tx_state, bare, max_logits={"max_logits": s})
  np.testing.assert_allclose(np.asarray(bare["q"]["kernel"] + updates["q"]["kernel"]), want, rtol=1e-6)
  with pytest.raises(ValueError, match=r"q/kernel has shape \(4, 6, 8\).*fits no kernel form"):
    qk_clip(bare, {"max_logits": s}, qk_clip_threshold=3.0, layout=lay)  # bare arrays, no names: not guessed
