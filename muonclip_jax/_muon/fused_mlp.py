"""A fused gate|up projection of a gated MLP, found by its name: two matrices, not one.

A gated MLP computes ``down(act(gate(x)) * up(x))``. Stored apart, gate and up are two Muon
matrices, each with its own orthogonalization and RMS factor; stored fused, as one matrix,
Muon would mix them (an up gradient 100x smaller than the gate's then gets a 100x smaller
update), so the same model would train differently by storage. The fused storages read here,
each gate then up along one axis (``x @ W`` chunked in two halves):

* Hugging Face transformers (v5) mixture-of-experts: ``experts.gate_up_proj`` of shape
  ``(experts, 2 * intermediate, hidden)`` (torch's ``(out, in)`` per expert) beside
  ``experts.down_proj`` ``(experts, hidden, intermediate)``;
* a torch ``Linear`` (Phi-3): ``gate_up_proj/weight`` ``(2 * intermediate, hidden)`` beside
  ``down_proj/weight`` ``(hidden, intermediate)``;
* a Flax ``Dense``: ``gate_up_proj/kernel`` ``(hidden, 2 * intermediate)`` beside
  ``down_proj/kernel`` ``(intermediate, hidden)``.

Such a leaf is cut into its two halves along the fused axis (``MatrixAxes.fused``) when its
``down_proj`` sibling's shape confirms the storage (a ``weight`` or ``kernel`` leaf whose
``down_proj`` is not in the tree Muon sees, routed to AdamW or frozen, is cut along its
layer's output axis by that convention) and the fused axis is one whole side of the matrix.
Any other leaf of that name (gpt-oss's ``(experts, hidden, 2 * intermediate)``, gate and up
interleaved column by column; shapes that fit no storage above; a bare ``gate_up_proj``
without its ``down_proj``) is a ValueError naming the leaf: declare the cut
(``MatrixAxes(..., fused=(axis, 2))``), or ``fused=(axis, 1)`` to keep one matrix.
"""

from __future__ import annotations

from typing import Any

from .._util import MatrixAxes, skeleton

NAME = "gate_up_proj"
DOWN = "down_proj"


def fused_gate_up(tree: Any):
  """``(path, shape, axes) -> axes``: ``axes`` with the gate|up cut for a fused projection whose
  ``axes`` declare no ``fused`` (module docstring); every other leaf's ``axes`` as given."""
  shapes = dict(skeleton(tree))

  def rule(path: str, shape: tuple[int, ...], axes: MatrixAxes) -> MatrixAxes:
    parts = path.split("/")
    if axes.fused is not None or len(shape) < 2:
      return axes
    if parts[-1] == NAME:  # transformers' bare parameter: (..., 2 * inter, hidden)
      down_path, axis = parts[:-1] + [DOWN], len(shape) - 2
    elif len(parts) >= 2 and parts[-2] == NAME and parts[-1] in ("weight", "kernel"):
      down_path = parts[:-2] + [DOWN, parts[-1]]
      axis = len(shape) - 2 if parts[-1] == "weight" else len(shape) - 1  # torch (out, in), Flax (in, out)
    else:
      return axes
    down = shapes.get("/".join(down_path))
    other = 2 * len(shape) - 3 - axis  # the matrix's other side
    fits = (down is not None and len(down) == len(shape) and down[:-2] == shape[:-2]
            and shape[axis] == 2 * down[other] and shape[other] == down[axis])
    if down is None and parts[-1] != NAME and shape[axis] % 2 == 0:
      fits = True  # a Linear's / Dense's out axis, by convention; its down_proj routed elsewhere (frozen, AdamW)
    _, fan_in, fan_out = axes.resolve(path, shape)
    if fits and (axis,) in (fan_in, fan_out):
      return MatrixAxes(axes.fan_in, axes.fan_out, fused=(axis, 2))
    seen = f"no {'/'.join(down_path)} beside it" if down is None else f"{'/'.join(down_path)} {tuple(down)}"
    raise ValueError(
        f"{path}: a fused gate|up projection of shape {tuple(shape)} ({seen}) whose cut the library cannot "
        f"read (the storages it reads by name: transformers' gate_up_proj (..., 2 * intermediate, hidden) beside "
        f"a down_proj (..., hidden, intermediate); gate_up_proj/weight (2 * intermediate, hidden); "
        f"gate_up_proj/kernel (hidden, 2 * intermediate), gate then up). Gate and up are two Muon matrices: "
        f"declare the cut with matrix_axes={{...: MatrixAxes(fan_in=..., fan_out=..., fused=(axis, 2))}} for "
        f"this leaf (the axis holding gate then up), or fused=(axis, 1) to keep it one matrix; gate and up "
        f"interleaved column by column (gpt-oss) is no cut: store them apart")

  return rule
