"""Per-head Muon from the layout (Kimi K3, GLM-5's Muon Split): ``muon_blocks`` and the layout
as Muon's one declaration.

The reference slices each head's block (or each part) out of the update direction by hand,
per storage form, runs the library's own ``newton_schulz`` on the stacked blocks and scales
each block by Moonlight's ``0.2 sqrt(max(rows, cols))`` of its own shape. The blocks here
are ``12 x 8``-like (aspect below 2), where ``newton_schulz`` runs its standard iteration,
and the update equals the reference as two separately compiled programs do
(``_exactness.assert_same_math``); Gram Newton–Schulz (aspect >= 2) rounds differently when its
input's memory layout differs, which ``test_gram_blocks_match_to_a_tolerance`` bounds.
"""

from __future__ import annotations

import math
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import muonclip_jax as mc
from muonclip_jax import newton_schulz
from _exactness import assert_same_math

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

H, HKV, D, IN, L = 2, 1, 8, 12, 2  # blocks 12 x 8: the standard iteration (aspect < 2)
NOPE, ROPE, V = 4, 4, 6  # MLA: wq_b blocks 12 x 8, wkv_b blocks 12 x 10
NS = dict(steps=None, coeffs="polar_express_4", method="auto")  # scale_by_muon's defaults
BETA = 0.95


def _scale(r, c):
  return 0.2 * math.sqrt(max(r, c))


def _direction(g):
  return g + BETA * g  # first Nesterov step: M_1 = G, direction G + beta M_1


def _ns_blocks(blocks):
  """``newton_schulz`` of a stack of by-hand blocks ``(..., rows, cols)``, each scaled by its own shape."""
  return newton_schulz(blocks, **NS) * _scale(*blocks.shape[-2:])


def _cols(x, h, w):
  return x[..., h * w:(h + 1) * w]


def _rows(x, h, w):
  return x[..., h * w:(h + 1) * w, :]


# ----------------------------------------------------------------------------- every storage form

def _gqa(**kw):
  return mc.GQALayout(H, HKV, D, **kw)


def _forms():
  """{module: (layout, {leaf: shape}, {leaf: by-hand reference of the per-head update})}."""
  qkv = (H + 2 * HKV) * D
  decl = mc.Projection
  forms = {
      # 2-D head-major (in, heads * D): q, k, v, and the output projection (heads * D, out)
      "dense": (_gqa(value="wv", out="wo"),
                {"wq": (IN, H * D), "wk": (IN, HKV * D), "wv": (IN, HKV * D), "wo": (H * D, IN)},
                {"wq": lambda d: _by_cols(d, H), "wk": lambda d: _by_cols(d, HKV), "wv": lambda d: _by_cols(d, HKV),
                 "wo": None}),
      # DenseGeneral (in, heads, D), Flax's names
      "general": (_gqa(query="query", key="key"),
                  {"query": (IN, H, D), "key": (IN, HKV, D), "value": (IN, HKV, D), "out": (H, D, IN)},
                  {"query": lambda d: _by_axis(d, 1), "key": lambda d: _by_axis(d, 1),
                   "value": lambda d: _by_axis(d, 1), "out": None}),
      # Gemma: heads-first einsums, fused k|v (2, kv_heads, in, D)
      "gemma": (_gqa(query=decl("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
                     key=decl("kv_einsum", leaf="w", axes=("parts", "heads", "in", "head_dim"), parts=("k", "v")),
                     out=decl("attn_vec_einsum", leaf="w", axes=("in", "in", "out"))),
                {"q_einsum/w": (H, IN, D), "kv_einsum/w": (2, HKV, IN, D), "attn_vec_einsum/w": (H, D, IN)},
                {"q_einsum/w": lambda d: _ns_blocks(jnp.stack([d[h] for h in range(H)])),
                 "kv_einsum/w": lambda d: _ns_blocks(jnp.stack([d[p, h] for p in range(2) for h in range(HKV)]))
                                          .reshape(2, HKV, IN, D),
                 "attn_vec_einsum/w": None}),
      # torch-style (out, in), declared
      "torch": (_gqa(query=decl("q", axes=("out", "in")), key=decl("k", axes=("out", "in")), value=None,
                          out=None),
                {"q/kernel": (H * D, IN), "k/kernel": (HKV * D, IN)},
                {"q/kernel": lambda d: _by_rows(d, H), "k/kernel": lambda d: _by_rows(d, HKV)}),
      # fused q|k|v in 2-D, H != Hkv: q heads, then k heads, then v heads, each head-major
      "fused2d": (_gqa(qkv="c_attn", out=None), {"c_attn": (IN, qkv)}, {"c_attn": lambda d: _by_cols(d, H + 2 * HKV)}),
      # fused (in, 3, H, D) (needs Hkv == H)
      "fused3": (mc.GQALayout(H, H, D, qkv="qkv", out=None), {"qkv": (IN, 3, H, D)},
                 {"qkv": lambda d: jnp.stack([_by_axis(d[:, p], 1) for p in range(3)], axis=1)}),
      # MaxText: layer axis at position 1, (in, layers, heads, D), declared
      "maxtext": (_gqa(query=decl("query", axes=("in", "layers", "heads", "head_dim")),
                       key=decl("key", axes=("in", "layers", "heads", "head_dim")), value=None, out=None),
                  {"query/kernel": (IN, L, H, D), "key/kernel": (IN, L, HKV, D)},
                  {"query/kernel": lambda d: jnp.stack([_by_axis(d[:, i], 1) for i in range(L)], axis=1),
                   "key/kernel": lambda d: jnp.stack([_by_axis(d[:, i], 1) for i in range(L)], axis=1)}),
      # nn.scan stacks of 2-D kernels: (layers, in, heads * D)
      "scan": (_gqa(value="wv", out=None), {"wq": (L, IN, H * D), "wk": (L, IN, HKV * D), "wv": (L, IN, HKV * D)},
               {"wq": _per_layer(lambda d: _by_cols(d, H)), "wk": _per_layer(lambda d: _by_cols(d, HKV)),
                "wv": _per_layer(lambda d: _by_cols(d, HKV))}),
      # MLA: wq_b (q_lora, H (nope + rope)), wkv_b (kv_lora, H (nope + v)), wo (H v, dim)
      "mla": (mc.MLALayout(H, NOPE, ROPE, V, out="wo"),
              {"wq_b": (IN, H * (NOPE + ROPE)), "wkv_b": (IN, H * (NOPE + V)), "wo": (H * V, IN)},
              {"wq_b": lambda d: _by_cols(d, H), "wkv_b": lambda d: _by_cols(d, H), "wo": None}),
  }
  return forms


def _per_layer(fn):
  """``fn`` on each layer of a stack (the update orthogonalizes ``ns_batch`` = 1 layer per call)."""
  return lambda d: jnp.stack([fn(d[i]) for i in range(d.shape[0])])


def _by_cols(d, heads):
  """Per head: columns ``[h w, (h + 1) w)`` of ``(in, heads * w)``, by hand."""
  w = d.shape[-1] // heads
  blocks = jnp.stack([_cols(d, h, w) for h in range(heads)])  # (heads, ..., in, w)
  out = _ns_blocks(blocks)
  return jnp.concatenate([out[h] for h in range(heads)], axis=-1)


def _by_rows(d, heads):
  """Torch-style ``(heads * w, in)``: head h's rows, its ``w x in`` block (the transpose of its matrix)."""
  w = d.shape[-2] // heads
  return jnp.concatenate(list(_ns_blocks(jnp.stack([_rows(d, h, w) for h in range(heads)]))), axis=0)


def _by_axis(d, axis):
  """DenseGeneral ``(in, heads, w)``: head h is ``d[:, h]``."""
  out = _ns_blocks(jnp.stack([jnp.take(d, h, axis=axis) for h in range(d.shape[axis])]))
  return jnp.stack(list(out), axis=axis)


def _out_by_heads(d, heads, form):
  """The output projection per head: ``(heads * w, out)`` rows or ``(heads, w, out)``."""
  if form == "rows":
    w = d.shape[0] // heads
    out = _ns_blocks(jnp.stack([_rows(d, h, w) for h in range(heads)]))
    return jnp.concatenate(list(out), axis=0)
  return _ns_blocks(jnp.stack([d[h] for h in range(heads)]))


_OUT = {("dense", "wo"): (H, "rows"), ("general", "out"): (H, "stack"), ("gemma", "attn_vec_einsum/w"): (H, "stack"),
        ("mla", "wo"): (H, "rows")}


def _nest(flat):
  tree = {}
  for path, x in flat.items():
    node = tree
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = x
  return tree


def _tree_of_forms(rng):
  forms = _forms()
  flat = {}
  for module, (_, shapes, _) in forms.items():
    for leaf, shape in shapes.items():
      name = leaf if "/" in leaf else f"{leaf}/kernel"
      flat[f"{module}/{name}"] = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return _nest(flat), {m: lay for m, (lay, _, _) in forms.items()}


def _get(tree, path):
  for p in path.split("/"):
    tree = tree[p]
  return tree


@pytest.fixture(scope="module")
def forms_and_updates():
  params, layout = _tree_of_forms(np.random.default_rng(0))
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  out = {}
  for blocks in ("head+out", "matrix"):
    opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks)
    out[blocks] = jax.jit(opt.update)(grads, opt.init(params))[0]
  return params, grads, layout, out


def test_per_head_equals_the_by_hand_reference_for_every_storage_form(forms_and_updates):
  _, grads, _, out = forms_and_updates
  forms = _forms()

  def reference(grads):
    ref = {}
    for module, (_, shapes, per_head) in forms.items():
      for leaf in shapes:
        name = leaf if "/" in leaf else f"{leaf}/kernel"
        d = _direction(_get(grads, f"{module}/{name}"))
        fn = per_head[leaf]
        ref[f"{module}/{name}"] = fn(d) if fn is not None else _out_by_heads(d, *_OUT[module, leaf])
    return ref

  ref = jax.jit(reference)(grads)
  assert len(ref) == 23
  for path, want in ref.items():
    got = _get(out["head+out"], path)
    assert got.shape == want.shape, path
    assert_same_math(np.asarray(got), np.asarray(want), err_msg=path)
    one_head = re.search(r"/(wk|wv|key|value|k)/", path) and "gemma" not in path  # HKV = 1: a head is the matrix
    assert np.allclose(got, _get(out["matrix"], path), atol=1e-3) == bool(one_head), path


def test_part_blocks_equal_the_by_hand_parts():
  """"part": fused q|k|v as q, k, v (equal parts batched, unequal ones sliced), Gemma's k|v, MLA's k_nope | v."""
  rng = np.random.default_rng(1)
  params = {"fused2d": {"c_attn": {"kernel": rng.standard_normal((IN, (H + 2 * HKV) * D))}},  # q 12x16, k, v 12x8
            "fused_eq": {"c_attn": {"kernel": rng.standard_normal((IN, 3 * HKV * D))}},  # 3 equal parts
            "gemma": {"q": {"w": rng.standard_normal((H, IN, D))}, "kv": {"w": rng.standard_normal((2, HKV, IN, D))}},
            "mla": {"wq_b": {"kernel": rng.standard_normal((IN, H * (NOPE + ROPE)))},
                    "wkv_b": {"kernel": rng.standard_normal((IN, H * (NOPE + V)))}}}
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  decl = mc.Projection
  layout = {"fused2d": mc.GQALayout(H, HKV, D, qkv="c_attn"), "fused_eq": mc.GQALayout(HKV, HKV, D, qkv="c_attn"),
            "gemma": mc.GQALayout(H, HKV, D, query=decl("q", leaf="w", axes=("heads", "in", "head_dim")),
                                  key=decl("kv", leaf="w", axes=("parts", "heads", "in", "head_dim"), parts=("k", "v"))),
            "mla": mc.MLALayout(H, NOPE, ROPE, V)}
  grads = jax.tree.map(jnp.sin, params)
  opt = mc.scale_by_muon(layout=layout, muon_blocks="part")
  got = jax.jit(opt.update)(grads, opt.init(params))[0]

  def whole(x):  # one matrix (in, out)
    return _ns_blocks(x[None])[0]

  def reference(grads):
    d = jax.tree.map(_direction, grads)
    c = d["fused2d"]["c_attn"]["kernel"]
    q, k, v = c[:, :H * D], c[:, H * D:(H + HKV) * D], c[:, (H + HKV) * D:]
    e = d["fused_eq"]["c_attn"]["kernel"]
    eq = _ns_blocks(jnp.stack([e[:, p * D:(p + 1) * D] for p in range(3)]))
    kv = d["gemma"]["kv"]["w"]  # (2, kv_heads, in, D): k and v, each one in x kv_heads*D matrix
    parts = [whole(jnp.concatenate([kv[p, h] for h in range(HKV)], axis=-1)) for p in range(2)]
    w = d["mla"]["wkv_b"]["kernel"].reshape(IN, H, NOPE + V)
    k_nope = whole(w[:, :, :NOPE].reshape(IN, H * NOPE)).reshape(IN, H, NOPE)
    v_cols = whole(w[:, :, NOPE:].reshape(IN, H * V)).reshape(IN, H, V)
    return {"fused2d": jnp.concatenate([whole(q), whole(k), whole(v)], axis=1),
            "fused_eq": jnp.concatenate(list(eq), axis=1),
            "gemma_q": _ns_blocks(d["gemma"]["q"]["w"].transpose(1, 0, 2).reshape(1, IN, H * D))[0],
            "gemma_kv": jnp.stack([jnp.stack([parts[p][:, h * D:(h + 1) * D] for h in range(HKV)]) for p in range(2)]),
            "wq_b": whole(d["mla"]["wq_b"]["kernel"]),
            "wkv_b": jnp.concatenate([k_nope, v_cols], axis=-1).reshape(IN, -1)}

  ref = jax.jit(reference)(grads)
  pairs = {"fused2d": got["fused2d"]["c_attn"]["kernel"], "fused_eq": got["fused_eq"]["c_attn"]["kernel"],
           "gemma_q": got["gemma"]["q"]["w"].transpose(1, 0, 2).reshape(IN, H * D), "gemma_kv": got["gemma"]["kv"]["w"],
           "wq_b": got["mla"]["wq_b"]["kernel"], "wkv_b": got["mla"]["wkv_b"]["kernel"]}
  for name, x in pairs.items():
    np.testing.assert_allclose(np.asarray(x), np.asarray(ref[name]), rtol=0, atol=2e-6, err_msg=name)


def test_gram_blocks_match_to_a_tolerance():
  """Blocks of aspect >= 2 run Gram Newton–Schulz, whose float32 rounding depends on the memory
  layout of its input (the batched view vs the by-hand stack): measured 5e-6 on entries ~0.4,
  about 60 ulps of the largest entry; the mathematics is the same."""
  lay = mc.GQALayout(2, 2, 8, value=None)
  g = {"wq": {"kernel": jnp.asarray(np.random.default_rng(2).standard_normal((24, 16)), jnp.float32)}}
  g["wk"] = {"kernel": g["wq"]["kernel"][::-1]}
  opt = mc.scale_by_muon(layout=lay, muon_blocks="head")
  got = jax.jit(opt.update)(g, opt.init(g))[0]["wq"]["kernel"]
  want = jax.jit(lambda d: _by_cols(_direction(d), 2))(g["wq"]["kernel"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- head groups (Group Muon)

GH, GKV = 4, 2  # 4 query heads, 2 key/value heads: GQA groups of 2 query heads; blocks 12 x 8 and 12 x 16


def _ns_each(blocks):
  """By-hand blocks orthogonalized, those of one shape stacked in one call, each scaled by its shape."""
  out = list(blocks)
  for shape in {b.shape for b in blocks}:
    at = [i for i, b in enumerate(blocks) if b.shape == shape]
    for i, y in zip(at, _ns_blocks(jnp.stack([blocks[i] for i in at]))):
      out[i] = y
  return out


def _along(d, axis, ks, width=D):
  """Flattened head-major ``axis`` (-1: columns, -2: rows) cut into runs ``ks`` = [(heads, k), ...]:
  every ``k`` consecutive heads (of ``width`` each) of a run one block."""
  cuts, start = [], 0
  for heads, k in ks:
    for _ in range(heads // k):
      cuts.append(jax.lax.slice_in_dim(d, start, start + k * width, axis=d.ndim + axis))
      start += k * width
  return jnp.concatenate(_ns_each(cuts), axis=d.ndim + axis)


def _heads_axis(d, heads, k, to_matrix, from_matrix):
  """A heads axis first (after ``to_matrix``'s view): groups of ``k`` heads as ``to_matrix(d[s:s + k])``."""
  return jnp.concatenate([from_matrix(m) for m in _ns_each([to_matrix(d[s:s + k]) for s in range(0, heads, k)])])


def _group_reference(d, kq, kkv):
  """By-hand per-group update of every kernel of ``_group_params``: query heads (and the output
  projection's) in groups of ``kq``, key/value heads in groups of ``kkv``."""
  q, kv = (GH, kq), (GKV, kkv)
  first = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731  (in, H, D) -> (H, in, D)
  ref = {
      "dense": {"wq": _along(d["dense"]["wq"], -1, [q]), "wk": _along(d["dense"]["wk"], -1, [kv]),
                "wv": _along(d["dense"]["wv"], -1, [kv]), "wo": _along(d["dense"]["wo"], -2, [q])},
      "torch": {"q": _along(d["torch"]["q"], -2, [q]), "k": _along(d["torch"]["k"], -2, [kv]),
                "v": _along(d["torch"]["v"], -2, [kv]), "o": _along(d["torch"]["o"], -1, [q])},
      "fused": {"c_attn": _along(d["fused"]["c_attn"], -1, [q, kv, kv])},
      "scan": {n: jnp.stack([_along(x, -1, [q if n == "wq" else kv]) for x in d["scan"][n]]) for n in ("wq", "wk")},
  }
  heads_first = lambda k: lambda x: jnp.moveaxis(x, 0, 1).reshape(IN, k * D)  # noqa: E731  (k, in, D) -> (in, k D)
  back = lambda k: lambda m: jnp.moveaxis(m.reshape(IN, k, D), 1, 0)  # noqa: E731
  general = {n: first(_heads_axis(first(d["general"][n]), h, k, heads_first(k), back(k)))
             for n, (h, k) in (("query", q), ("key", kv), ("value", kv))}
  general["out"] = _heads_axis(d["general"]["out"], GH, kq, lambda x: x.reshape(kq * D, IN),
                               lambda m: m.reshape(kq, D, IN))
  ref["general"] = general
  ref["gemma"] = {"q": _heads_axis(d["gemma"]["q"], GH, kq, heads_first(kq), back(kq)),
                  "kv": jnp.stack([_heads_axis(d["gemma"]["kv"][p], GKV, kkv, heads_first(kkv), back(kkv))
                                   for p in range(2)])}
  return ref


def _group_params(rng):
  """Every storage form "head" supports, ``GH`` query and ``GKV`` key/value heads of ``D`` columns."""
  decl, lay = mc.Projection, lambda **kw: mc.GQALayout(GH, GKV, D, **kw)  # noqa: E731
  torch = {f: decl(n, leaf="w", axes=("out", "in")) for f, n in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))}
  layout = {
      "dense": lay(value="wv", out="wo"),
      "torch": lay(**torch),
      "fused": lay(qkv="c_attn", out=None),
      "scan": lay(value=None, out=None),
      "general": lay(query="query", key="key"),
      "gemma": lay(query=decl("q", leaf="w", axes=("heads", "in", "head_dim")),
                   key=decl("kv", leaf="w", axes=("parts", "heads", "in", "head_dim"), parts=("k", "v")),
                   value=None, out=None),
  }
  shapes = {
      "dense": {"wq": (IN, GH * D), "wk": (IN, GKV * D), "wv": (IN, GKV * D), "wo": (GH * D, IN)},
      "torch": {"q": (GH * D, IN), "k": (GKV * D, IN), "v": (GKV * D, IN), "o": (IN, GH * D)},
      "fused": {"c_attn": (IN, (GH + 2 * GKV) * D)},
      "scan": {"wq": (L, IN, GH * D), "wk": (L, IN, GKV * D)},
      "general": {"query": (IN, GH, D), "key": (IN, GKV, D), "value": (IN, GKV, D), "out": (GH, D, IN)},
      "gemma": {"q": (GH, IN, D), "kv": (2, GKV, IN, D)},
  }
  leaf = {"torch": "w", "gemma": "w"}
  params = {m: {n: {leaf.get(m, "kernel"): jnp.asarray(rng.standard_normal(shape), jnp.float32)}
                for n, shape in kernels.items()} for m, kernels in shapes.items()}
  return params, layout


def _kernels(tree):
  """``{module: {projection: kernel}}``, the leaf name dropped."""
  return {m: {n: next(iter(leaf.values())) for n, leaf in mod.items()} for m, mod in tree.items()}


@pytest.fixture(scope="module")
def group_updates():
  params, layout = _group_params(np.random.default_rng(6))
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  out = {}
  for blocks in ("group:2+out", "group:kv+out", "group:1+out", "head+out"):
    opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks)
    out[blocks] = _kernels(jax.jit(opt.update)(grads, opt.init(params))[0])
  return _kernels(grads), out


@pytest.mark.parametrize("blocks, kq, kkv", [("group:2+out", 2, 2), ("group:kv+out", 2, 1)])
def test_head_groups_equal_the_by_hand_groups_on_every_storage_form(group_updates, blocks, kq, kkv):
  """"group:2": every 2 consecutive heads of a projection one block; "group:kv": the 2 query heads that
  share a key/value head one block, each key/value head its own (the fused q|k|v kernel cut both ways)."""
  grads, out = group_updates
  ref = jax.jit(lambda g: _group_reference(jax.tree.map(_direction, g), kq, kkv))(grads)
  for m, kernels in ref.items():
    for n, want in kernels.items():
      assert_same_math(np.asarray(out[blocks][m][n]), np.asarray(want), err_msg=f"{blocks} {m}/{n}")
  # the two differ where they should: on the key/value heads, not on the query heads
  assert not np.allclose(out["group:2+out"]["dense"]["wk"], out["group:kv+out"]["dense"]["wk"], atol=1e-3)
  assert_same_math(out["group:2+out"]["dense"]["wq"], out["group:kv+out"]["dense"]["wq"])


@pytest.mark.parametrize("heads, kv, parts", [(4, 2, None), (2, 2, None), (4, 2, ("k", "q", "v"))])
def test_qkv_grouped_by_kv_head_is_cut_into_its_parts_and_heads(heads, kv, parts):
  """``Projection(qkv, grouped=True)`` (Bloom, GPT-NeoX: per key/value head its query heads, its key,
  its value, in ``parts`` order): "part" takes every query column as one matrix, and the keys and
  the values; "group:kv" each group's query heads and each key/value head; "head" every head;
  "matrix" the whole kernel."""
  g = heads // kv
  order = parts or ("q", "k", "v")
  rng = np.random.default_rng(9)
  kernel = jnp.asarray(rng.standard_normal((IN, kv * (g + 2) * D)), jnp.float32)
  lay = mc.GQALayout(heads, kv, D, qkv=mc.Projection("qkv", parts=parts, grouped=True), out=None)
  params = {"attn": {"qkv": {"kernel": kernel}}}
  got = {}
  for blocks in ("part", "group:kv", "head", "matrix"):
    opt = mc.scale_by_muon(layout=lay, muon_blocks=blocks)
    got[blocks] = np.asarray(jax.jit(opt.update)(params, opt.init(params))[0]["attn"]["qkv"]["kernel"])
  d = _direction(kernel).reshape(IN, kv, g + 2, D)  # by key/value group: its heads of each part, in order
  sizes = [g if p == "q" else 1 for p in order]
  cuts = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(3)]

  def whole(x):
    return _ns_blocks(x.reshape(IN, -1)[None])[0].reshape(x.shape)

  part = jnp.concatenate([whole(d[:, :, a:b]) for a, b in cuts], axis=2)
  by_group = jnp.stack([jnp.concatenate([whole(d[:, j, a:b]) for a, b in cuts], axis=1) for j in range(kv)], axis=1)
  want = {"part": part, "group:kv": by_group, "head": _by_cols(d.reshape(IN, -1), heads + 2 * kv).reshape(d.shape),
          "matrix": whole(d)}
  for blocks, w in want.items():
    assert_same_math(got[blocks], np.asarray(w).reshape(IN, -1), err_msg=blocks)
  assert not np.allclose(got["part"], got["head"], atol=1e-3)
  with pytest.raises(ValueError, match=r"scale_by_muon: layout \(muon_blocks='group:2'\): attn/qkv/kernel .*"
                                       r"a block of 2 (query|key) heads would take columns of several key/value "
                                       r"groups .*cut by 'part', 'head' \('group:1'\) and 'group:kv' only"):
    mc.scale_by_muon(layout=lay, muon_blocks="group:2").init(params)


def test_group_of_one_head_is_head_and_of_all_heads_is_matrix(group_updates):
  _, out = group_updates
  for m, kernels in out["head+out"].items():
    for n, want in kernels.items():
      assert_same_math(out["group:1+out"][m][n], want, err_msg=f"{m}/{n}")
  rng = np.random.default_rng(7)  # MHA of 4 heads of 4 columns, separate projections: group:4 is the whole matrix
  params = {n: {"kernel": jnp.asarray(rng.standard_normal(s), jnp.float32)}
            for n, s in (("wq", (IN, 16)), ("wk", (IN, 16)), ("wv", (IN, 16)), ("wo", (16, IN)))}
  lay = mc.GQALayout(4, 4, 4, value="wv", out="wo")
  got = {}
  for blocks in ("group:4+out", "matrix"):
    opt = mc.scale_by_muon(layout=lay, muon_blocks=blocks)
    got[blocks] = opt.update(params, opt.init(params))[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-6), got["group:4+out"], got["matrix"])


def test_mla_head_groups_equal_the_by_hand_groups():
  """MLA: wq_b, wkv_b and wo in groups of 2 of its 4 heads (blocks 12 x 16, 12 x 20, 12 x 12)."""
  rng = np.random.default_rng(8)
  shapes = {"wq_b": (IN, GH * (NOPE + ROPE)), "wkv_b": (IN, GH * (NOPE + V)), "wo": (GH * V, IN)}
  params = {n: {"kernel": jnp.asarray(rng.standard_normal(s), jnp.float32)} for n, s in shapes.items()}
  opt = mc.scale_by_muon(layout=mc.MLALayout(GH, NOPE, ROPE, V, out="wo"), muon_blocks="group:2+out")
  got = jax.jit(opt.update)(params, opt.init(params))[0]
  want = jax.jit(lambda d: {"wq_b": _along(d["wq_b"]["kernel"], -1, [(GH, 2)], NOPE + ROPE),
                            "wkv_b": _along(d["wkv_b"]["kernel"], -1, [(GH, 2)], NOPE + V),
                            "wo": _along(d["wo"]["kernel"], -2, [(GH, 2)], V)})(jax.tree.map(_direction, params))
  for n, w in want.items():
    assert_same_math(np.asarray(got[n]["kernel"]), np.asarray(w), err_msg=n)


def test_a_group_size_that_does_not_divide_the_heads_is_refused():
  params, layout = _group_params(np.random.default_rng(0))
  with pytest.raises(ValueError, match=r"muon_blocks='group:3': the group size 3 does not divide the 4 query heads "
                                       r"of dense/wq/kernel"):
    mc.scale_by_muon(layout=layout, muon_blocks="group:3").init(params)
  with pytest.raises(ValueError, match=r"the group size 4 does not divide the 2 key heads of dense/wk/kernel.*'group:kv'"):
    mc.scale_by_muon(layout=layout, muon_blocks="group:4").init(params)
  mla = {"wq_b": {"kernel": jnp.ones((IN, H * (NOPE + ROPE)))}, "wkv_b": {"kernel": jnp.ones((IN, H * (NOPE + V)))}}
  with pytest.raises(ValueError, match=r"muon_blocks='group:kv' groups the query heads that share a key/value head, "
                                       r"which an MLALayout does not have"):
    mc.scale_by_muon(layout=mc.MLALayout(H, NOPE, ROPE, V), muon_blocks="group:kv").init(mla)


# ----------------------------------------------------------------------------- why per head

def test_a_head_with_a_1000x_smaller_gradient_is_still_orthogonalized(forms_and_updates):
  """Kimi K3's motivation: whole-matrix Muon lets the large heads take the shared direction;
  per head, every block's singular values lie in the preset's band (polar_express_4: [0.779,
  1.2] in exact arithmetic, for input singular values down to 3e-3 of the norm)."""
  rng = np.random.default_rng(3)
  g = rng.standard_normal((IN, 4 * D)).astype(np.float32)
  g[:, D:2 * D] *= 1e-3  # head 1
  params = {"wq": {"kernel": jnp.asarray(g)}, "wk": {"kernel": jnp.asarray(rng.standard_normal((IN, 4 * D)), jnp.float32)}}
  lay = mc.GQALayout(4, 4, D, value=None)
  for blocks in ("head", "matrix"):
    opt = mc.scale_by_muon(layout=lay, muon_blocks=blocks, beta=0.0, nesterov=False)
    u = np.asarray(opt.update(params, opt.init(params))[0]["wq"]["kernel"], np.float64)
    scale = _scale(IN, D) if blocks == "head" else _scale(IN, 4 * D)
    heads = [u[:, h * D:(h + 1) * D] for h in range(4)]
    sv = [np.linalg.svd(b / scale, compute_uv=False) for b in heads]
    rms = [np.sqrt(np.mean(b ** 2)) for b in heads]
    if blocks == "head":  # every head orthogonalized on its own, each with the update RMS ~0.2
      assert all(0.77 <= s.min() and s.max() <= 1.21 for s in sv), sv
      assert all(abs(r - 0.2) < 0.03 for r in rms), rms
    else:  # the small head's share of the whole matrix's update is ~1000x smaller than the others'
      assert sv[1].max() < 0.01 and rms[1] < 0.01, (sv[1], rms)
      assert min(rms[0], rms[2], rms[3]) > 0.15, rms


# ----------------------------------------------------------------------------- sharded

_COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def _collectives(compiled) -> dict[str, list[str]]:
  text = compiled.as_text()
  return {op: re.findall(rf"= ([^=\n]*?) {op}(?:-start)?\(", text) for op in _COLLECTIVES}


def _sharded_case():
  """DenseGeneral (in, H, D) and 2-D (in, H * D) kernels with 8 heads: 2 per device of a 4-way model axis."""
  h = 8
  rng = np.random.default_rng(4)
  params = {m: {p: {"kernel": jnp.asarray(rng.standard_normal((IN, h, D) if m == "general" else (IN, h * D)),
                                          jnp.float32)} for p in ("wq", "wk")} for m in ("general", "flat")}
  layout = mc.GQALayout(h, h, D, value=None, out=None)
  return params, {"general": layout, "flat": layout}


@pytest.fixture(scope="module")
def sharded_reference():
  params, layout = _sharded_case()
  grads = jax.tree.map(jnp.sin, params)
  opt = mc.scale_by_muon(layout=layout, muon_blocks="head")
  return params, layout, grads, jax.jit(opt.update)(grads, opt.init(params))[0]


@pytest.mark.parametrize("placement", ["heads", "fsdp"])
@pytest.mark.parametrize("distributed", [False, True], ids=["spmd", "shard_orthogonalization"])
def test_sharded_per_head_equals_one_device_and_heads_stay_where_they_live(sharded_reference, placement, distributed):
  """Heads on a 4-way "model" axis (DenseGeneral heads axis, 2-D columns): the blocks are
  orthogonalized on the devices that hold them: no all-gather, one device's
  update (2 heads per device, as batched as on one device; ``_exactness``). FSDP (the fan-in sharded): equal
  to a few float32 roundings (the Gram products are summed over shards, or gathered)."""
  params, layout, grads, want = sharded_reference
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  spec = {"heads": {"general": P(None, "model", None), "flat": P(None, "model")},
          "fsdp": {"general": P("data", None, None), "flat": P("data", None)}}[placement]
  ps = {m: {p: {"kernel": NamedSharding(mesh, spec[m])} for p in ("wq", "wk")} for m in spec}
  opt = mc.scale_by_muon(layout=layout, muon_blocks="head", shard_orthogonalization=ps if distributed else None)
  g = jax.device_put(grads, ps)
  state = mc.sharding.init_state(opt, jax.device_put(params, ps), ps)
  compiled = jax.jit(opt.update, out_shardings=(ps, None)).lower(g, state).compile()
  got = compiled(g, state)[0]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if placement == "heads":
      assert_same_math(np.asarray(a), np.asarray(b))
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
  found = _collectives(compiled)
  if placement == "heads":
    assert not found["all-gather"] and not found["all-to-all"], found
    # what moves at all is the one-element dependency that orders the calls (spmd) or nothing
    sizes = [math.prod(int(n) for n in re.search(r"\[([\d,]*)\]", s).group(1).split(",") if n)
             for s in sum(found.values(), [])]
    assert all(n <= 1 for n in sizes), found


@pytest.mark.parametrize("blocks", ["head", "matrix"])
def test_a_head_near_float32_max_gives_finite_updates_on_one_device_and_sharded(sharded_reference, blocks):
  """One head block with entries up to 2.6e38 (its Nesterov direction overflows float32
  unless the momentum is scaled: that head's block NaN per head, the whole kernel NaN as one matrix). Every update
  is finite; per head, each block's update is that of the normal-sized gradient (each leaf's
  momentum is stored divided by a power of two, and Newton–Schulz is scale-invariant); with
  ``shard_orthogonalization`` (heads on the 4-way model axis) it is one device's update."""
  params, layout, grads, want = sharded_reference
  big = np.float32(1.5 * 2.0 ** 127)
  huge = {"general": jax.tree.map(lambda g: g.at[:, 3].multiply(big), grads["general"]),
          "flat": jax.tree.map(lambda g: g.at[:, 3 * D:4 * D].multiply(big), grads["flat"])}
  single = mc.scale_by_muon(layout=layout, muon_blocks=blocks)
  got = jax.jit(single.update)(huge, single.init(params))[0]
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
  if blocks == "head":
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # to eps and 1.5 x's rounding, through NS
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-6)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  spec = {"general": P(None, "model", None), "flat": P(None, "model")}
  ps = {m: {p: {"kernel": NamedSharding(mesh, spec[m])} for p in ("wq", "wk")} for m in spec}
  opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks, shard_orthogonalization=ps)
  g = jax.device_put(huge, ps)
  sharded = jax.jit(opt.update, out_shardings=(ps, None))(g, mc.sharding.init_state(opt, g, ps))[0]
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(got)):  # two programs: to the suite's rounding
    assert_same_math(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("distributed", [False, True], ids=["spmd", "shard_orthogonalization"])
def test_sharded_head_groups_stay_where_they_live(distributed):
  """"group:2" on 8 heads over a 4-way model axis: each device holds one group of 2 heads (DenseGeneral
  heads axis, 2-D columns), orthogonalized there with no all-gather, one device's update (``_exactness``)."""
  params, layout = _sharded_case()
  grads = jax.tree.map(jnp.sin, params)
  single = mc.scale_by_muon(layout=layout, muon_blocks="group:2")
  want = jax.jit(single.update)(grads, single.init(params))[0]
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  spec = {"general": P(None, "model", None), "flat": P(None, "model")}
  ps = {m: {p: {"kernel": NamedSharding(mesh, spec[m])} for p in ("wq", "wk")} for m in spec}
  opt = mc.scale_by_muon(layout=layout, muon_blocks="group:2", shard_orthogonalization=ps if distributed else None)
  g = jax.device_put(grads, ps)
  state = mc.sharding.init_state(opt, jax.device_put(params, ps), ps)
  compiled = jax.jit(opt.update, out_shardings=(ps, None)).lower(g, state).compile()
  for a, b in zip(jax.tree.leaves(compiled(g, state)[0]), jax.tree.leaves(want)):
    assert_same_math(np.asarray(a), np.asarray(b))
  found = _collectives(compiled)
  assert not found["all-gather"] and not found["all-to-all"], found


@pytest.mark.parametrize("blocks", ["head", "group:kv"])
@pytest.mark.parametrize("distributed", [False, True], ids=["spmd", "shard_orthogonalization"])
def test_sharded_qkv_grouped_by_kv_head_stays_where_it_lives(blocks, distributed):
  """A fused q|k|v kernel grouped by key/value head (8 query heads, 4 key/value heads), its columns on a
  4-way model axis: one group per device, its heads orthogonalized there with no all-gather, one
  device's update (``_exactness``)."""
  rng = np.random.default_rng(10)
  params = {"qkv": {"kernel": jnp.asarray(rng.standard_normal((IN, 4 * (2 + 2) * D)), jnp.float32)}}
  layout = mc.GQALayout(8, 4, D, qkv=mc.Projection("qkv", grouped=True), out=None)
  grads = jax.tree.map(jnp.sin, params)
  single = mc.scale_by_muon(layout=layout, muon_blocks=blocks)
  want = jax.jit(single.update)(grads, single.init(params))[0]
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  ps = {"qkv": {"kernel": NamedSharding(mesh, P(None, "model"))}}
  opt = mc.scale_by_muon(layout=layout, muon_blocks=blocks, shard_orthogonalization=ps if distributed else None)
  g = jax.device_put(grads, ps)
  state = mc.sharding.init_state(opt, jax.device_put(params, ps), ps)
  compiled = jax.jit(opt.update, out_shardings=(ps, None)).lower(g, state).compile()
  assert_same_math(np.asarray(compiled(g, state)[0]["qkv"]["kernel"]), np.asarray(want["qkv"]["kernel"]))
  found = _collectives(compiled)
  assert not found["all-gather"] and not found["all-to-all"], found


def test_shard_orthogonalization_gathers_heads_it_cannot_split(sharded_reference):
  """A 2-D kernel of 4 heads with its columns split 8 ways: the view's heads axis cannot carry the
  sharding, and the distributed Newton–Schulz gathers those blocks first, as it gathers any
  layout it cannot use; the result is still one device's, in the kernel's sharding."""
  rng = np.random.default_rng(5)
  params = {"wq": {"kernel": jnp.asarray(rng.standard_normal((IN, 4 * D)), jnp.float32)},
            "wk": {"kernel": jnp.asarray(rng.standard_normal((IN, 4 * D)), jnp.float32)}}
  layout = mc.GQALayout(4, 4, D, value=None, out=None)
  grads = jax.tree.map(jnp.cos, params)
  single = mc.scale_by_muon(layout=layout, muon_blocks="head")
  want = jax.jit(single.update)(grads, single.init(params))[0]
  mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
  ps = jax.tree.map(lambda _: NamedSharding(mesh, P(None, "model")), params)
  opt = mc.scale_by_muon(layout=layout, muon_blocks="head", shard_orthogonalization=ps)
  g = jax.device_put(grads, ps)
  compiled = jax.jit(opt.update, out_shardings=(ps, None)).lower(g, mc.sharding.init_state(opt, g, ps)).compile()
  got = compiled(g, mc.sharding.init_state(opt, g, ps))[0]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5), got, want)
  assert _collectives(compiled)["all-gather"]
  for x in jax.tree.leaves(got):
    assert x.sharding.is_equivalent_to(ps["wq"]["kernel"], 2)


def test_logical_names_give_the_same_blocks_as_declared_axes(forms_and_updates):
  """MaxText's boxed kernels ``("embed", "layers", "q_heads", "kv")``: the layout reads the axes
  from the names (no ``Projection(axes=...)``), at ``init`` from the boxes, at ``update`` from
  the names remembered for the bare arrays (``nnx.Optimizer``'s pattern)."""
  params, grads, _, out = forms_and_updates
  names = {"query": ("embed", "layers", "q_heads", "kv"), "key": ("embed", "layers", "kv_heads", "kv_head_dim")}
  boxed = {n: {"kernel": nn.Partitioned(params["maxtext"][n]["kernel"], names=names[n])} for n in names}
  lay = mc.GQALayout(H, HKV, D, query="query", key="key", value=None, out=None)
  opt = mc.scale_by_muon(layout=lay, muon_blocks="head")
  state = nn.unbox(opt.init(boxed))  # the names are read here; the state and updates are bare arrays
  got = jax.jit(opt.update)(grads["maxtext"], state)[0]
  for n in names:
    assert_same_math(np.asarray(got[n]["kernel"]), np.asarray(out["head+out"]["maxtext"][n]["kernel"]))
