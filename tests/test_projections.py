"""QK-Clip on every kernel form: 2-D head-major, DenseGeneral, fused QKV, named projections.

The reference keeps each projection in a canonical per-head NumPy form ``(*stack, in, heads,
width)`` and applies the per-head rule of Kimi K2 (arXiv 2507.20534, section 2.1) there;
the tests lay the same weights out in each kernel form, clip, and read them back.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import muonclip_jax as mc
from muonclip_jax import GQALayout, MLALayout, qk_clip
from _exactness import assert_same_math

# ----------------------------------------------------------------------------- forms (test side)


def to_form(form, parts):
  """Canonical per-head arrays (..., h, w) of the parts (q | k | v for fused) -> one leaf."""
  if form == "dense_general":
    (x,) = parts
    return x
  if form == "fused3":
    return np.stack(parts, axis=-3)
  return np.concatenate([x.reshape(*x.shape[:-2], -1) for x in parts], axis=-1)  # 2-D, fused


def from_form(form, leaf, dims):
  """Inverse of ``to_form``: the leaf -> canonical arrays, one per (heads, width) of ``dims``."""
  leaf = np.asarray(leaf)
  if form == "dense_general":
    return [leaf]
  if form == "fused3":
    return [leaf[..., i, :, :] for i in range(3)]
  out, start = [], 0
  for h, w in dims:
    out.append(leaf[..., start : start + h * w].reshape(*leaf.shape[:-1], h, w))
    start += h * w
  return out


def np_factors(s, tau, lay):
  """{role: (*stack, heads, width) float64}: the per-head rule, written out in NumPy."""
  s = np.asarray(s, np.float64)
  clipped = np.isfinite(s) & (s > tau)
  g = np.where(clipped, tau / np.where(clipped, s, 1.0), 1.0)
  rep = lambda f, w: np.repeat(f[..., None], w, axis=-1)
  if isinstance(lay, MLALayout):
    nope, rope, v = lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim
    return {
        "query": np.concatenate([rep(np.sqrt(g), nope), rep(g, rope)], -1),
        "key_value": np.concatenate([rep(np.sqrt(g), nope), rep(np.ones_like(g), v)], -1),
    }
  d = lay.head_dim
  if lay.clip_mode == "query":
    return {"query": rep(g, d), "key": np.ones((*s.shape[:-1], lay.num_kv_heads, d))}
  group_min = g.reshape(*s.shape[:-1], lay.num_kv_heads, lay.group_size).min(-1)
  return {"query": rep(np.sqrt(g), d), "key": rep(np.sqrt(group_min), d)}


def assert_scaled(after, before, factor, what):
  """after == factor * before: bit for bit where the factor is 1, to float32 rounding elsewhere."""
  after, before = np.asarray(after), np.asarray(before)
  factor = np.broadcast_to(factor, before.shape)
  one = factor == 1.0
  np.testing.assert_array_equal(after[one], before[one], err_msg=f"{what}: unscaled entries")
  np.testing.assert_allclose(after[~one], (factor * before)[~one], rtol=2e-6, atol=1e-30, err_msg=what)


# ----------------------------------------------------------------------------- cases


def _roles(lay):
  """[(role, heads, width)] of the canonical projections (value included for GQA)."""
  if isinstance(lay, MLALayout):
    h = lay.num_heads
    return [("query", h, lay.qk_head_dim), ("key_value", h, lay.qk_nope_head_dim + lay.v_head_dim)]
  return [("query", lay.num_heads, lay.head_dim), ("key", lay.num_kv_heads, lay.head_dim),
          ("value", lay.num_kv_heads, lay.head_dim)]


def make_case(seed, lay, forms, *, stack=(), bias=True, d_in=5):
  """(params {"attn": ...}, canonical {role: (kernel, bias)}) for ``forms`` {projection: form}."""
  rng = np.random.default_rng(seed)
  f32 = lambda *s: rng.normal(size=s).astype(np.float32)
  canon = {r: (f32(*stack, d_in, h, w), f32(*stack, h, w) if bias else None) for r, h, w in _roles(lay)}
  attn = {"wo": {"kernel": f32(*stack, 4, d_in)}}
  for name, form in forms.items():
    roles = [r for r, _, _ in _roles(lay)] if form in ("fused", "fused3") else [_role_of(lay, name)]
    attn[name] = {"kernel": to_form(form, [canon[r][0] for r in roles])}
    if bias:
      attn[name]["bias"] = to_form(form, [canon[r][1] for r in roles])
  if isinstance(lay, GQALayout) and lay.qkv is None:
    attn["wv"] = {"kernel": to_form("2d", [canon["value"][0]])}
  return {"attn": attn}, canon


def _role_of(lay, name):
  if isinstance(lay, MLALayout):
    return "key_value" if name == lay.key_value else "query"
  return "key" if name == lay.key else "query"


def read_back(params, lay, forms):
  """{role: (kernel, bias)} in canonical form from clipped params."""
  dims = {r: (h, w) for r, h, w in _roles(lay)}
  out = {}
  for name, form in forms.items():
    roles = [r for r, _, _ in _roles(lay)] if form in ("fused", "fused3") else [_role_of(lay, name)]
    kernels = from_form(form, params["attn"][name]["kernel"], [dims[r] for r in roles])
    biases = from_form(form, params["attn"][name]["bias"], [dims[r] for r in roles]) \
        if "bias" in params["attn"][name] else [None] * len(roles)
    out.update({r: (k, b) for r, k, b in zip(roles, kernels, biases)})
  return out


def random_maxima(seed, shape, tau):
  """Maxima around tau: about half clipped, some exactly tau, and a few non-finite or <= 0."""
  rng = np.random.default_rng(seed + 1)
  s = rng.uniform(0.2, 3.0, size=shape) * tau
  specials = np.array([tau, np.nan, np.inf, -np.inf, 0.0, -1.0])
  pick = rng.random(shape) < 0.15
  s[pick] = rng.choice(specials, size=int(pick.sum()))
  return s.astype(np.float32)


@st.composite
def gqa_cases(draw):
  kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
  mode = draw(st.sampled_from(["split", "query"]))
  fused = ["fused"] + (["fused3"] if group == 1 else [])
  form = draw(st.sampled_from(["2d", "dense_general", *fused]))
  names = draw(st.sampled_from([("wq", "wk", "c_attn"), ("query", "key", "qkv_proj"), ("q_proj", "k_proj", "Wqkv")]))
  qkv = names[2] if form.startswith("fused") else None
  lay = GQALayout(kv * group, kv, draw(st.integers(1, 4)), mode, query=names[0], key=names[1], qkv=qkv)
  if qkv:
    return lay, {qkv: form}
  key_form = draw(st.sampled_from(["2d", "dense_general", form]))
  return lay, {names[0]: form, names[1]: key_form}


@st.composite
def mla_cases(draw):
  nope = draw(st.integers(0, 4))
  rope = draw(st.sampled_from([0, 2, 4]) if nope else st.sampled_from([2, 4]))
  query = draw(st.sampled_from([None, "wq", "q_b_proj"]))
  key_value = draw(st.sampled_from(["wkv_b", "kv_b_proj"]))
  lay = MLALayout(draw(st.integers(1, 4)), nope, rope, draw(st.integers(1, 3)), query=query, key_value=key_value)
  q_name = "wq_b" if query is None else query
  forms = st.sampled_from(["2d", "dense_general"])
  return lay, {q_name: draw(forms), key_value: draw(forms)}


# ----------------------------------------------------------------------------- the rule, per form


@settings(max_examples=60)
@given(
    case=gqa_cases() | mla_cases(),
    stack=st.sampled_from([(), (2,), (3,), (2, 2)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_every_form_matches_the_numpy_rule(case, stack, bias, seed):
  lay, forms = case
  params, canon = make_case(seed, lay, forms, stack=stack, bias=bias)
  tau = np.float32(3.0)
  s = random_maxima(seed, (*stack, lay.num_heads), tau)
  out = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=tau, layout=lay))(params, {"attn": {"max_logits": s}})
  factors = np_factors(s, tau, lay)
  got = read_back(out, lay, forms)
  for role, (kernel, b) in canon.items():
    if role not in got:  # a separate value projection: never touched
      continue
    factor = factors.get(role, 1.0)  # value columns of a fused kernel: 1
    assert_scaled(got[role][0], kernel, factor if np.ndim(factor) == 0 else factor[..., None, :, :], f"{role} kernel")
    if b is not None:
      assert_scaled(got[role][1], b, factor, f"{role} bias")
  for name in ("wo", "wv"):
    if name in params["attn"]:
      np.testing.assert_array_equal(out["attn"][name]["kernel"], params["attn"][name]["kernel"])
  chex.assert_trees_all_equal_shapes_and_dtypes(out, params)


@pytest.mark.parametrize("stack", [(), (3,)])
@pytest.mark.parametrize("lay", [GQALayout(4, 2, 3), GQALayout(4, 2, 3, "query"), MLALayout(3, 2, 2, 3)],
                         ids=["gqa-split", "gqa-query", "mla"])
def test_2d_and_dense_general_clip_to_the_same_values(lay, stack):
  """The same weights laid out as 2-D and as DenseGeneral kernels clip to the same values (``_exactness``)."""
  names = ("wq", "wk") if isinstance(lay, GQALayout) else ("wq_b", "wkv_b")
  s = random_maxima(0, (*stack, lay.num_heads), 3.0)
  results = {}
  for form in ("2d", "dense_general"):
    params, canon = make_case(7, lay, dict.fromkeys(names, form), stack=stack)
    out = qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=3.0, layout=lay)
    results[form] = read_back(out, lay, dict.fromkeys(names, form))
  assert_same_math(results["2d"], results["dense_general"])
  assert any(not np.array_equal(results["2d"][r][0], canon[r][0]) for r in results["2d"])  # it clipped


@pytest.mark.parametrize("stack", [(), (2,)])
def test_fused_forms_clip_like_separate_projections(stack):
  lay = GQALayout(3, 3, 2)
  s = random_maxima(1, (*stack, 3), 3.0)
  ml = {"attn": {"max_logits": s}}
  sep, _ = make_case(3, lay, {"wq": "2d", "wk": "2d"}, stack=stack)
  expected = read_back(qk_clip(sep, ml, qk_clip_threshold=3.0, layout=lay), lay, {"wq": "2d", "wk": "2d"})
  for form in ("fused", "fused3"):
    fused_lay = GQALayout(3, 3, 2, qkv="c_attn")
    params, canon = make_case(3, fused_lay, {"c_attn": form}, stack=stack)
    got = read_back(qk_clip(params, ml, qk_clip_threshold=3.0, layout=fused_lay), fused_lay, {"c_attn": form})
    assert_same_math({r: got[r] for r in ("query", "key")}, expected)
    chex.assert_trees_all_equal(got["value"], canon["value"])


# ----------------------------------------------------------------------------- Flax's own modules


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed", "heads", "kv"))
    attn = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, kernel_init=init, bias_init=nn.initializers.normal(0.5), name="attn"
    )
    return attn(x), None


class _LinenScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = blocks(name="layers")(x, None)
    return _LinenBlock(name="top")(x, None)[0]


FLAX_LAYOUT = GQALayout(2, 2, 4, query="query", key="key")


def _check_against_reference(out, params, ml, tau, modules):
  """qk_clip on Flax DenseGeneral params equals the NumPy rule, module by module."""
  for module in modules:
    node_in, node_out = params, out
    for part in module.split("/"):
      node_in, node_out = node_in[part], node_out[part]
    s = ml[module.split("/")[0]][module.split("/")[1]]["max_logits"] if "/" in module else ml[module]["max_logits"]
    factors = np_factors(s, tau, FLAX_LAYOUT)
    for name, role in (("query", "query"), ("key", "key")):
      assert_scaled(node_out[name]["kernel"], node_in[name]["kernel"], factors[role][..., None, :, :], name)
      assert_scaled(node_out[name]["bias"], node_in[name]["bias"], factors[role], name)
    for name in ("value", "out"):
      chex.assert_trees_all_equal(node_out[name], node_in[name])


def test_linen_multi_head_dot_product_attention_scanned_and_boxed():
  model = _LinenScanned()
  x = jnp.ones((1, 3, 8))
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  assert isinstance(params["layers"]["attn"]["query"]["kernel"], nn.Partitioned)
  chex.assert_shape(nn.unbox(params)["layers"]["attn"]["query"]["kernel"], (3, 8, 2, 4))
  init = mc.init_max_logits(params, FLAX_LAYOUT)
  chex.assert_trees_all_equal(init, {"layers": {"attn": {"max_logits": jnp.full((3, 2), -jnp.inf)}},
                                     "top": {"attn": {"max_logits": jnp.full((2,), -jnp.inf)}}})
  ml = {"layers": {"attn": {"max_logits": random_maxima(2, (3, 2), 3.0)}},
        "top": {"attn": {"max_logits": np.array([9.0, 1.0], np.float32)}}}
  out = jax.jit(lambda p, m: qk_clip(p, m, qk_clip_threshold=3.0, layout=FLAX_LAYOUT))(params, ml)
  assert jax.tree.structure(out) == jax.tree.structure(params)
  plain = qk_clip(nn.unbox(params), ml, qk_clip_threshold=3.0, layout=FLAX_LAYOUT)
  assert_same_math(nn.unbox(out), plain)
  _check_against_reference(jax.tree.map(np.asarray, plain), jax.tree.map(np.asarray, nn.unbox(params)),
                           ml, np.float32(3.0), ["layers/attn", "top/attn"])


class _NNXModel(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.normal(1.0)
    make = lambda: nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                          kernel_init=init, bias_init=init, rngs=rngs)
    self.l0, self.l1 = make(), make()


def test_nnx_multi_head_attention_state():
  model = _NNXModel(nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  init = mc.init_max_logits(state, FLAX_LAYOUT)
  assert set(init) == {"l0", "l1"}
  chex.assert_shape(init["l0"]["max_logits"], (2,))
  ml = {"l0": {"max_logits": np.array([9.0, 1.0], np.float32)}, "l1": {"max_logits": np.array([2.0, 30.0], np.float32)}}
  out = qk_clip(state, ml, qk_clip_threshold=3.0, layout=FLAX_LAYOUT)
  assert isinstance(out, nnx.State) and jax.tree.structure(out) == jax.tree.structure(state)
  pure_in, pure_out = nnx.to_pure_dict(state), nnx.to_pure_dict(out)
  assert_same_math(pure_out, qk_clip(pure_in, ml, qk_clip_threshold=3.0, layout=FLAX_LAYOUT))
  _check_against_reference(pure_out, pure_in, ml, np.float32(3.0), ["l0", "l1"])


# ----------------------------------------------------------------------------- the optimizers


def _dense_general_model(rng):
  """Two stacked DenseGeneral attention layers plus one unstacked, with biases."""
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  layer = lambda *st: {
      "query": {"kernel": f32(*st, 8, 2, 4), "bias": f32(*st, 2, 4)},
      "key": {"kernel": f32(*st, 8, 2, 4), "bias": f32(*st, 2, 4)},
      "value": {"kernel": f32(*st, 8, 2, 4), "bias": f32(*st, 2, 4)},
      "out": {"kernel": f32(*st, 2, 4, 8)},
  }
  params = {"layers": {"attn": layer(2)}, "top": {"attn": layer()}}
  ml = {"layers": {"attn": {"max_logits": jnp.array([[9.0, 1.0], [2.0, 40.0]])}},
        "top": {"attn": {"max_logits": jnp.array([1.0, 5.0])}}}
  return params, ml, FLAX_LAYOUT


def _fused_model(rng):
  """GPT-2 style: two blocks with a fused c_attn (q|k|v) and c_proj."""
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  block = lambda: {"attn": {"c_attn": {"kernel": f32(8, 24), "bias": f32(24)}, "c_proj": {"kernel": f32(8, 8)}}}
  params = {"h_0": block(), "h_1": block()}
  ml = {"h_0": {"attn": {"max_logits": jnp.array([9.0, 1.0])}}, "h_1": {"attn": {"max_logits": jnp.array([1.0, 40.0])}}}
  return params, ml, GQALayout(2, 2, 4, qkv="c_attn")


def _matrix_axes(params):
  """Muon's matrix of each leaf: DenseGeneral (in, heads, head_dim) and (heads, head_dim, out)."""
  def axes(path, x):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if x.ndim < 2 or name.endswith("bias"):
      return None
    lead = x.ndim - (3 if name.split("/")[-2] in ("query", "key", "value", "out") else 2)
    if name.split("/")[-2] == "out":
      return mc.MatrixAxes((lead, lead + 1), (lead + 2,))
    return mc.MatrixAxes((lead,), tuple(range(lead + 1, x.ndim)))
  return jax.tree_util.tree_map_with_path(axes, params)


@pytest.mark.parametrize("model", [_dense_general_model, _fused_model], ids=["dense_general", "fused"])
def test_optimizers_on_every_form(model):
  params, ml, lay = model(np.random.default_rng(0))
  grads = jax.tree.map(lambda p: jnp.cos(3 * p), params)
  tau = 3.0
  # init_max_logits: one (*stack, H) leaf per attention module.
  init = mc.init_max_logits(params, lay)
  chex.assert_trees_all_equal_shapes(init, ml)
  # muonclip = muon_adamw, then the per-head rule on the stepped weights (documented rounding).
  kw = dict(matrix_axes=_matrix_axes(params), weight_decay=0.0)
  base, clip = mc.muon_adamw(0.05, **kw), mc.muonclip(0.05, layout=lay, qk_clip_threshold=tau, **kw)
  ub, _ = jax.jit(base.update)(grads, base.init(params), params)
  uc, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=ml)
  expected = qk_clip(optax.apply_updates(params, ub), ml, qk_clip_threshold=tau, layout=lay)
  chex.assert_trees_all_close(optax.apply_updates(params, uc), expected, rtol=0, atol=1e-5)
  # qk_clip_transform after plain SGD: the per-head rule on the stepped weights, and every
  # leaf and column that the rule leaves alone keeps SGD's update bit for bit.
  sgd = optax.chain(optax.sgd(0.1), mc.qk_clip_transform(tau, layout=lay))
  u, _ = sgd.update(grads, sgd.init(params), params, max_logits=ml)
  plain, _ = optax.sgd(0.1).update(grads, optax.sgd(0.1).init(params), params)
  stepped = optax.apply_updates(params, plain)
  expected = qk_clip(stepped, ml, qk_clip_threshold=tau, layout=lay)
  chex.assert_trees_all_close(optax.apply_updates(params, u), expected, rtol=0, atol=1e-6)
  same = jax.tree.map(lambda e, s: np.asarray(e) == np.asarray(s), expected, stepped)
  jax.tree.map(lambda a, b, m: np.testing.assert_array_equal(np.asarray(a)[m], np.asarray(b)[m]), u, plain, same)
  assert not all(np.all(m) for m in jax.tree.leaves(same))  # it clipped
  acc = mc.multi_steps(sgd, 2, layout=lay)
  state, p = acc.init(params), params
  low = jax.tree.map(lambda s: jnp.minimum(s, 1.0), ml)  # the hot heads are in the first microbatch
  for m, g in ((ml, grads), (low, jax.tree.map(jnp.sin, params))):
    u, state = jax.jit(acc.update)(g, state, p, max_logits=m)
    p = optax.apply_updates(p, u)
  mean = jax.tree.map(lambda a, b: (jnp.cos(3 * b) + jnp.sin(b)) / 2, grads, params)
  u, _ = sgd.update(mean, sgd.init(params), params, max_logits=ml)
  chex.assert_trees_all_close(p, optax.apply_updates(params, u), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- bad input


def _dg_attn(*, heads=2, head_dim=4, d_in=8, stack=(), key_stack=None, bias=True):
  rng = np.random.default_rng(0)
  f32 = lambda *s: rng.normal(size=s).astype(np.float32)
  proj = lambda st: {"kernel": f32(*st, d_in, heads, head_dim), **({"bias": f32(*st, heads, head_dim)} if bias else {})}
  return {"attn": {"query": proj(stack), "key": proj(stack if key_stack is None else key_stack)}}


def _ml(*shape, value=9.0):
  return {"attn": {"max_logits": np.full(shape, value, np.float32)}}


def test_no_form_fits_names_path_shape_and_forms():
  params = _dg_attn()
  lay = GQALayout(4, 4, 2, query="query", key="key")
  with pytest.raises(ValueError, match=r"attn/query/kernel has shape \(8, 2, 4\), i\.e\. 2 heads of 4 columns as DenseGeneral "
                     r"\(or 4 columns as 2-D head-major\), but expected 4 heads of 2 columns; it fits no kernel form.*"
                     r"tried \('in', 8\) \(2-D head-major\) or \('in', 4, 2\) \(DenseGeneral\)"):
    qk_clip(params, _ml(4), qk_clip_threshold=3.0, layout=lay)
  with pytest.raises(ValueError, match=r"init_max_logits: attn/query/kernel has shape \(8, 2, 4\).*"
                     r"\(\*stack, 'in', 4, 2\) \(DenseGeneral\)"):
    mc.init_max_logits(params, lay)
  # the key head count is wrong: (in, 2, 4) is 2 key heads, the layout says 1
  with pytest.raises(ValueError, match=r"attn/key/kernel has shape \(8, 2, 4\).*key: 1 heads of 4"):
    qk_clip(params, _ml(2), qk_clip_threshold=3.0, layout=GQALayout(2, 1, 4, query="query", key="key"))
  fused = {"attn": {"c_attn": {"kernel": np.ones((8, 3, 4, 2), np.float32)}}}
  with pytest.raises(ValueError, match=r"attn/c_attn/kernel has shape \(8, 3, 4, 2\).*needs num_kv_heads == num_heads"):
    qk_clip(fused, _ml(4), qk_clip_threshold=3.0, layout=GQALayout(4, 2, 2, qkv="c_attn"))
  with pytest.raises(ValueError, match=r"attn/c_attn/kernel has shape \(8, 3, 4, 2\); expected \(2, 'in', 24\) "
                     r"\(fused 2-D q\|k\|v\) or \(2, 'in', 3, 4, 2\)"):
    qk_clip(fused, _ml(2, 4), qk_clip_threshold=3.0, layout=GQALayout(4, 4, 2, qkv="c_attn"))


def test_two_forms_fit_unless_maxima_or_bias_tell():
  """One head and no bias: (8, 1, 4) is DenseGeneral (in=8), or 2-D (in=1) stacked over 8 layers."""
  lay = GQALayout(1, 1, 4, query="query", key="key")
  params = _dg_attn(heads=1, bias=False)
  with pytest.raises(ValueError, match=r"attn/query/kernel has shape \(8, 1, 4\), which fits two kernel forms.*"
                     r"2-D head-major with stacked-layer shape \(8,\) and DenseGeneral with stacked-layer shape \(\)"):
    mc.init_max_logits(params, lay)
  chex.assert_shape(mc.init_max_logits(_dg_attn(heads=1), lay)["attn"]["max_logits"], (1,))  # the bias tells
  out = qk_clip(params, _ml(1), qk_clip_threshold=3.0, layout=lay)  # max_logits (1,): no stack, DenseGeneral
  np.testing.assert_allclose(out["attn"]["query"]["kernel"], params["attn"]["query"]["kernel"] * np.sqrt(3 / 9), rtol=1e-6)


def test_bias_and_stack_mismatches():
  lay = GQALayout(2, 2, 4, query="query", key="key")
  params = _dg_attn()
  params["attn"]["key"]["bias"] = np.ones(8, np.float32)
  with pytest.raises(ValueError, match=r"attn/key/bias has shape \(8,\); expected \(2, 4\) for the DenseGeneral "
                     r"kernel attn/key/kernel of shape \(8, 2, 4\)"):
    qk_clip(params, _ml(2), qk_clip_threshold=3.0, layout=lay)
  with pytest.raises(ValueError, match=r"projections of 'attn' disagree on their leading \(stacked-layer\) shape.*"
                     r"'attn/query/kernel': \[\(2,\)\], 'attn/key/kernel': \[\(3,\)\]"):
    mc.init_max_logits(_dg_attn(stack=(2,), key_stack=(3,)), lay)
  with pytest.raises(ValueError, match=r"attn/key/kernel has shape \(3, 8, 2, 4\); expected \(2, 'in', 8\) .*"
                     r"\(stacked-layer\) shape \(2,\) is that of attn/max_logits"):
    qk_clip(_dg_attn(stack=(2,), key_stack=(3,)), _ml(2, 2), qk_clip_threshold=3.0, layout=lay)


def test_per_example_maxima_on_an_unstacked_model_say_to_reduce_them():
  """Maxima (batch, heads) from a vmapped forward are read as (layers, heads): the error says that
  the kernels fit with fewer stacked axes and that examples or batches are reduced first."""
  lay = GQALayout(2, 2, 4, query="query", key="key")
  with pytest.raises(ValueError, match=r"expected \(3, 'in', 8\) .*shape \(3,\) is that of attn/max_logits.*"
                     r"kernel fits with fewer stacked axes: if attn/max_logits's leading axes hold examples or "
                     r"batches .*take the maximum over them first"):
    qk_clip(_dg_attn(), _ml(3, 2), qk_clip_threshold=3.0, layout=lay)
  with pytest.raises(ValueError) as stacked:  # a stack of the wrong length: no such hint
    qk_clip(_dg_attn(stack=(2,)), _ml(3, 2), qk_clip_threshold=3.0, layout=lay)
  assert "fewer stacked axes" not in str(stacked.value)


def test_projection_names_are_checked():
  params = _dg_attn()
  with pytest.raises(ValueError, match=r"module 'attn' has no 'attn/q_proj/kernel' for GQALayout \(expected "
                     r"projections \['q_proj', 'k_proj'\].*\['key/bias', 'key/kernel', 'query/bias', 'query/kernel'\]"):
    qk_clip(params, _ml(2), qk_clip_threshold=3.0, layout=GQALayout(2, 2, 4, query="q_proj", key="k_proj"))
  with pytest.raises(ValueError, match="no attention module"):
    mc.init_max_logits(params, GQALayout(2, 2, 4))  # wq/wk by default
  for bad in ({"query": ""}, {"query": "a/b"}, {"key": 3}, {"qkv": ""}, {"query": "x", "key": "x"}):
    with pytest.raises(ValueError, match="GQALayout: (query|key|qkv)"):
      GQALayout(2, 2, 4, **bad)
  GQALayout(2, 2, 4, query="x", key="x", qkv="c_attn")  # fused: query/key are not used
  with pytest.raises(ValueError, match="MLALayout: query and key_value must differ"):
    MLALayout(2, 2, 2, 2, query="wkv_b")
  with pytest.raises(ValueError, match="MLALayout: key_value"):
    MLALayout(2, 2, 2, 2, key_value=None)
  with pytest.raises(TypeError):
    GQALayout(2, 2, 4, "split", "q_proj")  # names are keyword-only


# ----------------------------------------------------------------------------- strict inputs


def _library_mla(**kw):
  import muonclip_jax.nn as mnn

  module = mnn.MultiHeadLatentAttention(num_heads=4, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=8,
                                        qk_rope_head_dim=8, v_head_dim=8, **kw)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 16)), jnp.float32)
  variables = module.init(jax.random.key(0), x)
  return module, variables, module.apply(variables, x, mutable=["intermediates"])


def test_mla_layout_with_the_right_totals_but_the_wrong_split_is_detected():
  module, variables, (_, state) = _library_mla()
  params = {"attn": variables["params"]}
  ml = {"attn": state["intermediates"]}
  wrong = MLALayout(4, 12, 4, 4)  # same column totals as (4, 8, 8, 8)
  pattern = (r"attn/wkv_a/kernel has shape \(16, 14\), i\.e\. a latent of 6 columns .* rotary key of 8 "
             r"columns, but the layout says qk_rope_head_dim=4.*module\.layout")
  with pytest.raises(ValueError, match="qk_clip: " + pattern):
    qk_clip(params, ml, qk_clip_threshold=0.01, layout=wrong)
  with pytest.raises(ValueError, match="init_max_logits: " + pattern):
    mc.init_max_logits(params, wrong)
  qk_clip(params, ml, qk_clip_threshold=0.01, layout=module.layout)  # the module's own layout is right
  # DenseGeneral MLA kernels (MaxText) carry the per-head width: (4, 9, 3, 3) has other widths.
  rng = np.random.default_rng(0)
  dg = {"attn": {"wq_b": {"kernel": rng.normal(size=(8, 4, 16))}, "wkv_b": {"kernel": rng.normal(size=(6, 4, 16))}}}
  with pytest.raises(ValueError, match=r"attn/wq_b/kernel has shape \(8, 4, 16\).*fits no kernel form"):
    qk_clip(dg, _ml(4), qk_clip_threshold=3.0, layout=MLALayout(4, 9, 3, 3))


def test_variables_dict_as_params_says_what_was_expected():
  _, variables, (_, state) = _library_mla()
  lay = MLALayout(4, 8, 8, 8)
  expected = r"top-level 'params' key.*pass the 'params' collection \(variables\['params'\]\)"
  with pytest.raises(ValueError, match="qk_clip: params has a " + expected):
    qk_clip(variables, state, qk_clip_threshold=0.01, layout=lay)
  with pytest.raises(ValueError, match="init_max_logits: params has a " + expected):
    mc.init_max_logits(variables, lay)
  with pytest.raises(ValueError, match=expected):
    mc.multi_steps(mc.muonclip(0.1, layout=lay), 2, layout=lay).init(variables)
  opt = mc.muonclip(0.1, layout=lay)
  grads = jax.tree.map(jnp.zeros_like, variables)
  with pytest.raises(ValueError, match=expected):
    opt.update(grads, opt.init(variables), variables, max_logits=state)


def test_apply_output_pair_as_max_logits_says_what_was_expected():
  _, variables, out = _library_mla()
  lay = MLALayout(4, 8, 8, 8)
  params = variables["params"]
  expected = r"max_logits is a tuple of length 2; element 1 holds the maxima\. Expected the 'intermediates'.*not the \(y, state\) pair"
  with pytest.raises(TypeError, match="qk_clip: " + expected):
    qk_clip(params, out, qk_clip_threshold=0.01, layout=lay)
  with pytest.raises(TypeError, match="qk_clip_stats: " + expected):
    mc.qk_clip_stats(out, qk_clip_threshold=0.01)
  opt = mc.muonclip(0.1, layout=lay)
  grads = jax.tree.map(jnp.zeros_like, params)
  with pytest.raises(TypeError, match=expected):
    opt.update(grads, opt.init(params), params, max_logits=out)
  acc = mc.multi_steps(opt, 2, layout=lay)
  with pytest.raises(TypeError, match=expected):
    acc.update(grads, acc.init(params), params, max_logits=out)
  # the pair's second element is what was expected
  assert_same_math(qk_clip(params, out[1], qk_clip_threshold=0.01, layout=lay),
                              qk_clip(params, out[1]["intermediates"], qk_clip_threshold=0.01, layout=lay))
  # nnx.capture's (y, intermediates) pair
  model = _NNXModel(nnx.Rngs(0))
  pair = (jnp.zeros(()), nnx.State({"l0": {"max_logits": nnx.Intermediate(jnp.ones(2))}}))
  with pytest.raises(TypeError, match="element 1 holds the maxima"):
    qk_clip(nnx.state(model, nnx.Param), pair, qk_clip_threshold=3.0, layout=FLAX_LAYOUT)
  with pytest.raises(ValueError, match=r"max_logits leaf at 'state/intermediates/max_logits' lies under an 'intermediates' key"):
    qk_clip(params, {"state": out[1]}, qk_clip_threshold=0.01, layout=lay)
