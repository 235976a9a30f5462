"""Rotary position embeddings (RoPE) with optional YaRN long-context scaling.

RoPE (Su et al., "RoFormer", arXiv 2104.09864, Sec. 3.4) rotates pairs of coordinates
of a ``D``-wide vector at position ``p`` by the angle ``p * theta_i`` with
``theta_i = base^(-2i / D)``, ``i < D/2``. By default the pairs are ``(x_i, x_{i + D/2})``
("rotate half", GPT-NeoX/Llama). With ``rope_interleave=True`` they are
``(x_{2i}, x_{2i+1})``, as in DeepSeek-V3's reference ``inference/model.py``
(``view_as_complex``) and Hugging Face's ``rope_interleave``: checkpoints trained that way
load without permuting their rotary columns. The two pairings differ by a fixed
permutation of the rotary columns, which changes nothing for QK-Clip. Rotations preserve
norms and make ``<R_m q, R_n k>`` a function of ``m - n`` only.

YaRN (Peng et al., arXiv 2309.00071: "NTK-by-parts" interpolation plus the attention
temperature ``sqrt(1/t) = 0.1 ln(s) + 1``) as used by DeepSeek-V3 (arXiv 2412.19437,
Sec. 4.3) interpolates each frequency between ``theta_i / s`` (position
interpolation, for slow dimensions) and ``theta_i`` (kept, for fast ones):

  gamma_i = 1 - clip((i - low) / (high - low), 0, 1), where ``low = max(floor(c_fast), 0)``
    and ``high = min(ceil(c_slow), D - 1)``, ``c_beta`` being the (fractional) index whose
    frequency makes ``beta`` rotations over the original context ``L_orig``
    (``beta_fast`` for ``low``, ``beta_slow`` for ``high``; ``high += 0.001`` when
    ``high == low``): 1 for fast dimensions, 0 for slow ones;
  theta_i' = (1 - gamma_i) * theta_i / s + gamma_i * theta_i

and corrects the softmax temperature by ``mscale = 0.1 * m * ln(s) + 1``;
DeepSeek-V3 multiplies the softmax scale ``1 / sqrt(d_qk)`` by ``mscale^2``
(``softmax_scale`` below).

The ramp is exactly DeepSeek-V3's reference ``precompute_freqs_cis`` for every
configuration: ``find_correction_range`` clamps ``high`` to ``D - 1``, the rotary width,
although the ramp runs over ``D/2`` frequencies (Hugging Face's YaRN does the same);
equal betas (Kimi K2: 1.0 / 1.0) give a one-step ramp; and when ``low > high`` (a huge
``L_orig``) the formula is kept as the reference has it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._util import check_bool


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN long-context scaling of the rotary frequencies (arXiv 2309.00071).

  Attributes:
    factor: context extension factor ``s`` (new length / original length), ``>= 1``.
    original_max_position: context length ``L_orig`` the model was pretrained with.
    beta_fast: rotations over ``L_orig`` above which a dimension is kept (DeepSeek-V3: 32).
    beta_slow: rotations over ``L_orig`` below which a dimension is interpolated (1);
      ``beta_slow <= beta_fast`` (equal betas, as in Kimi K2, make a one-index ramp).
    mscale: coefficient ``m`` of the temperature correction ``0.1 * m * ln(s) + 1`` (1.0).

  Example:
    >>> from muonclip_jax.nn import YarnScaling, rope_frequencies, softmax_scale
    >>> yarn = YarnScaling(factor=40.0, original_max_position=4096)
    >>> freqs = rope_frequencies(64, yarn=yarn)
    >>> freqs.shape, float(freqs[0]), round(float(freqs[-1] * 40 / rope_frequencies(64)[-1]), 6)
    ((32,), 1.0, 1.0)
    >>> round(softmax_scale(192, yarn) / softmax_scale(192), 4)  # mscale^2 = (0.1 ln 40 + 1)^2
    1.8739
  """

  factor: float
  original_max_position: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0

  def __post_init__(self):
    if not self.factor >= 1.0:
      raise ValueError(f"YarnScaling: factor must be >= 1, got {self.factor!r}")
    if not (isinstance(self.original_max_position, int) and self.original_max_position >= 1):
      raise ValueError(
          "YarnScaling: original_max_position must be an int >= 1, "
          f"got {self.original_max_position!r}"
      )
    if not self.beta_fast >= self.beta_slow > 0:
      raise ValueError(
          "YarnScaling: need beta_fast >= beta_slow > 0, "
          f"got beta_fast={self.beta_fast!r}, beta_slow={self.beta_slow!r}"
      )


def _correction_index(num_rotations: float, dim: int, base: float, max_position: int) -> float:
  """Index ``i`` whose frequency makes ``num_rotations`` turns over ``max_position``.

  Solves ``max_position * base^(-2i/dim) = 2 pi * num_rotations`` for ``i``.
  """
  return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(
    dim: int, *, base: float = 10000.0, yarn: YarnScaling | None = None
) -> np.ndarray:
  """Angular frequencies ``theta_i`` (radians per position) of a ``dim``-wide rotary embedding.

  Args:
    dim: rotary width ``D`` (even).
    base: RoPE base (``rope_theta``).
    yarn: optional YaRN scaling; ``None`` gives plain RoPE.

  Returns:
    A float64 NumPy array of shape ``(dim // 2,)`` (static, computed once at trace time).

  Example:
    >>> from muonclip_jax.nn import rope_frequencies
    >>> rope_frequencies(4).round(6).tolist()  # base^(-2i / D), i < D / 2
    [1.0, 0.01]
  """
  if dim % 2 or dim <= 0:
    raise ValueError(f"rope_frequencies: dim must be a positive even int, got {dim!r}")
  if not base > 1.0:
    raise ValueError(f"rope_frequencies: base must be > 1, got {base!r}")
  half = dim // 2
  freqs = base ** (-np.arange(half, dtype=np.float64) * 2.0 / dim)
  if yarn is None or yarn.factor == 1.0:
    return freqs
  low = math.floor(_correction_index(yarn.beta_fast, dim, base, yarn.original_max_position))
  high = math.ceil(_correction_index(yarn.beta_slow, dim, base, yarn.original_max_position))
  low, high = max(low, 0), min(high, dim - 1)  # dim - 1, not half - 1: as the reference
  if high == low:
    high += 1e-3  # avoid 0/0 when the ramp collapses to a step (as the reference)
  keep = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - keep  # 1 for fast dimensions (kept), 0 for slow ones (interpolated)
  return freqs / yarn.factor * (1.0 - keep) + freqs * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``).

  Example:
    >>> from muonclip_jax.nn import yarn_mscale
    >>> round(yarn_mscale(40.0), 4), yarn_mscale(1.0)  # 0.1 * ln(40) + 1; no scaling: 1
    (1.3689, 1.0)
  """
  if factor <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, yarn: YarnScaling | None = None) -> float:
  """The number multiplying ``q . k`` before the softmax.

  ``1 / sqrt(qk_head_dim)``, times ``yarn_mscale(s, m)^2`` with YaRN, as DeepSeek-V3.

  Example:
    >>> from muonclip_jax.nn import YarnScaling, softmax_scale
    >>> softmax_scale(64)  # 1 / sqrt(64)
    0.125
    >>> round(softmax_scale(64, YarnScaling(factor=40.0, original_max_position=4096)), 5)
    0.23423
  """
  scale = qk_head_dim**-0.5
  if yarn is not None:
    scale *= yarn_mscale(yarn.factor, yarn.mscale) ** 2
  return scale


def default_positions(batch: int, length: int) -> jax.Array:
  """``(batch, length)`` int32 positions ``0 .. length-1``."""
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    base: float = 10000.0,
    yarn: YarnScaling | None = None,
    rope_interleave: bool = False,
) -> jax.Array:
  """Rotates ``x`` of shape ``(batch, seq, heads, D)`` by its ``positions`` ``(batch, seq)``.

  Rotate-half pairing (default): ``out[..., i] = x_i cos(p theta_i) - x_{i+D/2} sin(p theta_i)``
  and ``out[..., i+D/2] = x_{i+D/2} cos(p theta_i) + x_i sin(p theta_i)`` for ``i < D/2``
  (RoFormer Sec. 3.4). ``rope_interleave=True``: the same with the pair
  ``(x_{2i}, x_{2i+1})`` written to ``(out_{2i}, out_{2i+1})``, i.e. the complex product
  ``(x_{2i} + j x_{2i+1}) e^{j p theta_i}`` of DeepSeek-V3's ``apply_rotary_emb``.
  Angles are computed in float32; the result has the dtype of ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> from muonclip_jax.nn import apply_rope
    >>> x = jnp.ones((1, 3, 2, 4))  # (batch, seq, heads, D)
    >>> positions = jnp.arange(3)[None, :]
    >>> out = apply_rope(x, positions)
    >>> out.shape, bool(jnp.allclose(jnp.linalg.norm(out, axis=-1), 2.0))  # rotations keep norms
    ((1, 3, 2, 4), True)
    >>> bool(jnp.allclose(out[:, 0], x[:, 0]))  # position 0 is not rotated
    True
  """
  check_bool("apply_rope: rope_interleave", rope_interleave)
  if x.ndim != 4:
    raise ValueError(f"apply_rope: expected x of shape (batch, seq, heads, dim), got {x.shape}")
  if positions.shape != x.shape[:2]:
    raise ValueError(
        f"apply_rope: positions must have shape {x.shape[:2]} (batch, seq), got {positions.shape}"
    )
  dim = x.shape[-1]
  freqs = jnp.asarray(rope_frequencies(dim, base=base, yarn=yarn), jnp.float32)
  angles = positions.astype(jnp.float32)[:, :, None, None] * freqs[None, None, None, :]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  if rope_interleave:
    pairs = xf.reshape(*x.shape[:-1], dim // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
