"""Which modules of a parameter tree are attention modules of a layout, and what lies under each.

A module is an attention module of its layout when it holds every query/key projection the
layout names (``_clip.kernel_forms.missing_projections``). QK-Clip (``_clip.qk_clip``) and Muon's
matrices from a layout (``_muon.layout_matrices``) find them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .layouts import GQALayout, layout_for, matching_patterns, MLALayout
from .._util import path_str
from .kernel_forms import missing_projections

Layout = MLALayout | GQALayout


def leaves_by_module(flat: list) -> dict[str, dict[str, int]]:
  """{module path: {"<projection path>/<leaf>": index in flat}} for every ancestor module.

  ``flat`` is ``tree_flatten_with_path``'s list. A projection's name may be a path
  (``Projection("attn/q_einsum", leaf="w")``), so each leaf is listed under every ancestor
  of its parent module, by its path relative to it.
  """
  found: dict[str, dict[str, int]] = {}
  for i, (path, _) in enumerate(flat):
    parts = path_str(path).split("/")  # a flat dict's dotted or tuple key: its components
    for cut in range(len(parts) - 1):
      found.setdefault("/".join(parts[:cut]), {})["/".join(parts[cut:])] = i
  return found


def names_under(module: str, names: Mapping[str, tuple]) -> dict[str, tuple]:
  """The logical names of the leaves under ``module``, keyed by their path relative to it."""
  if not module:
    return dict(names)
  prefix = module + "/"
  return {p[len(prefix):]: n for p, n in names.items() if p.startswith(prefix)}


def layouts_of(module: str, layout: Any) -> list[Layout]:
  """The layouts a module could have: the single one, those whose pattern matches, else all."""
  if not isinstance(layout, Mapping):
    return [layout]
  return [layout[p] for p in matching_patterns(module, layout)] or list(layout.values())


def attention_modules(shapes_by_module: Mapping[str, Mapping[str, tuple]], layout: Any,
                      caller: str, typed: Mapping[str, tuple] | None = None) -> dict[str, Layout]:
  """{module path: layout} of the modules that have every projection their layout names.

  ``typed``: ``_clip.equinox.storage_axes`` of the tree (a ``Linear`` named by its module alone
  counts by its ``weight``).
  """
  found = {}
  for module, shapes in shapes_by_module.items():
    under = names_under(module, typed or {})
    looks = lambda lay: not missing_projections(module, lay, shapes, caller, under)  # noqa: B023, E731
    if not any(looks(lay) for lay in layouts_of(module, layout)):
      continue
    lay = layout_for(module, layout)
    if looks(lay):
      found[module] = lay
  return found
