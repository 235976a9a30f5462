"""QK-Clip for attention with QK-norm: the clip acts on the norms' scales, not the kernels.

Gemma 3, Qwen3, OLMo 2 and Flax's ``normalize_qk=True`` attention normalize each head's
query and key after the projection: q_h = g_q * n(W_q x) (+ b_q), k likewise. Scaling the
kernels W_q, W_k is then undone by the norm (n(c x) = n(x)): the clip would be reported but
have no effect. What can still grow is the norm's scale g (and bias b), which bounds the
logits: |q_h . k_h| <= ||g_q (.) n(.)|| ||g_k (.) n(.)||. So the clip acts there.

Design (why this and not refusing): a Gemma 3 / Qwen3 user keeps QK-norm *and* wants the
logit bound of MuonClip; the norm's affine output is exactly linear in (g, b), so scaling
g and b by c scales q (or k) by c, the same per-head rule as on a kernel:

* per-head scale (``(*stack, heads, head_dim)`` or ``(*stack, heads * head_dim)``): query
  head h by sqrt(gamma_h), key head g by sqrt(min of its group) (``clip_mode="split"``; query
  by gamma_h and key untouched for ``"query"``), so every clipped head ends at <= tau and,
  for MHA, an unclipped head is untouched;
* scale shared by heads (``(*stack, head_dim)``, Gemma 3, Qwen3, Flax's ``LayerNorm``): one
  factor per layer, the smallest over the heads (sqrt(min_h gamma_h) on query and key), so
  every head's logits shrink by at least its own gamma_h. This still bounds every head by
  tau but is **weaker than per-head clipping**: the layer's other heads shrink too (the
  per-layer clipping Kimi K2, section 2.1, argues against). A model that wants per-head
  clipping needs per-head norm scales.

``GQALayout(query_norm=..., key_norm=...)`` names the norms: sub-module paths next to the
projections (their gain is the leaf ``scale``, else their one leaf other than ``bias``, as
Tunix's ``q_norm/w`` or torch ports' ``q_norm/weight``; an optional ``bias`` beside it), or
the gain's own path (``"q_norm/w"``). ``norm_scale_offset`` says how the norm
applies its scale: 0.0 (default) for ``x * scale`` (Flax's ``LayerNorm``/``RMSNorm``, Qwen3,
OLMo 2, and Gemma 4, whose QK-norm scale starts at 1), 1.0 for ``x * (1 + scale)`` (Gemma 2
and Gemma 3's RMSNorm, whose scale starts at 0): the new scale is then c (1 + g) - 1. The
wrong offset mis-scales the head: ``1.0`` on Gemma 4's ``x * scale`` with g = 1 and
``clip_mode="query"`` turns gamma = 0.75 into the scale 2 * 0.75 - 1 = 0.5, so a head at 8
with tau 6 ends at 4 instead of 6. A GQA module
with a norm that its layout does not declare is a ValueError naming the norm: a sub-module of
a known QK-norm name (``NORM_NAMES``) holding a gain, whatever its leaf is called, or a
norm-like one (``_norm_like``: ``q_ln``, ``norm_q``, ``qn``, ...) whose gain has a QK-norm's shape
and whose name says query or key. A norm-like one of another name (Flax's own ``RMSNorm_0``), or
any sub-module holding only a ``scale`` of such a shape (Flax's norms' name for the gain; a
``bias`` beside it), is a
UserWarning: it may as well normalize the input, the values or the output, or scale the query
linearly. A norm without a gain (an L2 norm, ``use_scale=False``) is not seen in the parameters.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from .layouts import GQALayout
from .projection import as_projection
from .._util import join

# Sub-module names that QK-norm takes in Flax, Gemma, Hugging Face ports and this repository.
NORM_NAMES = ("query_ln", "key_ln", "q_norm", "k_norm", "query_norm", "key_norm", "_query_norm", "_key_norm",
              "q_layernorm", "k_layernorm")


def gain_key(norm: str, index: Mapping[str, object]) -> str | None:
  """The path of a norm's gain under its attention module: ``norm`` itself when it names a leaf,
  else ``norm/scale``, else the norm's one leaf other than ``bias`` (``w``, ``weight``); None."""
  if norm in index:
    return norm
  if f"{norm}/scale" in index:
    return f"{norm}/scale"
  inside = [k for k in index if k.startswith(norm + "/") and "/" not in k[len(norm) + 1:]]
  gains = [k for k in inside if k.rpartition("/")[2] != "bias"]
  return gains[0] if len(gains) == 1 else None


def _words(name: str) -> list[str]:
  """``name``'s words, lower case: ``"RMSNorm_0"`` -> rms, norm, 0; ``"q_ln"`` -> q, ln."""
  return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+", name)]


def _norm_like(name: str, gain: str, leaves: set, shape: tuple, lay: GQALayout, stack: tuple) -> bool:
  """A sub-module whose name says norm (Flax's own names ``RMSNorm_0``, ``LayerNorm_1``; ``q_ln``,
  ``norm_q``, ``qnorm``, ``q_rms``, ``qn``) or whose ``leaves`` (its own leaf names) are a gain
  ``scale`` (Flax's norms' name for it) and at most a ``bias`` (not a quantized projection's
  ``kernel`` and ``scale``), not of the value or output, holding a gain of a QK-norm's shape
  after the maxima's stacked-layer shape ``stack``: ``(head_dim,)`` (shared by heads) or ``(heads, head_dim)``, or, for
  a name that also says query or key, ``(heads * head_dim,)`` (which an input norm of ``heads *
  head_dim`` features has as well)."""
  words = _words(name)
  if not (_says_norm(name) or gain == f"{name}/scale" and set(leaves) <= {"scale", "bias"}):
    return False
  if any(w in ("v", "value", "values", "o", "out", "output", "vnorm", "onorm", "vn") for w in words):
    return False
  if tuple(shape[: len(stack)]) != tuple(stack):
    return False
  tail, heads = tuple(shape[len(stack):]), (lay.num_heads, lay.num_kv_heads)
  if tail in {(lay.head_dim,)} | {(h, lay.head_dim) for h in heads}:
    return True
  return _says_qk(name) and tail in {(h * lay.head_dim,) for h in heads}


def _says_norm(name: str) -> bool:
  """Whether ``name`` says norm: a word with ``norm`` in it, ``ln``, ``rms``, or ``qn``/``kn``."""
  return any("norm" in w or w in ("ln", "rms", "qn", "kn") for w in _words(name))


def _role(name: str, letter: str) -> bool:
  """Whether ``name`` says query (``letter`` "q": ``q_norm``, ``query_ln``, ``qnorm``, ``norm_q``,
  ``qn``) or key ("k")."""
  full = {"q": ("query", "queries"), "k": ("key", "keys")}[letter]
  return any(w == letter or w in full or (w[:1] == letter and w[1:] in ("norm", "ln", "rms", "n"))
             for w in _words(name))


def _says_qk(name: str) -> bool:
  return _role(name, "q") or _role(name, "k") or "qk" in _words(name)


def check_undeclared(module: str, lay: GQALayout, shapes: Mapping[str, tuple], caller: str, stack: tuple) -> None:
  """For a GQA module whose layout declares no QK-norm: a ValueError for a sub-module of a usual
  QK-norm name (``NORM_NAMES``) holding a gain, or for a norm-like one (``_norm_like``) whose name
  says query or key; a UserWarning for a norm-like one of another name (Flax's own ``RMSNorm_0``:
  a QK-norm, or an input, value or output norm that the parameters cannot tell apart from one).
  ``stack``: the maxima's stacked-layer shape. Not one of the layout's projections."""
  if lay.query_norm is not None:
    return
  sure = [n for n in NORM_NAMES if gain_key(n, shapes) not in (None, n)]
  declared = (getattr(lay, f) for f in ("query", "key", "qkv", "value", "out"))
  projections = {as_projection(p).name.partition("/")[0] for p in declared if p is not None}
  unsure = []
  for n in dict.fromkeys(k.partition("/")[0] for k in shapes if "/" in k):
    gain = gain_key(n, shapes)
    own = {k[len(n) + 1:] for k in shapes if k.startswith(n + "/")}
    if n not in sure and n not in projections and gain is not None and _norm_like(n, gain, own, tuple(shapes[gain]),
                                                                                   lay, stack):
      (sure if _says_norm(n) and _says_qk(n) else unsure).append(n)
  found = sure or unsure
  if not found:
    return
  q = next((n for n in found if _role(n, "q")), None)
  k = next((n for n in found if _role(n, "k")), None)
  names = f"{q!r}, key_norm={k!r}" if q and k else "<the query's norm>, key_norm=<the key's norm>"
  message = (
      f"{caller}: {join(module, found[0])} looks like a QK-norm (a normalization of each head's query "
      f"or key after the projection, e.g. Flax's normalize_qk=True; norms under {module or '<root>'!r}: "
      f"{found}): it undoes any scaling of the query/key kernels, so the clip would have no effect. "
      f"Declare the norms so that the clip acts on their scales: GQALayout(..., query_norm={names}) "
      "(add norm_scale_offset=1.0 for norms computing x * (1 + scale), as Gemma 2 and 3's RMSNorm; "
      "Gemma 4's QK-norm computes x * scale: leave it at 0)")
  if sure:
    raise ValueError(message)
  warnings.warn(f"{message}. If they normalize the attention's input, values or output instead, or scale the "
                "query or key linearly, the clip acts on the kernels as it should: ignore this warning",
                UserWarning, stacklevel=2)


def _kind(module: str, gain: str, shape: tuple, stack: tuple, heads: int, head_dim: int, caller: str) -> str:
  tail = tuple(shape[len(stack):])
  if tuple(shape[: len(stack)]) == tuple(stack):
    if tail == (head_dim,):
      return "shared"
    if tail in ((heads, head_dim), (heads * head_dim,)):
      return "per_head"
  raise ValueError(
      f"{caller}: {join(module, gain)} has shape {shape}; a QK-norm scale is expected to be "
      f"{(*stack, head_dim)} (shared by heads), {(*stack, heads, head_dim)} or {(*stack, heads * head_dim)} "
      f"(per head), where {stack} is the stacked-layer shape of the maxima"
  )


def scale_norms(module: str, lay: GQALayout, index: Mapping[str, int], leaves: list, gamma: jax.Array,
                caller: str = "qk_clip") -> None:
  """Scales the declared query/key norms of one module in ``leaves`` (in place in the list).

  ``gamma``: per-head factors ``(*stack, num_heads)`` in (0, 1].
  """
  stack = gamma.shape[:-1]
  root = jnp.sqrt(gamma)
  if lay.clip_mode == "query":
    per_head = {"query": gamma, "key": None}
  else:
    group_min = gamma.reshape(*stack, lay.num_kv_heads, lay.group_size).min(axis=-1)
    per_head = {"query": root, "key": jnp.sqrt(group_min)}
  gains = {}
  for role, norm, heads in (("query", lay.query_norm, lay.num_heads), ("key", lay.key_norm, lay.num_kv_heads)):
    key = gain_key(norm, index)
    if key is None:
      raise ValueError(f"{caller}: the layout names the {role} norm {norm!r}, but {join(module, norm)} holds no "
                       f"gain (a leaf 'scale', or one leaf other than 'bias'; or name the leaf: '{norm}/w'); "
                       f"parameters under {module or '<root>'!r}: {sorted(index)}")
    gains[role] = key
    _kind(module, key, jnp.shape(leaves[index[key]]), stack, heads, lay.head_dim, caller)  # checks the shape
  for role, heads in (("query", lay.num_heads), ("key", lay.num_kv_heads)):
    f = per_head[role]
    if f is None:
      continue
    key = gains[role]
    i = index[key]
    shape = jnp.shape(leaves[i])
    if _kind(module, key, shape, stack, heads, lay.head_dim, caller) == "shared":
      # One factor for every head: the smallest, so that each head shrinks at least by its own.
      factor = jnp.broadcast_to(jnp.min(f, axis=-1)[..., None], shape)
    else:
      factor = jnp.broadcast_to(f[..., None], (*stack, heads, lay.head_dim)).reshape(shape)
    leaves[i] = _affine(leaves[i], factor, lay.norm_scale_offset)
    bias = f"{key.rpartition('/')[0]}/bias" if "/" in key else None
    b = index.get(bias) if bias else None
    if b is not None:
      if jnp.shape(leaves[b]) != shape:
        raise ValueError(f"{caller}: {join(module, bias)} has shape {jnp.shape(leaves[b])}; expected "
                         f"{shape}, the shape of its scale")
      leaves[b] = _affine(leaves[b], factor, 0.0)


def _affine(x: jax.Array, factor: jax.Array, offset: float) -> jax.Array:
  """The leaf g with (offset + g) scaled by ``factor``: factor (offset + g) - offset; exact where factor is 1."""
  dtype = jnp.result_type(x)
  compute = jnp.promote_types(dtype, jnp.float32)
  xc, fc = x.astype(compute), factor.astype(compute)
  new = xc * fc if offset == 0 else (offset + xc) * fc - offset
  return jnp.where(fc == 1, xc, new).astype(dtype)
