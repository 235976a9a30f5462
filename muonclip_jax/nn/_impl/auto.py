"""``impl="auto"``: which attention implementation runs, by backend and mask.

* TPU: ``"splash"`` (tokamax's splash kernel, fused capture). Falls back to
  ``"chunked"`` when tokamax is not installed, when an explicit ``(B, H, Tq, Tk)`` mask
  is given (splash's masks are static), or for ``is_causal`` with ``Tq > Tk``.
* GPU: ``"tokamax_gpu"`` (Mosaic GPU on SM90/SM100, else Triton; fused capture). Falls
  back to ``"dpa_max"`` (``jax.nn.dot_product_attention`` plus a max-only pass) when
  tokamax is not installed.
* CPU (and any other backend): ``"dense"``, the reference (tests and small models).

Every fallback is logged (``logging.getLogger("muonclip_jax")``, level WARNING, once
per reason), never silent. The choice is made at trace time from static shapes and the
presence (not the values) of the mask.
"""

from __future__ import annotations

import functools
import logging

import jax

from . import tokamax_adapter

logger = logging.getLogger("muonclip_jax")


@functools.lru_cache(maxsize=None)
def _log_fallback(chosen: str, reason: str) -> None:
  logger.warning("attention(impl='auto'): using impl=%r because %s", chosen, reason)


def resolve_impl(q, k, v, *, mask=None, is_causal: bool = False, backend: str | None = None,
                 logits_soft_cap: float | None = None, return_max_logits: bool = False) -> str:
  """The implementation ``impl="auto"`` runs for these inputs on ``backend``.

  With a ``logits_soft_cap``: ``"dense"`` (logged) wherever the chosen kernel cannot take
  it: with ``return_max_logits`` everywhere (only ``"dense"`` keeps the maxima before the
  cap), and on GPU (tokamax's GPU op is called without a cap).
  """
  del v
  backend = jax.default_backend() if backend is None else backend
  if backend not in ("tpu", "gpu", "cuda", "rocm"):
    return "dense"  # without importing tokamax
  if logits_soft_cap is not None and (return_max_logits or backend != "tpu"):
    _log_fallback("dense", "only 'dense' applies a logits_soft_cap here and keeps the maxima before it")
    return "dense"
  has_tokamax = tokamax_adapter.version() is not None
  if backend == "tpu":
    reason = None
    if not has_tokamax:
      reason = f"tokamax is not installed ({tokamax_adapter.EXTRA})"
    elif mask is not None:
      reason = "splash cannot take an explicit (B, H, Tq, Tk) mask array"
    elif is_causal and q.shape[1] > k.shape[1]:
      reason = "splash does not support causal attention with Tq > Tk"
    if reason is None:
      return "splash"
    _log_fallback("chunked", reason)
    return "chunked"
  if has_tokamax:  # GPU
    return "tokamax_gpu"
  _log_fallback("dpa_max", f"tokamax is not installed ({tokamax_adapter.EXTRA})")
  return "dpa_max"
