"""``capture_tunix``, ``tunix_layout`` and ``capture_tunix_trainer`` on the installed Tunix (google-tunix 0.1.7).

Tiny models of Tunix's own code (2 layers, 4 query heads): Llama 3 and Qwen 3 (GQA 4/2; Qwen 3
with QK-norm ``q_norm/w``), Gemma (``qkv_einsum`` with 4 kv heads, ``q_einsum``/``kv_einsum``
with 2 or 1) and Gemma 3 (the same, with QK-norm ``_query_norm/scale``, ``x * (1 + scale)``, and
the query scale 1/sqrt(embed_dim / heads)), both Gemmas with a local sliding-window layer and a
global one; and Qwen3-MoE (4 experts, top-2), trained by Tunix's own ``PeftTrainer`` train
step with ``mc.muonclip``. Checked against NumPy:
1. the sown maxima equal NumPy's scaled logits of the q and k reaching each attention, masked
   causally, for padding and by a local layer's sliding window, heads in the query
   projection's order;
2. in the trainer, the clip of each step uses that step's maxima (its ``min_gamma`` is
   ``tau / max`` of NumPy's), and after it, on the inputs it was measured on, every clipped
   head's recomputed maximum is <= tau (1 + 1e-5), each clipped layer's hottest head lands at
   tau (the clip is no silent no-op, QK-norm included), and heads the clip does not reach
   are unchanged;
3. each expert is its own Muon matrix: an expert's update equals ``mc.muon_adamw`` on that
   expert's gradient alone;
4. Tunix's gradient accumulation (a plain ``optax.MultiSteps``) clips with the maximum over
   the micro-batches, not the last one's;
5. what the adapter refuses: a Tunix attention that no longer masks as it reads (a moved
   private API), soft-capped attention, a trainer without a clip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
from _tunix_package import (batch, expert_matrix_axes, maxima_on_inputs_before, model_inputs, numpy_maxima,
                            params_of, tiny)

from tunix.sft import peft_trainer  # both suites install Tunix (Makefile): a missing one fails here
from muonclip_jax.nn._capture.tunix import tunix_families  # the adapter's list of what it reads


@pytest.fixture(autouse=True)
def _tunix_promotes_ranks():
  """Tunix's own RMSNorm multiplies a (dim,) scale into (batch, seq, dim): allowed here, not in conftest."""
  with jax.numpy_rank_promotion("allow"):
    yield


def _captured(model, x) -> list[np.ndarray]:
  inputs = model_inputs(x)
  with mcnn.capture_tunix():
    _, inter = nnx.capture(model, nnx.Intermediate)(
        inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])
  return [np.asarray(inter["layers"][i]["attn"]["max_logits"]) for i in range(len(model.layers))]


def _clip_state(trainer) -> mc.QKClipState:
  state = nnx.as_pure(trainer.optimizer.opt_state)
  return next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, mc.QKClipState))
              if isinstance(x, mc.QKClipState))


def _trainer(model, tau, *, lr=0.0, accumulate=None, matrix_axes=None):
  opt = mc.muonclip(lr, layout=mcnn.tunix_layout(model), qk_clip_threshold=tau, weight_decay=0.0,
                    matrix_axes=matrix_axes)
  config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=2, gradient_accumulation_steps=accumulate)
  trainer = peft_trainer.PeftTrainer(model, opt, config).with_gen_model_input_fn(model_inputs)
  return mcnn.capture_tunix_trainer(trainer)


# id -> (family, tiny's keywords): every attention form of Tunix's Llama 3, Qwen 3, Gemma and Gemma 3.
MODELS = {"llama3": ("llama3", {}), "qwen3": ("qwen3", {}),
          "gemma-mha": ("gemma", dict(kv_heads=4)), "gemma-gqa": ("gemma", dict(kv_heads=2)),
          "gemma-mqa": ("gemma", dict(kv_heads=1)),
          "gemma3-mha": ("gemma3", dict(kv_heads=4)), "gemma3-gqa": ("gemma3", dict(kv_heads=2))}
QK_NORM = {"qwen3", "gemma3"}  # a norm scale shared by heads: the clip shrinks the whole layer


@pytest.mark.parametrize("name", list(MODELS))
def test_captured_maxima_are_numpys_masked_logits(name, monkeypatch):
  family, kw = MODELS[name]
  model = tiny(family, **kw)
  x = batch(3)  # a batch whose maxima the window and the padding change
  got, want = _captured(model, x), numpy_maxima(model, x, monkeypatch)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)
  if family.startswith("gemma"):  # layer 0 is local: its window hides keys that would give other maxima
    assert [layer.attn.attn_type.name for layer in model.layers] == ["LOCAL_SLIDING", "GLOBAL"]
    unwindowed = numpy_maxima(model, x, monkeypatch, window=False)
    assert not np.allclose(got[0], unwindowed[0])
    np.testing.assert_allclose(unwindowed[1], want[1])
  x_unpadded = batch(3, pad=0)  # the padding is honoured: the maxima differ once padded keys count
  assert any(not np.allclose(a, b) for a, b in zip(got, _captured(model, x_unpadded)))
  _, inter = nnx.capture(model, nnx.Intermediate)(*[model_inputs(x)[k] for k in ("input_tokens", "positions")],
                                                  None, model_inputs(x)["attention_mask"])
  assert "max_logits" not in str(inter)  # outside the capture nothing is sown


def test_gemma3_layout_declares_its_qk_norm():
  layout = mcnn.tunix_layout(tiny("gemma3", kv_heads=2))
  assert (layout.num_heads, layout.num_kv_heads, layout.head_dim) == (4, 2, 8)
  assert (layout.query_norm, layout.key_norm, layout.norm_scale_offset) == ("_query_norm/scale", "_key_norm/scale", 1.0)
  mha = mcnn.tunix_layout(tiny("gemma", kv_heads=4))
  assert mha.qkv.name == "qkv_einsum" and mha.query_norm is None


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma-mha", "gemma-gqa", "gemma3-gqa"])
def test_peft_trainer_clips_with_the_steps_own_maxima(name, monkeypatch):
  """lr 0: the trainer's steps change the weights by the clip alone."""
  family, kw = MODELS[name]
  model = tiny(family, seed=1, **kw)
  group = mcnn.tunix_layout(model).group_size
  b1, b2 = batch(1), batch(2)
  s1 = numpy_maxima(model, b1, monkeypatch)
  tau = float(np.median(np.concatenate(s1)))
  trainer = _trainer(model, tau)
  step, _ = trainer.jit_train_and_eval_step()
  before = params_of(model)
  step(b1)
  state = _clip_state(trainer)
  hot = np.concatenate(s1) > tau
  assert int(state.num_clipped) == hot.sum() > 0
  np.testing.assert_allclose(float(state.min_gamma), tau / np.concatenate(s1).max(), rtol=1e-5)
  after = maxima_on_inputs_before(model, before, b1, monkeypatch)
  for layer, (old, new) in enumerate(zip(s1, after)):
    assert np.all(new[old > tau] <= tau * (1 + 1e-5)), (layer, old, new, tau)
    if not np.any(old > tau):  # a layer the clip did not reach is unchanged
      np.testing.assert_allclose(new, old, rtol=1e-6)
      continue
    np.testing.assert_allclose(new[old.argmax()], tau, rtol=1e-5)  # the hottest head lands at tau: no silent no-op
    if family not in QK_NORM:  # per-head kernels: a key group without a clipped head is untouched ("split")
      for g in range(len(old) // group):
        heads = slice(g * group, (g + 1) * group)
        if not np.any(old[heads] > tau):
          np.testing.assert_allclose(new[heads], old[heads], rtol=1e-6)
  s2 = numpy_maxima(model, b2, monkeypatch)
  step(b2)  # the second step clips with the second batch's maxima
  assert int(_clip_state(trainer).count) == 2
  top2 = np.concatenate(s2).max()
  np.testing.assert_allclose(float(_clip_state(trainer).min_gamma), min(1.0, tau / top2), rtol=1e-5)
  assert "_muonclip_step_max_logits" not in vars(model)  # the model's structure is as before
  assert set(jax.tree.leaves(jax.tree.map(lambda a: a.shape, before))) == set(
      jax.tree.leaves(jax.tree.map(lambda a: a.shape, params_of(model))))


def test_qwen3_moe_each_expert_is_its_own_muon_matrix():
  """Qwen3-MoE trained 2 steps by PeftTrainer.train; the first step's expert updates against muon_adamw."""
  model = tiny("qwen3", experts=True, seed=2)
  lr = 1e-2
  x = batch(3)
  inputs = model_inputs(x)
  trainer = _trainer(model, float("inf"), lr=lr, matrix_axes=expert_matrix_axes)
  loss = lambda m: trainer.loss_fn.__wrapped__(m, **inputs)  # noqa: E731  (Tunix's own loss, before the capture)
  grads = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(model)))  # eager: hundreds of compiles
  before = params_of(model)
  step, _ = trainer.jit_train_and_eval_step()
  step(x)
  after = params_of(model)
  ref = mc.muon_adamw(lr, weight_decay=0.0)
  ref_update = jax.jit(ref.update)  # one compile per shape (eagerly, each call compiled its loop anew)
  for layer in (0, 1):
    for name in ("gate_proj", "up_proj", "down_proj"):
      w0, w1, g = (t["layers"][layer]["mlp"][name] for t in (before, after, grads))
      assert w0.shape[0] == 4
      for e in range(4):
        leaf = {"w": jnp.asarray(g[e])}
        u, _ = ref_update(leaf, ref.init(leaf), {"w": jnp.asarray(w0[e])})
        np.testing.assert_allclose(w1[e] - w0[e], np.asarray(u["w"]), rtol=2e-3, atol=2e-3 * np.abs(u["w"]).max(),
                                   err_msg=f"layer {layer} {name} expert {e}")
  trainer.train([batch(4)])  # Tunix's own loop runs a further step
  assert int(trainer.optimizer.step[...]) == 2 and int(_clip_state(trainer).count) == 2


def test_gradient_accumulation_clips_with_every_micro_batchs_maxima(monkeypatch):
  model = tiny("llama3", seed=3)
  b1, b2 = batch(5), batch(6)
  s1, s2 = (np.concatenate(numpy_maxima(model, b, monkeypatch)) for b in (b1, b2))
  first, last = (b1, b2) if s1.max() > s2.max() else (b2, b1)  # the larger maximum in the first micro-batch
  top, last_top = max(s1.max(), s2.max()), min(s1.max(), s2.max())
  tau = 0.5 * (top + last_top) if top > last_top * 1.01 else 0.9 * last_top
  trainer = _trainer(model, tau, accumulate=2)
  step, _ = trainer.jit_train_and_eval_step()
  before = params_of(model)
  step(first)
  assert int(_clip_state(trainer).count) == 0  # MultiSteps: no step yet
  step(last)
  state = _clip_state(trainer)
  assert int(state.count) == 1
  # the maximum over both micro-batches (the last one's alone would give tau / last_top)
  np.testing.assert_allclose(float(state.min_gamma), tau / top, rtol=1e-5)
  after = np.concatenate(maxima_on_inputs_before(model, before, first, monkeypatch))
  assert after.max() <= tau * (1 + 1e-5)
  # the running maximum starts again: the next step's clip sees its own micro-batches only
  b3, b4 = batch(7), batch(8)
  top2 = max(np.concatenate(numpy_maxima(model, b, monkeypatch)).max() for b in (b3, b4))
  step(b3)
  step(b4)
  state = _clip_state(trainer)
  assert int(state.count) == 2 and abs(top2 - top) > 1e-3 * top
  np.testing.assert_allclose(float(state.min_gamma), min(1.0, tau / top2), rtol=1e-5)


def test_a_moved_tunix_attention_is_refused(monkeypatch):
  """What a moved private API looks like: an Attention.block that no longer masks with K_MASK."""
  from tunix.models.llama3 import model as llama3
  families = tunix_families()
  assert {c.__module__ for c in families} == {"tunix.models.llama3.model", "tunix.models.qwen3.model",
                                              "tunix.models.gemma.model", "tunix.models.gemma3.model"}
  model = tiny("llama3")
  inputs = model_inputs(batch(0))
  monkeypatch.setattr(llama3.Attention, "block", _without_mask(llama3.Attention.block))
  with pytest.raises(RuntimeError, match="did not mask its logits"):
    with mcnn.capture_tunix():
      nnx.capture(model, nnx.Intermediate)(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])


def _without_mask(block):
  """Tunix's own ``block`` masking with another constant than its module's ``K_MASK``."""
  import types
  g = {**block.__globals__, "K_MASK": -3.0e38}
  return types.FunctionType(block.__code__, g, block.__name__, block.__defaults__, block.__closure__)


def test_soft_capped_gemma_is_refused():
  from tunix.models.gemma import model as gemma
  config = gemma.ModelConfig(num_layers=1, num_embed=32, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
                             num_kv_heads=2, final_logit_softcap=None, use_post_attn_norm=False,
                             use_post_ffw_norm=False, attention_types=(gemma.AttentionType.GLOBAL,),
                             attn_logits_soft_cap=50.0)
  model = gemma.Gemma(config, rngs=nnx.Rngs(0))
  tokens, positions = jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None]
  causal = jnp.tril(jnp.ones((1, 4, 4), bool))
  with pytest.raises(ValueError, match="soft-caps its logits"):
    with mcnn.capture_tunix():
      nnx.capture(model, nnx.Intermediate)(tokens, positions, None, causal)


def test_trainer_without_a_clip_is_refused():
  model = tiny("llama3")
  config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=1)
  trainer = peft_trainer.PeftTrainer(model, mc.muon_adamw(1e-3, layout=mcnn.tunix_layout(model)), config)
  with pytest.raises(ValueError, match="has no QK-Clip"):
    mcnn.capture_tunix_trainer(trainer)
  with pytest.raises(TypeError, match="must be a Tunix trainer"):
    mcnn.capture_tunix_trainer(object())
  # a LoRA PeftTrainer's optimizer updates its adapters (wrt=nnx.LoRAParam), never the kernels the clip scales
  lora = peft_trainer.PeftTrainer(model, mc.muonclip(1e-3, layout=mcnn.tunix_layout(model)), config)
  lora.optimizer = nnx.Optimizer(model, mc.muonclip(1e-3, layout=mcnn.tunix_layout(model)), wrt=nnx.LoRAParam)
  with pytest.raises(ValueError, match="LoRAParam.*not the nnx.Param kernels"):
    mcnn.capture_tunix_trainer(lora)
