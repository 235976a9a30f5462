"""``attention``: the one place that chooses an attention implementation.

Every implementation computes scaled dot-product attention and can report, for each head
``h``, the largest logit that enters its softmax (QK-Clip, Kimi K2, arXiv 2507.20534,
Sec. 2.1):

  S_max^h = max over batch b, query i, key j with (i, j) unmasked of  s_{b,h,i,j},
  s_{b,h,i,j} = softmax_scale * <q_{b,i,h}, k_{b,j,g(h)}>,   g(h) = h // (H // Hkv).

They share one contract (arguments, masks, outputs; ``_impl.masking`` holds the shared parts)
and each lives in its own module:

* ``"dense"`` (``_impl.dense``): the materialized reference, ``O(Tq * Tk)`` memory.
* ``"chunked"`` (``_impl.chunked``): online softmax in a ``lax.scan`` over key blocks; its
  running row maximum is the capture.
* ``"dpa_max"`` (``_impl.dpa_max``): ``jax.nn.dot_product_attention`` plus a max-only pass.
* ``"splash"`` (``_impl.splash``) and ``"tokamax_gpu"`` (``_impl.tokamax_gpu``): tokamax's maintained
  TPU and GPU kernels (the optional ``tokamax`` extra, imported only when called).
* ``"auto"`` (``_impl.auto``): one of the above by backend and masks.

Grouped-query attention: ``q`` has ``H`` heads, ``k``/``v`` have ``Hkv`` heads with
``H % Hkv == 0``. Multi-head latent attention passes its per-head keys with ``Hkv == H``.
"""

from __future__ import annotations

from typing import Literal

import jax

from .._util import check_bool
from ._impl import (check_soft_cap, chunked_attention, dense_attention, dpa_max_attention, resolve_impl,
                    splash_attention, tokamax_gpu_attention)

AttentionImpl = Literal["auto", "dense", "chunked", "dpa_max", "splash", "tokamax_gpu"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "dense", "chunked", "dpa_max", "splash", "tokamax_gpu")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    impl: AttentionImpl = "auto",
    block_size: int = 512,
    is_causal: bool = False,
    mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_mask: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    return_max_logits: bool = False,
    logits_soft_cap: float | None = None,
    window: tuple[int | None, int | None] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Dispatches on ``impl``, the one place that chooses an implementation.

  * ``"dense"``: ``dense_attention``, the materialized reference.
  * ``"chunked"``: ``chunked_attention``, online softmax in ``lax.scan`` (key blocks of
    ``block_size``).
  * ``"dpa_max"``: ``dpa_max_attention``, ``jax.nn.dot_product_attention`` (cuDNN where
    it applies) plus a max-only pass over key blocks of ``block_size``.

  * ``"splash"``: ``splash_attention``, tokamax's TPU splash kernel (interpret mode on the
    CPU); no explicit ``mask``; a local ``window=(left, right)`` (query ``i`` sees key ``j``
    only if ``i + Tk - Tq - left <= j <= i + Tk - Tq + right``, None unbounded on that side;
    splash only: any other ``impl`` with a window raises ValueError). Needs the ``tokamax``
    extra.
  * ``"tokamax_gpu"``: ``tokamax_gpu_attention``, tokamax's maintained GPU flash kernels
    (Mosaic GPU on SM90/SM100, else Triton; its XLA op on the CPU). Needs ``tokamax``.
  * ``"auto"`` (default): ``resolve_impl`` picks one of the above from the backend and
    the masks (splash on TPU, ``tokamax_gpu`` on GPU, ``dense`` on CPU), logging any
    fallback.

  See ``dense_attention`` for the arguments and outputs, which all share.
  ``logits_soft_cap`` (``cap * tanh(s / cap)`` before the softmax; the maxima stay those of
  the logits before the cap) is supported by ``"dense"``, and by ``"splash"`` without
  ``return_max_logits`` (splash keeps only the capped maximum); any other ``impl`` with a
  cap raises ValueError, and ``"auto"`` then falls back to ``"dense"`` with a log line.

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = k = v = jnp.ones((1, 4, 2, 8))  # (batch, length, heads, head_dim)
    >>> out, max_logits = attention(q, k, v, softmax_scale=8 ** -0.5, impl="dense",
    ...                             is_causal=True, return_max_logits=True)
    >>> out.shape, max_logits.shape
    ((1, 4, 2, 8), (2,))
    >>> round(float(max_logits[0]), 4)  # q . k / sqrt(8) = 8 / sqrt(8)
    2.8284
  """
  check_bool("attention: is_causal", is_causal)
  check_bool("attention: return_max_logits", return_max_logits)
  if impl == "auto":
    impl = resolve_impl(q, k, v, mask=mask, is_causal=is_causal, logits_soft_cap=logits_soft_cap,
                        return_max_logits=return_max_logits)
  check_soft_cap(logits_soft_cap, impl if impl in ATTENTION_IMPLS else "dense", "attention")
  if window is not None and impl != "splash":
    raise ValueError(f"attention: window={window!r} is supported only with impl='splash', got impl={impl!r}")
  kwargs = dict(
      softmax_scale=softmax_scale, is_causal=is_causal, mask=mask, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, q_mask=q_mask, kv_mask=kv_mask,
      return_max_logits=return_max_logits,
  )
  if impl == "dense":
    return dense_attention(q, k, v, logits_soft_cap=logits_soft_cap, **kwargs)
  if impl == "chunked":
    return chunked_attention(q, k, v, block_size=block_size, **kwargs)
  if impl == "dpa_max":
    return dpa_max_attention(q, k, v, block_size=block_size, **kwargs)
  if impl == "splash":
    return splash_attention(q, k, v, block_size=block_size, logits_soft_cap=logits_soft_cap, window=window,
                            **kwargs)
  if impl == "tokamax_gpu":
    return tokamax_gpu_attention(q, k, v, **kwargs)
  raise ValueError(f"attention: impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
