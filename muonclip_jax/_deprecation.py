"""Deprecated spellings and values: accepted for one release, with a DeprecationWarning.

Each deprecation is listed in ``CHANGELOG.md``. The warning is attributed to the first
caller outside this library and the libraries that call into it (Flax's module machinery,
JAX's tracing, optax's wrappers), so the user sees the line to change, however deep inside
the library the deprecated argument is read, and Python's default filter (which shows a
DeprecationWarning only when it is attributed to ``__main__``) shows it to a script.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# Modules whose frames stand between a user's call and the place that warns.
_INTERNAL = ("muonclip_jax", "flax", "jax", "jaxlib", "optax", "dataclasses", "functools", "contextlib")


def user_stacklevel() -> int:
  """The ``stacklevel`` of ``warnings.warn``, called by this function's caller, that names the user's line."""
  frame = sys._getframe(2)  # the caller of warnings.warn's caller
  level = 2
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INTERNAL:
    frame = frame.f_back
    level += 1
  return level


def warn_deprecated(message: str) -> None:
  """A DeprecationWarning with ``message``, attributed to the user's line."""
  warnings.warn(message, DeprecationWarning, stacklevel=user_stacklevel())


def warn_renamed(owner: str, old: str, new: str) -> None:
  """Warns that ``owner``'s argument ``old`` is now spelled ``new``."""
  warnings.warn(f"{owner}: {old!r} is deprecated and will be removed in the next release; use {new!r}",
                DeprecationWarning, stacklevel=user_stacklevel())


def renamed_keywords(**old_to_new: str) -> Callable[[F], F]:
  """Decorator: the keyword ``old`` is still accepted as ``new``, with a DeprecationWarning.

  The decorated function keeps its own signature (``functools.wraps``), so
  ``inspect.signature``, ``optax.inject_hyperparams`` and IDEs see only the new names. Passing
  both spellings is a TypeError.
  """

  def wrap(fn: F) -> F:
    @functools.wraps(fn)
    def renamed(*args: Any, **kwargs: Any) -> Any:
      for old, new in old_to_new.items():
        if old in kwargs:
          if new in kwargs:
            raise TypeError(f"{fn.__name__}() got both {old!r} (deprecated) and {new!r}; pass only {new!r}")
          warn_renamed(f"{fn.__name__}()", old, new)
          kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)

    return renamed  # type: ignore[return-value]

  return wrap


def renamed_value(owner: str, old: str, new: str, *, old_value: Any, new_value: Any, new_default: Any) -> Any:
  """The value of a renamed field or argument whose deprecated spelling ``old`` defaults to None.

  ``old_value is None``: ``new_value``. Otherwise a DeprecationWarning (attributed to the
  user's line) and ``old_value``. Both spellings with different values is a TypeError;
  ``new_value`` counts as given when it differs from ``new_default`` (a dataclass field
  cannot tell a default from an explicit equal value).
  """
  if old_value is None:
    return new_value
  if new_value != new_default and new_value != old_value:
    raise TypeError(f"{owner}: got both {old!r} (deprecated) = {old_value!r} and {new!r} = {new_value!r}; "
                    f"pass only {new!r}")
  warn_renamed(owner, old, new)
  return old_value
