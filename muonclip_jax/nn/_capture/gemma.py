"""``capture_gemma``: per-head max logits from Google DeepMind's ``gemma`` package, unmodified.

The ``gemma`` package's models (``gm.nn.Gemma3_*``, ``gm.nn.Transformer``, or blocks built
from ``gm.nn.Block``/``gm.nn.Attention``) compute their attention logits inside
``Attention.__call__`` and pass them to nothing a caller can reach. Under ``capture_gemma()``
every such call sows, on that attention module, the ``(num_heads,)`` float32 ``max_logits``
that ``qk_clip`` and ``muonclip`` read (``sow_max_logits``): each query head's largest
pre-softmax logit ``S_max^h`` (Kimi K2, arXiv 2507.20534, section 2.1), over the batch, the
queries and the keys its mask allows (the sliding window of a local layer included). Heads
come in ``q_einsum``'s order. Nothing is computed unless ``intermediates`` is mutable::

  from gemma import gm
  model = gm.nn.Gemma3_1B()
  with muonclip_jax.nn.capture_gemma():
    logits, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
  # state["intermediates"]["layer_0"]["attn"]["max_logits"]: (num_heads,)

It must be active while the model is *traced*: inside the loss function a train step jits.
Enter it innermost among Flax method interceptors: one entered inside it does not see the
attention calls themselves (the capture runs gemma's function in their place).

How: Flax's public ``nn.intercept_methods`` sees each ``Attention.__call__``; the adapter runs
gemma's own function in its place with one name of the function's globals rebound, ``jnp``,
to ``jax.numpy`` whose ``where`` also sows the maximum when gemma masks its logits. Nothing
in ``gemma`` is modified: other calls, threads and modules are untouched.

Traces made inside and outside the capture are never shared. ``gm.nn.Transformer.__call__``
runs under Flax's ``nn.jit``, whose cache of traces is keyed by the module, the mutable
collections and the argument shapes, not by the interceptors active when it traced: an apply
with ``mutable=["intermediates"]`` outside the capture (an eval step) would otherwise leave a
trace without the sows that every later captured apply of the same shapes reused, and a
captured trace would sow in a later apply outside the capture. The capture therefore also
sets a JAX user context (public ``jax.make_user_context``), which ``jax.jit`` adds to the key
of its tracing, lowering and compilation caches: ``nn.jit``'s inner ``jax.jit``, and any
``jax.jit`` entered inside the capture, trace once with the capture and once without. A
``capture_gemma()`` object can be entered again, and nested; each ``with`` is undone by its
own exit.

Private API, read from gemma 3.3.0 (Python 3.11) and 4.0.1 (Python 3.12), the same in both:
the module ``gemma.gm.nn._modules``, its ``Attention`` and ``K_MASK``, and that
``Attention.__call__`` masks its ``(batch, query, heads, key)`` logits with
``jnp.where(mask, logits, K_MASK)`` before the softmax, after soft-capping if any.
``tests/test_gemma_package.py`` fails if one moves, and a capture that sees an attention call
without that masking raises ``RuntimeError`` rather than return without the maxima.

Soft-capped attention (Gemma 2, ``attn_logits_soft_cap``) is refused: its masked logits are
already capped, and a maximum taken after ``cap * tanh(s / cap)`` cannot exceed the cap, so it
would hide the growth QK-Clip exists to stop (``examples/recipe_gemma.py`` sows before the
cap). Gemma 3 does not soft-cap its attention.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .rebind import with_numpy
from .sow import sow_max_logits

READ_FROM = "gemma 3.3.0 and 4.0.1"

# Part of jax.jit's cache keys: "capture_gemma" inside a capture, None outside. Created once, at
# import (jax.make_user_context is not thread-safe against other JAX calls).
_IN_CAPTURE = jax.make_user_context(default_value=None)


def _gemma_modules() -> Any:
  try:
    from gemma.gm.nn import _modules
  except ImportError as err:
    raise ImportError("capture_gemma needs Google DeepMind's gemma package (pip install gemma sentencepiece==0.2.2: "
                      f"sentencepiece 0.2.3 fails to import with gemma's protobuf; docs/your-model.md): {err}") from err
  for name in ("Attention", "K_MASK"):
    if not hasattr(_modules, name):
      raise RuntimeError(f"capture_gemma: gemma.gm.nn._modules has no {name!r} (read from {READ_FROM}); "
                         f"this gemma release moved it")
  return _modules


class _SowingNumpy:
  """``jax.numpy`` for one gemma attention call; ``where(mask, logits, K_MASK)`` also sows the maxima."""

  def __init__(self, module: Any, k_mask: float):
    self._module, self._k_mask, self.sown = module, k_mask, False

  def __getattr__(self, name: str) -> Any:
    return getattr(jnp, name)

  def where(self, condition: Any, x: Any = None, y: Any = None, **kwargs: Any) -> Any:
    if isinstance(y, float) and y == self._k_mask:  # (batch, query, heads, key) logits, mask (batch, query, 1, key)
      sow_max_logits(self._module, x, mask=condition, head_axis=2)
      self.sown = True
    return jnp.where(condition, x, y, **kwargs)


class _CaptureGemma:
  """The context manager ``capture_gemma()`` returns: reusable and re-entrant (module docstring)."""

  def __init__(self, modules: Any):
    self._modules = modules
    self._open = threading.local()  # per thread, as Flax's interceptors and JAX's contexts: a stack of exits

  def __enter__(self) -> None:
    if not hasattr(self._open, "exits"):
      self._open.exits = []
    with contextlib.ExitStack() as stack:
      stack.enter_context(_IN_CAPTURE("capture_gemma"))
      stack.enter_context(nn.intercept_methods(functools.partial(_intercept, self._modules)))
      self._open.exits.append(stack.pop_all())

  def __exit__(self, *exc_info: Any) -> bool:
    return self._open.exits.pop().__exit__(*exc_info)


def _intercept(modules: Any, next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
  """Runs a gemma ``Attention.__call__`` with the sowing ``jnp``; any other call as it is."""
  module = context.module
  if context.method_name != "__call__" or not isinstance(module, modules.Attention):
    return next_fun(*args, **kwargs)
  if module.attn_logits_soft_cap is not None:
    raise ValueError(
        f"capture_gemma: attention {'/'.join(module.path)!r} soft-caps its logits "
        f"(attn_logits_soft_cap={module.attn_logits_soft_cap}, Gemma 2) and masks them after the cap, where "
        "a maximum cannot exceed the cap; sow before it as examples/recipe_gemma.py does")
  numpy = _SowingNumpy(module, modules.K_MASK)
  if not isinstance(context.orig_method, functools.partial):  # flax 0.12: partial(function, module)
    raise RuntimeError(f"capture_gemma: flax's InterceptorContext.orig_method is {context.orig_method!r}, "
                       "not partial(function, module) as in flax 0.12; this flax release moved it")
  raw = context.orig_method.func
  out = with_numpy(raw, numpy)(module, *args, **kwargs)
  if not numpy.sown:
    raise RuntimeError(
        f"capture_gemma: gemma's attention {'/'.join(module.path)!r} did not mask its logits with "
        f"jnp.where(mask, logits, K_MASK) (read from {READ_FROM}); this gemma release computes them "
        "differently, so no maximum was captured")
  return out


def capture_gemma() -> contextlib.AbstractContextManager[None]:
  """Within it, every ``gemma`` package attention sows its per-head max logits (module docstring).

  The returned object may be entered again (``c = capture_gemma()``, then ``with c:`` in each
  step) and nested. Traces of gemma's ``nn.jit`` (and of any ``jax.jit`` entered inside the
  capture) made within and outside it are kept apart (module docstring).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gemma import gm
    >>> import muonclip_jax.nn as mcnn
    >>> attn = gm.nn.Attention(num_heads=4, num_kv_heads=2, features=16, head_dim=8, use_qk_norm=True,
    ...                        attn_type=gm.nn.AttentionType.GLOBAL, query_pre_attn_scalar=8 ** -0.5)
    >>> x, positions = jnp.ones((1, 4, 16)), jnp.arange(4)[None]
    >>> causal = jnp.tril(jnp.ones((1, 4, 4), bool))
    >>> variables = attn.init(jax.random.key(0), x, positions, None, causal)
    >>> with mcnn.capture_gemma():
    ...   _, state = attn.apply(variables, x, positions, None, causal, mutable=["intermediates"])
    >>> state["intermediates"]["max_logits"].shape
    (4,)

  Raises:
    ImportError: ``gemma`` is not installed.
    ValueError: (at trace time) an attention soft-caps its logits (Gemma 2).
    RuntimeError: the installed gemma no longer has the names or the masking this reads.
  """
  return _CaptureGemma(_gemma_modules())
