"""The library's input contract (docs/training.md): every input is used as documented or refused.

Boolean options are bools; constant learning rates are >= 0; non-float and zero-size leaves
get a zero update (``float0`` gradients included) and no state from every optimizer and
transform; an infinite max logit is reported as above tau and left unclipped; missing
maxima say how to capture them (Linen and NNX), and are optional where nothing reads them.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import muonclip_jax as mc
from muonclip_jax import nn as mnn
from muonclip_jax import sharding, training
from muonclip_jax._train import clip_metrics
from _exactness import assert_same_math

LAYOUT = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4)
MAXIMA = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}
AXES = mc.MatrixAxes((-2,), (-1,))


# ----------------------------------------------------------------------------- boolean options


def test_boolean_options_refuse_strings_numbers_and_none():
  """``"False"`` is truthy: a string (or 0/1, None) for a bool option is a TypeError naming it."""
  q = jnp.ones((1, 3, 2, 4))
  gqa = dict(num_heads=2, num_kv_heads=2, head_dim=4)
  mla = dict(num_heads=2, q_lora_rank=0, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
  hf = {"num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 2, "v_head_dim": 4, "rope_theta": 10000.0, "rope_interleave": "false"}
  cases = [
      ("nesterov", lambda: mc.muonclip(0.1, layout=LAYOUT, nesterov="False")),
      ("nesterov", lambda: mc.muon(0.1, nesterov=1)),
      ("nesterov", lambda: mc.muon_adamw(0.1, nesterov=None)),
      ("nesterov", lambda: mc.scale_by_muon(nesterov="True")),
      ("exact_clip", lambda: training.make_train_step(lambda p, b: (0.0, None), optax.sgd(0.1), exact_clip="False")),
      ("use_grad_mean", lambda: mc.multi_steps(optax.sgd(0.1), 2, layout=LAYOUT, use_grad_mean="yes")),
      ("donate", lambda: sharding.jit_train_step(lambda *a: a, {}, {}, {}, donate="no")),
      ("GroupedQueryAttention: is_causal", lambda: mnn.GroupedQueryAttention(**gqa, is_causal="False")),
      ("GroupedQueryAttention: qkv_bias", lambda: mnn.GroupedQueryAttention(**gqa, qkv_bias=0)),
      ("GroupedQueryAttention: use_rope", lambda: mnn.GroupedQueryAttention(**gqa, use_rope="no")),
      ("MultiHeadLatentAttention: is_causal", lambda: mnn.MultiHeadLatentAttention(**mla, is_causal="False")),
      ("MultiHeadLatentAttention: rope_interleave", lambda: mnn.MultiHeadLatentAttention(**mla, rope_interleave=1)),
      ("GroupedQueryAttentionNNX: is_causal",
       lambda: mnn.GroupedQueryAttentionNNX(8, **gqa, is_causal="False", rngs=nnx.Rngs(0))),
      ("MultiHeadLatentAttentionNNX: is_causal",
       lambda: mnn.MultiHeadLatentAttentionNNX(8, **mla, is_causal="False", rngs=nnx.Rngs(0))),
      ("config['rope_interleave']", lambda: mnn.mla_from_hf_config(hf)),
      ("attention: is_causal", lambda: mnn.attention(q, q, q, softmax_scale=0.5, is_causal="False")),
      ("attention: return_max_logits",
       lambda: mnn.attention(q, q, q, softmax_scale=0.5, impl="dense", return_max_logits="yes")),
      ("attention: is_causal",
       lambda: mnn.attention(q, q, q, softmax_scale=0.5, impl="chunked", is_causal="no")),
      ("attention: is_causal",
       lambda: mnn.attention(q, q, q, softmax_scale=0.5, impl="dpa_max", is_causal=1)),
      ("dot_product_attention: is_causal", lambda: mnn.dot_product_attention(q, q, q, is_causal="False")),
      ("dot_product_attention: deterministic", lambda: mnn.dot_product_attention(q, q, q, deterministic="True")),
      ("dot_product_attention_weights: deterministic",
       lambda: mnn.dot_product_attention_weights(q, q, deterministic="True", module=None)),
      ("apply_rope: rope_interleave", lambda: mnn.apply_rope(q, jnp.zeros((1, 3)), rope_interleave="no")),
  ]
  for name, build in cases:
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a bool")):
      build()
  # NumPy's bool is a bool; one passed as an array to inject_hyperparams (which would trace
  # it) is refused, a Python bool stays static.
  assert mnn.GroupedQueryAttention(**gqa, is_causal=np.bool_(False)).is_causal == np.False_
  params = {"w": jnp.ones((4, 8))}
  optax.inject_hyperparams(mc.muon)(0.1, nesterov=False).init(params)
  with pytest.raises(TypeError, match="nesterov must be a bool"):
    optax.inject_hyperparams(mc.muon)(0.1, nesterov=jnp.array(True)).init(params)


def test_make_train_step_refuses_a_compute_dtype_that_is_no_float_and_a_bool_microbatch_count():
  """An integer ``compute_dtype`` truncated the weights of the forward pass and left every gradient
  zero (weight decay alone moved them); ``num_microbatches=True`` read as 1."""
  loss_fn = lambda p, b: (jnp.sum(p["w"] * b), None)  # noqa: E731
  for dtype in (jnp.int32, jnp.bool_, "foo", jnp.float8_e4m3fn):
    with pytest.raises(TypeError, match=re.escape(f"compute_dtype must be a floating dtype of 16 bits or more "
                                                  f"(float32, bfloat16, float16) or None for the params' own, got")):
      training.make_train_step(loss_fn, optax.sgd(0.1), compute_dtype=dtype)
  for k in (True, 0, 2.0):
    with pytest.raises(ValueError, match=re.escape(f"num_microbatches must be an int >= 1, got {k!r}")):
      training.make_train_step(loss_fn, optax.sgd(0.1), num_microbatches=k)
  params = {"w": jnp.ones((2, 3))}
  for dtype in (jnp.bfloat16, jnp.float16, None):  # taken: the step's gradient is the float one
    _, _, metrics = training.make_train_step(loss_fn, optax.sgd(0.1), compute_dtype=dtype)(
        params, optax.sgd(0.1).init(params), jnp.full((2, 3), 0.5))
    assert float(metrics["grad_norm"]) == pytest.approx(np.sqrt(6) * 0.5)


def test_a_dtype_under_inject_hyperparams_is_static_or_refused():
  """``jnp.bfloat16`` is callable, so ``optax.inject_hyperparams`` took it for a schedule and traced a
  bfloat16 scalar: the CPU's path read it as the dtype, the GPU's and TPU's failed to trace. Now it
  is a TypeError naming ``static_args`` at ``init`` on any backend; named there, it is the dtype."""
  params = {"w": jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)}
  for factory, name in ((mc.muon, "compute_dtype"), (mc.muon, "mu_dtype"), (mc.muon_adamw, "compute_dtype")):
    with pytest.raises(TypeError, match=re.escape(f"{name} is a dtype, fixed when the transform is built, got an "
                                                  f"array") + ".*" + re.escape(f"static_args=({name!r},)")):
      optax.inject_hyperparams(factory)(1.0, **{name: jnp.bfloat16}).init(params)
    opt = optax.inject_hyperparams(factory, static_args=(name,))(1.0, **{name: jnp.bfloat16})
    ref = factory(1.0, **{name: jnp.bfloat16})
    got = opt.update(params, opt.init(params), params)[0]
    assert_same_math(np.asarray(got["w"]), np.asarray(ref.update(params, ref.init(params), params)[0]["w"]))
  with pytest.raises(TypeError, match="compute_dtype is a dtype"):
    mc.scale_by_muon(compute_dtype=jnp.zeros((), jnp.bfloat16))


def test_negative_constant_learning_rates_are_refused():
  with pytest.raises(ValueError, match=r"learning_rate must be >= 0.0 and < inf, got -0.1"):
    mc.muon(-0.1)
  with pytest.raises(ValueError, match=r"learning_rate must be >= 0.0 and < inf, got -0.02"):
    mc.muonclip(-0.02, layout=LAYOUT)
  with pytest.raises(ValueError, match=r"adam_learning_rate must be >= 0.0 and < inf, got -0.001"):
    mc.muon_adamw(0.02, adam_learning_rate=-1e-3)
  mc.muon_adamw(0.0, adam_learning_rate=optax.linear_schedule(0.0, 1e-3, 10))  # 0 and schedules are taken


# ----------------------------------------------------------------------------- frozen leaves

# Integer, boolean and zero-size leaves next to an attention layer and a hidden matrix: each
# of a shape no float leaf has, so the state can be searched for moments of them.
PARAMS = {
    "attn": {"wq": {"kernel": jnp.ones((8, 8))}, "wk": {"kernel": jnp.ones((8, 8))}},
    "mlp": {"kernel": jnp.full((8, 16), 0.5)},
    "step": jnp.array(3, jnp.int32),
    "table": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
    "keep": jnp.array([True, False, True, True, False]),
    "rows0": jnp.ones((0, 8)),
    "cols0": jnp.ones((8, 0)),
    "stack0": jnp.ones((3, 0, 4)),
}
FROZEN = ("step", "table", "keep", "rows0", "cols0", "stack0")


def _grads():
  """``jax.grad(..., allow_int=True)``'s float0 for the counter and the mask; an integer
  gradient of ones for the table (a user's); floats elsewhere."""
  def loss(p):
    return jnp.sum(p["attn"]["wq"]["kernel"] ** 2) + jnp.sum(jnp.sin(p["mlp"]["kernel"])) + jnp.sum(p["rows0"])
  g = jax.grad(loss, allow_int=True)(PARAMS)
  assert g["step"].dtype == jax.dtypes.float0 and g["keep"].dtype == jax.dtypes.float0
  return {**g, "table": jnp.ones((2, 3), jnp.int32)}


@pytest.mark.parametrize("name", ["scale_by_muon", "muon", "muon_adamw", "muonclip", "qk_clip_transform",
                                  "multi_steps"])
def test_non_float_and_zero_size_leaves_get_a_zero_update_and_no_state(name):
  """As ``optax.sgd`` leaves a step counter alone: weight decay never moves an integer leaf,
  no moment is kept for it, ``float0`` gradients are taken, and a (0, 8) or (3, 0, 4) leaf
  is no reduction error. The float leaves are still updated."""
  opt = {
      "scale_by_muon": lambda: mc.scale_by_muon(),
      "muon": lambda: mc.muon(0.1, matrix_axes=AXES),
      "muon_adamw": lambda: mc.muon_adamw(0.1),
      "muonclip": lambda: mc.muonclip(0.1, layout=LAYOUT, qk_clip_threshold=100.0),
      "qk_clip_transform": lambda: mc.qk_clip_transform(100.0, layout=LAYOUT),  # the update: the gradient, clipped
      "multi_steps": lambda: mc.multi_steps(mc.muonclip(0.1, layout=LAYOUT), 1, layout=LAYOUT),
  }[name]()
  state = opt.init(PARAMS)
  for leaf in jax.tree.leaves(state):  # no moment of a frozen leaf
    assert jnp.shape(leaf) not in ((2, 3), (5,), (0, 8), (8, 0), (3, 0, 4)), (name, jax.tree.map(jnp.shape, state))
  if name == "scale_by_muon":  # without params: the gradients' dtypes say which leaves are frozen
    updates, _ = jax.jit(opt.update)(_grads(), state)
  else:
    updates, _ = jax.jit(lambda g, s, p: opt.update(g, s, p, max_logits=MAXIMA))(_grads(), state, PARAMS)
  new = optax.apply_updates(PARAMS, updates)
  for key in FROZEN:
    assert new[key].dtype == PARAMS[key].dtype and new[key].shape == PARAMS[key].shape, key
    np.testing.assert_array_equal(new[key], PARAMS[key], err_msg=f"{name}: {key}")
    assert not np.any(np.asarray(updates[key])), (name, key)
  assert float(jnp.max(jnp.abs(updates["mlp"]["kernel"]))) > 0.0


def test_train_step_with_an_integer_counter_in_the_params():
  """``make_train_step`` differentiates integer leaves with ``allow_int`` (zero gradients),
  casts only float leaves to ``compute_dtype``, and ``muon_adamw`` leaves the counter; the
  maxima are optional for an optimizer that does not clip."""
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,)), "step": jnp.array(257, jnp.int32)}
  seen = []

  def loss_fn(p, x):
    seen.append(p["step"].dtype)  # 257 is not a bfloat16: the counter must not be cast
    return jnp.mean((x @ p["w"] + p["b"][None]) ** 2) + 0.0 * p["step"], None

  opt = mc.muon_adamw(0.01)
  step = jax.jit(training.make_train_step(loss_fn, opt, num_microbatches=2, compute_dtype=jnp.bfloat16))
  new, _, metrics = step(params, opt.init(params), jnp.ones((2, 4)))
  assert int(new["step"]) == 257 and new["step"].dtype == jnp.int32 and set(seen) == {jnp.dtype(jnp.int32)}
  assert sorted(metrics) == ["grad_norm", "loss"]  # nothing captured: no max-logit or clip metrics
  assert float(jnp.max(jnp.abs(new["w"] - params["w"]))) > 0


# ----------------------------------------------------------------------------- the distributed path


def test_zero_size_and_integer_leaves_under_shard_orthogonalization():
  """The sharded orthogonalization never sees a frozen leaf: (0, 8) and an int matrix beside
  a sharded matrix, on the 8 test devices."""
  mesh = Mesh(np.array(jax.devices()), ("model",))
  params = {"w": jnp.ones((8, 16)), "rows0": jnp.ones((0, 8)), "table": jnp.ones((2, 3), jnp.int32)}
  opt = mc.scale_by_muon(shard_orthogonalization=mesh)
  grads = {"w": jax.random.normal(jax.random.key(0), (8, 16)), "rows0": jnp.ones((0, 8)),
           "table": jnp.ones((2, 3), jnp.int32)}
  updates, _ = jax.jit(opt.update)(grads, opt.init(params))
  ref, _ = jax.jit(mc.scale_by_muon().update)({"w": grads["w"]}, mc.scale_by_muon().init({"w": params["w"]}))
  np.testing.assert_allclose(updates["w"], ref["w"], atol=1e-5)
  assert updates["rows0"].shape == (0, 8) and not np.any(np.asarray(updates["table"]))
  # Called directly, the sharded orthogonalization takes zero-size matrices too.
  xs = [jnp.ones((0, 8)), grads["w"], jnp.ones((3, 0, 4))]
  axes = [((), (0,), (1,)), ((), (0,), (1,)), ((0,), (1,), (2,))]
  out = jax.jit(lambda *a: sharding.orthogonalize_sharded(list(a), axes, mc.newton_schulz, mesh=mesh))(*xs)
  assert [o.shape for o in out] == [(0, 8), (8, 16), (3, 0, 4)]


# ----------------------------------------------------------------------------- non-finite maxima


def test_an_infinite_max_logit_is_counted_above_tau_and_left_unclipped():
  """+inf is above any tau: ``num_above_threshold`` counts it; the clip has no finite factor
  for it and leaves the head (``num_clipped`` does not count it); NaN and -inf are not above."""
  s = jnp.array([jnp.inf, 400.0, jnp.nan, -jnp.inf])
  stats = mc.qk_clip_stats({"attn": {"max_logits": s}}, qk_clip_threshold=100.0)["attn"]
  counts = {k: int(stats[k]) for k in ("num_above_threshold", "num_clipped", "num_nonfinite")}
  assert counts == {"num_above_threshold": 2, "num_clipped": 1, "num_nonfinite": 3}
  assert float(stats["min_gamma"]) == 0.25
  m = clip_metrics({"attn": s}, 100.0)  # the train step's metrics, read from the report
  assert int(m["num_above_threshold"]) == 2 and np.isnan(float(m["max_logit"]))
  m = clip_metrics({"attn": jnp.array([jnp.inf, 50.0])}, 100.0)
  assert int(m["num_above_threshold"]) == 1 and float(m["max_logit"]) == np.inf
  layout = mc.GQALayout(4, 4, 2)
  params = {"attn": {"wq": {"kernel": jnp.ones((3, 8))}, "wk": {"kernel": jnp.ones((3, 8))}}}
  new = mc.qk_clip(params, {"attn": {"max_logits": s}}, qk_clip_threshold=100.0, layout=layout)
  np.testing.assert_array_equal(new["attn"]["wq"]["kernel"][0], [1, 1, 0.5, 0.5, 1, 1, 1, 1])  # head 1 only


# ----------------------------------------------------------------------------- missing maxima


def test_missing_maxima_give_the_nnx_cure_too():
  """``nnx.MultiHeadAttention`` sows only under ``sow_weights=True``: the error says so, and
  how NNX captures them, not only Linen's ``mutable=['intermediates']``."""
  mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                               attention_fn=mnn.dot_product_attention, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 3, 8))
  _, intermediates = nnx.capture(mha, nnx.Intermediate)(x)  # called without sow_weights=True
  layout = mc.GQALayout(2, 2, 4, query="query", key="key")
  cure = r"nnx.capture\(model, nnx.Intermediate\).*sow_weights=True"
  with pytest.raises(ValueError, match=r"mutable=\['intermediates'\].*" + cure):
    mc.qk_clip(nnx.state(mha, nnx.Param), intermediates, qk_clip_threshold=1.0, layout=layout)
  opt = mc.qk_clip_transform(100.0, layout=LAYOUT)  # muonclip's clip
  with pytest.raises(ValueError, match=r"max_logits is missing.*" + cure):
    opt.update(jax.tree.map(jnp.zeros_like, PARAMS), opt.init(PARAMS), PARAMS)
  _, intermediates = nnx.capture(mha, nnx.Intermediate)(x, sow_weights=True)  # the cure
  assert nnx.to_pure_dict(intermediates)["max_logits"].shape == (2,)


def test_train_step_needs_maxima_only_where_something_reads_them():
  """No maxima: fine for ``muon_adamw`` alone; a ValueError that says what needs them for a
  clipping optimizer, a ``qk_clip_threshold`` or ``exact_clip``."""
  params = {"w": jnp.ones((4, 4))}
  loss_fn = lambda p, x: (jnp.mean((x @ p["w"]) ** 2), {})
  x = jnp.ones((2, 4))
  for opt, kw, why in [(mc.muonclip(0.01, layout=LAYOUT), {}, "the optimizer clips"),
                       (mc.muon_adamw(0.01), dict(qk_clip_threshold=10.0), "qk_clip_threshold=10.0 was given"),
                       (mc.muon_adamw(0.01), dict(qk_clip_threshold=10.0, exact_clip=True, layout=LAYOUT),
                        "qk_clip_threshold=10.0")]:
    with pytest.raises(ValueError, match=rf"intermediates hold no max_logits, but {why}.*nnx.capture"):
      jax.jit(training.make_train_step(loss_fn, opt, **kw))(params, opt.init(params), x)
