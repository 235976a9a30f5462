"""How a layout finds, reads and scales the query/key projections of one attention module.

QK-Clip's math (``_clip.qk_clip``) yields, for each projection role of a layout, a factor per
head and per column of that head, shape ``(*stack, heads, width)``:

* ``GQALayout``: roles ``"query"`` ``(*stack, num_heads, head_dim)`` and ``"key"``
  ``(*stack, num_kv_heads, head_dim)``;
* ``MLALayout``: roles ``"query"`` ``(*stack, num_heads, qk_nope + qk_rope)`` and
  ``"key_value"`` ``(*stack, num_heads, qk_nope + v)``.

This module finds the projections that carry those roles under a module path (by the
layout's names), detects each kernel's form from the layout and the shape, and multiplies
kernel and bias by the factors laid out in that form. The forms, each with optional leading
stacked-layer axes ``*stack`` (``nn.scan``):

* 2-D head-major: kernel ``(*stack, in, heads * width)``, bias ``(*stack, heads * width)``;
* DenseGeneral: kernel ``(*stack, in, heads, width)``, bias ``(*stack, heads, width)``
  (Flax's ``MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``, MaxText);
* fused QKV (``GQALayout(qkv=...)``): kernel ``(*stack, in, (H + 2 Hkv) * head_dim)``,
  query heads then key heads then value heads, each head-major, bias
  ``(*stack, (H + 2 Hkv) * head_dim)``; or kernel ``(*stack, in, 3, H, head_dim)``, bias
  ``(*stack, 3, H, head_dim)`` (needs ``Hkv == H``). Value columns get the factor 1. A
  ``Projection(..., grouped=True)`` orders the 2-D form's columns by key/value head instead
  (Bloom, GPT-NeoX: ``projection.flat_columns``).

When the stacked-layer shape is known (from ``max_logits``) the kernel's rank decides
between forms; otherwise (``init_max_logits``) the projections of a module must agree on it.
A kernel that fits no form, or two, is a ValueError naming its path, shape and the forms tried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from .equinox import linear_leaf
from .layouts import GQALayout, MLALayout
from .._util import join
from .projection import (as_projection, axes_from_logical, declared_bias_order, declared_factor, declared_stack,
                         flat_columns, kernel_factor, Projection)

Shape = tuple[int, ...]
Part = tuple[str | None, int, int]  # (role or None for never-scaled value columns, heads, width)

TORCH_LEAF = "weight"  # torch's (and Equinox's) name for an (out, in) kernel
HEAD_MAJOR = "2-D head-major"
DECLARED = "declared axes"
DENSE_GENERAL = "DenseGeneral"
FUSED_3 = "fused (in, 3, heads, head_dim)"


def _tail(form: str, parts: Sequence[Part]) -> Shape | None:
  """The kernel's shape after ``(*stack, in)`` in ``form``; None where the form does not apply."""
  if form == HEAD_MAJOR:
    return (sum(h * w for _, h, w in parts),)
  if form == DENSE_GENERAL:
    return tuple(parts[0][1:]) if len(parts) == 1 else None
  if len({(h, w) for _, h, w in parts}) == 1 and len(parts) == 3:  # FUSED_3
    return (3, *parts[0][1:])
  return None


def _forms(parts: Sequence[Part], grouped: bool = False) -> tuple[str, ...]:
  if grouped:  # columns ordered by key/value head: only a flattened column axis has an order
    return (HEAD_MAJOR,)
  return (HEAD_MAJOR, DENSE_GENERAL) if len(parts) == 1 else (HEAD_MAJOR, FUSED_3)


def _form_label(form: str, parts: Sequence[Part]) -> str:
  return "fused 2-D q|k|v" if form == HEAD_MAJOR and len(parts) > 1 else form


@dataclasses.dataclass(frozen=True)
class Found:
  """One detected projection: its spec, parts, kernel form and stacked-layer shape."""

  spec: Projection
  parts: tuple[Part, ...]
  form: str
  stack: Shape
  has_bias: bool
  bias_order: tuple[int, ...] | None = None  # a declared kernel's bias: ``declared_bias_order``

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def groups(self) -> int:
    """The key/value heads that order a ``grouped`` projection's columns (``flat_columns``), else 0."""
    return next(h for role, h, _ in self.parts if role == "key") if self.spec.grouped else 0

  @property
  def in_size_axis(self) -> int:
    return self.spec.axes.index("in") if self.form == DECLARED else len(self.stack)

  def factor(self, factors: Mapping[str, jax.Array]) -> jax.Array | None:
    """Per-element factor of the bias's shape; None if no role is scaled."""
    if not any(role in factors for role, _, _ in self.parts):
      return None
    per_head = [
        factors[role] if role in factors else jnp.ones((*self.stack, h, w), jnp.float32)
        for role, h, w in self.parts
    ]
    if self.form == DECLARED:
      return declared_factor(self.spec.axes, per_head, self.groups)
    if self.form == DENSE_GENERAL:
      return per_head[0]
    if self.form == FUSED_3:
      return jnp.stack(per_head, axis=-3)
    return flat_columns(per_head, self.groups)

  def scale(self, kernel, bias, factors: Mapping[str, jax.Array]):
    """``(kernel, bias)`` scaled by the role factors; the same objects if no role is scaled."""
    factor = self.factor(factors)
    if factor is None:
      return kernel, bias
    if self.form == DECLARED:
      kf = kernel_factor(self.spec.axes, factor)
    else:
      kf = jnp.expand_dims(factor, len(self.stack))
    if self.bias_order is not None:
      factor = jnp.transpose(factor, self.bias_order)
    return scale(kernel, kf), (None if bias is None else scale(bias, factor))


def scale(x: jax.Array, factor: jax.Array) -> jax.Array:
  """x * factor in (at least) float32, cast back to x's dtype. Elementwise, so it keeps sharding."""
  dtype = jnp.result_type(x)
  compute = jnp.promote_types(dtype, jnp.float32)
  return (x.astype(compute) * factor.astype(compute)).astype(dtype)


# ----------------------------------------------------------------------------- names


def _mla_query(module: str, lay: MLALayout, shapes: Mapping[str, Shape], caller: str) -> Projection:
  if lay.query is not None:
    return as_projection(lay.query)
  if "wq/kernel" in shapes and "wq_b/kernel" in shapes:
    raise ValueError(
        f"{caller}: {module or '<root>'!r} has both wq/kernel and wq_b/kernel; an MLA module "
        "has one query projection (wq_b with query LoRA, wq without); name it with "
        "MLALayout(..., query=...)"
    )
  return Projection("wq_b" if "wq_b/kernel" in shapes else "wq")


def projection_parts(
    module: str, lay: MLALayout | GQALayout, shapes: Mapping[str, Shape], caller: str = "qk_clip",
    typed: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[Projection, tuple[Part, ...]]:
  """{projection spec: its parts, in storage order} that ``lay`` expects under ``module``.

  ``typed``: as for ``detect``; a projection named by a module that is an Equinox ``Linear``
  reads its ``weight`` (``linear_leaf``).
  """
  typed = typed or {}
  if isinstance(lay, MLALayout):
    h, nope = lay.num_heads, lay.qk_nope_head_dim
    return {
        linear_leaf(_mla_query(module, lay, shapes, caller), typed): (("query", h, nope + lay.qk_rope_head_dim),),
        linear_leaf(as_projection(lay.key_value), typed): (("key_value", h, nope + lay.v_head_dim),),
    }
  h, hkv, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
  part = {"q": ("query", h, d), "k": ("key", hkv, d), "v": (None, hkv, d)}
  if lay.qkv is not None:
    spec = linear_leaf(as_projection(lay.qkv), typed)
    return {spec: tuple(part[p] for p in spec.parts or ("q", "k", "v"))}
  q, k = linear_leaf(as_projection(lay.query), typed), linear_leaf(as_projection(lay.key), typed)
  return {q: (part["q"],), k: tuple(part[p] for p in k.parts or ("k",))}


def missing_projections(
    module: str, lay: MLALayout | GQALayout, shapes: Mapping[str, Shape], caller: str = "qk_clip",
    typed: Mapping[str, tuple[str, ...]] | None = None,
) -> list[str]:
  """Kernel paths (relative to ``module``) that ``lay`` needs and ``shapes`` lacks."""
  specs = projection_parts(module, lay, shapes, caller, typed)
  return [spec.kernel for spec in specs if spec.kernel not in shapes]


def check_orientation(caller: str, path: str, spec: Projection, shape: Shape, owner: str | None,
                      flat_fits: bool) -> None:
  """Refuses an undeclared kernel that may be ``(out, in)`` and fits ``(in, out)`` as well.

  A leaf named ``weight`` (torch's and Equinox's name for ``(out, in)`` storage) or an array
  held by an Equinox module of a type not known here (``owner``, its class name; Equinox's
  convention is ``x @ w.T``), square in its last two axes, where the 2-D ``(in, out)`` reading
  fits (``flat_fits``): both readings fit, and one for the other would scale (or cut) the wrong
  axis. Plain dicts keep Flax's ``(in, out)`` for every other leaf name.
  """
  if not flat_fits or len(shape) < 2 or shape[-1] != shape[-2] or (spec.leaf != TORCH_LEAF and owner is None):
    return
  why = (f"named '{TORCH_LEAF}', torch's name for (out, in) storage" if owner is None else
         f"held by the Equinox module {owner}, whose type the library does not know (Equinox's convention "
         "is (out, in), used as x @ w.T)")
  raise ValueError(
      f"{caller}: {path} is a square kernel of shape {shape} {why}, and nothing declares its axes (no "
      "axes=, no logical axis names, no known layer type): (in, out) and (out, in) fit it alike, and "
      "reading one for the other scales or cuts the wrong axis (heads reported clipped whose logits stay "
      f"above tau, per-head blocks that are slabs of input columns). Declare it: "
      f"muonclip_jax.Projection({spec.name!r}, leaf={spec.leaf!r}, axes=('out', 'in')) for torch-style "
      "storage, axes=('in', 'out') otherwise (with a 'layers' axis in front for each stacked-layer axis)"
  )


# ----------------------------------------------------------------------------- detection


def _fits(form: str, parts: Sequence[Part], kernel: Shape, bias: Shape | None) -> Shape | None:
  """The stacked-layer shape under which ``kernel`` (and ``bias``) fit ``form``, or None."""
  tail = _tail(form, parts)
  if tail is None or len(kernel) < len(tail) + 1 or tuple(kernel[len(kernel) - len(tail) :]) != tail:
    return None
  stack = tuple(kernel[: len(kernel) - len(tail) - 1])
  if bias is not None and tuple(bias) != (*stack, *tail):
    return None
  return stack


def _expected(parts: Sequence[Part], stack: Shape | None, grouped: bool = False) -> str:
  lead = "*stack, " if stack is None else "".join(f"{n}, " for n in stack)
  tried = []
  for form in _forms(parts, grouped):
    tail = _tail(form, parts)
    if tail is None:
      tried.append(f"{_form_label(form, parts)} (needs num_kv_heads == num_heads)")
    else:
      tried.append(f"({lead}'in', {', '.join(map(str, tail))}) ({_form_label(form, parts)})")
  return " or ".join(tried)


def _head_hint(parts: Sequence[Part], kernel: Shape) -> str:
  """Why a kernel of one part does not fit: its head count or width, read from its shape."""
  if len(parts) != 1 or len(kernel) < 2:
    return ""
  _, h, w = parts[0]
  cols = kernel[-1]
  if len(kernel) >= 3:
    return (
        f", i.e. {kernel[-2]} heads of {cols} columns as DenseGeneral (or {cols} columns as "
        f"2-D head-major), but expected {h} heads of {w} columns"
    )
  if cols % w:
    return f": {cols} columns are not a multiple of the per-head width {w}"
  return f", i.e. {cols // w} heads of {w} columns, but expected {h} heads ({h * w} columns)"


def _describe(parts: Sequence[Part]) -> str:
  return " | ".join(f"{role or 'value'}: {h} heads of {w} columns" for role, h, w in parts)


def detect(
    module: str,
    lay: MLALayout | GQALayout,
    shapes: Mapping[str, Shape],
    *,
    stack: Shape | None = None,
    caller: str = "qk_clip",
    names: Mapping[str, tuple] | None = None,
    typed: Mapping[str, tuple[str, ...]] | None = None,
    raw: Mapping[str, str] | None = None,
) -> list[Found]:
  """The query/key projections of one module with their forms, checked against ``lay``.

  Args:
    module: the module path (for messages).
    lay: the module's layout.
    shapes: ``{"<projection>/<leaf>": shape}`` of the leaves under ``module``.
    stack: the stacked-layer shape from ``max_logits``; None to infer it from the kernels.
    caller: the public function named in messages.
    names: ``{"<projection>/<leaf>": logical axis names}`` of the boxed leaves under
      ``module``; a projection without declared ``axes`` whose kernel has names that tell
      (``axes_from_logical``) is read as declared by them.
    typed: ``{"<projection>/<leaf>": axes}`` of the kernels whose storage their layer's
      type tells (an Equinox ``Linear`` weight: ``(*layers, "out", "in")``); a projection
      without declared ``axes`` is read as declared by them (before logical names); a
      projection named by a ``Linear`` module alone reads its ``weight``.
    raw: ``{"<projection>/<leaf>": owner class name}`` of the arrays held by Equinox modules of
      types not known (``_clip.equinox.held_raw``).

  A kernel whose axes nothing declares (no ``axes``, type or logical names), whose leaf is
  named ``weight`` (torch's ``(out, in)`` convention) or that an Equinox module of an unknown
  type holds, and whose last two axes are equal is a ValueError (``check_orientation``):
  ``(in, out)`` and ``(out, in)`` fit it alike, and reading one for the other would scale
  the wrong axis (the clip would report heads clipped whose logits it did not bound).

  Raises:
    ValueError: a missing projection kernel; a kernel that fits no form or two forms (or
      not its declared axes); an undeclared square ``weight`` kernel; a bias that does not
      match its kernel; projections that disagree on the stacked-layer shape; an MLA
      ``wkv_a`` whose rotary width disagrees with ``lay.qk_rope_head_dim``.
  """
  parts_of = projection_parts(module, lay, shapes, caller, typed)
  missing = missing_projections(module, lay, shapes, caller, typed)
  if missing:
    raise ValueError(
        f"{caller}: module {module or '<root>'!r} has no {join(module, missing[0])!r} for "
        f"{type(lay).__name__} (expected projections {[s.name for s in parts_of]}, named by the "
        f"layout's fields); parameters under {module or '<root>'!r}: {sorted(shapes)}"
    )
  names, typed, raw = names or {}, typed or {}, raw or {}
  fits: dict[Projection, list[tuple[str, Shape]]] = {}
  orders: dict[Projection, tuple[int, ...] | None] = {}  # declared kernels' bias orders
  for spec, parts in list(parts_of.items()):
    kernel, bias = shapes[spec.kernel], shapes.get(spec.bias)
    if spec.axes is None:
      axes = typed.get(spec.kernel) or axes_from_logical(names.get(spec.kernel))
      if axes is not None:
        del parts_of[spec]
        try:
          spec = dataclasses.replace(spec, axes=axes)
        except ValueError as e:  # grouped=True on a kernel whose names or type say it has no flat columns
          origin = "its type" if spec.kernel in typed else f"its logical names {names.get(spec.kernel)}"
          raise ValueError(f"{caller}: {join(module, spec.kernel)}: the axes {axes} read from {origin}: {e}") from None
        parts_of[spec] = parts
    if spec.axes is not None:
      s = declared_stack(caller, join(module, spec.kernel), spec.axes, kernel, parts)
      if bias is not None:
        orders[spec] = declared_bias_order(caller, join(module, spec.kernel), spec.axes, kernel,
                                           join(module, spec.bias), bias, names.get(spec.bias))
      fits[spec] = [(DECLARED, s)]
      continue
    kernel_fits = [(f, s) for f in _forms(parts, spec.grouped) if (s := _fits(f, parts, kernel, None)) is not None]
    torch = spec.leaf == TORCH_LEAF or spec.kernel in raw
    if not kernel_fits:
      raise ValueError(
          f"{caller}: {join(module, spec.kernel)} has shape {kernel}"
          f"{_head_hint(parts, kernel)}; it fits no kernel form of "
          f"{lay} ({_describe(parts)}): tried {_expected(parts, stack, spec.grouped)}; a kernel stored "
          "otherwise (head axis first, torch-style (out, in), a layer axis that is not "
          "leading) needs its axes declared: muonclip_jax.Projection(name, leaf=..., axes=...)"
          + (f"; a leaf named '{TORCH_LEAF}' or held by an Equinox module is (out, in) in torch ports "
             f"and Equinox: Projection({spec.name!r}, leaf={spec.leaf!r}, axes=('out', 'in'))" if torch else "")
      )
    check_orientation(caller, join(module, spec.kernel), spec, kernel, raw.get(spec.kernel),
                      any(f == HEAD_MAJOR for f, _ in kernel_fits))
    if stack is not None:
      on_stack = [(f, s) for f, s in kernel_fits if s == stack]
      if not on_stack:
        raise ValueError(
            f"{caller}: {join(module, spec.kernel)} has shape {kernel}; expected "
            f"{_expected(parts, stack, spec.grouped)} ({_describe(parts)}), whose leading (stacked-layer) "
            f"shape {stack} is that of {join(module, 'max_logits')}; a kernel whose layer "
            "axis is not leading needs its axes declared: muonclip_jax.Projection(name, "
            "axes=...), e.g. axes=('in', 'layers', 'heads', 'head_dim')"
            + (f"; the kernel fits with fewer stacked axes: if {join(module, 'max_logits')}'s leading axes "
               "hold examples or batches (a vmapped forward, per-example maxima), not layers, take the "
               "maximum over them first (e.g. jnp.max(m, axis=0))"
               if any(len(s) < len(stack) for _, s in kernel_fits) else "")
        )
      kernel_fits = on_stack
    both = [(f, s) for f, s in kernel_fits if _fits(f, parts, kernel, bias) is not None]
    if not both:
      form, s = kernel_fits[0]
      raise ValueError(
          f"{caller}: {join(module, spec.bias)} has shape {bias}; expected "
          f"{(*s, *_tail(form, parts))} for the {_form_label(form, parts)} kernel "
          f"{join(module, spec.kernel)} of shape {kernel} ({_describe(parts)}, {lay})"
      )
    fits[spec] = both
  if stack is not None:
    for spec, fl in fits.items():
      if fl[0][0] == DECLARED and fl[0][1] != stack:
        raise ValueError(
            f"{caller}: {join(module, spec.kernel)} has shape {shapes[spec.kernel]} with declared "
            f"axes {spec.axes}, i.e. the stacked-layer shape {fl[0][1]}, but "
            f"{join(module, 'max_logits')} has the stacked-layer shape {stack}"
            + ("; maxima of a forward jax.vmap-ped over the batch keep its batch axis: pass their maximum "
               "over it" if len(stack) > len(fl[0][1]) else "")
        )
  else:
    common = set.intersection(*({s for _, s in f} for f in fits.values()))
    if not common:
      found = {join(module, n.kernel): sorted({s for _, s in f}) for n, f in fits.items()}
      named = {join(module, n.kernel): (names or {}).get(n.kernel) for n in fits if (names or {}).get(n.kernel)}
      hint = ""
      if named:  # names that did not tell: an axis of a name the library does not know, read from shapes
        hint = (f"; their logical names {named} hold axes whose names the library does not know, so their "
                "storage was guessed from shapes: name a stacked-layer axis 'layers', 'stage' or '<any>_layers', "
                "or declare the kernels' axes with muonclip_jax.Projection(name, axes=...)")
      raise ValueError(
          f"{caller}: the projections of {module or '<root>'!r} disagree on their leading "
          f"(stacked-layer) shape: {found} ({lay}){hint}"
      )
    if len(common) == 1:
      fits = {n: [(f, s) for f, s in fl if s in common] for n, fl in fits.items()}
  projections = []
  for spec, fl in fits.items():
    if len(fl) > 1:
      tried = " and ".join(f"{_form_label(f, parts_of[spec])} with stacked-layer shape {s}" for f, s in fl)
      raise ValueError(
          f"{caller}: {join(module, spec.kernel)} has shape {shapes[spec.kernel]}, "
          f"which fits two kernel forms of {lay}: {tried}; the form cannot be told from the "
          "shapes (a bias, max_logits with the per-layer head maxima, or "
          "muonclip_jax.Projection(name, axes=...) would tell it)"
      )
    form, s = fl[0]
    projections.append(Found(spec, parts_of[spec], form, s, spec.bias in shapes, orders.get(spec)))
  if isinstance(lay, MLALayout):
    kv = next(p for p in projections if p.name == as_projection(lay.key_value).name)
    _check_mla_rope(module, lay, shapes, kv, caller)
  return projections


def _check_mla_rope(
    module: str, lay: MLALayout, shapes: Mapping[str, Shape], kv: Found, caller: str
) -> None:
  """The shared rotary key's width, read off ``wkv_a``, must be ``lay.qk_rope_head_dim``.

  ``wkv_a`` (DeepSeek-V3, MaxText, this library) is ``(*stack, dim, kv_lora_rank + dr)`` and
  the key/value up-projection takes the ``kv_lora_rank`` latent as input, so
  ``dr = wkv_a columns - key_value input size``. Layouts with the column totals of the true
  one but another nope/rope split are caught here.
  """
  wkv_a = shapes.get("wkv_a/kernel")
  if wkv_a is None or len(wkv_a) != len(kv.stack) + 2:
    return
  latent = shapes[kv.spec.kernel][kv.in_size_axis]
  rope = wkv_a[-1] - latent
  if rope != lay.qk_rope_head_dim:
    raise ValueError(
        f"{caller}: {join(module, 'wkv_a/kernel')} has shape {wkv_a}, i.e. a latent of "
        f"{latent} columns (the input size of {join(module, kv.spec.kernel)}) and a shared "
        f"rotary key of {rope} columns, but the layout says qk_rope_head_dim="
        f"{lay.qk_rope_head_dim}: {lay}; use module.layout of the attention module"
    )
