"""The two private Flax APIs the max-logit capture reads, and nothing else.

Read from flax 0.12.8 and 0.12.12 (the versions this package is tested with):

* ``flax.linen.module._context.module_stack`` (``flax/linen/module.py``): a thread-local
  list on which Linen pushes a module while one of its methods runs (``_call_wrapped_method``)
  and from which every submodule built in a ``compact`` method takes its parent. Its top is
  the module whose method is running, ``None`` outside Linen. There is no public way to ask
  "which module called me": it is needed only by code that calls an attention function
  without ``module=``, such as Flax's ``MultiHeadDotProductAttention`` without
  ``sow_weights`` or Hugging Face's Flax models, which call
  ``flax.linen.dot_product_attention_weights`` with no ``module``.
* ``Module.__captures__`` (``flax/nnx/module.py``): ``nnx.capture(fn, nnx.Intermediate)``
  sets it on every module for the duration of the call, a tuple of one variable per captured
  type; ``Module.sow`` looks it up the same way. Reading it tells whether a maximum is
  wanted at all, so that nothing is computed outside a capture.

Both are probed once, on first use, with a tiny module (a Linen module whose method looks
for itself on the stack; an NNX module called under ``nnx.capture``). If a Flax release moves
or changes either, that probe fails and every capture raises RuntimeError at trace time,
naming the API: it never returns without sowing. ``tests/test_capture.py`` runs the
probes, so such a release fails the tests too.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
from flax import nnx
from flax.linen import module as _linen_module

_READ_FROM = "flax 0.12.8 and 0.12.12"


def _moved(what: str, detail: str) -> RuntimeError:
  return RuntimeError(
      f"muonclip_jax cannot capture max logits with flax {flax.__version__}: {what} ({detail}). It was "
      f"read from {_READ_FROM}; this Flax release moved or changed it. Pass module= explicitly (Linen), or "
      "use a Flax version listed in muonclip_jax's requirements; please report it")


def _linen_stack() -> list:
  stack = getattr(getattr(_linen_module, "_context", None), "module_stack", None)
  if not isinstance(stack, list):
    raise _moved("flax.linen.module._context.module_stack", f"found {type(stack).__name__}, not a list")
  return stack


class _LinenProbe(nn.Module):
  @nn.compact
  def __call__(self):
    stack = _linen_stack()
    return bool(stack) and stack[-1] is self


@functools.cache
def _check_linen() -> None:
  found = _LinenProbe(parent=None).apply({})
  if found is not True:
    raise _moved("flax.linen.module._context.module_stack", "its top is not the module whose method runs")


def linen_calling_module() -> nn.Module | None:
  """The Linen module whose method is running (the caller of an attention function), or None.

  Raises RuntimeError when Flax's private module stack is gone or no longer means this.
  """
  _check_linen()
  stack = _linen_stack()
  return stack[-1] if stack else None


class _NNXProbe(nnx.Module):
  def __call__(self):
    return nnx_capturing(self, _probing=True)


def nnx_capturing(module: nnx.Module, *, _probing: bool = False) -> bool:
  """Whether ``module`` runs inside ``nnx.capture(..., nnx.Intermediate)``.

  Raises RuntimeError when ``nnx.capture`` no longer marks modules with ``__captures__``.
  """
  if not _probing:
    _check_nnx()
  captures = getattr(module, "__captures__", None)
  return captures is not None and any(type(c) is nnx.Intermediate for c in captures)


@functools.cache
def _check_nnx() -> None:
  capture = getattr(nnx, "capture", None)
  if capture is None:
    raise _moved("flax.nnx.capture", "it does not exist")
  try:
    found, _ = capture(_NNXProbe(), nnx.Intermediate)()
  except Exception as e:  # noqa: BLE001 (any failure of the probe means the API moved)
    raise _moved("nnx.capture / Module.__captures__", f"the probe raised {e!r}") from e
  if found is not True:
    raise _moved("Module.__captures__", "nnx.capture(module, nnx.Intermediate) no longer sets it")


def check_module(module: Any, where: str) -> Any:
  """``module`` if it is a Linen or NNX module, else TypeError naming ``where``."""
  if not isinstance(module, (nn.Module, nnx.Module)):
    raise TypeError(f"{where}: module must be a Flax Linen or NNX module, got {module!r}")
  return module
