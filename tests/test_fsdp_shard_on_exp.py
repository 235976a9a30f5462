"""MaxText's ``fsdp_shard_on_exp``: expert kernels whose logical names describe sharding, not the matrix.

With ``fsdp_shard_on_exp=True`` MaxText's ``RoutedMoE`` (``layers/moe.py``) names its expert
kernels ``wi_0``/``wi_1`` ``(experts, embed, mlp)`` ``("embed_no_exp", None, "mlp")`` and
``wo`` ``(experts, mlp, embed)`` ``("embed_no_exp", "mlp", None)``: the expert axis carries
``"embed_no_exp"`` so that the experts shard over ``fsdp``. A ``matrix_axes`` entry for those
leaves, ``MatrixAxes((-2,), (-1,))`` (MaxText's ``muon_utils.py``: one matrix per expert), wins
over the names with one warning per leaf (docs/your-model.md, "Mixture of experts").

The reference: each expert's update is ``0.2 sqrt(max(rows, cols))`` (Moonlight) times the
polar factor (NumPy SVD) of that expert's own gradient; Newton–Schulz runs to convergence
(Polar Express, 12 steps, as ``test_newton_schulz.test_many_steps_converge_to_polar_factor``)
so that the exact polar factor is the reference. The router and the other leaves are
updated as the same optimizer updates them without the expert kernels.
"""

import functools
import re
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import sharding
from muonclip_jax._muon import matrix_axes_lookup
from _exactness import assert_same_math

E, D, F = 4, 8, 12  # experts, model width, expert width
WI, WO = ("embed_no_exp", None, "mlp"), ("embed_no_exp", "mlp", None)  # MaxText, fsdp_shard_on_exp=True
EXPERT_KERNELS = ("wi_0", "wi_1", "wo")
EXPERT = mc.MatrixAxes((-2,), (-1,))  # (experts, in, out): one in x out matrix per expert
EXACT = dict(ns_coeffs="polar_express", ns_steps=12)  # converged: the SVD polar factor is the reference
INIT = nn.initializers.lecun_normal()
WARNS = r"MoeBlock_0/(wi_0|wi_1|wo): the matrix_axes entry"
ATOL = 2e-4


def shard_on_exp_axes(params):
  """The recipe's ``matrix_axes``: the expert kernels by name, everything else left to its names."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: EXPERT if {getattr(k, "key", None) for k in path} & set(EXPERT_KERNELS) else None, params)


SPECS = {"callable": shard_on_exp_axes,
         "tree": {"MoeBlock_0": {k: EXPERT for k in EXPERT_KERNELS}}}  # matched by path: other leaves left out


def polar_update(g):
  """Moonlight's scaled polar factor of each matrix of ``g`` (leading axes batched), in float64."""
  u, _, vt = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)
  return u @ vt * 0.2 * np.sqrt(max(g.shape[-2:]))


def gaussian_like(params, seed=0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def without_experts(tree):
  return {**tree, "MoeBlock_0": {k: v for k, v in tree["MoeBlock_0"].items() if k not in EXPERT_KERNELS}}


# ----------------------------------------------------------------------------- Linen


class MoeBlock(nn.Module):
  """MaxText's ``RoutedMoE`` storage with ``fsdp_shard_on_exp=True``; its gate ``("embed", None)``."""

  @nn.compact
  def __call__(self, x):
    gate = nn.Dense(E, use_bias=False, name="gate", kernel_init=nn.with_logical_partitioning(INIT, ("embed", None)))(x)
    wi_0 = self.param("wi_0", nn.with_logical_partitioning(INIT, WI), (E, D, F))
    wi_1 = self.param("wi_1", nn.with_logical_partitioning(INIT, WI), (E, D, F))
    wo = self.param("wo", nn.with_logical_partitioning(INIT, WO), (E, F, D))
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, wi_0)) * jnp.einsum("td,edf->tef", x, wi_1)
    return jnp.einsum("tef,efd,te->td", h, wo, jax.nn.softmax(gate))


class Model(nn.Module):
  """A norm scale, a shared MLP kernel and the MoE block."""

  @nn.compact
  def __call__(self, x):
    x = x * self.param("norm_scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (D,))[None]
    shared = nn.Dense(F, use_bias=False, name="shared",
                      kernel_init=nn.with_logical_partitioning(INIT, ("embed", "mlp")))
    return MoeBlock(name="MoeBlock_0")(x) + shared(x).sum(-1, keepdims=True)


@functools.cache
def _linen_case():
  """(boxed params, boxed gradients, minus the single-device update: learning rate 1, no decay)."""
  params = Model().init(jax.random.key(0), jnp.ones((3, D)))["params"]
  grads = gaussian_like(params)
  opt = mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=shard_on_exp_axes, **EXACT)
  with pytest.warns(UserWarning, match=WARNS):
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  return params, grads, jax.device_get(jax.tree.map(lambda u: -u, nn.unbox(updates)))


def test_the_names_alone_give_no_matrix():
  """Without a declaration the expert kernels stay an error naming the path (as before)."""
  params = _linen_case()[0]
  assert params["MoeBlock_0"]["wi_0"].names == WI and params["MoeBlock_0"]["wo"].names == WO
  with pytest.raises(ValueError, match=r"MoeBlock_0/wi_0: cannot tell the matrix .* \('embed_no_exp', None, 'mlp'\)"):
    mc.muon_adamw(1.0).init(params)
  with pytest.raises(ValueError, match=r"MoeBlock_0/wi_0: .*4 separate 8x12 .*an entry of a matrix_axes pytree"):
    mc.muon_adamw(1.0, matrix_axes=EXPERT).init(params)  # one MatrixAxes for every leaf: checked against names


@pytest.mark.parametrize("form", list(SPECS))
def test_linen_declared_experts_are_one_matrix_each(form):
  params, grads, single = _linen_case()
  opt = mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=SPECS[form], **EXACT)
  with pytest.warns(UserWarning) as record:
    state = opt.init(params)
  warned = [str(w.message) for w in record if re.match(WARNS, str(w.message))]
  assert sorted(m.split(":")[0] for m in warned) == [f"MoeBlock_0/{k}" for k in EXPERT_KERNELS]  # once per leaf
  assert "('embed_no_exp', None, 'mlp')" in warned[0] and "axes (0,)" in warned[0] and "4 separate 8x12" in warned[0]
  with pytest.warns(UserWarning, match=WARNS):  # boxed gradients: the names are read again
    updates, _ = jax.jit(opt.update)(grads, state, params)
  got, g = jax.tree.map(lambda u: -u, nn.unbox(updates)), nn.unbox(grads)
  for k in EXPERT_KERNELS:
    np.testing.assert_allclose(got["MoeBlock_0"][k], polar_update(g["MoeBlock_0"][k]), atol=ATOL, err_msg=k)
  np.testing.assert_allclose(got["MoeBlock_0"]["gate"]["kernel"], polar_update(g["MoeBlock_0"]["gate"]["kernel"]),
                             atol=ATOL)  # the router: one D x E matrix, as ever
  assert_same_math(jax.tree.map(lambda u: -u, nn.unbox(updates)), single)
  # the other leaves: as the same optimizer updates them without the expert kernels
  ref = mc.muon_adamw(1.0, weight_decay=0.0, **EXACT)
  rest, rest_grads = without_experts(params), without_experts(grads)
  want, _ = jax.jit(ref.update)(rest_grads, ref.init(rest), rest)
  assert_same_math(without_experts(nn.unbox(updates)), nn.unbox(want))


def test_scanned_experts_batch_experts_and_layers():
  """MaxText's scan (``param_scan_axis=1``) inserts ``"layers"`` second: the same entry batches both."""
  names = ("embed_no_exp", "layers", None, "mlp")
  tree = {"MoeBlock_0": {"wi_0": nn.Partitioned(jnp.zeros((E, 2, D, F)), names=names)}}
  lookup = matrix_axes_lookup(shard_on_exp_axes, tree)
  with pytest.warns(UserWarning, match=r"MoeBlock_0/wi_0: .*axes \(0,\) .*8 separate 8x12 .*\('embed_no_exp',\)"):
    assert lookup("MoeBlock_0/wi_0", (E, 2, D, F)).resolve("w", (E, 2, D, F)) == ((0, 1), (2,), (3,))


@pytest.mark.parametrize("mode", ["plain", "shard_orthogonalization"])
def test_experts_sharded_over_fsdp_equal_one_device(mode):
  """The names' purpose: experts split over the ``fsdp`` axis; the update is one device's."""
  params, grads, single = _linen_case()
  mesh = Mesh(np.array(jax.devices()).reshape(E, 2), ("fsdp", "data"))
  ps = sharding.param_shardings(params, mesh)  # "embed_no_exp" -> fsdp: whole experts per fsdp slice
  for k in EXPERT_KERNELS:
    assert ps["MoeBlock_0"][k].spec == P("fsdp", None, None), (k, ps["MoeBlock_0"][k].spec)
  kw = dict(shard_orthogonalization=ps) if mode != "plain" else {}
  opt = mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=shard_on_exp_axes, **EXACT, **kw)
  sp, sg = jax.device_put(nn.unbox(params), ps), jax.device_put(nn.unbox(grads), ps)
  state = sharding.init_state(opt, sp, ps)
  updates, _ = jax.jit(opt.update, out_shardings=(ps, jax.tree.map(lambda x: x.sharding, state)))(sg, state, sp)
  for k in EXPERT_KERNELS:
    assert updates["MoeBlock_0"][k].sharding.is_equivalent_to(ps["MoeBlock_0"][k], 3)
  assert_same_math(jax.tree.map(lambda u: -u, jax.device_get(updates)), single)


# ----------------------------------------------------------------------------- NNX


class NnxMoeBlock(nnx.Module):
  """MaxText's NNX ``RoutedMoE`` with ``fsdp_shard_on_exp=True``."""

  def __init__(self, rngs):
    part = lambda names: nnx.with_partitioning(INIT, names, eager_sharding=False)  # noqa: E731
    self.gate = nnx.Linear(D, E, use_bias=False, rngs=rngs, kernel_init=part(("embed", None)))
    self.wi_0 = nnx.Param(part(WI)(rngs.params(), (E, D, F)))
    self.wi_1 = nnx.Param(part(WI)(rngs.params(), (E, D, F)))
    self.wo = nnx.Param(part(WO)(rngs.params(), (E, F, D)))


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.norm_scale = nnx.Param(jnp.ones((D,)), out_sharding=("norm",), eager_sharding=False)
    self.MoeBlock_0 = NnxMoeBlock(rngs)


def test_nnx_optimizer_declared_experts_are_one_matrix_each():
  model = NnxModel(nnx.Rngs(0))
  assert nnx.state(model, nnx.Param)["MoeBlock_0"]["wo"].get_metadata()["out_sharding"] == WO
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  grads = gaussian_like(nnx.state(model, nnx.Param), seed=1)
  with pytest.warns(UserWarning) as record:  # nnx.Optimizer hands init the boxed nnx.Params
    opt = nnx.Optimizer(model, mc.muon_adamw(1.0, weight_decay=0.0, matrix_axes=shard_on_exp_axes, **EXACT),
                        wrt=nnx.Param)
  warned = sorted(str(w.message).split(":")[0] for w in record if re.match(WARNS, str(w.message)))
  assert warned == [f"MoeBlock_0/{k}" for k in EXPERT_KERNELS]  # once per leaf
  with warnings.catch_warnings(record=True) as record:  # bare arrays: the axes read at init are reused, no warning
    warnings.simplefilter("always")
    nnx.jit(lambda m, o, g: o.update(m, g))(model, opt, grads)
  assert not [w for w in record if re.match(WARNS, str(w.message))]
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  got = jax.tree.map(lambda b, a: b - a, before, after)  # learning rate 1, no decay: the update itself
  g = nnx.to_pure_dict(grads)
  for k in EXPERT_KERNELS:
    np.testing.assert_allclose(got["MoeBlock_0"][k], polar_update(g["MoeBlock_0"][k]), atol=ATOL, err_msg=k)
  np.testing.assert_allclose(got["MoeBlock_0"]["gate"]["kernel"], polar_update(g["MoeBlock_0"]["gate"]["kernel"]),
                             atol=ATOL)
  # the other leaves: as the same optimizer updates them without the expert kernels
  ref = mc.muon_adamw(1.0, weight_decay=0.0, **EXACT)
  rest, rest_grads = without_experts(before), without_experts(g)
  want, _ = ref.update(rest_grads, ref.init(rest), rest)
  chex.assert_trees_all_close(without_experts(got), jax.tree.map(lambda u: -u, want), atol=1e-6)
