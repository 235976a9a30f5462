"""``capture_tunix_trainer``: Tunix's ``PeftTrainer`` steps clip with their own batch's max logits.

QK-Clip (Kimi K2, arXiv 2507.20534, Algorithm 1) scales each head whose max logit S_max^h on
the step's batch exceeds tau, right after the optimizer's update. Tunix's train step computes
``nnx.value_and_grad(trainer.loss_fn)(model, **inputs)`` and then calls
``trainer.optimizer.update(model, grads)``, an ``nnx.Optimizer``, with no ``max_logits``.
``capture_tunix_trainer(trainer)`` changes two public attributes of the trainer, and nothing
in Tunix:

* ``trainer.loss_fn`` runs the loss under ``capture_tunix()`` and ``nnx.capture(...,
  nnx.Intermediate)``, and leaves the step's ``{attention: (num_heads,)}`` maxima on the
  model as one NNX variable (NNX hands a variable set inside ``value_and_grad`` back to the
  caller, the step);
* ``trainer.optimizer`` becomes an ``nnx.Optimizer`` whose ``update(model, grads)`` takes
  that variable off the model (so the model's structure, and what Tunix checkpoints, is as
  before) and passes ``max_logits=`` to the optimizer (``muonclip``).

Gradient accumulation: with ``gradient_accumulation_steps=k`` Tunix wraps the optimizer in a
plain ``optax.MultiSteps``, which hands its inner optimizer the arguments of each
micro-step. The optimizer therefore keeps the running maximum over the step's micro-batches
(as ``muonclip_jax.multi_steps`` does) and passes it, so the clip of step ``k`` uses every
micro-batch's maxima; the running maximum restarts when MultiSteps completes a step. It is
an ``nnx.Variable`` outside ``OptState``: Tunix does not checkpoint it (it resumes at step
boundaries, where it is ``-inf``).

Call it once, after ``with_loss_fn`` (which replaces ``trainer.loss_fn``) and before
``train``. ``eval_loss_fn`` is left alone: evaluation captures nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..._clip import check_opt_state, collect_max_logits, merge_max_logits, nest_max_logits, QKClipState
from .tunix import attention_heads, capture_tunix

_STEP = "_muonclip_step_max_logits"  # the attribute of the model that carries one step's maxima


class StepMaxLogits(nnx.Variable):
  """One train step's ``{attention module path: (num_heads,)}`` float32 maxima (never checkpointed)."""


class RunningMaxLogits(nnx.Variable):
  """The maximum over the micro-batches of the current accumulated step (plain ``optax.MultiSteps``)."""


class MaxLogitsOptimizer(nnx.Optimizer):
  """``nnx.Optimizer`` whose ``update(model, grads)`` passes the step's ``max_logits`` (module docstring)."""

  def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
    if "max_logits" in kwargs:
      raise TypeError("capture_tunix_trainer: the optimizer passes max_logits itself; do not pass it to update")
    held = vars(model).get(_STEP)
    if not isinstance(held, StepMaxLogits):
      raise ValueError(
          "capture_tunix_trainer: the model carries no max logits at optimizer.update: trainer.loss_fn is not the "
          "capturing loss. Call capture_tunix_trainer(trainer) after trainer.with_loss_fn(...), which replaces it")
    delattr(model, _STEP)
    maxima = held.get_value()
    if self.running is None:
      return super().update(model, grads, max_logits=nest_max_logits(maxima), **kwargs)
    running = merge_max_logits(self.running.get_value(), maxima)
    updates = super().update(model, grads, max_logits=nest_max_logits(running), **kwargs)
    done = nnx.as_pure(self.opt_state).mini_step == 0  # MultiSteps made the step (and the clip)
    self.running.set_value({m: jnp.where(done, -jnp.inf, v) for m, v in running.items()})
    return updates


def _capturing_loss(loss_fn: Any) -> Any:
  capture = capture_tunix()

  def loss(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    with capture:
      out, intermediates = nnx.capture(loss_fn, nnx.Intermediate)(model, *args, **kwargs)
    setattr(model, _STEP, StepMaxLogits(collect_max_logits(intermediates, "capture_tunix_trainer")))
    return out

  loss.__wrapped__ = loss_fn
  return loss


def capture_tunix_trainer(trainer: Any) -> Any:
  """Makes a Tunix trainer's every step pass its batch's max logits to ``muonclip``; returns ``trainer``.

  For Tunix's ``PeftTrainer`` (``tunix.sft.peft_trainer``) built with ``mc.muonclip(...,
  layout=muonclip_jax.nn.tunix_layout(model))``: see the module docstring for what it
  changes, and ``docs/your-model.md`` ("Tunix") for the recipe::

    trainer = PeftTrainer(model, mc.muonclip(1e-3, layout=mcnn.tunix_layout(model)), config)
    mcnn.capture_tunix_trainer(trainer.with_gen_model_input_fn(gen_inputs))
    trainer.train(train_ds)

  With ``gradient_accumulation_steps`` the clip uses the maximum over the step's
  micro-batches.

  Example:
    >>> import jax, numpy as np
    >>> from flax import nnx
    >>> from tunix.models.llama3 import model as llama3
    >>> from tunix.sft import peft_trainer, utils
    >>> import muonclip_jax as mc, muonclip_jax.nn as mcnn
    >>> config = llama3.ModelConfig(num_layers=1, vocab_size=32, embed_dim=16, hidden_dim=32, num_heads=4,
    ...                             head_dim=8, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6)
    >>> model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    >>> def inputs(x):  # Tunix's model inputs: positions, the causal and padding mask
    ...   mask = x["input_mask"]
    ...   return dict(input_tokens=x["input_tokens"], input_mask=mask, positions=utils.build_positions_from_mask(mask),
    ...               attention_mask=utils.make_causal_attn_mask(mask))
    >>> opt = mc.muonclip(1e-3, layout=mcnn.tunix_layout(model), qk_clip_threshold=1.0)
    >>> trainer = peft_trainer.PeftTrainer(model, opt, peft_trainer.TrainingConfig(eval_every_n_steps=9, max_steps=1))
    >>> trainer = mcnn.capture_tunix_trainer(trainer.with_gen_model_input_fn(inputs))
    >>> batch = {"input_tokens": np.arange(8, dtype=np.int32)[None], "input_mask": np.ones((1, 8), bool)}
    >>> with jax.numpy_rank_promotion("allow"):  # Tunix's RMSNorm broadcasts a (dim,) scale
    ...   trainer.train([batch])
    >>> int(trainer.optimizer.step[...])
    1

  Raises:
    TypeError: ``trainer`` has no ``nnx.Optimizer`` ``optimizer``, NNX ``model`` or callable
      ``loss_fn``; its optimizer is already wired.
    ValueError: its optimizer has no QK-Clip, has a transform after the clip, or has a plain
      ``optax.MultiSteps`` inside it (``check_opt_state``); it updates LoRA adapters, not the
      ``nnx.Param`` kernels; its model holds no Tunix attention.
  """
  opt, model, loss_fn = (getattr(trainer, a, None) for a in ("optimizer", "model", "loss_fn"))
  if not isinstance(opt, nnx.Optimizer) or not isinstance(model, nnx.Module) or not callable(loss_fn):
    raise TypeError("capture_tunix_trainer: trainer must be a Tunix trainer (PeftTrainer) with an nnx.Optimizer "
                    f"`optimizer`, an NNX `model` and a `loss_fn`; got {type(trainer).__name__}")
  if isinstance(opt, MaxLogitsOptimizer):
    raise TypeError("capture_tunix_trainer: this trainer is already wired; call it once")
  if type(opt) is not nnx.Optimizer:
    raise TypeError(f"capture_tunix_trainer: trainer.optimizer is a {type(opt).__name__}, not nnx.Optimizer")
  if opt.wrt is not nnx.Param:
    raise ValueError(
        f"capture_tunix_trainer: the trainer's optimizer updates {opt.wrt!r}, not the nnx.Param kernels whose "
        "heads QK-Clip scales (a LoRA PeftTrainer trains its adapters only); QK-Clip of LoRA training is not "
        "supported")
  state = nnx.as_pure(opt.opt_state)
  accumulates = isinstance(opt.tx, optax.MultiSteps)
  inner = state.inner_opt_state if accumulates else state
  check_opt_state(inner, caller="capture_tunix_trainer")
  if not any(isinstance(x, QKClipState) for x in jax.tree.leaves(inner, is_leaf=lambda x: isinstance(x, QKClipState))):
    raise ValueError("capture_tunix_trainer: the trainer's optimizer has no QK-Clip (build it with mc.muonclip or "
                     "mc.qk_clip_transform); without one there are no max logits to pass")
  heads = attention_heads(model)
  trainer.loss_fn = _capturing_loss(loss_fn)
  opt.__class__ = MaxLogitsOptimizer  # keeps its state, restored checkpoint included
  opt.running = RunningMaxLogits({m: jnp.full((h,), -jnp.inf, jnp.float32) for m, h in heads.items()}) \
      if accumulates else None
  if hasattr(trainer, "clear_jit_cache"):
    trainer.clear_jit_cache()
  return trainer
