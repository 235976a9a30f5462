"""The one place that imports tokamax, including its private modules.

tokamax (Google's Pallas kernel library, https://github.com/openxla/tokamax) is an
optional extra: ``pip install 'muonclip_jax[tokamax]'``. Its public API
(``tokamax.dot_product_attention``) returns only the attention output; the per-row
statistics that carry the max logit are reachable only through private modules, all
imported here and nowhere else:

* ``tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_kernel``:
  ``SplashConfig``, ``make_splash_mha_single_device`` (``save_residuals=True`` returns
  ``stats["max_logits"]``, already divided by log2(e) when ``use_base2_exp``);
* ``...splash_attention.splash_attention_mask``: ``CausalMask``, ``LocalMask``,
  ``FullMask``; ``...splash_attention.base``: ``SegmentIds``, ``DEFAULT_MASK_VALUE``;
* ``tokamax._src.ops.attention.api.IMPLEMENTATIONS``: the attention ops
  (``xla``, ``triton``, ``mosaic_gpu``, ...), whose ``return_residuals=True`` gives
  ``(row max, softmax denominator)``, each ``(*B, H, T)``.

Read from tokamax 0.0.12 (with JAX 0.10.2) and 0.0.17 (with JAX 0.12): the names
above are the same in both. ``tests/test_tokamax_adapter.py`` fails if one moves.
"""

from __future__ import annotations

from typing import Any

import jax

EXTRA = "pip install 'muonclip_jax[tokamax]'"
TESTED_VERSIONS = ("0.0.12", "0.0.17")


def _missing(what: str, err: Exception) -> ImportError:
  return ImportError(f"{what} needs tokamax, an optional dependency: {EXTRA} ({err})")


def splash_modules(what: str) -> Any:
  """``(kernel, mask, base)`` modules of tokamax's TPU splash attention."""
  try:
    from tokamax._src.ops.experimental.tpu.splash_attention import base
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as kernel
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask
  except ImportError as err:
    raise _missing(what, err) from err
  return kernel, mask, base


def _absl_flags_parsed() -> None:
  """Marks absl's flags parsed (defaults) unless something already parsed them.

  tokamax's config (``tokamax._src.config``) reads its options as absl flags and, when
  no absl program parsed them, parses ``sys.argv`` itself on first use: any command line
  with options absl does not know (``pytest -q``, an argparse script) then raises
  ``UnrecognizedFlagError``. Marking them parsed keeps tokamax's defaults; an absl
  ``app.run`` still parses its own argv.
  """
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def attention_implementations(what: str) -> Any:
  """tokamax's ``IMPLEMENTATIONS`` mapping (name -> attention op)."""
  try:
    from tokamax._src.ops.attention import api
  except ImportError as err:
    raise _missing(what, err) from err
  _absl_flags_parsed()
  return api.IMPLEMENTATIONS


def version() -> str | None:
  """The installed tokamax version, or None when it is not installed (imports nothing)."""
  from importlib import metadata

  try:
    return metadata.version("tokamax")
  except metadata.PackageNotFoundError:
    return None


def allowing_rank_promotion(fn):
  """``fn(q, k, v) -> (out, stats)`` traced, forward and backward, with rank promotion allowed.

  tokamax broadcasts arrays of different ranks (0.0.17's splash kernel ``(1, 1)`` against
  ``(1,)``, forward and backward; its attention ops a ``(Tq, Tk)`` causal mask against
  ``(B, 1, Tq, Tk)``), which fails under ``jax_numpy_rank_promotion="raise"``. A custom VJP traces
  the backward pass inside the same context, whatever the caller's setting.
  """

  @jax.custom_vjp
  def call(q, k, v):
    with jax.numpy_rank_promotion("allow"):
      return fn(q, k, v)

  def fwd(q, k, v):
    with jax.numpy_rank_promotion("allow"):
      out, vjp, stats = jax.vjp(fn, q, k, v, has_aux=True)
    return (out, stats), vjp

  def bwd(vjp, cts):
    with jax.numpy_rank_promotion("allow"):
      return vjp(cts[0])

  call.defvjp(fwd, bwd)
  return call
