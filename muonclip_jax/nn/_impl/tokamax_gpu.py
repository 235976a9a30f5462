"""``impl="tokamax_gpu"``: tokamax's maintained GPU flash kernels with the max-logit capture.

tokamax's attention ops take ``return_residuals=True`` and return, per head and query
row, ``(m, l)``: the softmax's row maximum and denominator, shape ``(B, H, Tq)``. With
``logits_scale=softmax_scale``, ``m_hi`` is ``max_j s_hij`` over the row's visible keys,
QK-Clip's quantity (Kimi K2, arXiv 2507.20534, Sec. 2.1), when the kernel runs a
*stable* softmax (one that subtracts the running max). Evidence, per op (tokamax 0.0.12
and 0.0.17):

* ``xla`` (used on the CPU): ``jnp.max`` of the masked logits; tested against
  ``dense_attention`` by tests/test_tokamax_gpu.py.
* ``mosaic_gpu`` (SM90/SM100): read from ``pallas_mosaic_gpu_kernel_sm90.py``: the
  residual is ``m_i / log2(e)`` where ``m_i = max(m_i, rowmax(s) * scale * log2(e))`` is
  updated every key block, even when ``rescale_threshold < 1`` defers the rescaling
  (that uses a separate ``m_scale``), so it is exact and in natural units. Masked
  logits are ``-inf`` there.
* ``triton``: read from ``pallas_triton.py``: ``m_i = maximum(m_i, max(s))`` every block;
  with ``use_base2=True`` it is in base-2 units (we divide by log2(e)).

Both GPU kernels skip the maximum (``m = 0``) when the softmax is not stable, which
tokamax chooses for soft-capped logits (cap <= 60); this module passes no soft cap, so
their softmax is always stable here. The tests run the XLA op. The ``mosaic_gpu`` op's
maxima were checked against ``dense_attention``'s on an H100 (bf16, causal, MLA and GQA,
4096 and 8192 tokens: ``benchmarks/accelerator.py``, figures in benchmarks/RESULTS.md, "On
a GPU"); what is said above of the ``triton`` op rests on reading its code.
The ``triton`` op rests on JAX's Pallas Triton backend, which JAX 0.12 deprecates.

Masks: ``is_causal`` (bottom-right aligned) uses the op's ``is_causal`` when ``Tq == Tk``;
any other mask (segment ids, padding, cross-length causal, an explicit ``mask``) is
passed as one boolean ``(B, H|1, Tq, Tk)`` array, which the kernels read in tiles but
which costs ``B * Tq * Tk`` bytes to build. Rows without a visible key report the op's
mask value (``float32 min``), converted to ``-inf``, and return zeros.

Needs the optional extra ``pip install 'muonclip_jax[tokamax]'``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import tokamax_adapter
from .masking import check_and_prepare, dense_mask, head_max, Static
from .residual_max import row_max_from_residual

GPU_IMPLEMENTATIONS = ("mosaic_gpu", "triton")


def default_implementation(backend: str, compute_capability: str | None = None) -> str:
  """tokamax op for a backend: Mosaic GPU on SM90/SM100, Triton on older GPUs, XLA on CPU."""
  if backend == "cpu":
    return "xla"
  if backend in ("gpu", "cuda", "rocm"):
    major = None
    if compute_capability:
      try:
        major = int(str(compute_capability).split(".")[0])
      except ValueError:
        major = None
    return "mosaic_gpu" if major in (9, 10) else "triton"
  raise ValueError(
      f"attention(impl='tokamax_gpu'): no GPU kernel for the '{backend}' backend; use impl='splash' on "
      "TPU or impl='auto'"
  )


def _device_capability() -> str | None:
  dev = jax.devices()[0]
  return getattr(dev, "compute_capability", None)


def tokamax_gpu_attention(
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
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Attention through a tokamax op; same contract as ``dense_attention``.

  Args:
    implementation: static tokamax op name (``"mosaic_gpu"``, ``"triton"``, ``"xla"``);
      None: ``default_implementation`` for the default backend.
    (the others as ``dense_attention``)

  Reverse-mode differentiable (``grad``, ``vjp``: a custom VJP around tokamax's), not
  forward mode (``jvp``).

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import attention
    >>> q = k = v = jnp.linspace(-1.0, 1.0, 1 * 8 * 2 * 8).reshape(1, 8, 2, 8)
    >>> out, m = attention(q, k, v, softmax_scale=0.35, impl="tokamax_gpu", is_causal=True,
    ...                    return_max_logits=True)  # on the CPU: tokamax's XLA op
    >>> ref, ref_m = attention(q, k, v, softmax_scale=0.35, impl="dense", is_causal=True, return_max_logits=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5)), bool(jnp.allclose(m, ref_m))
    ((1, 8, 2, 8), True, True)
  """
  q_side, k_side = check_and_prepare(
      q, k, v, mask=mask, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      q_mask=q_mask, kv_mask=kv_mask, name="attention(impl='tokamax_gpu')",
      is_causal=is_causal, return_max_logits=return_max_logits,
  )
  if implementation is None:
    backend = jax.default_backend()
    implementation = default_implementation(
        backend, _device_capability() if backend == "gpu" else None)
  ops = tokamax_adapter.attention_implementations("impl='tokamax_gpu'")
  if implementation not in ops or implementation not in GPU_IMPLEMENTATIONS + ("xla",):
    raise ValueError(
        f"attention(impl='tokamax_gpu'): implementation {implementation!r} is not available; tokamax "
        f"offers {sorted(ops)} here, this path uses {GPU_IMPLEMENTATIONS + ('xla',)}"
    )
  op = ops[implementation]
  if getattr(op, "use_stable_softmax", True) is False:
    raise ValueError(f"attention(impl='tokamax_gpu'): op {implementation!r} has no stable softmax: "
                     "its residual is not a row maximum")
  b, tq, h, _ = q.shape
  tk = k.shape[1]
  # the op's is_causal is used for Tq == Tk only; causal with Tq != Tk (bottom-right) is in the mask
  cfg = Static(float(softmax_scale), bool(is_causal) and tq != tk, tq, tk, tk, False)
  allowed = dense_mask(cfg, q_side, k_side)
  run = lambda q, k, v: op(q, k, v, logits_scale=float(softmax_scale), mask=allowed,
                          is_causal=bool(is_causal) and tq == tk, return_residuals=True)
  out, (m, _) = tokamax_adapter.allowing_rank_promotion(run)(q, k, v)
  row_max = row_max_from_residual(
      m, log2_units=implementation == "triton" and bool(getattr(op, "use_base2", False)))
  visible = jnp.swapaxes(~jnp.isneginf(row_max), 1, 2)  # (B, Tq, H)
  out = jnp.where(visible[..., None], out, 0).astype(jnp.result_type(q.dtype, k.dtype, v.dtype))
  return out, (head_max(row_max, head_axis=1) if return_max_logits else None)
