"""``capture_tunix``: per-head max logits from Tunix's own attention (``google-tunix``), unmodified.

Tunix's models (``tunix.models.llama3``, ``qwen3`` dense and MoE, ``gemma``, ``gemma3``) are
Flax NNX modules whose ``Attention.block`` computes the scaled ``q . k`` logits, masks them
and takes their softmax, with nothing a caller can reach in between. Under
``capture_tunix()`` every such call sows, on that attention module, the ``(num_heads,)``
float32 ``max_logits`` that ``qk_clip`` and ``muonclip`` read (``sow_max_logits``): each
query head's largest pre-softmax logit ``S_max^h`` (Kimi K2, arXiv 2507.20534, section 2.1),
over the batch, the queries and the keys its mask allows (causal, padding and a local
layer's sliding window: Tunix folds them all into the mask it applies). Heads come in the
query projection's order (with GQA, one maximum per query head). As for any NNX sow, nothing
is computed unless the call runs under ``nnx.capture(..., nnx.Intermediate)``::

  with muonclip_jax.nn.capture_tunix():
    (logits, _), intermediates = nnx.capture(model, nnx.Intermediate)(tokens, positions, None, mask)
  # intermediates["layers"][0]["attn"]["max_logits"]: (num_heads,)

It must be active while the model is *traced* (inside the loss function a train step jits).
``tunix_layout(model)`` gives the layout ``muonclip`` needs for the same model, and
``capture_tunix_trainer`` wires both into Tunix's ``PeftTrainer``.

How: while a capture is open, each supported ``Attention`` class has its ``block`` replaced by
a wrapper (Flax's own ``nnx.capture(..., method_outputs=)`` wraps module methods the same
way); in a thread with an open capture the wrapper runs Tunix's own function with one name
of its globals rebound, ``jnp``, to ``jax.numpy`` whose ``where`` also records the logits and
the mask when Tunix masks them (``jnp.where(mask, logits, K_MASK)``), and sows their
maximum when the call returns. Other threads, and calls outside a capture, run Tunix's
function itself; the last exit restores the classes. As in ``capture_gemma``, a JAX user
context keeps the traces ``jax.jit`` (and ``nnx.jit``) makes inside and outside a capture
apart, and the returned object may be entered again and nested.

Private API, read from google-tunix 0.1.7 (Python 3.12): the modules ``tunix.models.llama3.model``,
``qwen3.model``, ``gemma.model`` and ``gemma3.model``, each with a class ``Attention`` whose
method ``block`` masks its logits with ``jnp.where(mask, logits, K_MASK)`` (the module's
``K_MASK``) before the softmax, the logits laid out ``(batch, heads, query, key)`` (Llama 3),
``(batch, kv_heads, group, query, key)`` (Qwen 3) or ``(batch, query, heads, key)`` (Gemma);
Gemma's ``attn_logits_soft_cap`` attribute; and, for
``tunix_layout``, the kernels ``q_proj/w`` ``(embed, heads, head_dim)``, ``k_proj/w``,
``v_proj/w``, ``o_proj/w`` ``(heads, head_dim, embed)`` and Qwen 3's ``q_norm/w``/``k_norm/w``
(``x * w``), Gemma's ``q_einsum/w`` ``(heads, embed, head_dim)``, ``kv_einsum/w``
``(2, kv_heads, embed, head_dim)``, ``qkv_einsum/w`` ``(3, heads, embed, head_dim)``,
``attn_vec_einsum/w`` and Gemma 3's ``_query_norm/scale``/``_key_norm/scale``
(``x * (1 + scale)``). ``tests/test_tunix_package.py`` fails if one moves, and a captured
call without that masking (a Tunix release that computes it differently, a call with
``attn_mask=None``, or ``use_flash_attention=True``, whose splash kernel returns no maxima)
raises ``RuntimeError`` rather than return without the maxima.

Soft-capped attention (Gemma 2, ``attn_logits_soft_cap``) is refused with a ValueError: Tunix
masks the capped logits, whose maximum cannot exceed the cap (see ``capture_gemma``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..._clip import GQALayout, Projection
from .rebind import with_numpy
from .sow import capturing, sow_head_max
from .._impl import head_max

READ_FROM = "google-tunix 0.1.7"

# Tunix model module -> the axes of the logits it masks ("N": heads, "K", "G": kv heads x group).
FAMILIES = {
    "tunix.models.llama3.model": "BNTS",
    "tunix.models.qwen3.model": "BKGTS",
    "tunix.models.gemma.model": "BTNS",
    "tunix.models.gemma3.model": "BTNS",
}

_IN_CAPTURE = jax.make_user_context(default_value=None)  # part of jax.jit's cache keys (see capture_gemma)
_LOCK = threading.Lock()
_OPEN = threading.local()  # per thread: the number of captures open in it
_installed: dict[type, Any] = {}  # Attention class -> Tunix's own block, while any capture is open
_users = 0  # captures open in all threads


def _moved(what: str) -> RuntimeError:
  return RuntimeError(f"capture_tunix: {what} (read from {READ_FROM}); this Tunix release moved it")


def tunix_families() -> dict[type, tuple[Any, str]]:
  """``{Attention class: (its model module, logits axes)}`` of the installed Tunix; RuntimeError if one moved."""
  found = {}
  for name, axes in FAMILIES.items():
    try:
      module = importlib.import_module(name)
    except ImportError as err:
      if name == "tunix.models.llama3.model" and isinstance(err, ModuleNotFoundError) and err.name in ("tunix", "tunix.models"):
        raise ImportError(f"capture_tunix needs Tunix (pip install google-tunix==0.1.7; docs/your-model.md): {err}") from err
      raise _moved(f"{name} does not import ({err})") from err
    cls, k_mask = getattr(module, "Attention", None), getattr(module, "K_MASK", None)
    if not isinstance(cls, type) or not isinstance(k_mask, float):
      raise _moved(f"{name} has no Attention class and float K_MASK")
    with _LOCK:
      raw = _installed.get(cls, cls.__dict__.get("block", None))
    if not isinstance(raw, types.FunctionType) or "jnp" not in raw.__code__.co_names:
      raise _moved(f"{name}.Attention.block is not a function that reads the global jnp")
    found[cls] = (module, axes)
  return found


class _RecordingNumpy:
  """``jax.numpy`` for one Tunix attention call; ``where(mask, logits, K_MASK)`` records logits and mask."""

  def __init__(self, k_mask: float):
    self._k_mask = k_mask
    self.logits = self.mask = self._masked = None
    self.capped = False

  def __getattr__(self, name: str) -> Any:
    return getattr(jnp, name)

  def tanh(self, *args: Any, **kwargs: Any) -> Any:
    self.capped = True  # a soft-cap before the masking: refused by the caller
    return jnp.tanh(*args, **kwargs)

  def where(self, condition: Any, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
    out = jnp.where(condition, x, y, **kwargs)
    if isinstance(y, float) and y == self._k_mask:
      if self._masked is not None and x is self._masked:  # a second mask over the masked logits: both hold
        self.mask = jnp.logical_and(self.mask, condition)
      else:
        self.logits, self.mask = x, condition
      self._masked = out
    return out


def _heads_max(logits: jax.Array, mask: Any, axes: str) -> jax.Array:
  """``(num_heads,)`` maxima of Tunix's masked logits, heads in the query projection's order."""
  if logits.ndim != len(axes):
    raise _moved(f"the masked logits have shape {logits.shape}, not the {axes} layout")
  if axes == "BKGTS":  # query head n = kv head k * group + g (Tunix reshapes q (B, T, N, H) to (B, T, K, G, H))
    b, k, g, t, s = logits.shape
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), logits.shape).reshape(b, k * g, t, s)
    return head_max(logits.reshape(b, k * g, t, s), mask, head_axis=1, where="capture_tunix")
  return head_max(logits, mask, head_axis=axes.index("N"), where="capture_tunix")


def _wrapper(raw: types.FunctionType, module: Any, axes: str) -> Any:
  """The ``block`` installed while a capture is open: captures only in a thread with one open."""

  @functools.wraps(raw)
  def block(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    if not getattr(_OPEN, "count", 0) or not capturing(self):
      return raw(self, *args, **kwargs)
    cap = getattr(self, "attn_logits_soft_cap", None)
    if cap is not None:
      raise ValueError(
          f"capture_tunix: {type(self).__module__}.Attention soft-caps its logits (attn_logits_soft_cap={cap}, "
          "Gemma 2) and masks them after the cap, where a maximum cannot exceed the cap; QK-Clip is refused "
          "with soft-capping")
    numpy = _RecordingNumpy(module.K_MASK)
    out = with_numpy(raw, numpy)(self, *args, **kwargs)
    if numpy.capped:
      raise ValueError(f"capture_tunix: {type(self).__module__}.Attention.block applied tanh (a soft-cap) "
                       "before masking its logits; QK-Clip is refused with soft-capping")
    if numpy.logits is None:
      raise RuntimeError(
          f"capture_tunix: {type(self).__module__}.Attention.block did not mask its logits with "
          f"jnp.where(mask, logits, K_MASK) (read from {READ_FROM}), so no maximum was captured: it was called "
          "with attn_mask=None (pass the attention mask), with use_flash_attention=True (the splash kernel "
          "returns no maxima), or this Tunix release computes them differently")
    maxima = _heads_max(numpy.logits, numpy.mask, axes)
    heads = _attention_layout(self, type(self).__module__).num_heads
    if maxima.shape != (heads,):
      raise _moved(f"the masked logits of {type(self).__module__}.Attention give {maxima.shape[0]} heads, "
                   f"its query projection {heads}")
    sow_head_max(self, maxima)
    return out

  block._muonclip_tunix = True  # noqa: SLF001 (marks the wrapper, so a class is never wrapped twice)
  return block


class _CaptureTunix:
  """The context manager ``capture_tunix()`` returns: reusable and re-entrant (module docstring)."""

  def __init__(self, families: dict[type, tuple[Any, str]]):
    self._families = families
    self._exits = threading.local()

  def __enter__(self) -> None:
    global _users
    with _LOCK:
      if _users == 0:  # every wrapper made (or the refusal raised) before any class changes
        raws = {cls: cls.__dict__["block"] for cls in self._families}
        for cls, raw in raws.items():
          if getattr(raw, "_muonclip_tunix", False):
            raise _moved(f"{cls.__module__}.Attention.block is already wrapped")
        wrappers = {cls: _wrapper(raws[cls], module, axes) for cls, (module, axes) in self._families.items()}
        _installed.update(raws)
        for cls, block in wrappers.items():
          cls.block = block
      _users += 1
    _OPEN.count = getattr(_OPEN, "count", 0) + 1
    if not hasattr(self._exits, "stack"):
      self._exits.stack = []
    stack = contextlib.ExitStack()
    stack.enter_context(_IN_CAPTURE("capture_tunix"))
    self._exits.stack.append(stack)

  def __exit__(self, *exc_info: Any) -> bool:
    global _users
    try:
      return self._exits.stack.pop().__exit__(*exc_info)
    finally:
      _OPEN.count -= 1
      with _LOCK:
        _users -= 1
        if _users == 0:
          for cls, raw in _installed.items():
            cls.block = raw
          _installed.clear()


def capture_tunix() -> contextlib.AbstractContextManager[None]:
  """Within it, every Tunix attention (Llama 3, Qwen 3 and Qwen3-MoE, Gemma, Gemma 3) sows its per-head max logits.

  See the module docstring: heads in the query projection's order, only the keys the mask
  allows, recorded under ``nnx.capture(..., nnx.Intermediate)``, active while the model is
  traced. The returned object may be entered again and nested.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from tunix.models.qwen3 import model as qwen3
    >>> import muonclip_jax.nn as mcnn
    >>> config = qwen3.ModelConfig(num_layers=1, vocab_size=32, embed_dim=16, hidden_dim=32, num_heads=4,
    ...                            head_dim=8, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6)
    >>> model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
    >>> tokens, positions = jnp.ones((1, 5), jnp.int32), jnp.arange(5)[None]
    >>> causal = jnp.tril(jnp.ones((1, 5, 5), bool))
    >>> with jax.numpy_rank_promotion("allow"), mcnn.capture_tunix():  # Tunix's RMSNorm broadcasts ranks
    ...   _, intermediates = nnx.capture(model, nnx.Intermediate)(tokens, positions, None, causal)
    >>> intermediates["layers"][0]["attn"]["max_logits"].shape
    (4,)

  Raises:
    ImportError: Tunix is not installed.
    ValueError: (at trace time) an attention soft-caps its logits (Gemma 2).
    RuntimeError: the installed Tunix no longer has the names or the masking this reads.
  """
  return _CaptureTunix(tunix_families())


def _proj(name: str, axes: tuple[str, ...], **kw: Any) -> Projection:
  return Projection(name, leaf="w", axes=axes, **kw)


def _attention_layout(attn: Any, path: str) -> GQALayout:
  """The ``GQALayout`` of one Tunix attention module, read from its kernels' shapes."""
  mods = vars(attn)
  w = lambda name: getattr(mods[name], "w").shape  # noqa: E731
  out = _proj("o_proj", ("in", "in", "out"))
  if "q_proj" in mods:  # Llama 3, Qwen 3: (embed, heads, head_dim)
    (_, n, hd), (_, k, _) = w("q_proj"), w("k_proj")
    norm = {}
    if "q_norm" in mods:  # Qwen 3's RMSNorm: x * w
      norm = dict(query_norm="q_norm/w", key_norm="k_norm/w", norm_scale_offset=0.0)
    return GQALayout(n, k, hd, query=_proj("q_proj", ("in", "heads", "head_dim")),
                     key=_proj("k_proj", ("in", "heads", "head_dim")),
                     value=_proj("v_proj", ("in", "heads", "head_dim")), out=out, **norm)
  norm = {}
  if "_query_norm" in mods:  # Gemma 3's RMSNorm: x * (1 + scale)
    norm = dict(query_norm="_query_norm/scale", key_norm="_key_norm/scale", norm_scale_offset=1.0)
  out = _proj("attn_vec_einsum", ("in", "in", "out"))
  if mods.get("qkv_einsum") is not None:  # Gemma with as many kv heads as heads: (3, heads, embed, head_dim)
    _, n, _, hd = w("qkv_einsum")
    return GQALayout(n, n, hd, qkv=_proj("qkv_einsum", ("parts", "heads", "in", "head_dim")), out=out, **norm)
  if "q_einsum" in mods:  # Gemma: (heads, embed, head_dim), k|v (2, kv_heads, embed, head_dim)
    (n, _, hd), (_, k, _, _) = w("q_einsum"), w("kv_einsum")
    return GQALayout(n, k, hd, query=_proj("q_einsum", ("heads", "in", "head_dim")),
                     key=_proj("kv_einsum", ("parts", "heads", "in", "head_dim"), parts=("k", "v")), out=out, **norm)
  raise _moved(f"the attention {path!r} has none of q_proj, qkv_einsum, q_einsum")


def tunix_layout(model: nnx.Module) -> GQALayout | dict[str, GQALayout]:
  """The layout ``muonclip``/``qk_clip`` need for a Tunix model, read from its attention modules.

  One ``GQALayout`` when every attention module has the same one (Llama 3, Qwen 3, Gemma 3),
  else ``{module path: layout}``. Projections are declared with their storage
  (``mc.Projection("q_proj", leaf="w", axes=("in", "heads", "head_dim"))``), so Muon takes
  each kernel as one matrix from them; Qwen 3's ``q_norm``/``k_norm`` and Gemma 3's
  ``_query_norm``/``_key_norm`` are declared with their conventions (module docstring).

  Example:
    >>> from flax import nnx
    >>> from tunix.models.llama3 import model as llama3
    >>> import muonclip_jax.nn as mcnn
    >>> config = llama3.ModelConfig(num_layers=1, vocab_size=32, embed_dim=16, hidden_dim=32, num_heads=4,
    ...                             head_dim=8, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6)
    >>> layout = mcnn.tunix_layout(llama3.Llama3(config, rngs=nnx.Rngs(0)))
    >>> layout.num_heads, layout.num_kv_heads, layout.head_dim
    (4, 2, 8)

  Raises:
    TypeError: ``model`` is not an NNX module.
    ValueError: it holds no Tunix attention module.
  """
  layouts = {p: _attention_layout(m, p) for p, m in _attention_modules(model, "tunix_layout").items()}
  first = next(iter(layouts.values()))
  return first if all(v == first for v in layouts.values()) else layouts


def _attention_modules(model: nnx.Module, caller: str) -> dict[str, nnx.Module]:
  """``{module path: module}`` of the Tunix attention modules in ``model``; TypeError/ValueError if none."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"{caller}: model must be a Tunix (Flax NNX) model, got {type(model).__name__}")
  classes = tuple(tunix_families())
  found = {"/".join(map(str, path)): m for path, m in nnx.iter_modules(model) if isinstance(m, classes)}
  if not found:
    raise ValueError(f"{caller}: {type(model).__name__} holds no attention module of {', '.join(sorted(FAMILIES))}")
  return found


def attention_heads(model: nnx.Module) -> dict[str, int]:
  """``{module path: number of query heads}`` of the Tunix attention modules in ``model``."""
  return {p: _attention_layout(m, p).num_heads for p, m in _attention_modules(model, "capture_tunix_trainer").items()}
