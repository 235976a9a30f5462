"""Device models for the distributed Newton–Schulz planner: a step time from FLOPs and bytes.

``time = FLOPs / matmul rate + bytes received / link bandwidth`` per device (no overlap of
compute and communication assumed: an upper estimate; with perfect overlap it would be the
maximum of the two). A step is *communication-bound* when the second term is the larger.
The rates are vendors' peak figures:

* ``H100_NVLINK``: NVIDIA H100 SXM5, 989 TFLOP/s dense bf16 (NVIDIA H100 Tensor Core GPU
  datasheet: 1,979 TFLOP/s "with sparsity", half that dense); NVLink 4, 900 GB/s total
  bidirectional per GPU, so 450 GB/s received.
* ``TPU_V5P``: Google Cloud TPU v5p, 459 TFLOP/s bf16 per chip and 4,800 Gbps inter-chip
  interconnect per chip (Cloud TPU v5p documentation), taken as 600 GB/s total, 300 GB/s
  received.

Within one H100 node NVLink reaches 8 GPUs; across nodes the bandwidth is the network's
(typically 8 x 400 Gb/s InfiniBand per node, 50 GB/s per GPU), which this single-link model
does not distinguish.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Device:
  """A device's peak bf16 matmul rate (FLOP/s) and the bytes per second it can receive."""

  name: str
  flops_per_s: float
  link_bytes_per_s: float

  def compute_s(self, flops: float) -> float:
    return flops / self.flops_per_s

  def comm_s(self, nbytes: float) -> float:
    return nbytes / self.link_bytes_per_s

  def step_s(self, flops: float, nbytes: float) -> float:
    """Estimated seconds of a step doing ``flops`` and receiving ``nbytes``, unoverlapped."""
    return self.compute_s(flops) + self.comm_s(nbytes)


H100_NVLINK = Device("H100 SXM, NVLink 4", 989e12, 450e9)
TPU_V5P = Device("TPU v5p, ICI", 459e12, 300e9)
DEVICES = {"h100": H100_NVLINK, "tpu_v5p": TPU_V5P}
