"""``capture_gemma`` on the installed ``gemma`` package's own attention (3.3.0 on Python 3.11, 4.0.1 on 3.12).

The model is Gemma 3 in small, built from the package's modules as its ``gm.nn.Transformer``
builds it: ``Embedder``, ``Block`` layers ``layer_{i}`` alternating local sliding-window and
global attention (GQA, QK-norm with ``x * (1 + scale)``, RoPE bases 10k and 1M with scale
factor 8 on the global layer, ``query_pre_attn_scalar``), ``RMSNorm``. ``make test`` installs
gemma without its dependencies (Makefile); the two kauldron names its attention imports come
from ``tests/_kauldron_standin`` where kauldron itself (which imports tensorflow) is absent.

Checked, as for the recipes (test_recipes_thirdparty.py):
1. the capture changes no output, and without it nothing is sown;
2. the sown maxima equal NumPy's scaled, masked logits of each attention's recorded inputs;
3. one ``muonclip`` step equals ``muon_adamw`` then the clip rule on the QK-norm scales;
4. after ``qk_clip``, each clipped head's recomputed maximum is <= tau (1 + 1e-5);
5. per-head Muon: every head block of the q, k|v and output einsums is ``newton_schulz`` of
   that head's block of the direction, cut by hand (to 1e-6, rounding, on entries of order 0.1);
6. what the adapter refuses: soft-capped attention, and an attention that no longer masks
   its logits as the adapter reads it (what a moved private API looks like);
7. through ``nn.jit``'s cache (``gm.nn.Transformer.__call__`` is under ``nn.jit``): a captured
   apply after an uncaptured one of the same shapes, also under an outer ``jax.jit``, sows the
   same maxima, and an uncaptured apply after a captured one sows nothing;
8. one ``capture_gemma()`` object entered again, and nested.
"""

from __future__ import annotations

import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muonclip_jax as mc
import muonclip_jax.nn as mcnn
from _gemma_package import import_gemma
from test_recipes import (LR, check_clip_bounds, check_step, flat, replaying_inputs, sown_by_layer,
                          tau_between)
from _exactness import assert_same_math


layers, modules = import_gemma()
HEADS, KV_HEADS, HEAD_DIM, EMBED, VOCAB, T, WINDOW = 4, 2, 8, 12, 32, 8, 4
KINDS = (modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL)  # Gemma 3: local, ..., global
ROPE = {modules.AttentionType.LOCAL_SLIDING: (10_000, 1.0), modules.AttentionType.GLOBAL: (1_000_000, 8.0)}
SCALAR = HEAD_DIM ** -0.5
NS = dict(steps=None, coeffs="polar_express_4", method="auto")  # scale_by_muon's defaults
LAYOUT = mc.GQALayout(
    HEADS, KV_HEADS, HEAD_DIM,
    query=mc.Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
    key=mc.Projection("kv_einsum", leaf="w", axes=("parts", "heads", "in", "head_dim"), parts=("k", "v")),
    out=mc.Projection("attn_vec_einsum", leaf="w", axes=("in", "in", "out")),
    query_norm="_query_norm", key_norm="_key_norm", norm_scale_offset=1.0)


def matrix_axes(params):
  """The MLP's ``gating_einsum`` (a leaf, no ``w`` under it): gate and up stacked, ``(2, hidden, embed)``
  (``transpose_gating_einsum``)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: mc.MatrixAxes((-1,), (-2,)) if "gating_einsum" in jax.tree_util.keystr(path) else None, params)


def gemma3(tokens):
  """gemma's Transformer in small, from its own modules (unscanned ``layer_{i}``, as gemma builds
  it); called inside a compact method, whose module owns the layers."""
  embedder = modules.Embedder(vocab_size=VOCAB, embed_dim=EMBED, name="embedder")
  x = embedder.encode(tokens)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (tokens.shape[0], T, T))
  for i, kind in enumerate(KINDS):
    base, factor = ROPE[kind]
    _, x = modules.Block(
        num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=EMBED, head_dim=HEAD_DIM, hidden_dim=2 * EMBED,
        use_post_attn_norm=True, use_post_ffw_norm=True, attn_type=kind, query_pre_attn_scalar=SCALAR,
        transpose_gating_einsum=True, rope_base_frequency=base, rope_scale_factor=factor,
        sliding_window_size=WINDOW, use_qk_norm=True, name=f"layer_{i}")(x, positions, None, mask)
  return embedder.decode(layers.RMSNorm(name="final_norm")(x))


class Gemma3(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return gemma3(tokens)


def jitted_gemma3():
  """``Gemma3`` with ``__call__`` under ``nn.jit``, as gemma 3.3.0 and 4.0.1 decorate
  ``gm.nn.Transformer.__call__``; a new class each call, so a new ``nn.jit`` cache."""

  class JittedGemma3(nn.Module):
    @functools.partial(nn.jit, static_argnames=("self",))
    @nn.compact
    def __call__(self, tokens):
      return gemma3(tokens)

  return JittedGemma3()


MODEL = Gemma3()


def loss_fn(params, tokens):
  with mcnn.capture_gemma():
    logits, state = MODEL.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), state["intermediates"]


def np_max_logits(attn, kind, x, positions, cache, mask):
  """NumPy (float64) forward of one gemma attention up to its masked logits; per-head max."""
  assert cache is None
  x, positions = np.float64(x), np.float64(positions)
  q = np.einsum("btd,ndh->btnh", x, np.float64(attn["q_einsum"]["w"]))
  k = np.einsum("bsd,kdh->bskh", x, np.float64(attn["kv_einsum"]["w"][0]))

  def rms(y, scale):
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + 1e-6) * (1 + np.float64(scale))

  def rope(y):
    base, factor = ROPE[kind]
    half = y.shape[-1] // 2
    angle = (positions[..., None] / base ** (2 * np.arange(half) / y.shape[-1]) / factor)[..., None, :]
    a, b = y[..., :half], y[..., half:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)

  q = rope(rms(q, attn["_query_norm"]["scale"])) * SCALAR
  k = np.repeat(rope(rms(k, attn["_key_norm"]["scale"])), HEADS // KV_HEADS, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k)
  allowed = np.asarray(mask, bool)
  if kind == modules.AttentionType.LOCAL_SLIDING:
    gap = positions[:, None, :] - positions[:, :, None]  # key position - query position
    allowed = allowed & (np.abs(gap) < WINDOW)
  return np.where(allowed[:, None], s, -np.inf).max(axis=(0, 2, 3))


@pytest.fixture(scope="module")
def measured():
  tokens = (jnp.arange(2 * (T + 1)).reshape(2, T + 1) * 7) % VOCAB
  params = MODEL.init(jax.random.key(0), tokens[:, :-1])["params"]
  params = jax.tree.map(lambda p: p * 3, params)  # larger logits: heads on both sides of a threshold

  @jax.jit
  def run(p, t):
    (_, intermediates), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, t)
    store = {}
    with replaying_inputs(modules.Attention, store, "record"):
      plain = MODEL.apply({"params": p}, t[:, :-1])
    with mcnn.capture_gemma():
      captured, state = MODEL.apply({"params": p}, t[:, :-1], mutable=["intermediates"])
    inputs = {path[0]: args for path, (args, _) in store.items()}
    return intermediates, grads, inputs, plain, captured, state

  return (params, tokens, *run(params, tokens))


def test_capture_changes_no_output_and_sows_only_when_asked(measured):
  params, tokens, intermediates, _, _, plain, captured, state = measured
  assert_same_math(captured, plain)
  assert set(state["intermediates"]) == {"layer_0", "layer_1"}
  assert set(state["intermediates"]["layer_0"]["attn"]) == {"max_logits"}
  _, without = MODEL.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
  assert not jax.tree.leaves(without)  # no capture, nothing sown


def test_maxima_equal_numpys_masked_logits(measured):
  params, _, intermediates, _, inputs, *_ = measured
  maxima = sown_by_layer(intermediates, HEADS)
  want = np.stack([np_max_logits(params[f"layer_{i}"]["attn"], kind, *inputs[f"layer_{i}"])
                   for i, kind in enumerate(KINDS)])
  np.testing.assert_allclose(maxima, want, rtol=2e-5, atol=1e-6)


def test_muonclip_step_and_clip_bound(measured):
  params, tokens, intermediates, grads, *_ = measured
  maxima = sown_by_layer(intermediates, HEADS)
  tau = tau_between(maxima)
  clip = mc.muonclip(LR, layout=LAYOUT, qk_clip_threshold=tau, matrix_axes=matrix_axes)
  plain = mc.muon_adamw(LR, layout=LAYOUT, matrix_axes=matrix_axes)
  u, _ = jax.jit(clip.update)(grads, clip.init(params), params, max_logits=intermediates)
  v, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  p_clip, p_ref = optax.apply_updates(params, u), optax.apply_updates(params, v)
  ref, expected = flat(p_ref), {}
  for i in range(len(KINDS)):  # the norm scale is shared by heads: one factor per layer, sqrt(min gamma), on 1 + scale
    c = np.sqrt(np.where(maxima[i] > tau, tau / maxima[i], 1.0).min())
    for norm in ("_query_norm", "_key_norm"):
      name = f"layer_{i}/attn/{norm}/scale"
      expected[name] = c * (1 + np.float64(ref[name])) - 1
  check_step(p_clip, p_ref, expected)
  # the clip bounds the recomputed maxima; layers without a clipped head keep theirs bit for bit
  tau = tau_between(maxima.max(-1))
  untouched = np.repeat((maxima.max(-1) <= tau)[:, None], HEADS, axis=1)

  def forward(p):  # the capture innermost: the interceptor replaying each layer's inputs runs before it
    with mcnn.capture_gemma():
      return MODEL.apply({"params": p}, tokens[:, :-1], mutable=["intermediates"])[1]["intermediates"]

  check_clip_bounds(forward, modules.Attention, params, intermediates, tau, LAYOUT, HEADS, untouched)


def test_per_head_muon_blocks_are_the_heads_blocks(measured):
  params, _, _, grads, *_ = measured
  einsums = ("q_einsum", "kv_einsum", "attn_vec_einsum")  # the attention's matrices, norms left out
  grads = {f"layer_{i}": {"attn": {e: grads[f"layer_{i}"]["attn"][e] for e in einsums}} for i in range(len(KINDS))}
  opt = mc.scale_by_muon(layout=LAYOUT, muon_blocks="head+out")
  updates = jax.jit(opt.update)(grads, opt.init(grads))[0]

  @jax.jit
  def by_hand(g):  # first Nesterov step: direction G + beta G; each (rows, cols) block scaled by its own shape
    def blocks(x):  # the heads (or parts and heads) of x, stacked by hand
      x = jnp.stack([x[i] for i in range(x.shape[0])])
      return mc.newton_schulz(x, **NS) * 0.2 * math.sqrt(max(x.shape[-2:]))

    out = {}
    for i in range(len(KINDS)):
      a = jax.tree.map(lambda x: x + 0.95 * x, g[f"layer_{i}"]["attn"])
      out[f"layer_{i}/attn/q_einsum/w"] = blocks(a["q_einsum"]["w"])  # (heads, embed, head_dim)
      out[f"layer_{i}/attn/kv_einsum/w"] = blocks(a["kv_einsum"]["w"])  # (k|v, kv_heads, embed, head_dim)
      out[f"layer_{i}/attn/attn_vec_einsum/w"] = blocks(a["attn_vec_einsum"]["w"])  # (heads, head_dim, embed)
    return out

  got = flat(updates)
  for path, want in by_hand(grads).items():  # to rounding: the library batches blocks of several leaves in one call
    np.testing.assert_allclose(got[path], want, rtol=0, atol=1e-6, err_msg=path)


class _SoftCapped(nn.Module):
  @nn.compact
  def __call__(self, x, positions, mask):
    return modules.Attention(num_heads=2, num_kv_heads=2, features=EMBED, head_dim=HEAD_DIM,
                             attn_type=modules.AttentionType.GLOBAL, query_pre_attn_scalar=SCALAR,
                             attn_logits_soft_cap=50.0, name="attn")(x, positions, None, mask)


class _Moved(modules.Attention):
  """What a gemma release computing its logits differently looks like to the adapter."""

  def __call__(self, x, segment_pos, cache, attn_mask):
    return cache, self.attn_vec_einsum("BTNH,NHD->BTD", self.q_einsum("BTD,NDH->BTNH", x))


def test_soft_capped_and_moved_attention_are_refused():
  x, positions = jnp.ones((1, T, EMBED)), jnp.arange(T)[None]
  mask = jnp.tril(jnp.ones((1, T, T), bool))
  variables = _SoftCapped().init(jax.random.key(0), x, positions, mask)
  with mcnn.capture_gemma(), pytest.raises(ValueError, match=r"'attn' soft-caps.*attn_logits_soft_cap=50\.0"):
    _SoftCapped().apply(variables, x, positions, mask, mutable=["intermediates"])
  moved = _Moved(num_heads=2, num_kv_heads=1, features=EMBED, head_dim=HEAD_DIM,
                 attn_type=modules.AttentionType.GLOBAL, query_pre_attn_scalar=SCALAR)
  variables = moved.init(jax.random.key(0), x, positions, None, mask)
  with mcnn.capture_gemma(), pytest.raises(RuntimeError, match=r"did not mask its logits.*gemma 3\.3\.0 and 4\.0\.1"):
    moved.apply(variables, x, positions, None, mask, mutable=["intermediates"])


def test_capture_through_nn_jits_cache(measured):
  """gemma's ``nn.jit`` caches traces by module, mutable collections and shapes: one traced
  outside the capture (an eval step) must not be reused inside it, nor the reverse."""
  params, tokens, intermediates, *_ = measured
  inputs = tokens[:, :-1]

  def captured(model, p):
    with mcnn.capture_gemma():
      return model.apply({"params": p}, inputs, mutable=["intermediates"])

  def uncaptured(model, p):
    return model.apply({"params": p}, inputs, mutable=["intermediates"])

  model = jitted_gemma3()  # an uncaptured apply first, then captured ones of the same shapes
  plain, state = uncaptured(model, params)
  assert not jax.tree.leaves(state)
  eager, want = functools.partial(captured, model), sown_by_layer(intermediates, HEADS)
  for how, run in (("after an uncaptured apply", eager), ("under an outer jax.jit", jax.jit(eager))):
    out, state = run(params)
    assert_same_math(out, plain, how)
    assert_same_math(sown_by_layer(state["intermediates"], HEADS), want, how)
  model = jitted_gemma3()  # the reverse: a captured apply first, then an uncaptured one
  assert_same_math(sown_by_layer(captured(model, params)[1]["intermediates"], HEADS), want)
  out, state = uncaptured(model, params)
  assert not jax.tree.leaves(state)  # plain gemma: nothing sown
  assert_same_math(out, plain)


def test_one_capture_object_enters_again_and_nests():
  attn = modules.Attention(num_heads=2, num_kv_heads=1, features=EMBED, head_dim=HEAD_DIM,
                           attn_type=modules.AttentionType.GLOBAL, query_pre_attn_scalar=SCALAR)
  x, positions = jnp.ones((1, T, EMBED)), jnp.arange(T)[None]
  mask = jnp.tril(jnp.ones((1, T, T), bool))
  variables = attn.init(jax.random.key(0), x, positions, None, mask)

  def sown():
    return attn.apply(variables, x, positions, None, mask, mutable=["intermediates"])[1]

  capture = mcnn.capture_gemma()
  with capture:
    first = sown()
  with capture:  # entered again
    with capture:  # and nested
      nested = sown()
    outer = sown()  # the inner exit leaves the outer capture on
  assert first["intermediates"]["max_logits"].shape == (2,)
  chex.assert_trees_all_equal(nested, first)
  chex.assert_trees_all_equal(outer, first)
  assert not jax.tree.leaves(sown())  # every exit undone
