"""What the Hugging Face Flax recipes share: forward with capture, the train step, the loop.

Each recipe (``recipe_hf_llama.py``, ``recipe_hf_gpt2.py``) keeps its patch line, its
config and its layout; the two MuonClip lines every HF model needs beyond those are here,
marked ``# MuonClip (3/4)`` and ``(4/4)``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from _recipe_common import batches, train


def forward(params, module, tokens):
  """Logits and the sown max logits of Hugging Face's Linen module."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
  out, state = module.apply({"params": params}, tokens, jnp.ones_like(tokens), positions,
                            mutable=["intermediates"])  # MuonClip (3/4): capture the max logits
  return out.logits, state["intermediates"]


def loss_fn(params, module, tokens):
  logits, intermediates = forward(params, module, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), intermediates


def make_step(module, opt: optax.GradientTransformationExtraArgs):
  @jax.jit
  def step(params, opt_state, tokens):
    (loss, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, module, tokens)
    updates, opt_state = opt.update(grads, opt_state, params, max_logits=intermediates)  # MuonClip (4/4)
    return optax.apply_updates(params, updates), opt_state, loss, intermediates

  return step


def main(recipe, argv=None):
  """Trains ``recipe``'s model (its ``Config``, ``model_and_params`` and ``optimizer``)."""
  parser = argparse.ArgumentParser(description=recipe.__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args(argv)
  cfg = recipe.Config()
  (module, params), opt = recipe.model_and_params(cfg), recipe.optimizer(cfg)
  opt_state, jitted = opt.init(params), make_step(module, opt)

  def step(tokens):
    nonlocal params, opt_state
    params, opt_state, loss, intermediates = jitted(params, opt_state, tokens)
    return loss, intermediates

  train(step, batches(cfg, batch_size=8), args.steps)
