"""The installed ``maxtext`` package (0.2.5): tiny decoder configs, their NNX models and a batch.

MaxText needs Python >= 3.12 and JAX >= 0.11; the Python 3.12 suite installs it (Makefile).
What the tests call of MaxText: ``pyconfig.initialize`` with keyword overrides of a model config,
``maxtext_utils.get_mesh_from_config``, ``model_creation_utils.from_config``, the pre-training
``loss_fn`` and ``TrainStateNNX`` (the library itself reads none of MaxText's names, only the
logical axis names its parameters carry).
"""

import contextlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

T = 16  # tokens per sequence
VOCAB = 128
# DeepSeek-V3-style: 1 dense + 2 MoE layers, 4 routed experts (top 2), 1 shared, routing bias, MLA.
# The routed experts go through MaxText's sparse-matmul MoE by ``jax.lax.ragged_dot``
# (megablox=False): its megablox Pallas kernel runs in interpret mode off a TPU, where the
# tests of this file took 268 s against 103 s (the same parameters, the same experts' matrices).
DEEPSEEK = dict(model_name="deepseek3-tiny", base_num_decoder_layers=3, first_num_dense_layers=1, num_experts=4,
                num_experts_per_tok=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, megablox=False)
# Llama-style dense GQA: 4 query heads, 2 key/value heads of 8
LLAMA = dict(model_name="llama2-7b", base_num_decoder_layers=2, base_emb_dim=32, base_num_query_heads=4,
             base_num_kv_heads=2, head_dim=8, base_mlp_dim=64)


def config(model: dict, *, scan: bool, **overrides):
  from maxtext.configs import pyconfig
  import maxtext
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  return pyconfig.initialize(
      [None, base], scan_layers=scan, run_name="muonclip_test", enable_checkpointing=False,
      skip_jax_distributed_system=True, per_device_batch_size=1, max_target_length=T, vocab_size=VOCAB,
      attention="dot_product", gradient_clipping_threshold=0.0, override_model_config=True,
      base_output_directory="/tmp/maxtext_muonclip_test", **model, **overrides)


def model_and_mesh(cfg):
  """MaxText's NNX ``Transformer``, built under its mesh (so every step sees the same shardings)."""
  from maxtext.utils import maxtext_utils, model_creation_utils
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  with jax.set_mesh(mesh):
    model = model_creation_utils.from_config(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  return model, mesh


def batch(cfg, seed: int = 0) -> dict:
  b = cfg.global_batch_size_to_train_on
  tok = jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, (b, T + 1)), jnp.int32)
  return dict(inputs=tok[:, :-1], targets=tok[:, 1:], inputs_position=jnp.broadcast_to(jnp.arange(T), (b, T)),
              inputs_segmentation=jnp.ones((b, T), jnp.int32), targets_segmentation=jnp.ones((b, T), jnp.int32))


@contextlib.contextmanager
def context(cfg, mesh):
  """MaxText's mesh and logical axis rules, as its trainer sets them."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.logical_axis_rules):
    yield


def loss_and_grads(cfg):
  """``(loss, intermediates), grads`` of MaxText's own pre-training ``loss_fn`` for an NNX model."""
  from maxtext.trainers.pre_train import train as mt_train

  def loss(model, data):
    value, aux = mt_train.loss_fn(model, cfg, dict(data), None, None, is_train=True)
    return value, aux["intermediate_outputs"]

  return lambda model, data: nnx.value_and_grad(loss, has_aux=True)(model, data)
