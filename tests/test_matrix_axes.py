"""Muon's matrix axes without hand-written callables: logical names, MuonDimensionNumbers, layouts."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muonclip_jax as mc
from muonclip_jax._muon import axes_from_names, matrix_axes_lookup
from _exactness import assert_same_math

MDN = optax.contrib.MuonDimensionNumbers
KELLER = dict(ns_coeffs="muon", ns_steps=5, ns_method="standard")


def _tree(rng):
  return {"stack": jnp.asarray(rng.standard_normal((3, 8, 12)), jnp.float32),
          "per_head": jnp.asarray(rng.standard_normal((16, 4, 8)), jnp.float32),
          "out": jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32),
          "w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}


AXES = {"stack": mc.MatrixAxes((-2,), (-1,)), "per_head": mc.MatrixAxes((0,), (1, 2)),
        "out": mc.MatrixAxes((0, 1), (2,)), "w": None}
DIMS = {"stack": MDN(-2, -1), "per_head": MDN(0, (1, 2)), "out": MDN((0, 1), 2), "w": None}


@pytest.mark.parametrize("form", ["tree", "callable", "single"])
def test_muon_dimension_numbers_equal_matrix_axes(form):
  g = _tree(np.random.default_rng(0))
  if form == "single":
    g = {"stack": g["stack"]}
    ours, theirs = mc.MatrixAxes((-2,), (-1,)), MDN(-2, -1)
  else:
    ours, theirs = AXES, DIMS
    if form == "callable":
      ours, theirs = (lambda p: AXES), (lambda p: DIMS)
  want, _ = mc.scale_by_muon(matrix_axes=ours, **KELLER).update(g, mc.scale_by_muon(matrix_axes=ours).init(g))
  opt = mc.scale_by_muon(matrix_axes=theirs, **KELLER)
  got, _ = opt.update(g, opt.init(g))
  assert_same_math(got, want)


def test_bad_spec_leaf_names_its_path():
  with pytest.raises(ValueError, match=r"matrix_axes: leaf at w: expected a MatrixAxes, an optax.contrib.MuonDimensionNumbers"):
    matrix_axes_lookup({"w": "rows"}, {"w": jnp.zeros((2, 2))})


def test_matrix_axes_take_one_int_as_one_axis_and_refuse_other_axes():
  """As ``optax.contrib.MuonDimensionNumbers`` does, one int is one axis; anything else that is not a
  tuple (or list) of ints is a TypeError naming the field."""
  assert mc.MatrixAxes(1, 2) == mc.MatrixAxes((1,), (2,)) == mc.MatrixAxes([1], [2])
  assert mc.MatrixAxes(np.int64(-2), (-1,)).fan_in == (-2,)
  assert mc.MatrixAxes(range(1), np.array([1, 2])) == mc.MatrixAxes((0,), (1, 2))
  for bad in (1.0, True, "0", (0, 1.5), None, {1: 2}):
    with pytest.raises(TypeError, match=r"MatrixAxes: fan_out must be an axis \(an int\) or a tuple of them, got fan_out="):
      mc.MatrixAxes(0, bad)
  with pytest.raises(TypeError, match=r"matrix_axes: leaf at w: MuonDimensionNumbers\(reduction_axis=0, output_axis=1.5\) "
                                      r"\(reduction_axis: fan_in, output_axis: fan_out\): MatrixAxes: fan_out must be"):
    matrix_axes_lookup({"w": MDN(0, 1.5)}, {"w": jnp.zeros((2, 2))})("w", (2, 2))


@pytest.mark.parametrize("names, shape, want", [
    (("embed", "heads", "kv"), (16, 4, 8), ((0,), (1, 2))),
    (("heads", "kv", "embed"), (4, 8, 16), ((0, 1), (2,))),
    (("layers", "embed", "mlp"), (3, 16, 32), ((1,), (2,))),
    (("layers", "embed", "q_heads", "kv"), (3, 16, 4, 8), ((1,), (2, 3))),
    (("kv_lora", "heads", "kv"), (8, 4, 6), ((0,), (1, 2))),
    (("embed", "vocab"), (16, 64), ((0,), (1,))),
])
def test_axes_from_logical_names(names, shape, want):
  assert axes_from_names("p", shape, names).resolve("p", shape)[1:] == want


@pytest.mark.parametrize("names", [("a", "b", "c"), ("layers", "embed"), ("heads", "embed", "kv"), ("embed", None, "mlp")])
def test_undecidable_names_raise(names):
  shape = (4,) * len(names)
  with pytest.raises(ValueError, match=rf"x/kernel: cannot tell .* shape {re.escape(str(shape))} .* names"):
    axes_from_names("x/kernel", shape, names)


class Named(nn.Module):
  """DenseGeneral q/out kernels and an MLP stacked by nn.scan, all logically partitioned."""

  @nn.compact
  def __call__(self, x):
    def body(mdl, x, _):
      init = nn.initializers.lecun_normal()
      q = nn.DenseGeneral((4, 8), kernel_init=nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
                          name="query", parent=mdl)(x)
      x = x + nn.DenseGeneral(16, axis=(-2, -1), name="out", parent=mdl,
                              kernel_init=nn.with_logical_partitioning(init, ("heads", "kv", "embed")))(q)
      return x + nn.Dense(16, name="mlp", parent=mdl,
                          kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x), None

    x, _ = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                   metadata_params={nn.PARTITION_NAME: "layers"})(self, x, None)
    return nn.Dense(32, name="proj", kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "vocab")))(x)


def test_linen_logical_names_decide_the_matrices_and_vocab_goes_to_adamw():
  params = Named().init(jax.random.key(0), jnp.ones((2, 16)))["params"]
  assert params["query"]["kernel"].names == ("layers", "embed", "heads", "kv")
  labels = mc.muon_labels(params)
  assert nn.unbox(labels)["proj"]["kernel"] == "adam"  # "vocab" axis, though the path says nothing
  assert nn.unbox(labels)["query"]["kernel"] == "muon"
  grads = jax.tree.map(lambda x: jnp.cos(7 * x), params)
  kernels = lambda t: {k: {"kernel": v["kernel"]} for k, v in t.items() if k != "proj"}  # noqa: E731
  full, full_grads = params, grads
  params, grads = kernels(params), kernels(grads)
  named = mc.scale_by_muon(**KELLER)
  explicit = mc.scale_by_muon(matrix_axes={"query": {"kernel": mc.MatrixAxes((-3,), (-2, -1))},
                                           "out": {"kernel": mc.MatrixAxes((-3, -2), (-1,))},
                                           "mlp": {"kernel": mc.MatrixAxes((-2,), (-1,))}}, **KELLER)
  want, _ = explicit.update(nn.unbox(grads), explicit.init(nn.unbox(params)))
  got, _ = named.update(grads, named.init(params))
  assert_same_math(nn.unbox(got), want)
  # the whole optimizer keeps the boxes and routes through them
  opt = mc.muon_adamw(1e-2, **KELLER)
  updates, state = opt.update(full_grads, opt.init(full), full)
  assert isinstance(updates["query"]["kernel"], nn.Partitioned)
  adam_mu = nn.unbox(state.inner_states["adam"].inner_state[0].mu)
  assert adam_mu["proj"]["kernel"].shape == (16, 32)


def test_nnx_sharding_metadata_is_read():
  lin = nnx.LinearGeneral(16, (4, 8), rngs=nnx.Rngs(0),
                          kernel_metadata={"out_sharding": ("embed", "heads", "kv"), "eager_sharding": False})
  state = nnx.state(lin, nnx.Param)
  lookup = matrix_axes_lookup(None, state)
  assert lookup("kernel", (16, 4, 8)) == mc.MatrixAxes((0,), (1, 2))
  # nnx.Optimizer hands optax bare arrays: the names travel through matrix_axes
  axes = mc.logical_matrix_axes(state)
  bare = nnx.to_pure_dict(state)
  assert matrix_axes_lookup(axes, bare)("kernel", (16, 4, 8)) == mc.MatrixAxes((0,), (1, 2))
  g = {"kernel": jnp.cos(jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 4, 8))}
  want, _ = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((0,), (1, 2))).update(g, mc.scale_by_muon(
      matrix_axes=mc.MatrixAxes((0,), (1, 2))).init(g))
  opt = mc.scale_by_muon(matrix_axes={"kernel": axes["kernel"]})
  assert_same_math(opt.update(g, opt.init(g))[0], want)


def test_undeclared_rank3_gives_both_hints():
  opt = mc.scale_by_muon()
  with pytest.raises(ValueError) as err:
    opt.init({"attn": {"query": {"kernel": jnp.zeros((64, 4, 16))}}})
  msg = str(err.value)
  assert "attn/query/kernel" in msg and "(64, 4, 16)" in msg
  assert "stack of 64 layers (nn.scan) of 4x16 matrices: MatrixAxes((-2,), (-1,))" in msg
  assert "one DenseGeneral kernel (in, heads, head_dim): MatrixAxes((0,), (1, 2)) is one 64 x 64 matrix" in msg
  assert "attention_matrix_axes(layout)" in msg
  wrong = mc.GQALayout(4, 4, 16, query="q_proj", key="k_proj")  # Llama's names on Flax's attention
  with pytest.raises(ValueError, match=r"attn/query/kernel: Muon needs .*Note: the layout matched no attention "
                                       r"module .*GQALayout\(num_heads=4.*query='q_proj'"):
    mc.scale_by_muon(layout=wrong).init({"attn": {"query": {"kernel": jnp.zeros((64, 4, 16))}}})


def test_attention_matrix_axes_for_every_form():
  lay = mc.GQALayout(4, 2, 8, query="query", key="key")
  params = {"attn": {"query": {"kernel": jnp.zeros((16, 4, 8)), "bias": jnp.zeros((4, 8))},
                     "key": {"kernel": jnp.zeros((16, 2, 8))},
                     "value": {"kernel": jnp.zeros((16, 2, 8))},
                     "out": {"kernel": jnp.zeros((4, 8, 16))}},
            "stacked": {"query": {"kernel": jnp.zeros((2, 16, 4, 8))}, "key": {"kernel": jnp.zeros((2, 16, 2, 8))}},
            "scanned_2d": {"query": {"kernel": jnp.zeros((3, 16, 32))}},  # (layers, in, H*D): not DenseGeneral
            "mlp": {"kernel": jnp.zeros((16, 64))}}
  got = mc.attention_matrix_axes(lay)(params)
  assert got["attn"]["query"]["kernel"] == mc.MatrixAxes((-3,), (-2, -1))
  assert got["attn"]["key"]["kernel"] == mc.MatrixAxes((-3,), (-2, -1))
  assert got["attn"]["value"]["kernel"] == mc.MatrixAxes((-3,), (-2, -1))
  assert got["attn"]["out"]["kernel"] == mc.MatrixAxes((-3, -2), (-1,))
  assert got["stacked"]["key"]["kernel"] == mc.MatrixAxes((-3,), (-2, -1))
  assert got["scanned_2d"]["query"]["kernel"] is None and got["mlp"]["kernel"] is None
  assert got["attn"]["query"]["bias"] is None
  stack = mc.MatrixAxes((-2,), (-1,))
  assert mc.attention_matrix_axes(lay, default=stack)(params)["scanned_2d"]["query"]["kernel"] == stack
  fused = mc.attention_matrix_axes(mc.GQALayout(4, 4, 8, qkv="c_attn"))({"c_attn": {"kernel": jnp.zeros((16, 3, 4, 8))}})
  assert fused["c_attn"]["kernel"] == mc.MatrixAxes((-4,), (-3, -2, -1))
  mla = mc.MLALayout(4, 8, 4, 6)
  got = mc.attention_matrix_axes(mla)({"wq_b": {"kernel": jnp.zeros((12, 4, 12))},
                                       "wkv_b": {"kernel": jnp.zeros((10, 4, 14))},
                                       "out": {"kernel": jnp.zeros((4, 6, 16))}})
  assert got == {"wq_b": {"kernel": mc.MatrixAxes((-3,), (-2, -1))}, "wkv_b": {"kernel": mc.MatrixAxes((-3,), (-2, -1))},
                 "out": {"kernel": mc.MatrixAxes((-3, -2), (-1,))}}
  with pytest.raises(TypeError, match="expected a GQALayout or MLALayout"):
    mc.attention_matrix_axes("query")


def test_readme_optax_equivalent_matches_optax_muon_on_muon_leaves():
  """README "Switching from optax.contrib.muon": the Muon half of optax's defaults."""
  rng = np.random.default_rng(7)
  params = {"w": jnp.asarray(rng.standard_normal((32, 48)), jnp.float32),
            "heads": jnp.asarray(rng.standard_normal((16, 4, 8)), jnp.float32)}
  dims = {"w": MDN(), "heads": MDN(0, (1, 2))}
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  theirs = optax.contrib.muon(1e-2, weight_decay=0.05, muon_weight_dimension_numbers=dims)
  ours = mc.muon_adamw(1e-2, weight_decay=0.05, adam_weight_decay=0.0, adam_b2=0.999, ns_coeffs="muon", ns_steps=5,
                       ns_method="standard", ns_normalize="frobenius", eps=1e-8, rms_match="keller", matrix_axes=dims,
                       labels=lambda p: jax.tree.map(lambda x: "muon" if x.ndim >= 2 else "adam", p))
  s_theirs, s_ours = theirs.init(params), ours.init(params)
  for _ in range(2):
    u_theirs, s_theirs = theirs.update(grads, s_theirs, params)
    u_ours, s_ours = ours.update(grads, s_ours, params)
    chex.assert_trees_all_close(u_ours, u_theirs, rtol=2e-5, atol=1e-7)


def _boxed(shape, names):
  return nn.Partitioned(jnp.zeros(shape, jnp.float32), names=names)


def test_explicit_axes_that_contradict_logical_names_raise():
  """The scan hint given for every leaf must not give a named DenseGeneral kernel 64 separate 4x16
  matrices: a blanket spec is checked against each leaf's names. Declared for that leaf alone (a
  pytree entry, or a callable's), it is honoured, with one warning naming the path, names and axes."""
  params = {"attn": {"query": {"kernel": _boxed((64, 4, 16), ("embed", "heads", "kv"))}}}
  for spec in (mc.MatrixAxes((-2,), (-1,)), MDN(-2, -1), lambda p: mc.MatrixAxes((-2,), (-1,))):
    opt = mc.scale_by_muon(matrix_axes=spec)
    with pytest.raises(ValueError) as err:
      opt.init(params)
    msg = str(err.value)
    assert "attn/query/kernel" in msg and "(64, 4, 16)" in msg and "('embed', 'heads', 'kv')" in msg
    assert "64 separate 4x16 matrices" in msg and "axes (0,)" in msg
    assert "Leave this parameter at None in matrix_axes" in msg and "MatrixAxes(fan_in=(0,), fan_out=(1, 2))" in msg
    # the refusal names the declaration that works: an entry of a pytree for that leaf
    assert "an entry of a matrix_axes pytree" in msg
    assert "matrix_axes={'attn': {'query': {'kernel': MatrixAxes(fan_in=(-2,), fan_out=(-1,))}}}" in msg
    with pytest.raises(ValueError, match="64 separate 4x16"):  # at update time too
      opt.update(params, mc.scale_by_muon().init(params))
  # batch axes named "layers", or unnamed (nn.scan without a partition name), are fine
  stack = mc.MatrixAxes((-2,), (-1,))
  for names in (("layers", "embed", "mlp"), (None, "embed", "mlp")):
    assert matrix_axes_lookup(stack, {"w": _boxed((3, 16, 32), names)})("w", (3, 16, 32)) == stack
  # explicit axes that agree with the names, or regroup them without batching, are fine
  lookup = matrix_axes_lookup(mc.MatrixAxes((0,), (1, 2)), params)
  assert lookup("attn/query/kernel", (64, 4, 16)) == mc.MatrixAxes((0,), (1, 2))


@pytest.mark.parametrize("form", ["tree", "dimension_numbers", "callable"])
def test_axes_declared_for_one_leaf_win_over_its_names_with_a_warning(form):
  """A matrix_axes entry for that leaf means what it says: 64 separate 4x16 polar factors."""
  g = np.random.default_rng(3).standard_normal((64, 4, 16)).astype(np.float32)
  params = {"attn": {"query": {"kernel": _boxed((64, 4, 16), ("embed", "heads", "kv"))}}}
  leaf = {"tree": mc.MatrixAxes((-2,), (-1,)), "dimension_numbers": MDN(-2, -1), "callable": mc.MatrixAxes((1,), (2,))}
  spec = {"attn": {"query": {"kernel": leaf[form]}}}
  opt = mc.scale_by_muon(matrix_axes=(lambda p: spec) if form == "callable" else spec,
                         ns_coeffs="polar_express", ns_steps=12)
  with pytest.warns(UserWarning) as record:
    state = opt.init(params)
  msgs = [str(w.message) for w in record if "attn/query/kernel" in str(w.message)]
  assert len(msgs) == 1, msgs  # once per leaf per init
  assert "('embed', 'heads', 'kv')" in msgs[0] and "axes (0,)" in msgs[0] and "64 separate 4x16" in msgs[0]
  assert "MatrixAxes(fan_in=" in msgs[0] and "wins over its names" in msgs[0]
  boxed_g = jax.tree.map(lambda p: p.replace_boxed(jnp.asarray(g)), params,
                         is_leaf=lambda x: isinstance(x, nn.Partitioned))
  with pytest.warns(UserWarning, match="attn/query/kernel"):  # boxed updates read the names again
    got = nn.unbox(opt.update(boxed_g, state)[0])["attn"]["query"]["kernel"]
  u, _, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)  # per embed row: a 4x16 polar factor
  np.testing.assert_allclose(np.asarray(got), u @ vt * 0.2 * np.sqrt(16), atol=2e-4)
  # the same update as without names
  bare = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((-2,), (-1,)), ns_coeffs="polar_express", ns_steps=12)
  want, _ = bare.update({"attn": {"query": {"kernel": jnp.asarray(g)}}}, bare.init(nn.unbox(params)))
  assert_same_math(got, want["attn"]["query"]["kernel"])


def test_attention_matrix_axes_refuses_an_unnamed_dense_general_kernel():
  """`default` must not split a scanned `v_proj` (layers, in, kv_heads, head_dim) into per-head matrices."""
  lay = mc.GQALayout(4, 4, 8, query="q_proj", key="k_proj")
  stack = mc.MatrixAxes((-2,), (-1,))
  params = {"q_proj": {"kernel": jnp.zeros((2, 32, 4, 8))}, "k_proj": {"kernel": jnp.zeros((2, 32, 4, 8))},
            "v_proj": {"kernel": jnp.zeros((2, 32, 4, 8))}, "o_proj": {"kernel": jnp.zeros((2, 4, 8, 32))},
            "mlp": {"kernel": jnp.zeros((2, 32, 64))}, "bias3": {"bias": jnp.zeros((2, 4, 8))}}
  with pytest.raises(ValueError) as err:
    mc.attention_matrix_axes(lay, default=stack)(params)
  msg = str(err.value)
  assert "o_proj/kernel" in msg or "v_proj/kernel" in msg
  assert "DenseGeneral" in msg and "value=/out=" in msg
  cases = (("v_proj", (2, 32, 4, 8)), ("v_proj", (32, 4, 8)), ("o_proj", (4, 8, 32)), ("o_proj", (2, 4, 8, 32)))
  for name, shape in cases:
    with pytest.raises(ValueError, match=rf"{name}/kernel: .*shape {re.escape(str(shape))}.*value=/out="):
      mc.attention_matrix_axes(lay, default=stack)({name: {"kernel": jnp.zeros(shape)}})
  # told the names, every projection is one matrix; the scanned MLP gets `default`, the stacked bias None
  got = mc.attention_matrix_axes(lay, value="v_proj", out="o_proj", default=stack)(params)
  assert got["v_proj"]["kernel"] == got["q_proj"]["kernel"] == mc.MatrixAxes((-3,), (-2, -1))
  assert got["o_proj"]["kernel"] == mc.MatrixAxes((-3, -2), (-1,))
  assert got["mlp"]["kernel"] == stack and got["bias3"]["bias"] is None
  # `default` applies at rank 3 only: a rank-4 stack is left to names or to the undeclared-rank error
  assert mc.attention_matrix_axes(lay, default=stack)({"moe": {"kernel": jnp.zeros((2, 3, 32, 64))}}) == {
      "moe": {"kernel": None}}
  # a leaf with logical names is left to its names
  named = {"v_proj": {"kernel": _boxed((2, 32, 4, 8), ("layers", "embed", "kv_heads", "kv"))}}
  assert nn.unbox(mc.attention_matrix_axes(lay, default=stack)(named)) == {"v_proj": {"kernel": None}}
  assert matrix_axes_lookup(mc.attention_matrix_axes(lay, default=stack), named)(
      "v_proj/kernel", (2, 32, 4, 8)) == mc.MatrixAxes((1,), (2, 3))


@pytest.mark.parametrize("scan", ["dense_layers", "moe_layers"])
def test_maxtext_0_2_5_scan_names_are_stacked_layer_axes(scan):
  """MaxText 0.2.5 scans dense and MoE blocks apart (``dense_layers``, ``moe_layers``): any ``*_layers`` name
  is a stacked-layer axis. An MLA layer scanned on axis 1 and an expert stack update as when the axis is
  named ``layers``; before, the low-rank sizes were read as layer axes and init refused the module."""
  from _exactness import assert_same_math
  H, dn, dr, dv, ql, kl, D, L, E = 2, 4, 2, 4, 32, 16, 24, 3, 4
  rng = np.random.default_rng(0)

  def tree(name):
    def box(shape, names):
      return nn.Partitioned(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32), names=names)
    attn = {"wq_a": {"kernel": box((D, L, ql), ("embed", name, "q_lora"))},
            "wq_b": {"kernel": box((ql, L, H, dn + dr), ("q_lora", name, "q_heads", "kv"))},
            "wkv_a": {"kernel": box((D, L, kl + dr), ("embed", name, "kv_lora"))},
            "wkv_b": {"kernel": box((kl, L, H, dn + dv), ("kv_lora", name, "kv_heads", "kv_head_dim"))},
            "out": {"kernel": box((H, L, dv, D), ("heads", name, "kv", "embed"))}}
    moe = {"wi_0": box((E, L, D, 12), ("exp", name, "embed_no_exp", "mlp")),
           "gate": {"kernel": box((D, L, E), ("embed", name, None))}}
    return {"decoder": {"blocks": {"self_attention": attn, "MoeBlock_0": moe}}}

  lay = mc.MLALayout(H, dn, dr, dv, query="wq_b", key_value="wkv_b", out="out")
  ours, ref = tree(scan), tree("layers")
  ref = jax.tree.map(lambda a, b: b.replace_boxed(a.value), ours, ref, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  ml = {"decoder": {"blocks": {"self_attention": {"max_logits": jnp.full((L, H), 10.0)}}}}
  got = []
  for params in (ours, ref):
    opt = mc.muonclip(1e-2, layout=lay, qk_clip_threshold=5.0)
    bare = nn.unbox(params)
    updates, state = jax.jit(functools.partial(opt.update, max_logits=ml))(bare, opt.init(params), bare)
    got.append(updates)
    assert state[0].inner_states["muon"].inner_state[0].mu_scale["decoder"]["blocks"]["MoeBlock_0"]["wi_0"].shape == (
        E, L, 1, 1)  # one scale per expert and layer
  jax.tree.map(assert_same_math, got[0], got[1])
  assert mc.logical_matrix_axes(ours)["decoder"]["blocks"]["MoeBlock_0"]["wi_0"] == mc.MatrixAxes((2,), (3,))
  # a scan axis of a name the library does not know: the error names the names, not only the guessed shapes
  with pytest.raises(ValueError, match=r"'blocks_stack', 'q_heads', 'kv'\).*names the library does not know.*_layers"):
    mc.muonclip(1e-2, layout=lay).init({"decoder": {"blocks": {"self_attention": tree("blocks_stack")["decoder"][
        "blocks"]["self_attention"]}}})
