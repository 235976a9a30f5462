"""Mixture-of-experts models: each expert's matrix orthogonalized on its own, the router, the routing bias.

The references slice every expert's (and layer's) matrix out by hand and run ``newton_schulz``
on it, scaled by Moonlight's ``0.2 sqrt(max(rows, cols))`` of that one matrix.
"""

import re

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muonclip_jax as mc
from muonclip_jax._muon import axes_from_names
from _exactness import assert_same_math

E, D, F, H, HD = 4, 8, 12, 2, 4  # experts, model width, expert width, heads, head width
BETA = 0.95
NS = dict(steps=None, coeffs="polar_express_4", method="auto")  # scale_by_muon's defaults
BAND = (0.779 - 0.02, 1.200 + 0.02)  # polar_express_4's output band (newton_schulz), float32 slack
INIT = nn.initializers.lecun_normal()
_ns = jax.jit(lambda x: mc.newton_schulz(x, **NS))


def per_matrix_reference(g, lead):
  """Muon's first update of ``g`` (zero momentum, Nesterov): each matrix of its ``lead`` leading
  (batch) axes sliced out by hand, orthogonalized alone and scaled by its own RMS factor."""
  g = np.asarray(g, np.float32)
  out = np.empty_like(g)
  rows, cols = g.shape[-2:]
  for idx in np.ndindex(g.shape[:lead]):
    out[idx] = _ns(jnp.asarray(g[idx] * (1 + BETA))) * 0.2 * np.sqrt(max(rows, cols))
  return out


def muon_update(opt, params, grads):
  """``-update`` of ``opt`` (learning rate 1, no weight decay: Muon's direction itself)."""
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  return jax.tree.map(lambda u: -u, nn.unbox(updates))


def grads_like(params, seed=0):
  """Gaussian gradients of the shapes of ``params``, in the same boxes."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def assert_close(got, want):
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- MaxText-style Linen


class MoeBlock(nn.Module):
  """MaxText's ``RoutedMoE`` storage: ``gate`` ``("embed", None)``, expert stacks named ``"exp"``."""

  @nn.compact
  def __call__(self, x):
    gate = nn.Dense(E, use_bias=False, name="gate", kernel_init=nn.with_logical_partitioning(INIT, ("embed", None)))(x)
    wi_0 = self.param("wi_0", nn.with_logical_partitioning(INIT, ("exp", "embed_no_exp", "mlp")), (E, D, F))
    wi_1 = self.param("wi_1", nn.with_logical_partitioning(INIT, ("exp", "embed_no_exp", "mlp")), (E, D, F))
    wo = self.param("wo", nn.with_logical_partitioning(INIT, ("exp", "mlp", "embed_no_exp")), (E, F, D))
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, wi_0)) * jnp.einsum("td,edf->tef", x, wi_1)
    return jnp.einsum("tef,efd,te->td", h, wo, jax.nn.softmax(gate))


class Layer(nn.Module):
  """DenseGeneral attention kernels with logical names, then the MoE block."""

  @nn.compact
  def __call__(self, x, _):
    dense = lambda name, names, feat, axis=-1: nn.DenseGeneral(  # noqa: E731
        feat, axis=axis, name=name, use_bias=False, kernel_init=nn.with_logical_partitioning(INIT, names))
    q, k, v = (dense(n, ("embed", "heads", "kv"), (H, HD))(x) for n in ("query", "key", "value"))
    logits = jnp.einsum("thd,shd->hts", q, k)
    a = jnp.einsum("hts,shd->thd", jax.nn.softmax(logits), v)
    x = x + dense("out", ("heads", "kv", "embed"), D, axis=(-2, -1))(a)
    return x + MoeBlock(name="MoeBlock_0")(x), None


class Decoder(nn.Module):
  scan: bool

  @nn.compact
  def __call__(self, x):
    if self.scan:  # MaxText's param_scan_axis=1: "layers" second, experts (E, L, in, out)
      return nn.scan(Layer, variable_axes={"params": 1}, split_rngs={"params": True}, length=2,
                     metadata_params={nn.PARTITION_NAME: "layers"})(name="layers")(x, None)[0]
    for i in range(2):
      x = Layer(name=f"layers_{i}")(x, None)[0]
    return x


LAYOUT = mc.GQALayout(H, H, HD, query="query", key="key", value="value", out="out")


@pytest.mark.parametrize("scan", [False, True])
def test_maxtext_linen_moe_per_expert_with_per_head_attention(scan):
  params = Decoder(scan).init(jax.random.key(0), jnp.ones((3, D)))["params"]
  boxed_grads = grads_like(params)
  opt = mc.muon_adamw(1.0, weight_decay=0.0, layout=LAYOUT, muon_blocks="head")
  got = muon_update(opt, params, boxed_grads)
  grads = nn.unbox(boxed_grads)
  blocks = [(got["layers"]["MoeBlock_0"], grads["layers"]["MoeBlock_0"], 2)] if scan else [
      (got[f"layers_{i}"]["MoeBlock_0"], grads[f"layers_{i}"]["MoeBlock_0"], 1) for i in range(2)]
  for u, g, lead in blocks:
    assert u["wi_0"].shape == ((E, 2, D, F) if scan else (E, D, F))
    for name in ("wi_0", "wi_1", "wo"):
      assert_close(u[name], per_matrix_reference(g[name], lead))
    gate = g["gate"]["kernel"]  # ("embed", None), scanned ("embed", "layers", None): one matrix per layer
    want = per_matrix_reference(jnp.moveaxis(gate, 1, 0), 1).transpose(1, 0, 2) if scan else per_matrix_reference(gate, 0)
    assert_close(u["gate"]["kernel"], want)
  # the attention is per head at the same time: head 1 of a query kernel alone is an orthogonal block
  q = (got["layers"] if scan else got["layers_0"])["query"]["kernel"]
  gq = (grads["layers"] if scan else grads["layers_0"])["query"]["kernel"]
  head = (q[:, 0, 1] if scan else q[:, 1]) / (0.2 * np.sqrt(D))
  assert_close(head, np.asarray(mc.newton_schulz((gq[:, 0, 1] if scan else gq[:, 1]) * (1 + BETA), **NS)))
  labels = nn.unbox(mc.muon_labels(params))
  assert jax.tree.leaves(labels) == ["muon"] * len(jax.tree.leaves(labels))  # experts and gate included
  if scan:
    return
  # the same update under muonclip (its layout is the clip's too; no head above tau here)
  clip = mc.muonclip(1.0, layout=LAYOUT, weight_decay=0.0, muon_blocks="head")
  max_logits = jax.tree.map(jnp.zeros_like, mc.init_max_logits(params, LAYOUT))
  clipped = nn.unbox(jax.jit(clip.update)(boxed_grads, clip.init(params), params, max_logits=max_logits)[0])
  assert_same_math(jax.tree.map(lambda u: -u, clipped), got)  # two programs: to the suite's rounding


def test_one_expert_with_a_tiny_gradient_still_gets_an_orthogonal_update():
  """Flattening the stack into one (E*D) x F matrix would leave expert 0 with singular values near 0."""
  params = MoeBlock().init(jax.random.key(0), jnp.ones((3, D)))["params"]
  grads = grads_like(params)
  grads["wi_0"] = grads["wi_0"].replace_boxed(grads["wi_0"].value.at[0].multiply(1e-3))
  got = muon_update(mc.muon_adamw(1.0, weight_decay=0.0), params, grads)
  for e in range(E):
    s = np.linalg.svd(np.asarray(got["wi_0"][e]) / (0.2 * np.sqrt(F)), compute_uv=False)
    assert BAND[0] <= s.min() and s.max() <= BAND[1], (e, s)


# ----------------------------------------------------------------------------- NNX


class NnxMoE(nnx.Module):
  """MaxText's NNX ``RoutedMoE`` storage, expert axes ``"exp"`` and ``"expert"`` in ``out_sharding``."""

  def __init__(self, rngs):
    self.gate = nnx.Linear(D, E, use_bias=False, rngs=rngs,
                           kernel_metadata={"out_sharding": ("embed", None), "eager_sharding": False})
    self.wi_0 = nnx.Param(INIT(rngs.params(), (E, D, F)), out_sharding=("exp", "embed_no_exp", "mlp"),
                          eager_sharding=False)
    self.wo = nnx.Param(INIT(rngs.params(), (E, F, D)), out_sharding=("expert", "mlp", "embed"), eager_sharding=False)
    self.e_score_correction_bias = nnx.Param(jnp.full((E,), 0.5))


def test_nnx_moe_per_expert_under_nnx_optimizer():
  model = NnxMoE(nnx.Rngs(0))
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  grads = jax.tree.map(lambda x: jnp.cos(7 * x), nnx.state(model, nnx.Param))
  grads["e_score_correction_bias"][...] = jnp.zeros((E,))
  opt = nnx.Optimizer(model, mc.muon_adamw(1.0, weight_decay=0.1), wrt=nnx.Param)  # boxed at init, bare at update
  opt.update(model, grads)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  g = nnx.to_pure_dict(grads)
  for name in ("wi_0", "wo"):  # decoupled decay: p - lr * (u + 0.1 p)
    assert_close(before[name] * 0.9 - after[name], per_matrix_reference(g[name], 1))
  chex.assert_trees_all_equal(after["e_score_correction_bias"], jnp.full((E,), 0.5))  # frozen, not decayed


# ----------------------------------------------------------------------------- Equinox


class EqxMoE(eqx.Module):
  gate: eqx.nn.Linear
  w_in: eqx.nn.Linear
  w_out: eqx.nn.Linear
  e_score_correction_bias: jax.Array

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.gate = eqx.nn.Linear(D, E, use_bias=False, key=k1)  # (E, D), torch-style
    self.w_in = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, F, key=k))(jax.random.split(k2, E))  # (E, F, D)
    self.w_out = eqx.filter_vmap(lambda k: eqx.nn.Linear(F, D, key=k))(jax.random.split(k3, E))
    self.e_score_correction_bias = jnp.zeros((E,))


def test_equinox_filter_vmap_experts_stacked_over_layers():
  model = eqx.filter_vmap(EqxMoE)(jax.random.split(jax.random.key(0), 2))  # 2 layers: (L, E, F, D)
  params = eqx.filter(model, eqx.is_array)
  assert params.w_in.weight.shape == (2, E, F, D)
  labels = mc.muon_labels(params)
  assert (labels.gate.weight, labels.w_in.weight, labels.w_in.bias, labels.e_score_correction_bias) == (
      "muon", "muon", "adam", "frozen")
  grads = grads_like(params)
  got = muon_update(mc.muon_adamw(1.0, weight_decay=0.0), params, grads)
  for name in ("w_in", "w_out"):
    assert_close(getattr(got, name).weight, per_matrix_reference(getattr(grads, name).weight, 2))
  assert_close(got.gate.weight, per_matrix_reference(grads.gate.weight, 1))
  chex.assert_trees_all_equal(got.e_score_correction_bias, jnp.zeros((2, E)))


# ----------------------------------------------------------------------------- plain dicts


def test_plain_dict_with_explicit_matrix_axes_and_expert_named_axes():
  rng = np.random.default_rng(0)
  params = {"moe": {"w1": jnp.asarray(rng.standard_normal((2, E, D, F)), jnp.float32),  # (layers, experts, in, out)
                    "w2": jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)}}
  grads = grads_like(params)
  got = muon_update(mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=mc.MatrixAxes((-2,), (-1,))), params, grads)
  assert_close(got["moe"]["w1"], per_matrix_reference(grads["moe"]["w1"], 2))
  assert_close(got["moe"]["w2"], per_matrix_reference(grads["moe"]["w2"], 1))
  # explicit axes that batch an expert-named axis are accepted; ones that merge the experts are refused
  boxed = {"w": nn.Partitioned(params["moe"]["w2"], names=("experts", "mlp", "embed"))}
  spec = optax.contrib.MuonDimensionNumbers(-2, -1)
  got = muon_update(mc.scale_by_muon(matrix_axes=spec), boxed, grads_like(boxed))
  assert_close(-got["w"], per_matrix_reference(nn.unbox(grads_like(boxed))["w"], 1))
  with pytest.raises(ValueError) as err:
    mc.scale_by_muon(matrix_axes=mc.MatrixAxes((0, 1), (2,))).init(boxed)
  msg = str(err.value)
  assert re.search(r"^w: .*expert axes \(0,\).*\(4, 12, 8\).*one 48x8 matrix", msg)
  assert "MatrixAxes(fan_in=(1,), fan_out=(2,))" in msg and "'layers'" not in msg


def test_router_and_routing_bias_by_label_and_value_with_weight_decay():
  """The gate goes to Muon whatever its orientation and siblings; the routing bias never moves."""
  rng = np.random.default_rng(1)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  experts = {"gate_up_proj": arr(E, 2 * F, D), "down_proj": arr(E, D, F)}
  trees = {
      "(E, d) beside experts": {"mlp": {"gate": {"weight": arr(E, D)}, "experts": experts}},
      "(E, d) with routing bias": {"mlp": {"gate": {"weight": arr(E, D), "e_score_correction_bias": jnp.full((E,), .5)},
                                           "experts": experts}},
      "(d, E) with a shared expert": {"mlp": {"gate": {"kernel": arr(D, E)}, "experts": experts,
                                              "shared_expert": {"kernel": arr(D, F)}}},
  }
  for what, params in trees.items():
    for router in ("muon", "adam"):
      labels = mc.muon_labels(params, router=router)
      gate = labels["mlp"]["gate"]
      assert (gate.pop("weight", None) or gate.pop("kernel")) == router, what
      assert labels["mlp"]["experts"] == {"gate_up_proj": "muon", "down_proj": "muon"}, what
      assert gate == ({"e_score_correction_bias": "frozen"} if "bias" in what else {}), what
  halves = {"muon": mc.muon(0.1, weight_decay=0.1), "adam": optax.adamw(0.1, b2=0.95, weight_decay=0.1)}
  for what, router in (("(E, d) with routing bias", "muon"), ("(E, d) with routing bias", "adam"),
                       ("(d, E) with a shared expert", "adam")):
    params = trees[what]
    gate, half = params["mlp"]["gate"], halves[router]
    name = "weight" if "weight" in gate else "kernel"
    grads = jax.tree.map(jnp.cos, params)
    opt = mc.muon_adamw(0.1, weight_decay=0.1, matrix_axes=mc.MatrixAxes((-2,), (-1,)),
                        labels=lambda p, r=router: mc.muon_labels(p, router=r))
    state, p, ref = opt.init(params), params, {name: gate[name]}
    ref_state = half.init(ref)
    for _ in range(2):  # the gate's value is the reference optimizer's alone; the bias's its own
      u, state = opt.update(grads, state, p)
      p = optax.apply_updates(p, u)
      ru, ref_state = half.update({name: grads["mlp"]["gate"][name]}, ref_state, ref)
      ref = optax.apply_updates(ref, ru)
    chex.assert_trees_all_close(p["mlp"]["gate"][name], ref[name], rtol=1e-5, atol=1e-6)
    if "e_score_correction_bias" in gate:  # weight decay 0.1 would have made it 0.4995 after one step
      chex.assert_trees_all_equal(p["mlp"]["gate"]["e_score_correction_bias"], jnp.full((E,), .5))
  with pytest.raises(ValueError, match="router must be 'muon' or 'adam'"):
    mc.muon_labels({}, router="sgd")


# ----------------------------------------------------------------------------- reading names, bad input


@pytest.mark.parametrize("names, shape, want", [
    (("exp", "embed_no_exp", "mlp"), (4, 8, 12), ((1,), (2,))),
    (("exp", "layers", "mlp", "embed_no_exp"), (4, 2, 12, 8), ((2,), (3,))),
    (("layers", "expert", "embed", "mlp"), (2, 4, 8, 12), ((2,), (3,))),
    (("num_experts", "embed", "heads", "kv"), (4, 8, 2, 4), ((1,), (2, 3))),
    (("embed", "layers", None), (8, 2, 4), ((0,), (2,))),  # MaxText's scanned gate: None beside named axes
    (("exp", None, None), (4, 8, 12), ((1,), (2,))),  # an NNX spec shorter than the kernel, padded
])
def test_expert_and_unnamed_axes_are_read(names, shape, want):
  assert axes_from_names("p", shape, names).resolve("p", shape)[1:] == want


def test_two_expert_axes_are_refused_naming_the_path():
  params = {"moe": {"wi": nn.Partitioned(jnp.zeros((4, 4, 8, 12)), names=("exp", "experts", "embed", "mlp"))}}
  with pytest.raises(ValueError, match=r"moe/wi: .*name 2 expert axes \('exp', 'experts'\)"):
    mc.scale_by_muon().init(params)


def test_undeclared_rank3_plain_kernel_names_the_expert_case():
  with pytest.raises(ValueError) as err:
    mc.muon_adamw(0.1).init({"mlp": {"experts": {"down_proj": jnp.zeros((16, 8, 12))}}})
  msg = str(err.value)
  assert msg.startswith("mlp/experts/down_proj: ") and "(16, 8, 12)" in msg
  assert "expert stack of a mixture-of-experts layer, 16 experts of 8x12 matrices" in msg
  assert "MatrixAxes((-2,), (-1,)) too, which orthogonalizes each expert's matrix on its own" in msg
  expert_hint, = [h for h in msg.split("; ") if "mixture-of-experts" in h]
  assert "'exp', 'embed', 'mlp'" in expert_hint and "'layers'" not in expert_hint  # no renaming to 'layers'


def test_expert_matrices_share_the_grouping_loops():
  """Thousands of experts do not mean thousands of Newton-Schulz bodies: the program's products
  do not grow with the number of experts, stored as stacks or as separate leaves."""

  def products(n, stacked):
    if stacked:
      tree = {"layers_0": {"wi": jnp.zeros((n, D, F))}, "layers_1": {"wi": jnp.zeros((n, D, F))}}
    else:  # at most batching.STACKS loops of a shape
      tree = {"experts": {str(e): {"wi": jnp.zeros((D, F))} for e in range(n)}}
    opt = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((-2,), (-1,)))
    return str(jax.make_jaxpr(lambda g: opt.update(g, opt.init(g))[0])(tree)).count("dot_general")

  for stacked in (True, False):
    assert products(64, stacked) == products(128, stacked)


def test_a_bias_per_expert_is_a_vector():
  """MaxText's ``wi_0_bias`` ``("exp", "activation_mlp")``: one vector per expert, AdamW, no matrix."""
  params = {"moe": {"wi_0_bias": nn.Partitioned(jnp.zeros((E, F)), names=("exp", "activation_mlp")),
                    "wi_0": nn.Partitioned(jnp.zeros((E, D, F)), names=("exp", "embed_no_exp", "mlp"))}}
  assert nn.unbox(mc.muon_labels(params)) == {"moe": {"wi_0_bias": "adam", "wi_0": "muon"}}
  assert mc.logical_matrix_axes(params)["moe"] == {"wi_0_bias": None, "wi_0": mc.MatrixAxes((1,), (2,))}


# ----------------------------------------------------------------------------- fused gate|up, per-matrix scale


def _gated_mlp(rng, lead=(E,), up_scale=0.01):
  """Gate and up gradients of ``lead`` experts, up 100x smaller, with a down projection."""
  gate = rng.standard_normal((*lead, F, D)).astype(np.float32)
  up = rng.standard_normal((*lead, F, D)).astype(np.float32) * up_scale
  return gate, up, rng.standard_normal((*lead, D, F)).astype(np.float32)


def test_a_fused_gate_up_is_cut_into_gate_and_up_as_stored_apart():
  """transformers' (v5) gate_up_proj (experts, 2 * inter, hidden), a torch Linear's gate_up_proj/weight and a
  Flax Dense's gate_up_proj/kernel train as gate and up stored apart: each its own matrix and RMS factor."""
  gate, up, down = _gated_mlp(np.random.default_rng(0))
  per_expert = mc.MatrixAxes((-1,), (-2,))
  opt = mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=lambda t: jax.tree.map(lambda _: per_expert, t))
  fused = {"experts": {"gate_up_proj": np.concatenate([gate, up], -2), "down_proj": down}}
  apart = {"experts": {"gate_proj": gate, "up_proj": up, "down_proj": down}}
  got, want = muon_update(opt, fused, fused)["experts"], muon_update(opt, apart, apart)["experts"]
  assert_same_math(got["gate_up_proj"][:, :F], want["gate_proj"])
  assert_same_math(got["gate_up_proj"][:, F:], want["up_proj"])
  assert_close(got["gate_up_proj"][:, F:], per_matrix_reference(up, 1))  # RMS 0.2, not 0.006
  # a dense MLP: a torch Linear (out, in) and a Flax Dense (in, out), no matrix_axes needed
  for leaf, cat, pick in (("weight", 0, lambda x, h: x[h * F:(h + 1) * F]),
                          ("kernel", 1, lambda x, h: x[:, h * F:(h + 1) * F])):
    g, u = (gate[0], up[0]) if leaf == "weight" else (gate[0].T, up[0].T)
    d = down[0] if leaf == "weight" else down[0].T
    params = {"mlp": {"gate_up_proj": {leaf: np.concatenate([g, u], cat)}, "down_proj": {leaf: d}}}
    got = muon_update(mc.muon_adamw(1.0, weight_decay=0.0), params, params)["mlp"]["gate_up_proj"][leaf]
    for h, part in enumerate((g, u)):
      assert_close(pick(got, h), per_matrix_reference(part[None], 1)[0])


def test_a_fused_gate_up_beside_a_down_proj_routed_elsewhere_is_cut_by_its_layers_convention():
  """A Flax Dense's gate_up_proj/kernel whose down_proj is frozen (not in Muon's tree): cut along its output."""
  gate, up, down = _gated_mlp(np.random.default_rng(3))
  params = {"mlp": {"gate_up_proj": {"kernel": np.concatenate([gate[0].T, up[0].T], 1)},
                    "down_proj": {"kernel": down[0].T}}}
  labels = {"mlp": {"gate_up_proj": {"kernel": "muon"}, "down_proj": {"kernel": "frozen"}}}
  got = muon_update(mc.muon_adamw(1.0, weight_decay=0.0, labels=labels), params, params)["mlp"]
  assert_close(got["gate_up_proj"]["kernel"][:, F:], per_matrix_reference(up[:1].swapaxes(1, 2), 1)[0])
  np.testing.assert_array_equal(got["down_proj"]["kernel"], 0.0)


def test_a_fused_gate_up_the_library_cannot_read_is_refused_and_a_declared_cut_is_honoured():
  gate, up, down = _gated_mlp(np.random.default_rng(1))
  per_expert = mc.MatrixAxes((-1,), (-2,))
  axes = lambda t: jax.tree.map(lambda _: per_expert, t)  # noqa: E731
  gpt_oss = {"experts": {"gate_up_proj": np.zeros((E, D, 2 * F), np.float32),
                         "down_proj": np.zeros((E, F, D), np.float32)}}
  alone = {"gate_up_proj": np.zeros((E, 2 * F, D), np.float32)}
  for params, seen in ((gpt_oss, r"experts/down_proj \(4, 12, 8\)"), (alone, "no down_proj beside it")):
    with pytest.raises(ValueError, match=rf"gate_up_proj: a fused gate\|up projection of shape .*{seen}.*"
                                         rf"fused=\(axis, 2\)"):
      mc.muon_adamw(1.0, matrix_axes=axes).init(params)
  # declared: the cut (any storage), or fused=(axis, 1) for one matrix
  stored = {"w": np.concatenate([gate, up], -2)}
  cut = {"w": mc.MatrixAxes((-1,), (-2,), fused=(-2, 2))}
  got = -muon_update(mc.scale_by_muon(matrix_axes=cut), stored, stored)["w"]  # scale_by_muon: no minus sign
  assert_close(got[:, F:], per_matrix_reference(up, 1))
  whole = {"gate_up_proj": mc.MatrixAxes((-1,), (-2,), fused=(-2, 1)), "down_proj": per_expert}
  params = {"gate_up_proj": np.concatenate([gate, up], -2), "down_proj": down}
  got = -muon_update(mc.scale_by_muon(matrix_axes=whole), params, params)["gate_up_proj"]
  assert_close(got, per_matrix_reference(params["gate_up_proj"], 1))
  with pytest.raises(ValueError, match=r"w: .*cuts axis 1 .* 5 does not divide 24"):
    mc.scale_by_muon(matrix_axes={"w": mc.MatrixAxes((-1,), (-2,), fused=(1, 5))}).init(stored)
  with pytest.raises(ValueError, match="not one of its fan_in or fan_out"):
    mc.scale_by_muon(matrix_axes={"w": mc.MatrixAxes((-1,), (-2,), fused=(0, 2))}).init(stored)


def test_each_expert_of_a_stack_has_its_own_momentum_scale():
  """One expert's gradient near float32's largest rescales that expert only: its neighbours' updates are
  the updates they get alone (with exact 12-step Newton–Schulz, where eps would show a shared scale)."""
  rng = np.random.default_rng(2)
  g = rng.standard_normal((E, D, F)).astype(np.float32)
  g[0] *= 3e38 / np.abs(g[0]).max()
  g[1] *= 1e-8  # a quiet expert: its norm near eps, so a scale of 8 would move its update
  exact = dict(ns_coeffs=jnp.array([[1.5, -0.5, 0.0]] * 12), ns_steps=12, ns_method="standard")
  opt = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((-2,), (-1,)), **exact)
  state = opt.init({"w": g})
  assert state.mu_scale["w"].shape == (E, 1, 1)
  updates, state = jax.jit(opt.update)({"w": g}, state)
  np.testing.assert_array_equal(np.asarray(state.mu_scale["w"]).ravel(), [8.0, 1.0, 1.0, 1.0])
  assert np.isfinite(np.asarray(updates["w"])).all()
  for e in range(1, E):
    alone = mc.scale_by_muon(**exact)
    want = jax.jit(alone.update)({"w": g[e]}, alone.init({"w": g[e]}))[0]["w"]
    assert_same_math(updates["w"][e], want, err_msg=f"expert {e}")
  # a leaf of one matrix keeps one scalar scale; a stack of layers has one per layer
  assert opt.init({"w": g[0]}).mu_scale["w"].shape == ()
  scanned = nn.Partitioned(jnp.zeros((2, E, D, F)), names=("layers", "exp", "embed", "mlp"))
  assert mc.scale_by_muon().init({"w": scanned}).mu_scale["w"].shape == (2, E, 1, 1)
