"""Pytree key paths as strings: ``a/b/c``, without the ``value`` key of boxed leaves.

A key's components are read as the nested form's, whatever the dict stores: a flat dict's
dotted key (``safetensors.load_file``, torch's ``state_dict``: ``"model.layers.0.mlp.gate.weight"``)
and tuple key (``flax.traverse_util.flatten_dict``: ``("model", "layers", "0", ...)``) give the
same ``model/layers/0/mlp/gate/weight`` as nested dicts and ``"/"``-joined keys do, so every
rule that reads a path (``muon_labels``, ``matrix_axes``, the layouts) sees one path.
"""

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


def components(key: Any) -> tuple[str, ...]:
  """The path components one pytree key entry stands for: a tuple key's items, a dotted
  string key's dot-separated parts, else the key's name (module docstring)."""
  name = key_name(key)
  if isinstance(name, tuple):
    return tuple(c for item in name for c in str(item).split("."))
  return tuple(str(name).split(".")) if isinstance(name, str) else (str(name),)


def keystr(path: Sequence[Any]) -> str:
  """``a/b/c`` for a key path, each key read as its ``components``."""
  return "/".join(c for key in path for c in components(key))


def path_str(path: Sequence[Any]) -> str:
  """``a/b/c`` for the path of a (possibly boxed) leaf, without its trailing ``value`` components."""
  parts = keystr(path).split("/")
  while parts and parts[-1] == "value":
    parts.pop()
  return "/".join(parts)


def join(module: str, name: str) -> str:
  """``module/name``, or ``name`` at the top level (``module == ""``)."""
  return f"{module}/{name}" if module else name
