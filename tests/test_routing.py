"""Default routing of muon_adamw: hidden matrices to Muon, everything else to AdamW."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc


class TinyLM(nn.Module):
  """Embedding, a scanned block (kernel, norm scale, bias) and an LM head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(32, 16, name="embed")(tokens)

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        h = nn.RMSNorm(name="norm")(x)
        return x + nn.Dense(16, name="mlp")(h), None

    x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="layers")(x, None)
    x = nn.Dense(16, use_bias=False, name="proj")(x)
    return nn.Dense(32, name="lm_head")(x)


def test_default_labels_on_a_flax_model():
  params = TinyLM().init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))["params"]
  labels = mc.muon_labels(params)
  assert labels == {
      "embed": {"embedding": "adam"},
      "layers": {"norm": {"scale": "adam"}, "mlp": {"kernel": "muon", "bias": "adam"}},
      "proj": {"kernel": "muon"},
      "lm_head": {"kernel": "adam", "bias": "adam"},
  }
  assert params["layers"]["norm"]["scale"].shape == (3, 16)  # 2-D, yet not a matrix


def _train(opt, params, model, steps=2):
  state = opt.init(params)
  tokens = jnp.arange(10).reshape(2, 5) % 32

  def loss(p):
    logits = model.apply({"params": p}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  @jax.jit
  def step(p, s):
    grads = jax.grad(loss)(p)
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def test_muon_adamw_routes_scanned_model_and_embeddings_stay_adamw():
  model = TinyLM()
  params = model.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))["params"]
  opt = mc.muon_adamw(1e-2, matrix_axes=mc.MatrixAxes((-2,), (-1,)))
  new, state = _train(opt, params, model)
  chex.assert_tree_all_finite(new)
  muon_state = state.inner_states["muon"].inner_state[0]
  adam_state = state.inner_states["adam"].inner_state[0]
  # Muon momentum exists only for the two hidden matrices; the embedding is AdamW's.
  muon_leaves = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(muon_state.mu)}
  assert muon_leaves == {"['layers']['mlp']['kernel']", "['proj']['kernel']"}
  assert adam_state.mu["embed"]["embedding"].shape == (32, 16)


def test_scanned_kernel_without_matrix_axes_is_an_error():
  model = TinyLM()
  params = model.init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))["params"]
  with pytest.raises(ValueError, match=r"layers/mlp/kernel: .*shape \(3, 16, 16\)"):
    mc.muon_adamw(1e-2).init(params)


def test_label_tree_and_callable_override():
  params = {"a": {"kernel": jnp.ones((8, 8))}, "b": {"kernel": jnp.ones((8, 8))}}
  tree = {"a": {"kernel": "muon"}, "b": {"kernel": "adam"}}
  g = jax.tree.map(lambda x: jnp.sin(x * jnp.arange(8.0)[None, :]), params)
  for labels in (tree, lambda p: tree):
    opt = mc.muon_adamw(0.1, labels=labels, weight_decay=0.0)
    u, _ = opt.update(g, opt.init(params), params)
    ref_muon, _ = mc.muon(0.1, weight_decay=0.0).update(g["a"], mc.muon(0.1).init(g["a"]), params["a"])
    chex.assert_trees_all_close(u["a"]["kernel"], ref_muon["kernel"], atol=1e-6)
    adam = optax.adamw(0.1, b1=0.9, b2=0.95, weight_decay=0.0)
    ref_adam, _ = adam.update(g["b"], adam.init(g["b"]), params["b"])
    chex.assert_trees_all_close(u["b"]["kernel"], ref_adam["kernel"], atol=1e-6)


@pytest.mark.parametrize(
    "path,shape,label",
    [
        ("decoder/layers_0/attn/wq/kernel", (64, 64), "muon"),
        ("tok_embeddings/weight", (100, 64), "adam"),
        ("transformer/wte/embedding", (100, 64), "adam"),
        ("output/kernel", (64, 100), "adam"),
        ("head/kernel", (64, 10), "adam"),
        ("attn/wq/bias", (64,), "adam"),
        ("layers/norm/scale", (4, 64), "adam"),
        ("layers/mlp/kernel", (4, 64, 256), "muon"),
        ("heads/kernel", (64, 64), "muon"),  # "heads" is not "head"
    ],
)
def test_default_label_rules(path, shape, label):
  from muonclip_jax._routing import default_label

  assert default_label(path, shape) == label


def test_boxed_params_are_routed_by_path_without_value_suffix():
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

  boxed = M().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  labels = mc.muon_labels(boxed)
  assert jax.tree.leaves(labels) == ["adam", "muon"]  # bias, kernel
  opt = mc.muon_adamw(0.1)
  state = opt.init(nn.unbox(boxed))
  assert np.isfinite(jax.tree.leaves(state)[-1]).all()
