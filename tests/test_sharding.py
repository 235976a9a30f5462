"""Sharded MuonClip on 8 fake CPU devices: rules, state shardings, global max logits, distributed NS."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import sharding, training
from muonclip_jax._orthogonalize import newton_schulz
from muonclip_jax._clip import collect_max_logits
from _exactness import assert_same_math
from _tiny_lm import CFG, init_params, make_loss_fn, matrix_axes
from mla_lm import logical_axes

LR, TAU, STEPS = 0.02, 3.0, 5  # the initial max logit is ~3.7: the clip fires from the first step
LOSS_FN = make_loss_fn(CFG)
_TEXT = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 4, np.uint8)
# Two alternating batches of 8 sequences of 16+1 bytes: one per data shard of an 8x1 mesh.
BATCHES = [jnp.asarray(np.stack([_TEXT[i:i + 17] for i in range(o, o + 8)]), jnp.int32) for o in (0, 9)]
MESHES = {  # name: (mesh shape, axis names)
    "data8x1": ((8, 1), ("data", "model")),  # data parallel: params replicated
    "data2x4": ((2, 4), ("data", "model")),  # data x tensor parallel
    "fsdp2x4": ((2, 4), ("fsdp", "model")),  # FSDP (batch and embed over fsdp) x tensor parallel
    "model1x8": ((1, 8), ("data", "model")),  # tensor parallel only
}
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def _mesh(name):
  shape, axes = MESHES[name]
  return Mesh(np.array(jax.devices()).reshape(shape), axes)


def _collectives(compiled) -> dict[str, list[str]]:
  """{collective: [result shapes]} of a compiled executable's HLO."""
  text = compiled.as_text()
  return {op: re.findall(rf"= ([^=\n]*?) {op}(?:-start)?\(", text) for op in COLLECTIVES}


@functools.cache
def _params():
  return jax.device_get(jax.jit(lambda: init_params(CFG, 0))())


def _opt(**kw):
  return mc.muonclip(LR, layout=CFG.layout, matrix_axes=matrix_axes, qk_clip_threshold=TAU, **kw)


def _same_sharding(a, b):
  return a.sharding.is_equivalent_to(b.sharding, a.ndim)


# ----------------------------------------------------------------------------- rules


def test_logical_rules_on_a_data_fsdp_model_mesh():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"))
  spec = functools.partial(sharding.logical_to_spec, mesh=mesh)
  assert spec(("layers", "q_lora", "heads"), (2, 16, 32)) == P(None, "fsdp", "model")
  assert spec(("layers", "embed", "kv_lora"), (2, 32, 24)) == P(None, "fsdp", None)  # fsdp used once
  assert spec(("vocab", "embed"), (256, 32)) == P("model", "fsdp")
  assert spec(("heads", "embed"), (16, 32)) == P("model", "fsdp")
  assert spec(("layers", "norm"), (2, 32)) == P(None, None)
  assert spec(("batch",), (8, 17)) == P(("data", "fsdp"), None)
  assert spec(("embed", "mlp"), (3, 64)) == P(None, "model")  # 3 rows do not split in 2
  assert spec((None, "mlp"), (4, 64)) == P(None, "model")
  two = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # no fsdp axis
  assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), two) == P(None, "model")
  assert sharding.logical_to_spec(("batch",), (8,), two) == P("data")
  custom = (("embed", "model"), ("embed", "data"), ("mlp", "model"))  # fallbacks, in order
  assert sharding.logical_to_spec(("mlp", "embed"), (64, 32), two, custom) == P("model", "data")
  with pytest.raises(ValueError, match="3 names"):
    sharding.logical_to_spec(("a", "b", "c"), (2, 2), two)


def test_param_shardings_from_boxes_or_logical_axes():
  import flax.linen as nn
  from mla_lm import MLALM

  mesh = _mesh("fsdp2x4")
  boxed = jax.eval_shape(lambda: MLALM(CFG).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))["params"]
  from_boxes = sharding.param_shardings(boxed, mesh)  # abstract boxed params: names from the boxes
  params = nn.unbox(boxed)
  from_names = sharding.param_shardings(params, mesh, logical_axes=logical_axes(CFG))
  assert jax.tree.structure(from_boxes) == jax.tree.structure(params)
  chex.assert_trees_all_equal(jax.tree.map(lambda s: s.spec, from_boxes), jax.tree.map(lambda s: s.spec, from_names))
  attn = from_names["layers"]["attn"]
  assert attn["wq_b"]["kernel"].spec == P(None, "fsdp", "model")  # heads over model, q_lora over fsdp
  assert attn["wkv_b"]["kernel"].spec == P(None, "fsdp", "model")
  assert attn["wo"]["kernel"].spec == P(None, "model", "fsdp")
  assert from_names["layers"]["w_gate"]["kernel"].spec == P(None, "fsdp", "model")
  assert from_names["embed"]["embedding"].spec == P("model", "fsdp")
  stray = {"layers": {"atn": {"wo": {"kernel": ("layers", "heads", "embed")}}}}  # a typo: no such parameter
  with pytest.raises(ValueError, match=r"logical_axes names 1 path\(s\) that are no parameter .*\['layers/atn/wo/kernel'\]"):
    sharding.param_shardings(params, mesh, logical_axes=stray)
  assert sharding.param_shardings(params, mesh, logical_axes={"layers": {"atn": None}})  # None: nothing named
  assert from_names["final_norm"]["scale"].spec == P(None)


def test_state_shardings_follow_params_and_small_leaves_are_replicated():
  mesh = _mesh("fsdp2x4")
  params = _params()
  ps = sharding.param_shardings(params, mesh, logical_axes=logical_axes(CFG))
  opt = mc.multi_steps(_opt(), 2, layout=CFG.layout)
  sharded = jax.device_put(params, ps)
  state = sharding.init_state(opt, sharded, ps)
  by_path = {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in
             jax.tree_util.tree_flatten_with_path(sharded)[0]}
  found = scales = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = jax.tree_util.keystr(path, simple=True, separator="/")
    owner = [p for p in by_path if keys.endswith("/" + p) and by_path[p].shape == leaf.shape]
    if owner:
      assert _same_sharding(leaf, by_path[owner[0]]), keys
      found += 1
    elif "/mu_scale/" in keys:  # Muon's: a scalar, or one per layer of a stack, sharded as its stacked axis
      param = by_path[keys.partition("/mu_scale/")[2]]
      spec = tuple(param.sharding.spec) + (None,) * (param.ndim - len(param.sharding.spec))
      want = P(*(e if n > 1 else None for e, n in zip(spec, leaf.shape))) if leaf.ndim else P()
      assert leaf.ndim in (0, param.ndim) and leaf.sharding.is_equivalent_to(NamedSharding(mesh, want), leaf.ndim)
      scales += 1
    else:  # step counts, hyperparameters, the running max_logits
      assert leaf.ndim == 0 or "max_logits" in keys, keys
      assert leaf.sharding.is_fully_replicated, keys
  labels = jax.tree.leaves(mc.muon_labels(params))
  # Muon's momentum, Adam's two moments, MultiSteps' gradient accumulator
  assert found == labels.count("muon") + 2 * labels.count("adam") + len(labels)
  assert scales == labels.count("muon")  # one scale (or one per stacked layer) per Muon leaf
  assert not state.inner.inner_opt_state[0].inner_states["muon"].inner_state[0].mu["layers"]["w_up"][
      "kernel"].sharding.is_fully_replicated


# ----------------------------------------------------------------------------- train step


@functools.cache
def _single_device_run():
  """The reference: STEPS steps of muonclip on one device; the params after each step."""
  opt = _opt()
  params = _params()
  state = opt.init(params)
  step = jax.jit(training.make_train_step(LOSS_FN, opt))
  history = []
  for t in range(STEPS):
    params, state, metrics = step(params, state, BATCHES[t % 2])
    history.append((jax.device_get(params), jax.device_get(metrics)))
  return history


@pytest.mark.parametrize("mesh_name", ["data8x1", "fsdp2x4", "model1x8"])
def test_sharded_train_step_matches_single_device(mesh_name):
  """Update, max logits, clipped params and a 5-step loss trajectory; shardings kept.

  Batch over data (and fsdp), heads over model, matrices over fsdp, the distributed
  Newton–Schulz. The step's update is the change of the params (clip included).
  Tolerances: the sharded program sums in another order (gradients, logits); Newton–Schulz
  and Adam's normalization amplify those ~1e-7 relative differences: measured 2.5e-6 after
  one step and 5e-6 after five, on params of ~1.
  """
  mesh = _mesh(mesh_name)
  history = _single_device_run()
  assert sum(int(m["num_clipped"]) for _, m in history) > 0  # the clip fires in the reference
  params = _params()
  ps = sharding.param_shardings(params, mesh, logical_axes=logical_axes(CFG))
  opt = _opt(shard_orthogonalization=ps)
  params = jax.device_put(params, ps)
  state = sharding.init_state(opt, params, ps)
  ss = jax.tree.map(lambda x: x.sharding, state)
  bs = sharding.batch_shardings(BATCHES[0], mesh)
  step = sharding.jit_train_step(training.make_train_step(LOSS_FN, opt), ps, ss, bs)
  in_params, in_state, before, ref_before = params, state, jax.device_get(params), _params()
  for t in range(STEPS):
    params, state, metrics = step(params, state, jax.device_put(BATCHES[t % 2], bs))
    ref_params, ref = history[t]
    np.testing.assert_allclose(float(metrics["loss"]), float(ref["loss"]), rtol=2e-5)
    chex.assert_trees_all_close(jax.device_get(metrics["max_logit_per_layer"]), ref["max_logit_per_layer"],
                                rtol=2e-5)
    assert int(metrics["num_clipped"]) == int(ref["num_clipped"])
    after = jax.device_get(params)
    if t == 0:  # the update
      chex.assert_trees_all_close(jax.tree.map(np.subtract, after, before),
                                  jax.tree.map(np.subtract, ref_params, ref_before), atol=1e-5)
  chex.assert_trees_all_close(after, history[-1][0], atol=2e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(in_params)):
    assert _same_sharding(a, b), (a.sharding, b.sharding)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(in_state)):
    assert _same_sharding(a, b), (a.sharding, b.sharding)
  mu = state[0].inner_states["muon"].inner_state[0].mu  # Muon's momentum: the params' layout
  flat_ps = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(ps)[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(mu)[0]:
    assert leaf.sharding.is_equivalent_to(flat_ps[jax.tree_util.keystr(path)], leaf.ndim), path


@jax.jit
def _per_example_maxima(params, tokens):
  """(B, layers, heads) maxima, one example at a time."""
  return jax.vmap(lambda t: collect_max_logits(LOSS_FN(params, t[None])[1])["layers/attn"])(tokens)


@pytest.mark.parametrize("mesh_name,num_microbatches", [("data8x1", 1), ("data2x4", 2)])
def test_planted_max_logit_on_one_data_shard_clips_every_shard(mesh_name, num_microbatches):
  """The largest logit lives in one example of one data shard (and one microbatch).

  tau lies between that logit and every other example's: a clip with any shard's (or
  microbatch's) own maximum would leave the head alone. With learning rate 0 the step is
  the clip alone, so every device's copy of the query/key kernels must equal
  qk_clip(params, maxima of the whole batch).
  """
  mesh = _mesh(mesh_name)
  params = _params()
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 256), np.int32)
  per_example = np.asarray(_per_example_maxima(params, tokens))  # (8, L, H)
  layer, head = 1, 0
  hot = int(np.argmax(per_example[:, layer, head]))
  target = 7 if mesh_name == "data8x1" else 6  # 8x1: the last device; 2x4: data shard 1, microbatch 1
  order = list(range(8))
  order[hot], order[target] = order[target], order[hot]
  tokens, per_example = tokens[order], per_example[order]
  s_hot = float(per_example[target, layer, head])
  s_rest = float(np.delete(per_example[:, layer, head], target).max())
  assert s_hot > s_rest * 1.01, (s_hot, s_rest)
  tau = 0.5 * (s_hot + s_rest)
  opt = optax.chain(optax.scale(0.0), mc.qk_clip_transform(tau, layout=CFG.layout))  # the clip alone
  ps = sharding.param_shardings(params, mesh, logical_axes=logical_axes(CFG))
  sharded_params = jax.device_put(params, ps)
  state = sharding.init_state(opt, sharded_params, ps)
  bs = sharding.batch_shardings(tokens, mesh)
  step = jax.jit(training.make_train_step(LOSS_FN, opt, num_microbatches=num_microbatches))
  out, _, metrics = step(sharded_params, state, jax.device_put(tokens, bs))
  np.testing.assert_allclose(np.asarray(metrics["max_logit_per_layer"]["layers/attn"]), per_example.max(0).max(-1),
                             rtol=1e-5)
  assert float(metrics["max_logit"]) == pytest.approx(float(per_example.max()), rel=1e-5)
  global_maxima = {"layers": {"attn": {"max_logits": jnp.asarray(per_example.max(0))}}}
  ref = mc.qk_clip(params, global_maxima, qk_clip_threshold=tau, layout=CFG.layout)
  kernel = out["layers"]["attn"]["wq_b"]["kernel"]
  ref_kernel = np.asarray(ref["layers"]["attn"]["wq_b"]["kernel"])
  width = CFG.qk_nope_head_dim + CFG.qk_rope_head_dim
  hot_cols = slice(head * width, (head + 1) * width)
  before = np.asarray(params["layers"]["attn"]["wq_b"]["kernel"])
  assert not np.allclose(ref_kernel[layer, :, hot_cols], before[layer, :, hot_cols])  # the hot head is clipped
  for shard in kernel.addressable_shards:  # every device's copy, data replicas included
    np.testing.assert_allclose(np.asarray(shard.data), ref_kernel[shard.index], rtol=1e-6, atol=1e-7)
  for name in ("wq_b", "wkv_b"):
    np.testing.assert_allclose(np.asarray(out["layers"]["attn"][name]["kernel"]),
                               np.asarray(ref["layers"]["attn"][name]["kernel"]), rtol=1e-6, atol=1e-7)


def _elements(shapes: list[str]) -> list[int]:
  return [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
          for text in shapes for dims in re.findall(r"\[([\d,]*)\]", text)]


@pytest.mark.parametrize("mesh_name", ["data2x4", "fsdp2x4"])
def test_compiled_clip_scales_in_place_without_all_gather(mesh_name):
  """No all-gather; XLA moves at most factor-sized pieces (layers x columns), never weights.

  (Measured: a few all-to-alls of 4-8 floats, from laying the per-column factors out like
  the head-sharded columns.)
  """
  mesh = _mesh(mesh_name)
  params = _params()
  ps = sharding.param_shardings(params, mesh, logical_axes=logical_axes(CFG))
  sharded = jax.device_put(params, ps)
  maxima = {"layers": {"attn": {"max_logits": jnp.full((CFG.num_layers, CFG.num_heads), 50.0)}}}
  factor_size = CFG.num_layers * params["layers"]["attn"]["wq_b"]["kernel"].shape[-1]  # 64
  smallest_kernel = min(x.size for x in jax.tree.leaves(params["layers"]["attn"]) if x.ndim == 3)  # 1024
  assert factor_size < smallest_kernel // 8
  clip = jax.jit(lambda p, m: mc.qk_clip(p, m, qk_clip_threshold=TAU, layout=CFG.layout), out_shardings=ps)
  compiled = clip.lower(sharded, maxima).compile()
  transform = mc.qk_clip_transform(TAU, layout=CFG.layout)
  zeros = jax.tree.map(jnp.zeros_like, sharded)
  update = jax.jit(lambda u, p, m: transform.update(u, transform.init(p), p, max_logits=m)[0], out_shardings=ps)
  for program in (compiled, update.lower(zeros, sharded, maxima).compile()):
    found = _collectives(program)
    assert not found["all-gather"], found
    assert max(_elements(sum(found.values(), [])), default=0) <= factor_size, found
  chex.assert_trees_all_close(jax.device_get(compiled(sharded, maxima)),
                              mc.qk_clip(params, maxima, qk_clip_threshold=TAU, layout=CFG.layout), atol=1e-7)


# ----------------------------------------------------------------------------- Newton–Schulz


def _gpt2_like(d, layers, seed=0):
  """Separate q/k/v/o (d, d), fc (d, 4d), proj (4d, d) per layer, with logical names."""
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "fc": (d, 4 * d), "proj": (4 * d, d)}
  names = {"wq": ("embed", "heads"), "wk": ("embed", "heads"), "wv": ("embed", "heads"), "wo": ("heads", "embed"),
           "fc": ("embed", "mlp"), "proj": ("mlp", "embed")}
  keys = iter(jax.random.split(jax.random.key(seed), 6 * layers))
  params = {f"h{i}": {k: jax.random.normal(next(keys), s) for k, s in shapes.items()} for i in range(layers)}
  return params, {f"h{i}": {k: P(*names[k]) for k in shapes} for i in range(layers)}


KELLER = dict(ns_coeffs="muon", ns_steps=5, ns_method="standard")


@functools.cache
def _single_device_gpt2_like_update():
  """``(params, names, grads, FLOPs, update)`` of the one-device reference, compiled once for
  every mesh (called with ``fori_loop`` unrolled)."""
  params, names = _gpt2_like(32, 4)  # 16 (32, 32) and 8 (32, 128) matrices
  grads = jax.tree.map(jnp.sin, params)
  single = mc.muon(1.0, weight_decay=0.0, ns_batch=1, **KELLER)  # no stacking loop: cost analysis counts its body once
  ref = jax.jit(single.update).lower(grads, single.init(params), params).compile()
  return params, names, grads, ref.cost_analysis()["flops"], jax.device_get(ref(grads, single.init(params), params)[0])


@pytest.mark.parametrize("mesh_name", ["data8x1", "data2x4", "fsdp2x4"])
def test_distributed_newton_schulz_flops_and_result(mesh_name, monkeypatch):
  """Per-device FLOPs of the update <= 0.15 of one device's (0.125 ideal), same result.

  The Newton–Schulz loops are unrolled on both sides (XLA's cost analysis counts a rolled
  loop's body once), so the ratio compares the orthogonalization's work and not mostly the
  elementwise momentum work, which every device of ``data8x1`` repeats in full (its
  parameters are replicated) and whose per-element count XLA changes between versions.
  """
  monkeypatch.setattr(jax.lax, "fori_loop", functools.partial(jax.lax.fori_loop, unroll=True))
  mesh = _mesh(mesh_name)
  params, names, grads, ref_flops, ref_out = _single_device_gpt2_like_update()
  ps = sharding.param_shardings(params, mesh, logical_axes=names)
  opt = mc.muon(1.0, weight_decay=0.0, shard_orthogonalization=ps, **KELLER)
  sp, sg = jax.device_put(params, ps), jax.device_put(grads, ps)
  state = sharding.init_state(opt, sp, ps)
  compiled = jax.jit(opt.update).lower(sg, state, sp).compile()
  ratio = compiled.cost_analysis()["flops"] / ref_flops
  assert ratio <= 0.15, ratio
  out, new_state = compiled(sg, state, sp)
  # The same maths summed in other orders (_exactness).
  assert_same_math(jax.device_get(out), ref_out)
  for a, b in zip(jax.tree.leaves(out) + jax.tree.leaves(new_state), jax.tree.leaves(sp) * 2):
    assert _same_sharding(a, b)
  found = _collectives(compiled)
  assert not found["all-reduce"] and not found["reduce-scatter"], found  # only the exchange itself
  if mesh_name == "fsdp2x4":  # every matrix sharded over all devices: all-to-all only
    assert not found["all-gather"], found


def test_layouts_stacks_tall_and_fallback_leaves():
  """Stacked, per-head 3-D, tall and bf16 leaves; shardings the scheme cannot use."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"))
  rng = np.random.default_rng(0)
  leaves = {
      "stack": (rng.standard_normal((3, 16, 24)), mc.MatrixAxes((-2,), (-1,)), P(None, "fsdp", "model")),
      "heads": (rng.standard_normal((16, 4, 8)), mc.MatrixAxes((0,), (1, 2)), P("fsdp", "model", None)),
      "tall": (rng.standard_normal((40, 16)), None, P("model", ("data", "fsdp"))),
      "replicated": (rng.standard_normal((16, 24)), None, P()),
      "stack_axis": (rng.standard_normal((4, 16, 24)), mc.MatrixAxes((-2,), (-1,)), P("model", None, "fsdp")),
      "minor": (rng.standard_normal((16, 4, 8)), mc.MatrixAxes((0,), (1, 2)), P(None, None, "model")),
      "bf16": (rng.standard_normal((24, 16)), None, P("data", "model")),
  }
  params = {k: jnp.asarray(v[0], jnp.bfloat16 if k == "bf16" else jnp.float32) for k, v in leaves.items()}
  axes = {k: v[1] for k, v in leaves.items()}
  ps = {k: NamedSharding(mesh, v[2]) for k, v in leaves.items()}
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  single = mc.scale_by_muon(matrix_axes=axes, **KELLER)
  ref = jax.jit(single.update)(grads, single.init(params))[0]
  opt = mc.scale_by_muon(matrix_axes=axes, shard_orthogonalization=ps, **KELLER)
  sp = jax.device_put(params, ps)
  out = jax.jit(opt.update)(jax.device_put(grads, ps), sharding.init_state(opt, sp, ps))[0]
  for k in leaves:
    tol = 1e-2 if k == "bf16" else 2e-6  # bf16: one rounding of entries ~0.2 is ~1e-3
    np.testing.assert_allclose(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), atol=tol, err_msg=k)
    assert out[k].dtype == params[k].dtype


def test_orthogonalize_sharded_directly_and_bad_targets():
  mesh = _mesh("data2x4")
  x = jax.random.normal(jax.random.key(0), (5, 8, 24))
  ns = functools.partial(newton_schulz, steps=5, coeffs="muon")
  s = NamedSharding(mesh, P(None, None, "model"))
  out = jax.jit(lambda x: sharding.orthogonalize_sharded([x], [((0,), (1,), (2,))], ns, mesh=mesh,
                                                         shardings=[s])[0])(jax.device_put(x, s))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ns(x)), atol=2e-6)
  # A bare Mesh: every matrix is all-gathered, the work is still split.
  opt = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((1,), (2,)), shard_orthogonalization=mesh, **KELLER)
  g = {"w": jax.device_put(x, s)}
  compiled = jax.jit(opt.update).lower(g, opt.init(g)).compile()
  plain = mc.scale_by_muon(matrix_axes=mc.MatrixAxes((1,), (2,)), **KELLER)
  ref = jax.jit(plain.update)({"w": x}, plain.init({"w": x}))[0]["w"]
  np.testing.assert_allclose(np.asarray(compiled(g, opt.init(g))[0]["w"]), np.asarray(ref), atol=2e-6)
  assert _collectives(compiled)["all-gather"]
  with pytest.raises(TypeError, match="shard_orthogonalization must be"):
    mc.scale_by_muon(shard_orthogonalization={"w": P("model")})
  with pytest.raises(TypeError, match="shard_orthogonalization must be"):
    mc.muon(0.1, shard_orthogonalization=lambda p: p)
