"""Declared kernel storage: ``Projection`` names a projection and, optionally, its axes.

Model code stores attention kernels in many ways: ``(in, heads * head_dim)`` (Dense),
``(in, heads, head_dim)`` (DenseGeneral), ``(heads, in, head_dim)`` (Gemma's einsums, leaf
``w``), ``(2, kv_heads, in, head_dim)`` (Gemma's fused k|v), ``(out, in)`` (torch-style,
Hugging Face's ``FlaxConv1D``), ``(q_lora, layers, heads, width)`` (MaxText with
``param_scan_axis=1``). A ``Projection`` with ``axes`` says which is which, so nothing is
guessed from shapes; the same declaration gives Muon the kernel's matrix: ``"layers"`` axes
are batched, ``"in"`` axes are the fan-in, every other axis is the fan-out.

Where kernels carry Flax logical axis names (``nn.with_logical_partitioning`` boxes, NNX
``sharding`` metadata, MaxText's ``("embed", "q_heads", "kv")``), ``axes_from_logical``
reads ``axes`` from them, with the names of ``LOGICAL_AXES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .._util import check_bool, LAYER_NAMES, LOGICAL_AXES, MatrixAxes

AXES = ("layers", "in", "heads", "head_dim", "out", "parts")
PARTS = ("q", "k", "v")



@dataclasses.dataclass(frozen=True)
class Projection:
  """An attention projection: where its kernel lives and, optionally, how it is stored.

  Accepted wherever a layout takes a projection name (``GQALayout(query=, key=, qkv=,
  value=, out=)``, ``MLALayout(query=, key_value=, out=)``, ``attention_matrix_axes(value=,
  out=)``); a bare string ``s`` means ``Projection(s)``. An output projection declares its
  heads side as ``"in"`` (its fan-in) and its model dimension as ``"out"``.

  Examples (Gemma, MaxText scanned with ``param_scan_axis=1``, Hugging Face GPT-2)::

    mc.GQALayout(8, 4, 16,
        query=mc.Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim")),
        key=mc.Projection("kv_einsum", leaf="w", axes=("parts", "heads", "in", "head_dim"),
                          parts=("k", "v")))
    mc.MLALayout(4, 8, 4, 8, query=mc.Projection("wq_b", axes=("in", "layers", "heads", "head_dim")))
    mc.GQALayout(12, 12, 64, qkv=mc.Projection("c_attn", axes=("out", "in")))

  Attributes:
    name: the projection's sub-module path under the attention module; may contain ``/``.
    leaf: the kernel's leaf name (``"kernel"``; Gemma: ``"w"``). A bias is the leaf
      ``bias`` next to it, with the kernel's axes less the ``"in"`` axes, in their order or
      with its layer axes where ``nn.scan`` puts them (``param_scan_axis=1``: ``(heads,
      layers, head_dim)`` beside the kernel ``(in, layers, heads, head_dim)``;
      ``declared_bias_order``).
    axes: ``None`` (the form is detected from the layout and the shapes, or read from
      logical axis names), or one name per kernel axis, in storage order:
      ``"layers"``: a stacked layer axis (any position, any number of them);
      ``"in"``: the fan-in (exactly one for a query/key projection; an output projection
      ``(heads, head_dim, embed)`` declares ``("in", "in", "out")``);
      ``"heads"`` and ``"head_dim"``: DenseGeneral-style, both or neither;
      ``"out"``: head-major flattened columns (2-D ``(in, out)`` or torch-style ``(out, in)``);
      ``"parts"``: the axis that fuses q|k|v or k|v.
    parts: for a fused projection, which part is which, in storage order: ``("k", "v")`` or
      ``("q", "k", "v")``; along the ``"parts"`` axis, or concatenated along ``"out"``.
      ``None``: the role's own (``query``: q; ``key``: k; ``qkv``: q, k, v).
    grouped: for a fused q|k|v projection (``GQALayout(qkv=...)``) whose columns are
      flattened (2-D, or an ``"out"`` axis): ``True`` when they run key/value head by
      key/value head, each holding the query heads that read it, then its key head, then
      its value head (in ``parts`` order; for multi-head attention every head's q, k and v
      in turn: Bloom's and GPT-NeoX's ``query_key_value``, Megatron-LM's fused QKV); ``False``
      (default): all query heads, then all key heads, then all value heads (GPT-2's
      ``c_attn``, Llama ports' ``qkv_proj``). Both have the same shape, so only this tells
      them apart.

  Example:
    >>> import jax.numpy as jnp, muonclip_jax as mc
    >>> q = mc.Projection("q_einsum", leaf="w", axes=("heads", "in", "head_dim"))  # Gemma-style storage
    >>> k = mc.Projection("k_einsum", leaf="w", axes=("heads", "in", "head_dim"))
    >>> q.kernel, q.matrix_axes()  # Muon's matrix: 8 inputs x (2 heads * 4) columns
    ('q_einsum/w', MatrixAxes(fan_in=(1,), fan_out=(0, 2)))
    >>> layout = mc.GQALayout(num_heads=2, num_kv_heads=2, head_dim=4, query=q, key=k)
    >>> params = {"attn": {"q_einsum": {"w": jnp.ones((2, 8, 4))}, "k_einsum": {"w": jnp.ones((2, 8, 4))}}}
    >>> max_logits = {"attn": {"max_logits": jnp.array([400.0, 50.0])}}
    >>> new = mc.qk_clip(params, max_logits, qk_clip_threshold=100.0, layout=layout)
    >>> new["attn"]["q_einsum"]["w"][:, 0, 0]  # head 0 (the first axis) by sqrt(100 / 400)
    Array([0.5, 1. ], dtype=float32)
  """

  name: str
  leaf: str = "kernel"
  axes: tuple[str, ...] | None = None
  parts: tuple[str, ...] | None = None
  grouped: bool = False

  def __post_init__(self):
    where = f"Projection({self.name!r})"
    if not isinstance(self.name, str) or not self.name or any(not p for p in self.name.split("/")):
      raise ValueError(f"Projection: name must be a sub-module path such as 'q_proj' or 'attn/q', got {self.name!r}")
    if not isinstance(self.leaf, str) or not self.leaf or "/" in self.leaf:
      raise ValueError(f"{where}: leaf must be a leaf name such as 'kernel' or 'w', got {self.leaf!r}")
    if self.axes is not None:
      if isinstance(self.axes, str) or not isinstance(self.axes, Sequence):
        raise ValueError(f"{where}: axes must be a tuple of axis names from {AXES}, got {self.axes!r}")
      object.__setattr__(self, "axes", tuple(self.axes))
      _check_axes(where, self.axes)
    if self.parts is not None:
      if isinstance(self.parts, str) or not isinstance(self.parts, Sequence):
        raise ValueError(f"{where}: parts must be a tuple such as ('k', 'v'), got {self.parts!r}")
      object.__setattr__(self, "parts", tuple(self.parts))
      if not self.parts or any(p not in PARTS for p in self.parts) or len(set(self.parts)) != len(self.parts):
        raise ValueError(f"{where}: parts must be distinct names from {PARTS}, got {self.parts!r}")
    check_bool(f"{where}: grouped", self.grouped)
    if self.grouped and self.axes is not None and ("out" not in self.axes or "parts" in self.axes):
      raise ValueError(f"{where}: grouped=True orders flattened columns, so its axes need an 'out' axis and no "
                       f"'parts' axis, got axes={self.axes}")

  @property
  def kernel(self) -> str:
    return f"{self.name}/{self.leaf}"

  @property
  def bias(self) -> str:
    return f"{self.name}/bias"

  def matrix_axes(self):
    """Muon's matrix: ``"layers"`` axes batched, ``"in"`` axes the fan-in, the rest the fan-out."""

    if self.axes is None:
      raise ValueError(f"Projection({self.name!r}): matrix_axes needs declared axes")
    return declared_matrix_axes(self.axes)


def declared_matrix_axes(axes: Sequence[str]) -> MatrixAxes:
  """Muon's matrix of a kernel stored in declared ``axes``: ``"layers"`` batched, ``"in"`` the fan-in, the rest the fan-out."""
  fan_in = tuple(i for i, a in enumerate(axes) if a == "in")
  fan_out = tuple(i for i, a in enumerate(axes) if a not in ("in", "layers"))
  return MatrixAxes(fan_in, fan_out)


def _check_axes(where: str, axes: tuple[str, ...]) -> None:
  bad = [a for a in axes if a not in AXES]
  if bad:
    raise ValueError(f"{where}: unknown axis names {bad} in axes={axes}; use names from {AXES}")
  count = {a: axes.count(a) for a in AXES}
  problems = []
  if count["in"] < 1:
    problems.append("needs an 'in' (fan-in) axis")
  if count["heads"] != count["head_dim"] or count["heads"] > 1:
    problems.append("needs 'heads' and 'head_dim' once each, or neither")
  if count["out"] > 1 or count["parts"] > 1:
    problems.append("may have at most one 'out' and one 'parts' axis")
  if count["out"] and count["heads"]:
    problems.append("has both 'out' (flattened columns) and 'heads'/'head_dim'")
  if not (count["out"] or count["heads"]):
    problems.append("needs 'out' or 'heads' and 'head_dim' (the fan-out)")
  if problems:
    raise ValueError(f"{where}: axes={axes} " + "; ".join(problems))


def as_projection(x: object) -> Projection:
  """A ``Projection`` from itself or a bare name."""
  return x if isinstance(x, Projection) else Projection(x)  # type: ignore[arg-type]


def check_qk_projection(owner: str, field: str, proj: Projection, allowed_parts: Sequence[tuple[str, ...]]) -> None:
  """A query/key projection: one ``"in"`` axis, and parts allowed for its role."""
  if proj.axes is not None and proj.axes.count("in") != 1:
    raise ValueError(f"{owner}: {field}={proj}: a query/key projection has exactly one 'in' axis")
  if proj.parts is not None and proj.parts not in allowed_parts:
    raise ValueError(f"{owner}: {field}={proj}: parts must be one of {list(allowed_parts)}, got {proj.parts}")


# ----------------------------------------------------------------------------- declared storage


def _expected_shape(axes: tuple[str, ...], shape: tuple[int, ...], parts) -> tuple | None:
  """The shape ``parts`` ((role, heads, width), ...) need in ``axes`` (own sizes for layers/in)."""
  if len(axes) != len(shape):
    return None
  fused = "parts" in axes
  if not fused and "heads" in axes and len(parts) != 1:
    return None
  if fused and len({(h, w) for _, h, w in parts}) != 1:
    return None
  _, h, w = parts[0]
  size = {"parts": len(parts), "heads": h, "head_dim": w,
          "out": h * w if fused else sum(hh * ww for _, hh, ww in parts)}
  return tuple(n if a in ("in", "layers") else size[a] for a, n in zip(axes, shape))


def fits_declared(axes: tuple[str, ...], shape, parts) -> bool:
  """Whether a kernel of ``shape`` holds ``parts`` ((role, heads, width), ...) in the declared ``axes``."""
  return _expected_shape(axes, tuple(shape), parts) == tuple(shape)


def declared_stack(caller: str, path: str, axes, shape, parts) -> tuple[int, ...]:
  """Checks a declared kernel against ``parts``; returns the stacked-layer shape."""
  shape = tuple(shape)
  want = _expected_shape(axes, shape, parts)
  need = " | ".join(f"{role or 'value'}: {h} heads of {w} columns" for role, h, w in parts)
  if want != shape:
    hint = ""
    if want is None and len(axes) == len(shape):
      hint = "; a fused projection whose parts differ in heads needs an 'out' axis, else a 'parts' axis"
    raise ValueError(
        f"{caller}: {path} has shape {shape}, which does not match its declared axes {axes}"
        f" ({need}{'' if want is None else f': expected {want}'}){hint}"
    )
  return tuple(n for a, n in zip(axes, shape) if a == "layers")


def declared_bias_order(caller: str, path: str, axes, shape, bias_path: str, bias_shape,
                        bias_names=None) -> tuple[int, ...] | None:
  """How the bias of a declared kernel stores its axes: the permutation that takes the kernel's
  axes less ``"in"`` (the order of ``declared_factor``) to the bias's; None for that order itself.

  Two orders are read. ``nn.scan``'s: it puts a layer axis at the same index of every parameter
  (``param_scan_axis``), so the bias holds its layer axes where the kernel does, and its other
  axes in the kernel's order (MaxText's ``param_scan_axis=1``: kernel ``(embed, layers, heads,
  head_dim)``, bias ``(heads, layers, head_dim)``); and the kernel's axes less ``"in"``
  (``(layers, heads, head_dim)``). They differ only when an ``"in"`` axis precedes a layer axis.
  The bias's logical names, when they name as many stacked-layer axes as the kernel has, must
  put them where the order does; where both fit, they decide, else ``nn.scan``'s order does.
  ValueError naming ``bias_path`` when neither fits, or the names fit neither.
  """
  rest = [i for i, a in enumerate(axes) if a != "in"]
  scan = [i for i in rest if axes[i] != "layers"]
  for i in rest:
    if axes[i] == "layers":
      scan.insert(min(i, len(scan)), i)
  orders = list(dict.fromkeys([tuple(rest.index(i) for i in scan), tuple(range(len(rest)))]))
  bias_shape = tuple(bias_shape)
  fit = [o for o in orders if tuple(shape[rest[j]] for j in o) == bias_shape]
  layer_at = [k for k, n in enumerate(bias_names or ()) if n in LAYER_NAMES]
  if len(bias_names or ()) == len(bias_shape) and len(layer_at) == axes.count("layers"):
    fit = [o for o in fit if [k for k, j in enumerate(o) if axes[rest[j]] == "layers"] == layer_at]
  if not fit:
    want = " or ".join(str(tuple(shape[rest[j]] for j in o)) for o in orders)
    named = "" if bias_names is None else f" and logical names {tuple(bias_names)}"
    raise ValueError(
        f"{caller}: {bias_path} has shape {bias_shape}{named}; expected {want}, the shape of {path} {tuple(shape)} "
        f"(declared axes {axes}) without its 'in' axes, in their order or with its layer axes where nn.scan puts "
        "them (at the kernel's positions)"
    )
  return None if fit[0] == tuple(range(len(rest))) else fit[0]


def flat_columns(per_part: Sequence[jax.Array], groups: int = 0) -> jax.Array:
  """Per-part arrays ``(*stack, heads, width)`` as one flattened column axis ``(*stack, columns)``:
  the parts' head-major blocks one after another, or, with ``groups`` (the key/value heads) > 0,
  ``Projection.grouped``'s order: group by group, each part's heads of that group in turn."""
  lead = per_part[0].shape[:-2]
  if not groups:
    return jnp.concatenate([f.reshape(*lead, -1) for f in per_part], axis=-1)
  return jnp.concatenate([f.reshape(*lead, groups, -1) for f in per_part], axis=-1).reshape(*lead, -1)


def declared_factor(axes: tuple[str, ...], per_part: list[jax.Array], groups: int = 0) -> jax.Array:
  """Per-part factors ``(*stack, heads, width)`` laid out as the bias: ``axes`` less ``"in"``
  (``groups``: ``flat_columns``')."""
  nstack = per_part[0].ndim - 2
  if "out" in axes and "parts" not in axes:
    f, tail = flat_columns(per_part, groups), ["out"]
  elif "out" in axes:
    f, tail = jnp.stack([p.reshape(*p.shape[:-2], -1) for p in per_part], axis=nstack), ["parts", "out"]
  elif "parts" in axes:
    f, tail = jnp.stack(per_part, axis=nstack), ["parts", "heads", "head_dim"]
  else:
    f, tail = per_part[0], ["heads", "head_dim"]
  canonical = [("layers", i) for i in range(nstack)] + [(a, 0) for a in tail]
  storage, seen = [], 0
  for a in axes:
    if a == "layers":
      storage.append(("layers", seen))
      seen += 1
    elif a != "in":
      storage.append((a, 0))
  return jnp.transpose(f, [canonical.index(x) for x in storage])


def kernel_factor(axes: tuple[str, ...], factor: jax.Array) -> jax.Array:
  """The bias-shaped factor with size-1 axes where the kernel has its ``"in"`` axes."""
  return jnp.expand_dims(factor, tuple(i for i, a in enumerate(axes) if a == "in"))


# ----------------------------------------------------------------------------- logical names


def axes_from_logical(names: Sequence[object] | None) -> tuple[str, ...] | None:
  """Declared axes read from a kernel's logical axis names; None when they do not tell.

  Each name maps by ``LOGICAL_AXES``: layer names to ``"layers"``, head names to
  ``"heads"``, per-head width names to ``"head_dim"``, fusing names to ``"parts"``, and the
  one remaining axis (``embed``, ``q_lora``, ``kv_lora``, or any other name) to ``"in"``.
  A lone head or width name without the other (a 2-D ``("embed", "heads")`` kernel) is a
  flattened ``"out"`` axis. An expert axis (an attention projection has none) counts as an
  other name, so such names do not tell.
  """
  if names is None:
    return None
  out: list[str | None] = []
  for n in names:
    role = next((r for r, known in LOGICAL_AXES.items() if r not in ("in", "experts") and n in known), None)
    out.append(role)
  has_h, has_d = out.count("heads"), out.count("head_dim")
  if has_h > 1 or has_d > 1 or out.count("parts") > 1:
    return None
  if has_h != has_d:
    out = ["out" if r in ("heads", "head_dim") else r for r in out]
  if not (has_h or has_d):
    return None
  rest = [i for i, r in enumerate(out) if r is None]
  if len(rest) != 1 or names[rest[0]] is None:
    return None
  out[rest[0]] = "in"
  return tuple(out)  # type: ignore[arg-type]
