"""Expert parallelism: expert stacks sharded on an ``expert`` mesh axis are orthogonalized
where they live, under plain SPMD and under ``shard_orthogonalization``, never gathered.

Tiny MoE-shaped parameters (an attention matrix, a shared expert, 8 routed experts
unscanned ``(E, in, out)`` and MaxText-scanned ``(E, layers, in, out)``) named with
MaxText's logical axes and sharded by ``sharding.DEFAULT_RULES`` on 8 fake devices.
"""

import functools
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import sharding
from muonclip_jax._orthogonalize import distributed, newton_schulz, planner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import hlo_collectives  # noqa: E402

MESHES = {  # name: (mesh shape, axis names)
    "expert4xdata2": ((4, 2), ("expert", "data")),
    "expert2xfsdp2xdata2": ((2, 2, 2), ("expert", "fsdp", "data")),
}
E, D, F, L = 8, 48, 64, 2
LAYER = {  # name: (shape, logical names)
    "attn/wq": ((D, 96), ("embed", "heads")),
    "shared/wi": ((D, F), ("embed", "mlp")),
    "moe/wi_0": ((E, D, F), ("exp", "embed_no_exp", "mlp")),
    "moe/wo": ((E, F, D), ("exp", "mlp", "embed_no_exp")),
    "scanned/wi_0": ((E, L, D, F), ("exp", "layers", "embed_no_exp", "mlp")),  # MaxText, param_scan_axis=1
}
EXPERTS = ("moe/wi_0", "moe/wo", "scanned/wi_0")
AXES = mc.MatrixAxes((-2,), (-1,))  # one matrix per expert (and layer), as MaxText's muon_utils
NS = dict(steps=None, coeffs="polar_express_4", method="auto")  # scale_by_muon's default


def _mesh(name):
  shape, axes = MESHES[name]
  return Mesh(np.array(jax.devices()).reshape(shape), axes)


@functools.cache
def _case():
  """(params, grads, logical names, the single-device update)."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, (s, _) in LAYER.items()}
  names = {k: P(*n) for k, (_, n) in LAYER.items()}
  grads = jax.tree.map(lambda x: jnp.sin(3 * x), params)
  single = mc.scale_by_muon(matrix_axes=AXES)
  return params, grads, names, jax.device_get(jax.jit(single.update)(grads, single.init(params))[0])


def test_default_rules_map_expert_names_to_the_expert_axis():
  mesh = AbstractMesh((4, 2), ("expert", "fsdp"))
  for name in ("exp", "expert", "experts"):
    assert dict(sharding.DEFAULT_RULES)[name] == "expert"
    assert sharding.logical_to_spec((name, "embed_no_exp", "mlp"), (8, 32, 48), mesh) == P("expert", "fsdp", None)
  assert sharding.logical_to_spec(("batch", "length"), (16, 4), mesh) == P(("fsdp", "expert"), None)
  assert sharding.logical_to_spec(("batch", "length"), (6, 4), mesh) == P("fsdp", None)
  no_experts = AbstractMesh((2, 4), ("data", "model"))  # a mesh without the axis leaves experts whole
  assert sharding.logical_to_spec(("exp", "embed", "mlp"), (6, 32, 48), no_experts) == P(None, None, "model")


def test_an_expert_count_the_expert_axis_does_not_divide_is_refused_with_its_path():
  mesh = AbstractMesh((4, 2), ("expert", "data"))
  params = {"moe": {"wi_0": jax.ShapeDtypeStruct((6, 32, 48), jnp.float32)}}
  with pytest.raises(ValueError, match=r"moe/wi_0: .*6 experts .*\('expert',\) of 4 devices"):
    sharding.param_shardings(params, mesh, logical_axes={"moe": {"wi_0": ("exp", "embed", "mlp")}})
  rules = (("exp", None),) + sharding.DEFAULT_RULES  # the documented way to replicate them instead
  got = sharding.param_shardings(params, mesh, logical_axes={"moe": {"wi_0": ("exp", "embed", "mlp")}}, rules=rules)
  assert got["moe"]["wi_0"].spec == P(None, None, None)


def _plan(mesh, ps, params):
  xs, ss = jax.tree.leaves(params), jax.tree.leaves(ps)
  xs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(xs, ss)]
  axes = [AXES.resolve("w", x.shape) for x in xs]
  flops = distributed.ns_flops_of(NS)
  leaves = distributed.describe(xs, axes, mesh, ss)
  return xs, ss, axes, flops, leaves, planner.plan(leaves, dict(mesh.shape), flops)


def _check_gathers(hlo: str, mesh, params: dict, plan=None) -> None:
  """No all-gather across the expert axis holds an expert stack: under plain SPMD each is
  smaller than the smallest stack (XLA may spread and gather the small dense matrices as it
  likes; before the fix it gathered ``(8, 1, 32, 48)``, a whole stack); under
  ``shard_orthogonalization`` each is the ``(n_rep, s, width)`` result buffer of a class of
  matrices that are not experts."""
  slice_of = {int(d.id): int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}  # expert coordinate
  smallest = min(params[k].size for k in EXPERTS)
  others = None if plan is None else {(c.n_rep, c.s, c.width) for c in plan.classes if not c.stack}
  for c in hlo_collectives.collectives(hlo, 8):
    if c.op == "all-gather" and any(len({slice_of[d] for d in g}) > 1 for g in c.groups):
      (_, shape), = c.shapes
      assert c.elements < smallest if others is None else shape in others, c


@pytest.mark.parametrize("mode", ["plain", "shard_orthogonalization"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_update_equals_single_device_without_gathering_experts(mesh_name, mode):
  mesh = _mesh(mesh_name)
  params, grads, names, ref = _case()
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  assert all(ps[k].spec[0] == "expert" for k in EXPERTS)
  kw = dict(shard_orthogonalization=ps) if mode != "plain" else {}
  opt = mc.scale_by_muon(matrix_axes=AXES, **kw)
  sp, sg = jax.device_put(params, ps), jax.device_put(grads, ps)
  state = sharding.init_state(opt, sp, ps)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  compiled = jax.jit(opt.update, out_shardings=(ps, state_sh)).lower(sg, state).compile()
  out, _ = compiled(sg, state)
  chex.assert_trees_all_close(jax.device_get(out), ref, atol=1e-5)
  for k in EXPERTS:
    assert out[k].sharding.is_equivalent_to(ps[k], out[k].ndim)
  _check_gathers(compiled.as_text(), mesh, params, None if mode == "plain" else _plan(mesh, ps, params)[-1])


def test_expert_stacks_that_share_a_loop_stay_sharded():
  """Eight unscanned MoE layers' expert stacks of one shape share one of the default's loops
  (one whole stack an iteration): with no ``out_shardings``, each leaf's update and new
  momentum keep the expert sharding, no all-gather across the expert axis holds a stack, and
  the update is the single-device one."""
  mesh = _mesh("expert4xdata2")
  rng = np.random.default_rng(1)
  params = {f"layer_{i}": {"wi_0": jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32)} for i in range(8)}
  grads = jax.tree.map(lambda x: jnp.sin(3 * x), params)
  names = jax.tree.map(lambda _: P("exp", "embed_no_exp", "mlp"), params)
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  opt = mc.scale_by_muon(matrix_axes=AXES)
  ref = jax.device_get(jax.jit(opt.update)(grads, opt.init(params))[0])
  sg = jax.device_put(grads, ps)
  state = sharding.init_state(opt, jax.device_put(params, ps), ps)
  compiled = jax.jit(opt.update).lower(sg, state).compile()
  out, new = compiled(sg, state)
  chex.assert_trees_all_close(jax.device_get(out), ref, atol=1e-5)
  for x, s in zip(jax.tree.leaves(out) + jax.tree.leaves(new.mu), 2 * jax.tree.leaves(ps)):
    assert x.sharding.is_equivalent_to(s, 3), (x.sharding, s)
  slice_of = {int(d.id): int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}
  for c in hlo_collectives.collectives(compiled.as_text(), 8):
    if c.op == "all-gather" and any(len({slice_of[d] for d in g}) > 1 for g in c.groups):
      assert c.elements < D * F, c  # not even one expert's matrix


@pytest.fixture
def unrolled(monkeypatch):
  """XLA's cost analysis counts a rolled loop's body once: unroll the Newton–Schulz loops."""
  monkeypatch.setattr(jax.lax, "fori_loop", functools.partial(jax.lax.fori_loop, unroll=True))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_planner_matches_compiled_cost_analysis_with_expert_stacks(mesh_name, unrolled):
  """The plan pins every expert to the devices that hold it (their load fixed first), and
  its FLOPs (most loaded device) and bytes are the compiled program's."""
  mesh = _mesh(mesh_name)
  params, _, names, _ = _case()
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  xs, ss, axes, flops, leaves, plan = _plan(mesh, ps, params)
  pinned = [c for c in plan.classes if c.stack]
  assert pinned and all(c.stack == ("expert",) and "expert" not in c.rep for c in pinned)
  assert all(lf.gathered == 1 for lf in leaves)  # nothing gathered first
  # each slice's devices orthogonalize their own experts, the same positions in every slice
  own = [0.0] * plan.devices
  for c in pinned:
    for (i, _), d in zip(c.matrices, c.device):
      for e in range(plan.devices):
        own[e] += flops(*leaves[i].mn) * (plan.home(c, e) == d)
  assert sum(own) == pytest.approx(sum(flops(*lf.mn) * lf.count for lf in leaves if lf.stack))
  assert all(a <= b * (1 + 1e-12) for a, b in zip(own, plan.device_flops))
  ns = functools.partial(newton_schulz, **NS)
  fn = lambda *a: distributed.orthogonalize_sharded(list(a), axes, ns, mesh=mesh, shardings=ss, flops=flops)
  compiled = jax.jit(fn).lower(*xs).compile()
  measured = compiled.cost_analysis()["flops"]
  assert 1.0 <= measured / plan.max_flops <= 1.05, (measured, plan.max_flops)
  received, _ = hlo_collectives.communication(compiled.as_text(), 8)
  assert received == plan.comm
  _check_gathers(compiled.as_text(), mesh, params, plan)
  total = sum(flops(*lf.mn) * lf.count for lf in leaves)
  assert plan.max_flops <= total / plan.devices + max(flops(*lf.mn) for lf in leaves)  # LPT's bound
