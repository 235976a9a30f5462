"""Deprecated spellings of renamed arguments: accepted for one release, with a DeprecationWarning.

Each rename is listed in ``CHANGELOG.md``. The warning points at the caller's line
(``stacklevel``), so a caller sees where to change the name.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(owner: str, old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns that ``owner``'s argument ``old`` is now spelled ``new``."""
  warnings.warn(f"{owner}: {old!r} is deprecated and will be removed in the next release; use {new!r}",
                DeprecationWarning, stacklevel=stacklevel)


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
