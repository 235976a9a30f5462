"""Muon's matrices read from the attention layout: the layout is Muon's declaration.

For every attention module of the layout (the modules that hold its query/key projections,
``_clip.attention_modules``), the query, key, value and output kernels get their ``Blocks``
(``_muon.blocks``) from the layout, whatever their storage: the query/key forms are the ones
QK-Clip detects (``_clip.kernel_forms.detect``: 2-D head-major, DenseGeneral, fused q|k|v, declared
``Projection(axes=...)``, logical axis names; stacked layers batched); a value projection has
the forms of a key projection, and an output projection ``(heads * head_dim, dim)`` or
``(heads, head_dim, dim)`` their mirror image.

Per leaf, Muon's matrix is decided in this order (``muon_blocks_lookup``): an explicit
``matrix_axes`` entry for it (a pytree, or a callable's result), the layout, one
``MatrixAxes`` given for every leaf, the leaf's logical axis names, the 2-D default
``(in, out)``, else a ValueError naming the leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._clip import (as_projection, attention_modules, axes_from_logical, check_layout, check_orientation,
                     DECLARED, DENSE_GENERAL, detect, fits_declared, Found, GQALayout, HEAD_MAJOR, held_raw,
                     leaves_by_module, linear_leaf, MLALayout, names_under, Projection, storage_axes)
from .._util import decided_leaves, join, MatrixAxes, MatrixAxesSpec, names_by_path, path_str
from .blocks import Blocks, blocks_for, matrix_blocks, parse_mode
from .fused_mlp import fused_gate_up
from .matrix_axes_rules import matrix_axes_lookup


def check_blocks(muon_blocks: Any, layout: Any, name: str = "scale_by_muon") -> None:
  """Validates ``muon_blocks`` and ``layout`` together (in the factories)."""
  try:
    parse_mode(muon_blocks)
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from None
  if layout is None:
    if muon_blocks != "matrix":
      raise ValueError(
          f"{name}: muon_blocks={muon_blocks!r} needs layout= (the attention layout that says where each "
          "head's columns live: module.layout, a GQALayout/MLALayout, or a mapping of them); without one "
          "only muon_blocks='matrix' is possible")
    return
  check_layout(layout, name)


def _form_axes(found: Found) -> tuple[str, ...]:
  """A detected query/key kernel's axes, one name per axis (``_clip.projection.AXES``)."""
  lead = ("layers",) * len(found.stack)
  if found.form == DECLARED:
    return found.spec.axes
  if found.form == HEAD_MAJOR:
    return lead + ("in", "out")
  if found.form == DENSE_GENERAL:
    return lead + ("in", "heads", "head_dim")
  return lead + ("in", "parts", "heads", "head_dim")  # fused (in, 3, heads, head_dim)


def _output_reading(proj: Projection) -> tuple[str, ...]:
  """An output projection's declared axes (``"in"``: the heads side) read as a projection to heads."""
  bad = [a for a in proj.axes if a not in ("layers", "in", "out")]
  if bad or proj.axes.count("in") > 2:
    raise ValueError(
        f"{proj}: an output projection declares its heads side as one 'in' axis (heads * head_dim, "
        f"head-major) or two ('in', 'in' for (heads, head_dim)), its model dimension as 'out', and "
        f"stacked layers as 'layers'; got axes={proj.axes}")
  side = iter(("out",) if proj.axes.count("in") == 1 else ("heads", "head_dim"))
  return tuple({"layers": "layers", "out": "in"}.get(a) or next(side) for a in proj.axes)


def _find(kind: str, proj: Projection, module: str, shapes: Mapping[str, tuple], names: Mapping[str, tuple],
          parts: tuple, stack: tuple[int, ...], required: bool, lay: Any, caller: str,
          typed: Mapping[str, tuple], raw: Mapping[str, str]) -> tuple[Projection, tuple[str, ...] | None]:
  """The value (``kind="value"``) or output (``"out"``) projection and its kernel's axes (None if
  absent or not fitting), read as a query/key kernel is: declared axes, the ``Linear`` type (``typed``,
  a ``Linear`` named by its module alone included), logical names, else the shape, where an
  undeclared square ``weight`` or array of an unknown Equinox module (``raw``) is refused.

  ``required``: the blocks asked for need it, so absence or a misfit is a ValueError.
  """
  field = "value" if kind == "value" else "out"
  proj = linear_leaf(proj, typed)
  if proj.axes is None and proj.kernel in typed:
    proj = dataclasses.replace(proj, axes=typed[proj.kernel])
  path = join(module, proj.kernel)
  if proj.kernel not in shapes:
    if required:
      raise ValueError(
          f"{caller}: the attention module {module or '<root>'!r} has no {kind} projection {path!r} "
          f"({type(lay).__name__} {field}={as_projection(getattr(lay, field)).name!r}), which muon_blocks needs per "
          f"head; name it with {type(lay).__name__}(..., {field}=...) (a name or a muonclip_jax.Projection), or "
          f"{field}=None to keep it one matrix; parameters under it: {sorted(shapes)}")
    return proj, None
  shape = shapes[proj.kernel]
  lead = ("layers",) * len(stack)
  if proj.axes is not None:
    tried = [_output_reading(proj) if kind == "out" else proj.axes]
  elif (logical := axes_from_logical(names.get(proj.kernel))) is not None:
    tried = [logical]
  elif kind == "out":
    tried = [lead + ("out", "in"), lead + ("heads", "head_dim", "in")]
  else:
    tried = [lead + ("in", "out"), lead + ("in", "heads", "head_dim")]
  fit = [axes for axes in tried if len(axes) == len(shape) and fits_declared(axes, shape, parts)
         and tuple(n for a, n in zip(axes, shape) if a == "layers") == tuple(stack)]
  if proj.axes is None and axes_from_logical(names.get(proj.kernel)) is None:  # read from the shape alone
    check_orientation(caller, path, proj, shape, raw.get(proj.kernel), bool(fit) and fit[0] == tried[0])
  if fit:
    return proj, fit[0]
  if required:
    _, h, w = parts[0]
    what = (f"{caller}: {path} has shape {shape}, which does not hold the layout's {h} heads of {w} columns "
            f"({lay}) with the module's stacked-layer shape {tuple(stack)}")
    rest = list(shape)
    for n in stack:
      if n in rest:
        rest.remove(n)
    other = "muon_blocks='matrix'" if kind == "value" else "muon_blocks='head' (the output projection whole)"
    whole = (f"keep it one matrix with {type(lay).__name__}(..., {field}=None) (the other projections stay per "
             f"head), or use {other}")
    if h * w in rest or (h in rest and w in rest and (h != w or rest.count(h) > 1)):
      raise ValueError(f"{what}: tried axes {tried}. If it is stored another way, declare its storage with "
                       f"muonclip_jax.Projection({proj.name!r}, leaf={proj.leaf!r}, axes=...) in the layout's "
                       f"{field}=; if its heads are not {w} wide, {whole}")
    # no reading of these sizes holds h heads of w (e.g. value heads wider than head_dim): axes= cannot help
    raise ValueError(f"{what}: none of its sizes besides the stacked layers' ({tuple(rest)}) is {h * w}, nor are "
                     f"two of them {h} and {w}, so no axes= can declare it (heads of another width than {w}, say); {whole}")
  return proj, None


def _groups(group: int | str, parts: tuple, lay: Any, path: str, mode: str, caller: str) -> tuple[int, ...]:
  """Heads per block of each part: ``group``, or for ``"kv"`` GQA's group size on the query heads (and the
  output projection's, role ``"out"``) and 1 on the key/value heads. Each must divide its part's heads."""
  if group == "kv" and not isinstance(lay, GQALayout):
    raise ValueError(
        f"{caller}: muon_blocks={mode!r} groups the query heads that share a key/value head, which an "
        f"MLALayout does not have (every head has its own key): {path} ({lay}); use 'head' or 'group:<k>'")
  out = []
  for role, heads, _ in parts:
    k = (lay.group_size if role in ("query", "out") else 1) if group == "kv" else group
    if heads % k:
      raise ValueError(
          f"{caller}: muon_blocks={mode!r}: the group size {k} does not divide the {heads} "
          f"{role or 'value'} heads of {path} ({lay}); choose a group size that divides the head count of "
          "every projection it cuts (query, key, value, and with '+out' the output), or 'group:kv' for "
          "GQA's groups")
    out.append(k)
  return tuple(out)


def layout_blocks(tree: Any, layout: Any, mode: str, caller: str, declared: set | None = None) -> dict[str, Blocks]:
  """``{kernel path: Blocks}`` for every kernel the layout describes in ``tree``.

  ``declared``, if given, receives the paths whose axes were declared or read from logical
  names (the others were recognized from their shapes, with leading stacked-layer axes).
  """
  declared = set() if declared is None else declared
  kind, group, with_out = parse_mode(mode)
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]  # the arrays (a box masked by optax.partition holds none)
  shapes_by_module = {module: {rel: tuple(jnp.shape(flat[i][1])) for rel, i in index.items()}
                      for module, index in leaves_by_module(flat).items()}
  names, typed, raw = names_by_path(tree), storage_axes(tree), held_raw(tree)
  modules = attention_modules(shapes_by_module, layout, caller, typed)
  if not modules and kind != "matrix":
    raise ValueError(
        f"{caller}: no attention module of the layout in the parameters (a module holding the query/key "
        f"projections it names), so there are no heads to orthogonalize one by one; layout: {layout!r}")
  table = {}
  for module, lay in modules.items():
    shapes, under = shapes_by_module[module], names_under(module, names)
    typed_under, raw_under = names_under(module, typed), names_under(module, raw)
    found = detect(module, lay, shapes, caller=caller, names=under, typed=typed_under, raw=raw_under)
    for f in found:
      split = lay.qk_nope_head_dim if isinstance(lay, MLALayout) and f.parts[0][0] == "key_value" else 0
      path = join(module, f.spec.kernel)
      groups = _groups(group, f.parts, lay, path, mode, caller) if kind == "head" else None
      try:
        table[path] = blocks_for(_form_axes(f), shapes[f.spec.kernel], f.parts, mode=kind, split=split,
                                 groups=groups, kv_groups=f.groups)
      except ValueError as e:
        raise ValueError(f"{caller}: {path} {shapes[f.spec.kernel]} ({lay}): {e}") from None
      if f.form == DECLARED:
        declared.add(path)
    stack = found[0].stack
    extra = []
    if isinstance(lay, GQALayout) and lay.value is not None and lay.qkv is None and "v" not in (
        as_projection(lay.key).parts or ()):
      extra.append(("value", as_projection(lay.value), ((None, lay.num_kv_heads, lay.head_dim),), kind == "head"))
    if lay.out is not None:
      width = lay.v_head_dim if isinstance(lay, MLALayout) else lay.head_dim
      extra.append(("out", as_projection(lay.out), (("out", lay.num_heads, width),), with_out))
    for which, proj, parts, required in extra:
      proj, axes = _find(which, proj, module, shapes, under, parts, stack, required, lay, caller, typed_under,
                         raw_under)
      if axes is not None:
        path = join(module, proj.kernel)
        if proj.axes is not None or under.get(proj.kernel) is not None:
          declared.add(path)
        groups = _groups(group, parts, lay, path, mode, caller) if required else None
        table[path] = blocks_for(axes, shapes[proj.kernel], parts, output=which == "out",
                                 mode="head" if required else "matrix", groups=groups)
  return table


def _is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, (MatrixAxes, optax.contrib.MuonDimensionNumbers))


def muon_blocks_lookup(matrix_axes: MatrixAxesSpec, layout: Any, mode: str, tree: Any,
                       caller: str = "scale_by_muon", *,
                       rms_match: str | None = None) -> Callable[[str, tuple[int, ...]], Blocks]:
  """Turns ``matrix_axes``, ``layout`` and ``muon_blocks`` into ``(path, shape) -> Blocks``.

  Order per leaf: an explicit entry of a ``matrix_axes`` pytree (or of a callable's result),
  then the layout, then one ``MatrixAxes`` given for all leaves, logical names, the 2-D
  default (``matrix_axes_lookup``, which ``rms_match`` is handed to).
  """
  spec = (matrix_axes(decided_leaves(tree)) if callable(matrix_axes) and not isinstance(matrix_axes, MatrixAxes)
          else matrix_axes)
  lookup_axes = matrix_axes_lookup(spec, tree, rms_match=rms_match)
  gate_up = fused_gate_up(tree)

  def base(path: str, shape: tuple[int, ...]) -> Blocks:
    return matrix_blocks(gate_up(path, shape, lookup_axes(path, shape)), path, shape)

  if layout is None:
    return base
  table = layout_blocks(tree, layout, mode, f"{caller}: layout (muon_blocks={mode!r})")
  if not table:  # the layout names projections no module holds: say so beside any error of a leaf's
    def unmatched(path: str, shape: tuple[int, ...]) -> Blocks:
      try:
        return base(path, shape)
      except ValueError as e:
        flax = "; Flax's attention modules name them 'query', 'key'" if isinstance(layout, GQALayout) else ""
        raise ValueError(f"{e}. Note: the layout matched no attention module (none holds the query/key "
                         f"projections it names{flax}): {layout!r}") from None
    return unmatched
  explicit = set()
  if not _is_spec_leaf(spec):
    explicit = {path_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
                if leaf is not None}

  def lookup(path: str, shape: tuple[int, ...]) -> Blocks:
    if path in table and path not in explicit:
      return table[path]
    return base(path, shape)

  return lookup
