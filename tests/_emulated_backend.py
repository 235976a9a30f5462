"""Run JAX code on the CPU as if on another backend: its default matmul precision and its name.

``emulate(backend)`` (``"cpu"``, ``"gpu"`` or ``"tpu"``) is a context manager in which

* ``jax.default_backend()`` returns ``backend``, and
* every float32 x float32 ``dot_general`` rounds its operands the way that backend's matmul
  unit does, then multiplies the rounded operands exactly in float32 (``Precision.HIGHEST``
  on the real CPU). Products of two rounded operands are exact in float32 (at most 2 x 11
  significant bits); only the float32 accumulation rounds, as on the hardware.

What a float32 x float32 dot computes here, by the precision it names (JAX docs, "Matmul
precision" and ``jax.lax.Precision``'s docstring; google/jax #1856, #18934):

===============================================  =========  =========  =========
precision                                        ``"cpu"``  ``"gpu"``  ``"tpu"``
===============================================  =========  =========  =========
None, ``Precision.DEFAULT``, preset ``DEFAULT``  exact      TF32       bf16
``Precision.HIGH``                               exact      TF32       bf16 x 3
``Precision.HIGHEST``, ``F32_F32_F32``           exact      exact      exact
``BF16_BF16_F32``                                bf16       bf16       bf16
``BF16_BF16_F32_X3``                             bf16 x 3   bf16 x 3   bf16 x 3
``TF32_TF32_F32``                                TF32       TF32       TF32
``TF32_TF32_F32_X3``                             TF32 x 3   TF32 x 3   TF32 x 3
``F16_F16_F32``                                  float16    float16    float16
===============================================  =========  =========  =========

* bf16: each operand rounded to bfloat16 (8 significant bits, round to nearest even), one pass.
* TF32: each operand rounded to 10 explicit mantissa bits, round to nearest even on the float32
  bits (``lax.reduce_precision(x, 8, 10)``: the NumPy bit reference ``tf32_round_numpy`` below
  agrees bit for bit). Real tensor cores fed float32 may truncate instead; this is the
  rounding the brief asked for.
* float16: each operand converted to float16 and back (subnormals kept; overflow to inf).
* ``R x 3`` (``BF16_BF16_F32_X3``, ``TF32_TF32_F32_X3``, and ``HIGH`` on TPU): ``hi = R(x)``,
  ``lo = R(x - hi)``, product ``hi hi' + (hi lo' + lo hi')``, each exactly: about 16
  significant bits for bf16 (the ``lo lo'`` term is dropped, as on the hardware).
* ``Precision.HIGH`` on GPU is TF32, not bf16 x 3: JAX's own docstring of ``Precision`` says
  "HIGH: ... On GPU: uses tensorfloat32 where available", and XLA:GPU allows TF32 for every
  precision below HIGHEST. On the real CPU every ``Precision`` is exact.
* ``jax.default_matmul_precision(...)`` (the ``jax_default_matmul_precision`` option) is
  honoured for dots that name none, as JAX does.
* A pair of per-operand precisions ``(p, q)`` uses the higher one (XLA:GPU's rule).
* Any other ``DotAlgorithmPreset`` (``BF16_BF16_F32_X6``, ``ANY_F8_...``, ``F16_F16_F16``,
  ...) or a custom ``lax.DotAlgorithm`` raises ``NotImplementedError`` naming it.
* A float32 operand beside a bfloat16 or float16 one: JAX converts the narrower one to float32
  and runs a float32 dot (its StableHLO), so both go through the float32 rule above (a float16
  operand's 11 bits rounded to bfloat16's 8 on "tpu", as there).
* Other operands (both bf16, both f16, f64, integers) go to JAX's own ``dot_general``
  unchanged: on the real CPU that is what JAX computes for them.

How it intercepts (read in the sources of JAX 0.10.2 and JAX 0.12.0.1, the versions of
``.venv`` and ``.venv-python3.12``):

* ``jax._src.lax.lax.dot_general`` (PRIVATE module ``jax._src.lax.lax``, attribute
  ``dot_general``). ``jnp.matmul``, ``jnp.dot``, ``jnp.tensordot`` and the ``@`` operator
  (``jax._src.numpy.array_methods._operator_matmul`` -> ``tensor_contractions.matmul``) call
  ``lax.dot_general`` with ``lax`` that module, looked up at call time, so replacing the
  module attribute reaches them. So do JAX's own rules that call the module-level name
  ``dot_general`` (e.g. the transpose rules).
* ``jnp.einsum`` does NOT look it up at call time: its PRIVATE keyword-only argument
  ``_dot_general`` defaults to ``lax.dot_general`` bound at import
  (``jax/_src/numpy/einsum.py``, both versions). Its default in ``jnp.einsum.__kwdefaults__``
  is swapped as well.
* ``jax.lax.dot_general`` and ``jax.lax.dot`` (public names, bound at import to the
  private functions) are swapped too. In both versions ``lax.dot`` binds the primitive
  itself (``dot_general`` is the thin wrapper that calls ``dot``), so ``jax.lax.dot`` gets
  its own wrapper; JAX-internal calls of the module-level ``dot`` are not intercepted (only
  ``dot_general`` itself makes them). Code that did ``from jax.lax import dot_general``
  before the context is not intercepted either.
* ``jax.default_backend`` (public) is replaced on the ``jax`` module, where the library
  looks it up at trace time (``jax.default_backend()``). ``jax._src.xla_bridge.default_backend``
  is the same function object but is left alone: the library never reaches it that way, and
  JAX itself calls it to choose where arrays are created (``jax/_src/numpy/
  array_constructors.py``) and the export platform (``jax/_src/export/_export.py``), which
  must stay the real CPU.

The patches are installed by the outermost ``emulate`` and restored when it exits (nested
contexts switch the backend). Because ``jax.jit`` caches traces, ``emulate`` also sets the
value of one ``jax.make_user_context`` (public in both versions; created once at import) to
the backend, so a function traced outside, or under another emulated backend, is re-traced
(and recompiled) rather than reusing a trace with other rounding; the wrappers read the
backend from that context at trace time. ``tests/test_emulated_backend.py`` fails if any of
these names moves.

Also here: ``band`` and ``input_svd`` (the largest singular value of an orthogonalized
update and its responses ``u_i^T X v_i`` along the input's singular pairs),
``moonlight_scale`` and the seeded input generators ``make_input``, to measure Newton–Schulz's
band.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax import lax as _lax_src  # PRIVATE (JAX 0.10.2, 0.12.0.1): see the docstring

BACKENDS = ("cpu", "gpu", "tpu")

# The names patched, as (owner, attribute); restored from the values captured at import.
PRIVATE_DOT_GENERAL = ("jax._src.lax.lax", "dot_general")
EINSUM_KWARG = "_dot_general"  # PRIVATE keyword of jnp.einsum (JAX 0.10.2, 0.12.0.1)

_ORIGINAL_DOT_GENERAL = _lax_src.dot_general
_ORIGINAL_PUBLIC_DOT_GENERAL = jax.lax.dot_general
_ORIGINAL_PUBLIC_DOT = jax.lax.dot
_ORIGINAL_DEFAULT_BACKEND = jax.default_backend
_ORIGINAL_EINSUM_DEFAULT = (jnp.einsum.__kwdefaults__ or {}).get(EINSUM_KWARG)

# Part of every jit cache key: traces under different emulated backends never mix.
_BACKEND = jax.make_user_context(default_value=None)
_LOCK = threading.Lock()
_depth = 0


# ----------------------------------------------------------------------------------------
# Rounding of float32 operands.

def bf16_round(x: jax.Array) -> jax.Array:
  """float32 ``x`` rounded to bfloat16 (8 significant bits, nearest even), kept float32."""
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def tf32_round(x: jax.Array) -> jax.Array:
  """float32 ``x`` rounded to TF32 (10 explicit mantissa bits, nearest even), kept float32."""
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


def f16_round(x: jax.Array) -> jax.Array:
  """float32 ``x`` converted to float16 and back (subnormals kept, overflow to inf)."""
  return x.astype(jnp.float16).astype(jnp.float32)


def tf32_round_numpy(x: np.ndarray) -> np.ndarray:
  """NumPy reference of ``tf32_round``: round to nearest even on the float32 bits (finite x)."""
  bits = np.asarray(x, np.float32).view(np.uint32)
  lsb = (bits >> np.uint32(13)) & np.uint32(1)
  return ((bits + np.uint32(0xFFF) + lsb) & np.uint32(0xFFFFE000)).view(np.float32)


class _Mode(NamedTuple):
  """How a float32 dot runs: ``round`` each operand (None: exact), one pass or hi/lo x 3."""
  name: str
  round: Callable[[jax.Array], jax.Array] | None
  split: bool = False


EXACT = _Mode("exact", None)
BF16 = _Mode("bf16", bf16_round)
TF32 = _Mode("tf32", tf32_round)
F16 = _Mode("f16", f16_round)
BF16_X3 = _Mode("bf16_x3", bf16_round, split=True)
TF32_X3 = _Mode("tf32_x3", tf32_round, split=True)

_DEFAULT = {"cpu": EXACT, "gpu": TF32, "tpu": BF16}
_HIGH = {"cpu": EXACT, "gpu": TF32, "tpu": BF16_X3}
_PRESETS = {
    "F32_F32_F32": EXACT,
    "BF16_BF16_F32": BF16,
    "BF16_BF16_F32_X3": BF16_X3,
    "TF32_TF32_F32": TF32,
    "TF32_TF32_F32_X3": TF32_X3,
    "F16_F16_F32": F16,
}


def _as_precision(p: Any) -> Any:
  """A string or enum as a ``lax.Precision`` or ``lax.DotAlgorithmPreset`` (JAX's aliases)."""
  if isinstance(p, str):
    try:
      return lax.Precision(p)  # 'highest', 'float32', 'high', 'tensorfloat32', 'bfloat16', ...
    except ValueError:
      try:
        return lax.DotAlgorithmPreset[p]
      except KeyError:
        raise ValueError(f"emulate: unknown precision {p!r}") from None
  return p


def resolve_mode(precision: Any, backend: str) -> _Mode:
  """The rounding that ``backend`` applies to a float32 dot named with ``precision``."""
  p = precision
  if p is None:
    p = jax.config.jax_default_matmul_precision  # jax.default_matmul_precision(...), or None
    if p is None:
      return _DEFAULT[backend]
  if isinstance(p, (tuple, list)):
    if len(p) != 2:
      raise ValueError(f"emulate: a precision pair needs 2 entries, got {p!r}")
    pair = [_as_precision(q) for q in p]
    if not all(isinstance(q, lax.Precision) for q in pair):
      raise ValueError(f"emulate: a precision pair must be two lax.Precision, got {p!r}")
    p = max(pair, key=lambda q: q.value)  # XLA:GPU's rule: the higher of the two
  p = _as_precision(p)
  if isinstance(p, lax.Precision):
    if p == lax.Precision.HIGHEST:
      return EXACT
    return _HIGH[backend] if p == lax.Precision.HIGH else _DEFAULT[backend]
  if isinstance(p, lax.DotAlgorithmPreset):
    if p.name == "DEFAULT":
      return _DEFAULT[backend]
    if p.name in _PRESETS:
      return _PRESETS[p.name]
    raise NotImplementedError(
        f"emulate({backend!r}): DotAlgorithmPreset.{p.name} is not emulated (emulated: "
        f"DEFAULT, {', '.join(_PRESETS)})")
  raise NotImplementedError(f"emulate({backend!r}): precision {p!r} is not emulated")


# ----------------------------------------------------------------------------------------
# The wrappers.

def _dtype(x: Any) -> np.dtype | None:
  dt = getattr(x, "dtype", None)
  return None if dt is None else np.dtype(dt)


def _emulated_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None, **kwargs):
  """``jax.lax.dot_general`` with the current emulated backend's operand rounding."""
  backend = _BACKEND.value
  f32 = np.dtype(np.float32)
  dtypes = {_dtype(lhs), _dtype(rhs)}
  if backend is not None and f32 in dtypes and dtypes <= {f32, np.dtype(jnp.bfloat16), np.dtype(np.float16)}:
    lhs, rhs = lax.convert_element_type(lhs, f32), lax.convert_element_type(rhs, f32)  # as JAX lowers it
  if backend is None or _dtype(lhs) != f32 or _dtype(rhs) != f32:
    return _ORIGINAL_DOT_GENERAL(lhs, rhs, dimension_numbers, precision,
                                 preferred_element_type, **kwargs)
  mode = resolve_mode(precision, backend)

  def exact(a, b):
    return _ORIGINAL_DOT_GENERAL(a, b, dimension_numbers, lax.Precision.HIGHEST,
                                 preferred_element_type, **kwargs)

  if mode.round is None:
    return exact(lhs, rhs)
  a_hi, b_hi = mode.round(lhs), mode.round(rhs)
  if not mode.split:
    return exact(a_hi, b_hi)
  a_lo, b_lo = mode.round(lhs - a_hi), mode.round(rhs - b_hi)
  return exact(a_hi, b_hi) + (exact(a_hi, b_lo) + exact(a_lo, b_hi))


def _emulated_dot(lhs, rhs, *args, dimension_numbers=None, precision=None,
                  preferred_element_type=None, **kwargs):
  """``jax.lax.dot`` through ``_emulated_dot_general`` (its default dimension numbers)."""
  if args:  # an older positional form: let JAX's own function answer
    return _ORIGINAL_PUBLIC_DOT(lhs, rhs, *args, dimension_numbers=dimension_numbers,
                                precision=precision,
                                preferred_element_type=preferred_element_type, **kwargs)
  if dimension_numbers is None:
    ln, rn = np.ndim(lhs), np.ndim(rhs)
    if not (1 <= ln <= 2 and 1 <= rn <= 2):  # JAX's own error
      return _ORIGINAL_PUBLIC_DOT(lhs, rhs, precision=precision,
                                  preferred_element_type=preferred_element_type, **kwargs)
    dimension_numbers = (((ln - 1,), (0,)), ((), ()))
  return _emulated_dot_general(lhs, rhs, dimension_numbers, precision,
                               preferred_element_type, **kwargs)


def _emulated_default_backend() -> str:
  backend = _BACKEND.value
  return _ORIGINAL_DEFAULT_BACKEND() if backend is None else backend


# (set the name to a function, JAX's own, the emulated one) for each name the context replaces
_PATCHES = (
    (lambda f: setattr(_lax_src, "dot_general", f), _ORIGINAL_DOT_GENERAL, _emulated_dot_general),
    (lambda f: setattr(jax.lax, "dot_general", f), _ORIGINAL_PUBLIC_DOT_GENERAL, _emulated_dot_general),
    (lambda f: setattr(jax.lax, "dot", f), _ORIGINAL_PUBLIC_DOT, _emulated_dot),
    (lambda f: setattr(jax, "default_backend", f), _ORIGINAL_DEFAULT_BACKEND, _emulated_default_backend),
    (lambda f: jnp.einsum.__kwdefaults__.__setitem__(EINSUM_KWARG, f), _ORIGINAL_EINSUM_DEFAULT,
     _emulated_dot_general),
)


def _patch(emulated: bool) -> None:
  """Installs the emulated functions (``True``) or JAX's own back (``False``)."""
  for set_to, original, replacement in _PATCHES:
    set_to(replacement if emulated else original)


@contextlib.contextmanager
def emulate(backend: str):
  """Run the body as if on ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``): module docstring."""
  global _depth
  if backend not in BACKENDS:
    raise ValueError(f"emulate: backend must be one of {BACKENDS}, got {backend!r}")
  with _LOCK:
    if _depth == 0:
      _patch(True)
    _depth += 1
  try:
    with _BACKEND(backend):
      yield
  finally:
    with _LOCK:
      _depth -= 1
      if _depth == 0:
        _patch(False)


# ----------------------------------------------------------------------------------------
# Measuring Newton–Schulz's band.

BAND_FLOOR = 3e-3  # input singular values >= this times ||G||_F are measured


class Band(NamedTuple):
  """``top``: largest singular value of X; ``low``/``high``: extreme responses ``u_i^T X v_i``."""
  top: float
  low: float
  high: float


def moonlight_scale(shape: tuple[int, ...]) -> float:
  """Moonlight's update RMS factor ``0.2 sqrt(max(rows, cols))`` of the last two axes."""
  return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def input_svd(g: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """float64 SVD ``(U, s, V^T)`` of ``g`` (of each matrix of a stack), for ``band(svd=...)``."""
  return np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)


def band(x: Any, g: Any, *, scale: float = 1.0, floor: float = BAND_FLOOR,
         svd: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> Band:
  """Newton–Schulz's band of ``X = x / scale`` for its input ``g``, in float64 NumPy.

  For ``G = U diag(s) V^T`` (SVD): ``response_i = u_i^T X v_i`` for every ``i`` with
  ``s_i >= floor * ||G||_F``. For the polar factor ``X = U V^T`` every response is 1; Newton–
  Schulz's ``X = U p(S) V^T`` gives ``p(s_i / ||G||)`` (Muon's band, roughly [0.7, 1.2]:
  Keller Jordan; the brief's requirement is [0.70, 1.25]). ``x`` is the orthogonalized
  output or Muon's update divided by its RMS factor (``scale``, e.g. ``moonlight_scale``).
  Leading axes are a stack: the result is the largest ``top``, the smallest ``low`` and the
  largest ``high`` over it. ``svd``: ``input_svd(g)``, when several outputs share an input.
  """
  x = np.asarray(x, np.float64) / scale
  if x.shape != np.shape(g) or x.ndim < 2:
    raise ValueError(f"band: x and g must be matrices of one shape, got {x.shape}, {np.shape(g)}")
  u, s, vt = input_svd(g) if svd is None else svd
  k = s.shape[-1]
  us, ss, vts = u.reshape(-1, u.shape[-2], k), s.reshape(-1, k), vt.reshape(-1, k, vt.shape[-1])
  tops, lows, highs = [], [], []
  for xm, um, sm, vtm in zip(x.reshape(-1, *x.shape[-2:]), us, ss, vts):
    keep = sm >= floor * np.sqrt(np.sum(sm**2))  # ||G||_F from its singular values
    resp = np.sum((um[:, keep].T @ xm) * vtm[keep], axis=1)  # u_i^T X v_i
    tops.append(np.linalg.svd(xm, compute_uv=False)[0])
    lows.append(resp.min())
    highs.append(resp.max())
  return Band(float(max(tops)), float(min(lows)), float(max(highs)))


INPUT_KINDS = ("gaussian", "low_rank", "cond_1e6")
SHAPES = {
    "wide": (256, 1024),
    "tall": (1024, 256),
    "square": (256, 256),
    "small": (96, 384),
    "experts": (8, 128, 512),
}


def _one_input(kind: str, m: int, n: int, rng: np.random.Generator) -> np.ndarray:
  if kind == "gaussian":
    return rng.standard_normal((m, n))
  if kind == "low_rank":  # rank 16, entry RMS 1, plus noise of entry RMS 1e-3
    low = rng.standard_normal((m, 16)) @ rng.standard_normal((16, n))
    low /= np.sqrt(np.mean(low**2))
    return low + 1e-3 * rng.standard_normal((m, n))
  if kind == "cond_1e6":  # U diag(logspace(0, -6)) V^T, U and V random orthogonal
    k = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return (u * np.logspace(0.0, -6.0, k)) @ v.T
  raise ValueError(f"make_input: kind must be one of {INPUT_KINDS}, got {kind!r}")


def make_input(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
  """A seeded float32 input of ``shape`` (leading axes: a stack, each matrix drawn anew).

  ``"gaussian"``: i.i.d. N(0, 1). ``"low_rank"``: a rank-16 Gaussian product scaled to entry
  RMS 1, plus N(0, 1e-3^2) noise. ``"cond_1e6"``: ``U diag(s) V^T`` with ``U``, ``V``
  random orthogonal (QR of Gaussians) and ``s`` log-spaced from 1 to 1e-6 (condition 1e6).
  Every matrix is scaled to Frobenius norm 1.
  """
  rng = np.random.default_rng([seed, INPUT_KINDS.index(kind), *shape])
  *batch, m, n = shape
  mats = [_one_input(kind, m, n, rng) for _ in range(int(np.prod(batch)) if batch else 1)]
  out = np.stack([a / np.linalg.norm(a) for a in mats]).reshape(shape)
  return out.astype(np.float32)


def products(jaxpr: Any, times: int = 1) -> list[tuple[tuple[np.dtype, np.dtype], int, int]]:
  """``[(operand dtypes, FLOPs, batch size)]`` of every ``dot_general`` a run of ``jaxpr`` executes:
  scans' bodies counted ``length`` times, each branch of a ``cond``/``switch`` once (an upper
  bound); a ``while`` loop (unknown trip count) is refused."""
  out = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lc, _), (lb, _) = eqn.params["dimension_numbers"]
      a, b = (v.aval for v in eqn.invars)
      contract = int(np.prod([a.shape[d] for d in lc]))
      out.append(((a.dtype, b.dtype), times * 2 * contract * int(np.prod(eqn.outvars[0].aval.shape)),
                  int(np.prod([a.shape[d] for d in lb]))))
      continue
    if name == "while":
      raise ValueError("products: a while loop, whose trip count the jaxpr does not say")
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += products(sub, times * (eqn.params["length"] if name == "scan" else 1))
  return out


def weighted_flops(fn: Any, *args: Any, backend: str = "gpu") -> tuple[int, set, set]:
  """``fn(*args)``'s matmul FLOPs traced as if on ``backend`` (arguments may be
  ``jax.ShapeDtypeStruct``s), a product with a float32 operand counted twice (on a GPU it runs at
  the TF32 rate, half the 16-bit one); and the operand dtypes and batch sizes of its products."""
  with emulate(backend):
    dots = products(jax.make_jaxpr(fn)(*args).jaxpr)
  return (sum(f * (2 if np.dtype(np.float32) in dts else 1) for dts, f, _ in dots),
          {d for dts, _, _ in dots for d in dts}, {b for _, _, b in dots})
