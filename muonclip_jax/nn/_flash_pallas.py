"""Fused flash attention in Pallas that emits each head's max logit (``impl="pallas"``).

Deprecated: the kernels (``_flash_pallas_kernels``) are written for JAX's Pallas Triton
backend, which JAX 0.12 deprecates ("will be removed in a future JAX version").
``impl="tokamax_gpu"`` (tokamax's maintained Mosaic GPU and Triton kernels, same capture)
replaces it on GPU and ``impl="auto"`` never selects it; it stays as an interpret-mode
reference until JAX's Triton backend is removed (benchmarks/RESULTS.md records the
decision). Compiling it for a GPU (``interpret=False``) emits a ``DeprecationWarning``.

The forward kernel's final running row maximum is exactly each row's max logit; with
capture on it is written out ``(B, H, Tq)`` and reduced here over batch and real rows to
the per-head maxima: no second pass over ``Q K^T``.

Lowering: Pallas Triton on GPU (``jax.experimental.pallas.triton``); on a CPU backend
the same kernels run in Pallas interpret mode (slow: for tests and CPU correctness, not
speed). No TPU Mosaic variant is written: on any other backend (TPU) the default raises
ValueError rather than silently interpreting; pass ``interpret=True`` to run it there
anyway, or use ``impl="chunked"``/``"dpa_max"``. Triton needs power-of-two tiles of at least 16,
so the head widths are zero-padded to the next power of two (MLA's 192 runs as 256: zero
columns change no dot product) and the lengths to a multiple of the tile; padded keys
are masked, padded queries are dropped before the maximum.

XLA does not partition a Pallas call: on a mesh, call it inside ``jax.shard_map`` (batch
and heads shard freely).

Masks: causal (bottom-right aligned), segment ids, ``q_mask``/``kv_mask``. The explicit
``(B, H, Tq, Tk)`` boolean ``mask`` of ``attention`` is not supported (it would be a
``Tq x Tk`` input to stream): use ``"dense"``, ``"chunked"`` or ``"dpa_max"`` for it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from .._checks import check_bool
from .._deprecation import renamed_keywords, user_stacklevel
from ._flash_pallas_kernels import MAX_TILE, KernelConfig, flash, pow2_at_least, tile
from ._masking import check_and_prepare, check_block_size, head_max, pad_axis


def _default_interpret(backend: str) -> bool:
  """``interpret=None`` on ``backend``: False (Triton) on GPU, True on CPU, else ValueError."""
  if backend in ("gpu", "cuda", "rocm"):
    return False
  if backend == "cpu":
    return True
  raise ValueError(
      f"pallas_attention: the fused kernel has no variant for the {backend!r} backend (it is "
      "written for Pallas Triton on GPU; on TPU there is no Mosaic variant), and interpret mode "
      "there would be very slow; pass interpret=True explicitly to run it anyway, or use "
      "impl='chunked' or impl='dpa_max'"
  )


@renamed_keywords(causal="is_causal")
def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float,
    is_causal: bool = False,
    mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_mask: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    return_max_logits: bool = False,
    block_size: int = MAX_TILE,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Fused Pallas flash attention with max-logit capture (see the module docstring).

  Same arguments, outputs, gradients and maxima as ``dense_attention`` (to float
  tolerance), except the explicit ``mask``, which raises ``ValueError``. Reverse-mode
  differentiable (custom VJP), not forward mode.

  Args:
    block_size: cap on the query and key tiles: the tile is the largest power of two
      ``<= min(block_size, 64)`` (32 in the backward kernels), at least 16, and no longer
      than the sequence rounded up to a power of two.
    interpret: run the kernels in Pallas interpret mode. ``None``: compiled Triton on a
      GPU, interpret mode on a CPU, ValueError on any other backend (no TPU variant).
    (the others as in ``dense_attention``)

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import dense_attention, pallas_attention
    >>> q = k = v = jnp.linspace(-1.0, 1.0, 1 * 8 * 2 * 8).reshape(1, 8, 2, 8)
    >>> out, m = pallas_attention(q, k, v, softmax_scale=0.35, is_causal=True,
    ...                           return_max_logits=True, interpret=True)  # Pallas interpret mode
    >>> ref, ref_m = dense_attention(q, k, v, softmax_scale=0.35, is_causal=True, return_max_logits=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5)), bool(jnp.allclose(m, ref_m))
    ((1, 8, 2, 8), True, True)
  """
  if mask is not None:
    raise ValueError(
        "pallas_attention: the explicit boolean `mask` (B, H, Tq, Tk) is not supported by "
        "the fused kernel; use is_causal/q_segment_ids/kv_segment_ids/q_mask/kv_mask, or "
        "impl='dense', 'chunked' or 'dpa_max'"
    )
  check_block_size(block_size, "pallas_attention")
  q_side, k_side = check_and_prepare(
      q, k, v, mask=None, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="pallas_attention", is_causal=is_causal, return_max_logits=return_max_logits,
  )
  b, tq, h, d = q.shape
  tk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  check_bool("pallas_attention: interpret", interpret, allow_none=True)
  if interpret is None:
    interpret = _default_interpret(jax.default_backend())
  if not interpret:
    warnings.warn(
        "pallas_attention (impl='pallas') rests on JAX's Pallas Triton backend, which JAX "
        "deprecates; use impl='tokamax_gpu' or impl='auto' (pip install 'muonclip_jax[tokamax]')",
        DeprecationWarning, stacklevel=user_stacklevel(),
    )
  cfg = KernelConfig(
      scale=float(softmax_scale), is_causal=bool(is_causal), tq=tq, tk=tk,
      bq=tile(block_size, tq), bk=tile(block_size, tk), groups=h // hkv,
      segments=q_side.segment_ids is not None, q_valid=q_side.mask is not None,
      kv_valid=k_side.mask is not None, capture=bool(return_max_logits),
      interpret=bool(interpret),
  )
  tqp, tkp = -(-tq // cfg.bq) * cfg.bq, -(-tk // cfg.bk) * cfg.bk
  dp, dvp = pow2_at_least(d), pow2_at_least(dv)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  qp = pad_axis(pad_axis(q.astype(dtype), 1, tqp), 3, dp)
  kp = pad_axis(pad_axis(k.astype(dtype), 1, tkp), 3, dp)
  vp = pad_axis(pad_axis(v.astype(dtype), 1, tkp), 3, dvp)
  aux = []
  if cfg.segments:
    aux += [pad_axis(q_side.segment_ids.astype(jnp.int32), 1, tqp),
            pad_axis(k_side.segment_ids.astype(jnp.int32), 1, tkp)]
  if cfg.q_valid:
    aux.append(pad_axis(q_side.mask.astype(jnp.int32), 1, tqp))
  if cfg.kv_valid:
    aux.append(pad_axis(k_side.mask.astype(jnp.int32), 1, tkp))
  out, row_max = flash(cfg, qp, kp, vp, tuple(aux))
  out = out[:, :tq, :, :dv]
  if not cfg.capture:
    return out, None
  # Epilogue: the kernel's final running row maxima, reduced over batch and real rows.
  return out, head_max(row_max[:, :, :tq], head_axis=1)
