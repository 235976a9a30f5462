"""Checks of arguments when a transform or module is built: one home for every caller."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, schedule: bool = False) -> None:
  """Checks a numeric hyperparameter when the optimizer is built.

  Accepted: a real number (``int``, ``float``, a NumPy or JAX real scalar or 0-d array), a
  tracer (``optax.inject_hyperparams`` under jit) and, with ``schedule=True``, a schedule
  (any callable of the step count). A concrete number must lie in [low, high] (``low``
  excluded with ``low_open``, ``high`` with ``high_open``) and not be NaN, else ValueError. Anything else is a
  TypeError naming the argument: strings (``"0.95"``, which ``float()`` would take, but the
  update would not), booleans, complex numbers, ``None``, arrays that are not scalars, and
  a callable where no schedule is taken.
  """
  if (schedule and callable(value)) or isinstance(value, jax.core.Tracer):
    return
  real_array = (isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0
                and any(jnp.issubdtype(value.dtype, k) for k in (jnp.integer, jnp.floating)))
  if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or real_array):
    what = "a real number or a schedule" if schedule else "a real number"
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
  v = float(value)
  bad = math.isnan(v) or (low is not None and (v < low or (low_open and v == low)))
  if high is not None:
    bad = bad or v > high or (high_open and v == high)
  if bad:
    lo = "a number" if low is None else (f"> {low}" if low_open else f">= {low}")
    hi = "" if high is None else (f" and < {high}" if high_open else f" and <= {high}")
    raise ValueError(f"{name} must be {lo}{hi}, got {value!r}")


def is_int(value: Any) -> bool:
  """An integer that is no bool: a Python ``int`` or a NumPy integer (``numbers.Integral``)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
  """A Python ``int`` >= 1 (>= 0 with ``allow_zero``), else ValueError naming ``name``."""
  ok = isinstance(value, int) and not isinstance(value, bool)
  if not ok or value < 0 or (value == 0 and not allow_zero):
    bound = ">= 0" if allow_zero else ">= 1"
    raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def check_float_dtype(name: str, value: Any, *, none_means: str = "the gradient's") -> None:
  """A dtype option with None for ``none_means``: a floating dtype of 16 bits or more (an 8-bit float
  does not promote with float32); anything else (an int dtype, "foo", 3) is a TypeError naming it.

  An array is refused too: ``optax.inject_hyperparams`` takes a dtype such as ``jnp.bfloat16``,
  a callable, for a schedule, and hands the factory a traced scalar of that dtype, which the
  CPU's path happened to read as the dtype and the GPU's and TPU's fail to trace."""
  if isinstance(value, (jax.Array, np.ndarray)):
    raise TypeError(f"{name} is a dtype, fixed when the transform is built, got an array {value!r}: under "
                    f"optax.inject_hyperparams name it in static_args=({name!r},) (a dtype is callable, "
                    f"which inject_hyperparams takes for a schedule)")
  try:
    ok = value is None or (jnp.issubdtype(value, jnp.floating) and jnp.finfo(value).bits >= 16)
  except TypeError:  # not a dtype at all
    ok = False
  if not ok:
    raise TypeError(f"{name} must be a floating dtype of 16 bits or more (float32, bfloat16, float16) or None "
                    f"for {none_means}, got {value!r}")


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
  """A boolean option: a Python ``bool`` or a NumPy ``bool_`` (``None`` too with ``allow_none``).

  Anything else is a TypeError naming the option and the value: a string (``"False"`` is
  truthy, so ``if value`` would read it as True), a number (``0``/``1``), ``None`` where it
  is not a setting, an array. Boolean options are structure (they choose code paths, as
  ``nesterov`` or ``is_causal``), fixed when the transform or module is built: a traced
  value (``optax.inject_hyperparams`` injects a boolean only if it is passed as an array)
  is refused too.
  """
  if isinstance(value, (bool, np.bool_)) or (allow_none and value is None):
    return
  what = "a bool (True or False)" + (" or None" if allow_none else "")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be {what}, fixed when it is built; got a traced value {value!r} "
                    "(under optax.inject_hyperparams pass a Python bool, which stays static)")
  raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
