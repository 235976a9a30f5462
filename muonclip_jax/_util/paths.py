"""Pytree key paths as strings: ``a/b/c``, without the ``value`` key of boxed leaves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def key_name(key: Any) -> Any:
  """The name in one pytree path entry (dict key, attribute or sequence index)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def strip_value(path: Sequence[Any]) -> tuple:
  """Drops the trailing ``value`` keys of boxed leaves (``nn.Partitioned``, NNX variables)."""
  path = tuple(path)
  while path and key_name(path[-1]) == "value":
    path = path[:-1]
  return path


def keystr(path: Sequence[Any]) -> str:
  """``a/b/c`` for a key path."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def path_str(path: Sequence[Any]) -> str:
  """``a/b/c`` for the path of a (possibly boxed) leaf, without its trailing ``value``."""
  return keystr(strip_value(path))


def join(module: str, name: str) -> str:
  """``module/name``, or ``name`` at the top level (``module == ""``)."""
  return f"{module}/{name}" if module else name
