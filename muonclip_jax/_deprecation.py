"""Deprecated spellings of renamed arguments: accepted for one release, with a DeprecationWarning.

Each rename is listed in ``CHANGELOG.md``. The warning points at the caller's line
(``stacklevel``), so a caller sees where to change the name.
"""

from __future__ import annotations

import functools
import sys
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


def _inside(module: str, packages: tuple[str, ...]) -> bool:
  return any(module == p or module.startswith(p + ".") for p in packages)


def stacklevel_outside(packages: tuple[str, ...] = ("muonclip_jax",)) -> int:
  """The ``stacklevel`` that attributes a warning issued by this function's caller to the
  first frame up the stack whose module is outside ``packages`` (a package and its
  submodules): the user's line, however many library frames (decorators, Flax's module
  machinery) lie between."""
  frame = sys._getframe(1)
  level = 1
  while frame is not None and _inside(frame.f_globals.get("__name__", ""), packages):
    frame, level = frame.f_back, level + 1
  return level


def renamed_value(owner: str, old: str, new: str, *, old_value: Any, new_value: Any, new_default: Any,
                  outside: tuple[str, ...] = ("muonclip_jax",)) -> Any:
  """The value of a renamed field or argument whose deprecated spelling ``old`` defaults to None.

  ``old_value is None``: ``new_value``. Otherwise a DeprecationWarning, attributed to the first
  caller outside the packages ``outside`` (``stacklevel_outside``), and ``old_value``. Both
  spellings with different values is a TypeError; ``new_value`` counts as given when it differs
  from ``new_default`` (a dataclass field cannot tell a default from an explicit equal value).
  """
  if old_value is None:
    return new_value
  if new_value != new_default and new_value != old_value:
    raise TypeError(f"{owner}: got both {old!r} (deprecated) = {old_value!r} and {new!r} = {new_value!r}; "
                    f"pass only {new!r}")
  warn_renamed(owner, old, new, stacklevel=stacklevel_outside(outside) + 1)
  return old_value
