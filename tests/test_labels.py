"""Default routing of muon_adamw: hidden matrices to Muon, everything else to AdamW."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muonclip_jax as mc
from _exactness import assert_same_math


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


class AutoNamedLM(nn.Module):
  """Linen's auto-names only: Embed_0, two numbered blocks (Block_0, Block_1) and an unnamed head (Dense_0)."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(32, 16)(tokens)

    class Block(nn.Module):
      @nn.compact
      def __call__(self, x):
        return x + nn.Dense(32)(x) @ jnp.ones((32, 16))  # (16, 32): the head's shape, inside a block

    x = Block()(Block()(x))
    return nn.Dense(32)(x)


def test_an_unnamed_linen_head_goes_to_adamw_and_a_numbered_block_keeps_its_matrices():
  # The head's own module, Dense_0, is Linen's name for an unnamed nn.Dense, not a numbered
  # layer: the embedding's shape marks it as the head (it went to Muon before).
  params = AutoNamedLM().init(jax.random.key(0), jnp.zeros((2, 5), jnp.int32))["params"]
  assert mc.muon_labels(params) == {
      "Embed_0": {"embedding": "adam"},
      "Block_0": {"Dense_0": {"kernel": "muon", "bias": "adam"}},
      "Block_1": {"Dense_0": {"kernel": "muon", "bias": "adam"}},
      "Dense_0": {"kernel": "adam", "bias": "adam"},
  }


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
        ("model/final_logits_bias", (1, 100), "adam"),  # Bart's: a vector stored as a row
        ("value_head/kernel", (64, 1), "adam"),
        ("layers/mlp/kernel", (1, 64, 256), "muon"),  # one stacked layer: still a matrix
        # In a numbered layer a head name is the layer's own projection (BERT), unless shaped like
        # an embedding table (DeepSeek-V3's multi-token-prediction head).
        ("bert/encoder/layer/0/output/dense/kernel", (256, 64), "muon"),
        ("bert/encoder/layer/0/attention/output/dense/kernel", (64, 64), "muon"),
        ("bert/encoder/layer/0/output/dense/kernel", (100, 64), "adam"),  # shaped like the embedding
        # a head name that owns the leaf, or is followed by numbered parts, is a head
        ("model/layers/61/shared_head/head/weight", (128, 64), "adam"),
        ("params/classifier/1/kernel", (64, 10), "adam"),  # Hugging Face's Flax ResNet
        ("head/layers_1/kernel", (64, 10), "adam"),  # nn.Sequential
        ("ViT_0/head/kernel", (64, 10), "adam"),  # a Linen auto-named model
        ("resnet50/classifier/kernel", (64, 10), "adam"),
        ("models/0/classifier/kernel", (64, 10), "adam"),
        ("Block_0/output", (64, 64), "adam"),
    ],
)
def test_default_label_rules(path, shape, label):
  from muonclip_jax._muon.labels import default_label

  vocab = frozenset({(100, 64)}) if "layer" in path else frozenset()  # rule 8's tables, where they matter
  assert default_label(path, shape, vocab=vocab) == label


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers: "Flax classes are deprecated"
def test_hugging_face_bert_layers_go_to_muon_whatever_their_output_names():
  """FlaxBert's ``layer/N/output/dense`` (the MLP's down projection) and ``attention/output/dense``
  (the attention's output) are hidden matrices; the embeddings, norms and biases go to AdamW."""
  bert = pytest.importorskip("transformers.models.bert.modeling_flax_bert")
  config = bert.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=16)
  with jax.numpy_rank_promotion("allow"):  # transformers' own bias add
    model = bert.FlaxBertForMaskedLM(config, _do_init=False)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.key(0), (1, 8)))
  flat = {jax.tree_util.keystr(p, simple=True, separator="/"): label
          for p, label in jax.tree_util.tree_leaves_with_path(mc.muon_labels(params))}
  muon = sorted(p for p, label in flat.items() if label == "muon")
  per_layer = ["attention/output/dense", "attention/self/key", "attention/self/query", "attention/self/value",
               "intermediate/dense", "output/dense"]
  assert muon == sorted([f"bert/encoder/layer/{i}/{m}/kernel" for i in range(2) for m in per_layer]
                        + ["cls/predictions/transform/dense/kernel"])
  assert all(flat[p] == "adam" for p in flat if "embeddings" in p or "LayerNorm" in p or p.endswith("bias"))


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


def _partitioned(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names, eager_sharding=False)


class _VocabModel(nnx.Module):
  """An NNX model whose routing needs names, a vocabulary size and Flax-style short sharding specs."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(64, 32, rngs=rngs)
    self.gen = nnx.LinearGeneral(32, (4, 8), kernel_init=_partitioned((None, "model")), rngs=rngs)  # short spec
    self.proj = nnx.Linear(32, 32, kernel_init=_partitioned(("embed",)), rngs=rngs)  # short spec, 2-D
    self.query = nnx.LinearGeneral(32, (4, 8), kernel_init=_partitioned(("embed", "heads", "kv")), use_bias=False,
                                   rngs=rngs)  # its names say which axes form the matrix
    self.norm = nnx.RMSNorm(32, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",),
                                                                 eager_sharding=False), rngs=rngs)
    self.aux = nnx.Linear(32, 48, kernel_init=_partitioned(("embed", "vocab")), rngs=rngs)  # only its name says
    self.readout = nnx.Linear(32, 64, rngs=rngs)  # only the embedding's vocabulary size says
    self.output_layer = nnx.Linear(32, 64, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = self.proj(self.gen(x).reshape(x.shape) + self.query(x).reshape(x.shape))
    x = self.norm(x)
    return self.readout(x) + self.output_layer(x) + self.aux(x).sum(-1, keepdims=True)


def test_nnx_optimizer_init_and_update_route_alike():
  model = _VocabModel(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  labels = nnx.to_pure_dict(mc.muon_labels(params))
  want = {"embed": {"embedding": "adam"}, "gen": {"kernel": "muon", "bias": "adam"},
          "proj": {"kernel": "muon", "bias": "adam"}, "query": {"kernel": "muon"}, "norm": {"scale": "adam"},
          "aux": {"kernel": "adam", "bias": "adam"}, "readout": {"kernel": "adam", "bias": "adam"},
          "output_layer": {"kernel": "adam", "bias": "adam"}}
  assert labels == want
  assert mc.muon_labels(nnx.to_pure_dict(params))["aux"]["kernel"] == "muon"  # bare: no name
  from muonclip_jax._muon.labels import default_label

  vocab = frozenset({(64, 32)})  # (vocabulary, width) of the embedding
  assert default_label("readout/kernel", (64, 32), vocab=vocab) == "adam"
  assert default_label("readout/kernel", (32, 48), vocab=vocab) == "muon"
  assert default_label("layers_0/mlp/kernel", (32, 64), vocab=vocab) == "muon"  # an MLP as wide as the vocabulary
  assert default_label("h/1/mlp/c_fc/kernel", (64, 32), vocab=vocab) == "muon"
  assert default_label("up/kernel", (32, 64), ("embed", "mlp"), vocab=vocab) == "muon"  # names decide
  for head in ("output_layer", "logits_dense", "unembed", "head"):
    assert default_label(f"decoder/{head}/kernel", (32, 100)) == "adam"
  # logical_matrix_axes: 1-D named leaves are not matrices; short specs are padded as Flax pads them
  axes = mc.logical_matrix_axes({k: v for k, v in params.items() if k != "gen"})
  assert axes["norm"]["scale"] is None and axes["proj"]["kernel"] is None  # 2-D: (in, out)
  assert axes["aux"]["kernel"] == mc.MatrixAxes((0,), (1,))
  with pytest.raises(ValueError, match=r"gen/kernel: cannot tell the matrix .*\(None, 'model', None\).*padded "
                                       r"with None at the end.*transform_metadata=\{nnx.PARTITION_NAME: 'layers'\}"):
    mc.logical_matrix_axes(params)
  gen_axes = {"gen": {"kernel": mc.MatrixAxes((0,), (1, 2))}}  # (None, "model") names no matrix: declared
  opt = nnx.Optimizer(model, mc.muon_adamw(0.02, matrix_axes=gen_axes), wrt=nnx.Param)
  tokens = jnp.arange(12).reshape(2, 6) % 64
  grads = nnx.grad(lambda m: m(tokens).mean())(model)
  plain = nnx.to_pure_dict(params)
  opt.update(model, grads)  # init saw nnx.Param boxes, update sees bare arrays
  # the same step on bare arrays with the labels and matrices written out
  ref = mc.muon_adamw(0.02, labels=want, matrix_axes=gen_axes | {"query": {"kernel": mc.MatrixAxes((0,), (1, 2))}})
  u, _ = ref.update(nnx.to_pure_dict(grads), ref.init(plain), plain)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), optax.apply_updates(plain, u),
                              atol=1e-6)


class _ScannedGain(nn.Module):
  """``nn.scan`` without logical names over a block with a gain that is not named ``scale``."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        gain = self.param("gain", nn.initializers.ones, (x.shape[-1],))
        return x + nn.Dense(x.shape[-1], use_bias=False, name="mlp")(x * gain[None, :]), None

    return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="layers")(x, None)[0]


def _flat_labels(params):
  from muonclip_jax._util import path_str

  return {path_str(p): l for p, l in jax.tree_util.tree_flatten_with_path(mc.muon_labels(params))[0]}


def test_stacked_vectors_go_to_adamw_when_their_stack_shows_the_layer_axis():
  """A vector per layer of a stack, (layers, dim), is not a matrix: nn.scan without names, an Equinox
  filter_vmap stack of a layer type the library does not know, a hand-made stack."""
  import equinox as eqx

  flax_params = jax.eval_shape(_ScannedGain().init, jax.random.key(0), jnp.ones((2, 8)))["params"]
  assert _flat_labels(flax_params) == {"layers/gain": "adam", "layers/mlp/kernel": "muon"}

  class Custom(eqx.Module):  # an unknown type holding a raw gain next to a Linear
    gain: jax.Array
    proj: eqx.nn.Linear

    def __init__(self, key):
      self.gain, self.proj = jnp.ones(8), eqx.nn.Linear(8, 8, use_bias=False, key=key)

  stacked = eqx.filter(eqx.filter_vmap(Custom)(jax.random.split(jax.random.key(0), 3)), eqx.is_array)
  assert _flat_labels({"blocks": stacked}) == {"blocks/gain": "adam", "blocks/proj/weight": "muon"}
  by_hand = {"layers": {"ffn": {"w_in": jnp.ones((3, 8, 16)), "w_out": jnp.ones((3, 16, 8))},
                        "gate_gain": jnp.ones((3, 8)), "w_gate": jnp.ones((3, 8, 8))},
             "final": {"w": jnp.ones((8, 8)), "b": jnp.ones((8,))}}
  assert _flat_labels(by_hand) == {"layers/ffn/w_in": "muon", "layers/ffn/w_out": "muon",
                                   "layers/gate_gain": "adam", "layers/w_gate": "muon",
                                   "final/w": "muon", "final/b": "adam"}
  # unnamed experts with a bias per expert (E, f), unscanned and scanned (L, E, f): a vector either way
  def experts(*lead):
    return {"wi": jnp.ones((*lead, 4, 8, 16)), "bi": jnp.ones((*lead, 4, 16)), "wo": jnp.ones((*lead, 4, 16, 8))}
  want = {"experts/wi": "muon", "experts/bi": "adam", "experts/wo": "muon", "router/w": "muon"}
  for lead, prefix in (((), "layers_0/"), ((3,), "layers/")):
    tree = {prefix[:-1]: {"router": {"w": jnp.ones((*lead, 8, 4))}, "experts": experts(*lead)}}
    assert _flat_labels(tree) == {prefix + k: v for k, v in want.items()}, lead
  # but a scanned attention whose leaves all lead with (layers, d) holds no experts: its matrices stay
  attn = {"wq": jnp.ones((3, 16, 2, 8)), "wk": jnp.ones((3, 16, 16)), "wv": jnp.ones((3, 16, 16)),
          "wo": jnp.ones((3, 16, 16))}
  fused = {"w_qkv": jnp.ones((3, 16, 3, 16)), "w_o": jnp.ones((3, 16, 16))}
  for tree in (attn, fused):
    want = {f"layers/attn/{k}": "muon" for k in tree}
    assert _flat_labels({"layers": {"attn": tree, "ln": jnp.ones((3, 16))}}) == {**want, "layers/ln": "adam"}
    assert _flat_labels({"layers": {"attn": tree}}) == want


def test_what_shows_no_stack_keeps_its_matrices_and_the_listed_rules_decide():
  from muonclip_jax._muon.labels import default_label

  # unstacked modules: a rank-1 vector, or leading sizes that differ, show there is no stack
  dense_general = {"attn": {"q": jnp.ones((16, 2, 8)), "k": jnp.ones((16, 2, 8)), "o": jnp.ones((16, 16)),
                            "o_bias": jnp.ones((16,))}}
  assert _flat_labels(dense_general)["attn/o"] == "muon"
  mlp = {"mlp": {"w1": jnp.ones((16, 64)), "w2": jnp.ones((64, 16)), "w3": jnp.ones((16, 2, 32))}}
  assert set(_flat_labels(mlp).values()) == {"muon"}
  only_2d = {"attn": {"wq": jnp.ones((16, 16)), "wk": jnp.ones((16, 16))}}  # no stacked matrix: nothing shows
  assert set(_flat_labels(only_2d).values()) == {"muon"}
  # nothing shows the stack: a lone (layers, dim) leaf is read as a matrix (rule 10), unless named as a norm
  assert _flat_labels({"gains": jnp.ones((3, 16))}) == {"gains": "muon"}
  assert _flat_labels({"final_norm": {"weight": jnp.ones((3, 16))}}) == {"final_norm/weight": "adam"}
  assert default_label("h/ln_f/weight", (3, 16)) == default_label("h/ln_1/g", (3, 16)) == "adam"
  # logical names: fewer than two axes besides "layers" is a vector per layer
  assert default_label("blocks/gain", (3, 16), ("layers", "embed")) == "adam"
  assert default_label("blocks/w", (3, 16, 16), ("layers", "embed", "mlp")) == "muon"


class _BertLike(nn.Module):
  """BERT's layer: an MLP whose down projection is ``output/dense``, and an attention whose query is a
  DenseGeneral ``(d, heads, head_dim)`` beside Dense keys, values and output, without biases (every
  leaf of the attention leads with d). Unscanned (``layer_<i>``) or ``nn.scan``-ned (``layer``)."""

  scan: bool
  names: bool = False

  @nn.compact
  def __call__(self, x):
    def init(*names):
      return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names) if self.names else \
          nn.initializers.lecun_normal()

    class Output(nn.Module):
      @nn.compact
      def __call__(self, h):
        return nn.Dense(8, use_bias=False, kernel_init=init("mlp", "embed"), name="dense")(h)

    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        q = nn.DenseGeneral((2, 4), use_bias=False, kernel_init=init("embed", "heads", "kv"), name="query")(x)
        kv = [nn.Dense(8, use_bias=False, kernel_init=init("embed", "mlp"), name=n)(x) for n in ("key", "value")]
        a = nn.Dense(8, use_bias=False, kernel_init=init("mlp", "embed"), name="out")(q.reshape(x.shape) * sum(kv))
        h = nn.Dense(16, use_bias=False, kernel_init=init("embed", "mlp"), name="intermediate")(x + a)
        return x + Output(name="output")(h), None

    if self.scan:
      meta = {nn.PARTITION_NAME: "layers"} if self.names else {}
      return nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                     metadata_params=meta)(name="layer")(x, None)[0]
    for i in range(2):
      x = Layer(name=f"layer_{i}")(x, None)[0]
    return x


def test_a_layers_sub_modules_are_matrices_scanned_as_unscanned():
  """A head name holding a module of its own inside stacked layers is the layer's sub-module (BERT's
  ``output/dense``), as inside numbered ones; and an unscanned attention whose leaves all lead with the
  model width is no stack (its 2-D kernels stay matrices). Linen with and without names, Equinox."""
  import equinox as eqx

  want = {"intermediate", "key", "out", "output/dense", "query", "value"}
  for scan, names in ((False, False), (True, False), (True, True)):
    params = jax.eval_shape(_BertLike(scan, names).init, jax.random.key(0), jnp.ones((1, 8)))["params"]
    labels = {p.split("/", 1)[1].rsplit("/", 1)[0]: l for p, l in _flat_labels(params).items()}
    assert labels == dict.fromkeys(want, "muon"), (scan, names, labels)

  class Output(eqx.Module):
    dense: eqx.nn.Linear

  class Block(eqx.Module):
    intermediate: eqx.nn.Linear
    output: Output

    def __init__(self, key):
      self.intermediate = eqx.nn.Linear(8, 16, use_bias=False, key=key)
      self.output = Output(eqx.nn.Linear(16, 8, key=key))

  keys = jax.random.split(jax.random.key(0), 2)
  assert _flat_labels({"layer": eqx.filter(eqx.filter_vmap(Block)(keys), eqx.is_array)}) == {
      "layer/intermediate/weight": "muon", "layer/output/dense/weight": "muon", "layer/output/dense/bias": "adam"}
  assert _flat_labels({"layer": eqx.filter([Block(k) for k in keys], eqx.is_array)})["layer/0/output/dense/weight"] \
      == "muon"
  # a head that owns its leaf stays a head, stacked too; and so does a stack of heads (an ensemble)
  assert _flat_labels({"layers": {"mlp": {"w": jnp.ones((2, 8, 16))}, "head": {"w": jnp.ones((2, 8, 16))}}}) == {
      "layers/mlp/w": "muon", "layers/head/w": "adam"}

  class Head(eqx.Module):
    norm: eqx.nn.LayerNorm
    proj: eqx.nn.Linear

    def __init__(self, key):
      self.norm, self.proj = eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 50, use_bias=False, key=key)

  ensemble = {"embed": eqx.filter(eqx.nn.Embedding(50, 16, key=keys[0]), eqx.is_array),
              "head": eqx.filter(eqx.filter_vmap(Head)(jax.random.split(keys[0], 3)), eqx.is_array)}
  assert _flat_labels(ensemble)["head/proj/weight"] == "adam"

  class Model(eqx.Module):  # an ensemble of whole models: a head inside each is still a head
    embed: eqx.nn.Embedding
    mlp: eqx.nn.Linear
    classifier: Output

    def __init__(self, key):
      self.embed, self.mlp = eqx.nn.Embedding(50, 16, key=key), eqx.nn.Linear(16, 16, key=key)
      self.classifier = Output(eqx.nn.Linear(16, 4, key=key))

  want = {"mlp/weight": "muon", "embed/weight": "adam", "classifier/dense/weight": "adam"}
  for models, prefixes in ((eqx.filter_vmap(Model)(keys), ["models/"]),
                           ([Model(k) for k in keys], ["models/0/", "models/1/"])):
    labels = _flat_labels({"models": eqx.filter(models, eqx.is_array)})
    assert {k: v for k, v in labels.items() if k.endswith("weight")} == {
        p + k: v for p in prefixes for k, v in want.items()}, labels


def test_a_projection_to_one_output_goes_to_adamw_scanned_as_unscanned():
  """A ``Dense(1)`` (a scalar gate per token) is a vector stored as a column: AdamW unscanned
  (rule 1), and stacked too where names or the layer type show its matrix, so scanning a model
  does not move it to Muon."""
  import equinox as eqx
  from muonclip_jax._muon.labels import default_label

  assert default_label("layers_0/gate/kernel", (16, 1)) == "adam"
  assert default_label("layers/gate/kernel", (16, 3, 1), ("embed", "layers", None)) == "adam"
  assert default_label("layers/gate/kernel", (3, 16, 1), ("layers", "embed", "mlp")) == "adam"
  assert default_label("moe/wi/kernel", (4, 3, 16, 1), ("exp", "layers", "embed", "mlp")) == "adam"
  # a side of size 1 inside a group is no vector: an MQA key kernel (embed, kv_heads=1, head_dim)
  assert default_label("layers/key/kernel", (16, 3, 1, 8), ("embed", "layers", "kv_heads", "kv")) == "muon"
  assert default_label("layers/mlp/kernel", (1, 16, 64), ("layers", "embed", "mlp")) == "muon"  # one layer

  class Block(eqx.Module):
    score: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, key):
      self.score = eqx.nn.Linear(8, 1, use_bias=False, key=key)
      self.proj = eqx.nn.Linear(8, 8, use_bias=False, key=key)

  one = eqx.filter(Block(jax.random.key(0)), eqx.is_array)
  stacked = eqx.filter(eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3)), eqx.is_array)
  assert _flat_labels({"b": one}) == _flat_labels({"b": stacked}) == {"b/score/weight": "adam", "b/proj/weight": "muon"}


def _deepseek_layer(rng):
  """One DeepSeek-V3-style MoE layer as nested dicts: router, routing bias, two experts, attention."""
  def w(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return {"model": {"embed_tokens": {"weight": w(32, 8)}, "layers": {"1": {
      "mlp": {"gate": {"weight": w(4, 8), "e_score_correction_bias": jnp.full((4,), 0.5)},
              "experts": {"0": {"gate_proj": {"weight": w(12, 8)}}, "1": {"gate_proj": {"weight": w(12, 8)}}}},
      "input_layernorm": {"weight": w(8)},
      "self_attn": {"q_proj": {"weight": w(8, 8)}}}}}, "lm_head": {"weight": w(32, 8)}}


@functools.cache
def _nested_after_two_zero_steps():
  """``_deepseek_layer``'s nested params after two zero-gradient steps of ``muon_adamw`` (router to
  AdamW), flattened: the reference of every flat key form, computed once."""
  from flax import traverse_util
  opt = mc.muon_adamw(1e-2, weight_decay=0.1, labels=functools.partial(mc.muon_labels, router="adam"))
  params = _deepseek_layer(np.random.default_rng(0))
  state = opt.init(params)
  for _ in range(2):
    u, state = opt.update(jax.tree.map(jnp.zeros_like, params), state, params)
    params = optax.apply_updates(params, u)
  return traverse_util.flatten_dict(params)


@pytest.mark.parametrize("form", ["dotted", "tuple", "slash"])
def test_flat_keyed_dicts_label_as_their_nested_form(form):
  """safetensors' dotted keys and flatten_dict's tuple keys are read by their components: the routing
  bias stays frozen (no weight decay moves it), router='adam' sends the router to AdamW."""
  from flax import traverse_util
  nested = _deepseek_layer(np.random.default_rng(0))
  tuples = traverse_util.flatten_dict(nested)
  flat = {"dotted": {".".join(k): v for k, v in tuples.items()}, "tuple": tuples,
          "slash": {"/".join(k): v for k, v in tuples.items()}}[form]
  sep = {"dotted": ".", "slash": "/"}
  key = (lambda k: sep[form].join(k)) if form in sep else (lambda k: k)
  for router in ("muon", "adam"):
    want = traverse_util.flatten_dict(mc.muon_labels(nested, router=router))
    assert mc.muon_labels(flat, router=router) == {key(k): v for k, v in want.items()}
  bias = key(("model", "layers", "1", "mlp", "gate", "e_score_correction_bias"))
  router = key(("model", "layers", "1", "mlp", "gate", "weight"))
  assert mc.muon_labels(flat)[bias] == "frozen" and mc.muon_labels(flat, router="adam")[router] == "adam"
  to_adam = functools.partial(mc.muon_labels, router="adam")
  opt = mc.muon_adamw(1e-2, weight_decay=0.1, labels=to_adam)
  state = opt.init(flat)
  zero = jax.tree.map(jnp.zeros_like, flat)
  for _ in range(2):
    updates, state = opt.update(zero, state, flat)
    flat = optax.apply_updates(flat, updates)
  np.testing.assert_array_equal(flat[bias], 0.5)  # frozen: weight decay 0.1 would give 0.4995 per step
  # the router went to AdamW: decoupled weight decay at AdamW's rate, the same as the nested tree's
  for k, v in _nested_after_two_zero_steps().items():  # two programs (other trees), the same math
    assert_same_math(flat[key(k)], v, err_msg=str(k))
  if form == "dotted":  # a flat key beside the nested path it spells: refused, never one leaf for the other
    clash = {"l": {"w": jnp.ones((8, 8))}, "l.w": jnp.ones((4, 8))}
    with pytest.raises(ValueError, match=r"two parameters have the path 'l/w'"):
      mc.muon_adamw(1e-2).init(clash)


@pytest.mark.parametrize("names", [("embed", "exp"), ("embed", "expert"), ("exp", "embed"), ("layers", "embed", "exp")])
def test_a_router_whose_expert_axis_is_named_is_one_matrix_for_muon(names):
  """The router's expert axis is its matrix's output, not a batch axis: Muon, embed x experts."""
  shape = {"embed": 8, "exp": 4, "expert": 4, "layers": 2}
  kernel = nn.Partitioned(jnp.zeros(tuple(shape[n] for n in names)), names=names)
  bias = nn.Partitioned(jnp.zeros((4, 12)), names=("exp", "mlp"))  # a bias per expert stays a vector
  params = {"moe": {"gate": {"kernel": kernel}, "wi": {"bias": bias}}}
  assert nn.unbox(mc.muon_labels(params)) == {"moe": {"gate": {"kernel": "muon"}, "wi": {"bias": "adam"}}}
  axes = nn.unbox(mc.logical_matrix_axes(params))["moe"]["gate"]["kernel"]
  rest = [a for a, n in enumerate(names) if n != "layers"]
  assert axes == mc.MatrixAxes((rest[0],), (rest[1],))
  # under a module named gate, a stack of experts stays a batch and a per-expert vector a vector
  stack = {"experts": {"gate": {"kernel": nn.Partitioned(jnp.zeros((4, 8, 12)), names=("exp", "embed", "mlp"))},
                       "gate_b": {"bias": nn.Partitioned(jnp.zeros((4, 12)), names=("exp", "mlp"))}}}
  assert nn.unbox(mc.logical_matrix_axes(stack))["experts"]["gate"]["kernel"] == mc.MatrixAxes((1,), (2,))
  vector = {"moe": {"gate": {"kernel": nn.Partitioned(jnp.zeros((4, 12)), names=("exp", "mlp"))}}}
  assert nn.unbox(mc.muon_labels(vector)) == {"moe": {"gate": {"kernel": "adam"}}}
  g = jax.random.normal(jax.random.key(0), kernel.value.shape)
  opt = mc.scale_by_muon(beta=0.0)
  u = opt.update({"moe": {"gate": {"kernel": g}}}, opt.init({"moe": {"gate": {"kernel": kernel}}}))[0]
  m = np.asarray(u["moe"]["gate"]["kernel"])
  m = m if "layers" not in names else np.moveaxis(m, names.index("layers"), 0)
  for mat in m.reshape(-1, *m.shape[-2:]):
    s = np.linalg.svd(mat / (0.2 * np.sqrt(8)), compute_uv=False)
    assert 0.75 < s.min() and s.max() < 1.22  # one orthogonalized 8 x 4 matrix per layer
