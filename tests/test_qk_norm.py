"""QK-Clip with QK-norm: the clip acts on the norms' scales, or refuses; never a clip with no effect.

After the clip, recomputing the forward on the same batch must give every head's maximum
<= tau (1 + 1e-5); an undeclared QK-norm must be a ValueError at the first update.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pytest
from flax import nnx

import muonclip_jax as mc
import muonclip_jax.nn as mnn
from muonclip_jax import GQALayout, Projection, qk_clip, training
from _exactness import assert_same_math

H, HKV, D, HD, B, T = 4, 2, 16, 8, 2, 8


def _rms(x, scale, offset, bias=None):
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (offset + scale)
  return y if bias is None else y + bias


def _bcast(v):
  """A norm scale (head_dim,) or (heads, head_dim) against (batch, heads, time, head_dim)."""
  v = jnp.asarray(v)
  return v.reshape(1, 1, 1, -1) if v.ndim == 1 else v[None, :, None, :]


def _gemma_maxima(p, x, offset):
  """Per-layer, per-head max of the scaled logits of a Gemma-style attention (head-first einsums)."""
  out = []
  for layer in ("layer_0", "layer_1"):
    a = p[layer]["attn"]
    q = jnp.einsum("btd,hde->bhte", x, a["q_einsum"]["w"])
    k = jnp.einsum("btd,hde->bhte", x, a["k_einsum"]["w"])
    qn, kn = a["_query_norm"], a["_key_norm"]
    q = _rms(q, _bcast(qn["scale"]), offset, None if "bias" not in qn else _bcast(qn["bias"]))
    k = _rms(k, _bcast(kn["scale"]), offset, None if "bias" not in kn else _bcast(kn["bias"]))
    k = jnp.repeat(k, H // k.shape[1], axis=1)
    s = jnp.einsum("bhqe,bhke->bhqk", q, k) * HD**-0.5
    causal = jnp.tril(jnp.ones((T, T), bool))
    out.append(jnp.max(jnp.where(causal, s, -jnp.inf), axis=(0, 2, 3)))
  return {layer: {"attn": {"max_logits": m}} for layer, m in zip(("layer_0", "layer_1"), out)}


def _gemma_params(per_head, hkv, offset, rng):
  def layer():
    scale = lambda h: rng.uniform(1.5, 3.0, size=(h, HD) if per_head else (HD,)).astype(np.float32) - offset
    a = {"q_einsum": {"w": rng.normal(size=(H, D, HD)).astype(np.float32)},
         "k_einsum": {"w": rng.normal(size=(hkv, D, HD)).astype(np.float32)},
         "_query_norm": {"scale": scale(H)}, "_key_norm": {"scale": scale(hkv)}}
    if per_head:
      a["_query_norm"]["bias"] = rng.normal(size=(H, HD)).astype(np.float32) * 0.1
      a["_key_norm"]["bias"] = rng.normal(size=(hkv, HD)).astype(np.float32) * 0.1
    return {"attn": a}
  return {"layer_0": layer(), "layer_1": layer()}


@pytest.mark.parametrize("per_head, hkv, offset", [(False, HKV, 1.0), (True, H, 0.0)])
def test_clip_acts_on_norm_scales_and_bounds_every_head(per_head, hkv, offset):
  rng = np.random.default_rng(0)
  params = _gemma_params(per_head, hkv, offset, rng)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  ml = _gemma_maxima(params, x, offset)
  s = np.stack([np.asarray(ml[l]["attn"]["max_logits"]) for l in ml])
  tau = float(np.median(s))
  base = dict(query=Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
              key=Projection("k_einsum", leaf="w", axes=("heads", "in", "head_dim")))
  with pytest.raises(ValueError, match=r"layer_0/attn/_query_norm looks like a QK-norm.*query_norm='_query_norm', "
                                       r"key_norm='_key_norm'"):
    qk_clip(params, ml, qk_clip_threshold=tau, layout=GQALayout(H, hkv, HD, **base))
  lay = GQALayout(H, hkv, HD, query_norm="_query_norm", key_norm="_key_norm", norm_scale_offset=offset, **base)
  clipped = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))(params, ml)
  after = np.stack([np.asarray(v["attn"]["max_logits"]) for v in _gemma_maxima(clipped, x, offset).values()])
  assert np.all(after <= tau * (1 + 1e-5)), (s, after, tau)
  assert np.any(s > tau) and np.any(after < s)  # the clip did act
  for layer in params:  # kernels untouched: QK-norm would undo their scaling
    for proj in ("q_einsum", "k_einsum"):
      np.testing.assert_array_equal(clipped[layer]["attn"][proj]["w"], params[layer]["attn"][proj]["w"])
  if per_head:  # MHA with per-head scales: unclipped heads bit for bit
    np.testing.assert_array_equal(after[s <= tau], s[s <= tau])


class _FlaxQKNormLM(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = x + nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * HD, normalize_qk=True,
                                              attention_fn=mnn.dot_product_attention, name=f"attn_{i}")(x)
    return x


def test_flax_normalize_qk_is_refused_undeclared_and_clipped_declared():
  model = _FlaxQKNormLM()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, D)) * 4, jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  params = jax.tree.map(lambda a: a * 3.0, params)  # large norm scales: large logits
  _, state = model.apply({"params": params}, x, mutable=["intermediates"])
  lay = GQALayout(H, H, HD, query="query", key="key")
  opt = mc.muonclip(1e-3, layout=lay, qk_clip_threshold=1.0, matrix_axes=mc.attention_matrix_axes(lay))
  opt_state = opt.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(ValueError, match=r"attn_0/query_ln looks like a QK-norm.*query_norm='query_ln', key_norm='key_ln'"):
    opt.update(grads, opt_state, params, max_logits=state)  # the first update
  s = np.stack([np.asarray(state["intermediates"][f"attn_{i}"]["max_logits"][0]) for i in range(2)])
  tau = float(np.median(s))
  normed = GQALayout(H, H, HD, query="query", key="key", query_norm="query_ln", key_norm="key_ln")
  clipped = qk_clip(params, state, qk_clip_threshold=tau, layout=normed)
  _, after = model.apply({"params": clipped}, x, mutable=["intermediates"])
  after = np.stack([np.asarray(after["intermediates"][f"attn_{i}"]["max_logits"][0]) for i in range(2)])
  assert np.any(s > tau) and np.all(after <= tau * (1 + 1e-5)), (s, after, tau)


def test_nnx_normalize_qk_is_refused():
  mha = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=H * HD, normalize_qk=True, decode=False,
                               rngs=nnx.Rngs(0))
  params = nnx.state(mha, nnx.Param)
  with pytest.raises(ValueError, match="query_ln looks like a QK-norm"):
    qk_clip(params, {"max_logits": jnp.full((H,), 9.0)}, qk_clip_threshold=1.0,
            layout=GQALayout(H, H, HD, query="query", key="key"))


def test_norm_declarations_are_checked():
  with pytest.raises(ValueError, match="declared together"):
    GQALayout(2, 2, 4, query_norm="q_norm")
  with pytest.raises(ValueError, match="query_norm must be None or a norm"):
    GQALayout(2, 2, 4, query_norm="", key_norm="k")
  params = {"wq": {"kernel": np.ones((4, 8), np.float32)}, "wk": {"kernel": np.ones((4, 8), np.float32)},
            "q_norm": {"scale": np.ones((3,), np.float32)}, "k_norm": {"scale": np.ones((4,), np.float32)}}
  with pytest.raises(ValueError, match=r"q_norm/scale has shape \(3,\); a QK-norm scale is expected"):
    qk_clip(params, {"max_logits": jnp.full((2,), 9.0)}, qk_clip_threshold=1.0,
            layout=GQALayout(2, 2, 4, query_norm="q_norm", key_norm="k_norm"))



def _one_head_max(p, x, offset):
  """The max scaled logit of one Gemma-style head with QK-norm ``x * (offset + scale)``."""
  q = _rms(jnp.einsum("btd,hde->bhte", x, p["attn"]["q_einsum"]["w"]), _bcast(p["attn"]["_query_norm"]["scale"]), offset)
  k = _rms(jnp.einsum("btd,hde->bhte", x, p["attn"]["k_einsum"]["w"]), _bcast(p["attn"]["_key_norm"]["scale"]), offset)
  return jnp.max(jnp.einsum("bhqe,bhke->bhqk", q, k) * HD**-0.5, axis=(0, 2, 3))


@pytest.mark.parametrize("model, offset, start", [("gemma 2 and 3: x * (1 + scale)", 1.0, 0.0),
                                                  ("gemma 4: x * scale", 0.0, 1.0)])
def test_gemma_qk_norm_conventions_clip_to_tau_exactly(model, offset, start):
  """The right ``norm_scale_offset`` brings the head to tau exactly; the other one misses it
  (Gemma 4 with 1.0 over-clips to 0.5 of the logit instead of 0.75; Gemma 3 with 0.0 leaves
  the head above tau)."""
  rng = np.random.default_rng(3)
  w = lambda: jnp.asarray(rng.normal(size=(1, D, HD)) * 2, jnp.float32)
  norm = {"scale": jnp.full((HD,), start, jnp.float32)}
  params = {"attn": {"q_einsum": {"w": w()}, "k_einsum": {"w": w()}, "_query_norm": norm, "_key_norm": dict(norm)}}
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  s = _one_head_max(params, x, offset)
  tau = 0.75 * float(s[0])
  proj = dict(query=Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
              key=Projection("k_einsum", leaf="w", axes=("heads", "in", "head_dim")))
  after = {}
  for guess in (0.0, 1.0):
    lay = GQALayout(1, 1, HD, "query", query_norm="_query_norm", key_norm="_key_norm", norm_scale_offset=guess, **proj)
    clipped = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=lay)
    after[guess] = float(_one_head_max(clipped, x, offset)[0])
  np.testing.assert_allclose(after[offset], tau, rtol=1e-5)  # the documented convention: exactly tau
  wrong = after[1.0 - offset]
  if offset == 0.0:  # Gemma 4 declared as x * (1 + scale): scale 2 * 0.75 - 1 = 0.5, the head at 2/3 of tau
    np.testing.assert_allclose(wrong, tau * 0.5 / 0.75, rtol=1e-5)
  else:  # Gemma 3 declared as x * scale: 0.75 * 0 = 0, so 1 + 0 leaves the head above tau
    np.testing.assert_allclose(wrong, float(s[0]), rtol=1e-5)
  with pytest.raises(ValueError, match=r"Gemma 2 and 3's RMSNorm; Gemma 4's QK-norm computes x \* scale"):
    qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=tau, layout=GQALayout(1, 1, HD, **proj))


def _tunix_style(params, gain="w"):
  """The Gemma-style tree with Tunix's naming: norms ``q_norm``/``k_norm`` whose gain is the leaf ``w``."""
  out = {}
  for layer, v in params.items():
    a = dict(v["attn"])
    a["q_norm"] = {gain if k == "scale" else k: x for k, x in a.pop("_query_norm").items()}
    a["k_norm"] = {gain if k == "scale" else k: x for k, x in a.pop("_key_norm").items()}
    out[layer] = {"attn": a}
  return out


@pytest.mark.parametrize("gain", ["w", "weight"])
def test_a_qk_norm_is_found_by_what_it_is_whatever_its_gain_is_called(gain):
  """Tunix's ``q_norm/w`` (torch ports' ``q_norm/weight``): undeclared, refused (the clip would do nothing);
  declared by module (``query_norm="q_norm"``) or by leaf (``"q_norm/w"``), clipped as a ``scale`` leaf is."""
  rng = np.random.default_rng(1)
  params = _gemma_params(True, H, 0.0, rng)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  ml = _gemma_maxima(params, x, 0.0)
  tau = float(np.median(np.stack([np.asarray(v["attn"]["max_logits"]) for v in ml.values()])))
  base = dict(query=Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
              key=Projection("k_einsum", leaf="w", axes=("heads", "in", "head_dim")))
  tunix = _tunix_style(params, gain)
  with pytest.raises(ValueError, match=r"layer_0/attn/q_norm looks like a QK-norm.*query_norm='q_norm', "
                                       r"key_norm='k_norm'"):
    qk_clip(tunix, ml, qk_clip_threshold=tau, layout=GQALayout(H, H, HD, **base))
  want = qk_clip(params, ml, qk_clip_threshold=tau,
                 layout=GQALayout(H, H, HD, query_norm="_query_norm", key_norm="_key_norm", **base))
  for q, k in (("q_norm", "k_norm"), (f"q_norm/{gain}", f"k_norm/{gain}")):
    got = qk_clip(tunix, ml, qk_clip_threshold=tau, layout=GQALayout(H, H, HD, query_norm=q, key_norm=k, **base))
    for layer in params:
      for norm, ref in (("q_norm", "_query_norm"), ("k_norm", "_key_norm")):
        assert_same_math(got[layer]["attn"][norm][gain], want[layer]["attn"][ref]["scale"])
        assert_same_math(got[layer]["attn"][norm]["bias"], want[layer]["attn"][ref]["bias"])
  with pytest.raises(ValueError, match=r"the layout names the query norm 'q_norm/scale', but .* holds no gain"):
    qk_clip(tunix, ml, qk_clip_threshold=tau,
            layout=GQALayout(H, H, HD, query_norm="q_norm/scale", key_norm="k_norm/scale", **base))


class _NamedNormAttention(nn.Module):
  """Hand-written attention whose query/key norms have the names given (None: Flax's own
  ``RMSNorm_0``, ``RMSNorm_1``), and an input norm and a value norm, which are no QK-norm."""
  names: tuple

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(name="LayerNorm_0")(x)  # over the input's H * HD features
    q = nn.RMSNorm(name=self.names[0])(nn.DenseGeneral((H, HD), name="query")(x))
    k = nn.RMSNorm(name=self.names[1])(nn.DenseGeneral((H, HD), name="key")(x))
    v = nn.RMSNorm(name="v_norm")(nn.DenseGeneral((H, HD), name="value")(x))
    return nn.DenseGeneral(H * HD, axis=(-2, -1), name="out")(mnn.dot_product_attention(q, k, v))


@pytest.mark.parametrize("names,refused", [((None, None), False), (("q_ln", "k_ln"), True),
                                           (("norm_q", "norm_k"), True), (("qnorm", "knorm"), True),
                                           (("q_rms", "k_rms"), True), (("qn", "kn"), True),
                                           (("q_gain", "k_gain"), False)])
def test_a_qk_norm_of_any_norm_like_name_is_refused_undeclared_and_clipped_declared(names, refused):
  """Not only the usual names: a norm-like sub-module whose name says query or key, holding a gain
  of a QK-norm's shape, is refused undeclared (the clip would report heads clipped and change no
  logit); under Flax's own names (``RMSNorm_0``), which could as well be a value or output norm, or
  under a name that does not say norm but with a gain named ``scale`` as Flax's norms have, a
  UserWarning says the same. Declared, the clip bounds every head by tau. The input norm over
  ``H * HD`` features and the value's norm are not taken for QK-norms."""
  model = _NamedNormAttention(names)  # the input norm's gain has a flattened QK-norm's shape, (H * HD,)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, H * HD)) * 4, jnp.float32)
  params = jax.tree.map(lambda a: a * 3.0, model.init(jax.random.key(0), x)["params"])
  _, state = model.apply({"params": params}, x, mutable=["intermediates"])
  q, k = names if names[0] else ("RMSNorm_0", "RMSNorm_1")
  declared = f"query_norm='{q}', key_norm='{k}'" if names[0] else "query_norm=<the query's norm>"
  message = rf"^qk_clip: {min(q, k)} looks like a QK-norm .*\['{min(q, k)}', '{max(q, k)}'\]\).*GQALayout\(\.\.\., {declared}"
  undeclared = GQALayout(H, H, HD, query="query", key="key")
  with pytest.raises(ValueError, match=message) if refused else pytest.warns(UserWarning, match=message):
    qk_clip(params, state["intermediates"], qk_clip_threshold=1.0, layout=undeclared)
  s = np.asarray(state["intermediates"]["max_logits"])
  assert s.shape == (H,), s.shape
  tau = float(np.median(s))
  lay = GQALayout(H, H, HD, query="query", key="key", query_norm=q, key_norm=k)
  _, after = model.apply({"params": qk_clip(params, state["intermediates"], qk_clip_threshold=tau, layout=lay)}, x,
                         mutable=["intermediates"])
  after = np.asarray(after["intermediates"]["max_logits"])
  assert np.any(s > tau) and np.all(after <= tau * (1 + 1e-5)), (s, after, tau)


def test_norm_like_names_are_read_on_stacked_layers():
  """Two scanned layers (every leaf with a leading layer axis, maxima (2, H)): a norm named for the
  query and key is refused, one of Flax's own names warned about, and neither an input norm over
  ``H * HD`` features nor a gain without the layers' leading axis nor a quantized projection's
  per-channel ``scale`` beside its ``kernel`` is taken for a QK-norm."""
  def params(q, k, extra=None, leaf="scale"):
    attn = {"query": {"kernel": np.ones((2, H * HD, H, HD), np.float32)},
            "key": {"kernel": np.ones((2, H * HD, H, HD), np.float32)},
            q: {leaf: np.ones((2, HD), np.float32)}, k: {leaf: np.ones((2, H, HD), np.float32)},
            "LayerNorm_0": {"scale": np.ones((2, H * HD), np.float32)}}
    return {"attn": {**attn, **(extra or {})}}
  ml = {"attn": {"max_logits": np.full((2, H), 9.0, np.float32)}}
  lay = GQALayout(H, H, HD, query="query", key="key")
  with pytest.raises(ValueError, match=r"\['k_rms', 'q_rms'\]\).*query_norm='q_rms', key_norm='k_rms'"):
    qk_clip(params("q_rms", "k_rms"), ml, qk_clip_threshold=1.0, layout=lay)
  with pytest.warns(UserWarning, match=r"\['RMSNorm_0', 'RMSNorm_1'\]\)"):
    qk_clip(params("RMSNorm_0", "RMSNorm_1"), ml, qk_clip_threshold=1.0, layout=lay)
  quantized = {"kernel": np.ones((2, H * HD, H, HD), np.int8), "scale": np.ones((2, H, HD), np.float32)}
  unstacked = params("q_proj_bias", "k_proj_bias", {"RMSNorm_0": {"scale": np.ones((HD,), np.float32)},
                                                    "wv": quantized}, leaf="b")  # an int8 projection's scale
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    qk_clip(unstacked, ml, qk_clip_threshold=1.0, layout=lay)  # no QK-norm found: the kernels are clipped


class _GainlessNormAttention(nn.Module):
  """Query and key normalized without a gain (``use_scale=False``), or not at all: a QK-norm that
  the parameters do not show."""
  normalized: bool

  @nn.compact
  def __call__(self, x):
    norm = (lambda y: 3.0 * nn.RMSNorm(use_scale=False)(y)) if self.normalized else (lambda y: y)
    q, k = (norm(nn.DenseGeneral((H, HD), name=n)(x)) for n in ("query", "key"))
    v = nn.DenseGeneral((H, HD), name="value")(x)
    return nn.DenseGeneral(H * HD, axis=(-2, -1), name="out")(mnn.dot_product_attention(q, k, v))


@pytest.mark.parametrize("normalized", [True, False])
def test_the_exact_clip_reports_heads_that_a_hidden_qk_norm_keeps_above_tau(normalized):
  """No parameter shows a norm without a gain, so the clip scales the kernels, which the norm
  undoes. ``make_train_step(exact_clip=True)`` measures after every clip: its
  ``exact_clip_max_logit`` stays at the forward pass's maximum, above tau, after one clip and
  its measurement (2 passes); without the norm it is tau, and equal to a separate forward pass."""
  model = _GainlessNormAttention(normalized)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, H * HD)) * 2, jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(p, x):
    y, state = model.apply({"params": p}, x, mutable=["intermediates"])
    return jnp.mean(y ** 2), state["intermediates"]

  first = float(np.max(loss_fn(params, x)[1]["max_logits"]))
  tau, opt = first / 2, optax.sgd(0.0)
  step = jax.jit(training.make_train_step(loss_fn, opt, qk_clip_threshold=tau, exact_clip=True,
                                          layout=GQALayout(H, H, HD, query="query", key="key")))
  params, _, metrics = step(params, opt.init(params), x)
  after = float(np.max(loss_fn(params, x)[1]["max_logits"]))
  assert int(metrics["exact_clip_passes"]) == 2 and int(metrics["num_clipped"]) > 0
  assert float(metrics["exact_clip_max_logit"]) == pytest.approx(after, rel=1e-5)
  if normalized:
    assert after == pytest.approx(first, rel=1e-5), (after, first)  # the clip changed no logit
  else:
    assert after <= tau * (1 + 1e-4), (after, tau)
