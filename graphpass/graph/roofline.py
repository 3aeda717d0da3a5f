"""One description of the target device's rates, for every time graphpass estimates.

The FP8 cost model (``fp8/cost.py``: is a linear faster in FP8 or bf16?) and the memory budget
(``passes/memory_budget.py``: what does a recompute or an offload add?) both time work as a
roofline: ``max(FLOPs / peak, bytes / bandwidth)``, and copies to and from the host at the host
link's rate. graphpass measures nothing: the numbers are an H100 SXM's on every device, a CPU
graph included (``graphpass.plan`` on a machine without a GPU plans for an H100).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    """A GPU's dense peaks and its link to the host."""

    name: str
    bf16_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    fp8_flops: float
    """Dense FP8 tensor-core FLOP/s."""
    fp32_flops: float
    """FP32 FLOP/s without TF32 (torch's default for fp32 matmuls)."""
    bandwidth: float
    """Device-memory (HBM) bytes/s."""
    host_link: float
    """Host-device copy bytes/s, each way (the two directions run at once)."""

    def compute(self, flops: float, nbytes: float, dtype: torch.dtype | None = None) -> float:
        """Seconds of work of ``flops`` at ``dtype``'s peak moving ``nbytes`` of device memory."""
        rate = (self.fp32_flops if dtype in (torch.float32, torch.float64)
                else self.fp8_flops if dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                else self.bf16_flops)
        return max(flops / rate, nbytes / self.bandwidth)

    def copy(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` one way between the device and the host."""
        return nbytes / self.host_link


H100 = Device("H100", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12, bandwidth=3.35e12,
              host_link=50e9)
"""H100 SXM (NVIDIA's datasheet: 989 TFLOP/s bf16, 1,979 TFLOP/s FP8, 67 TFLOP/s FP32, 3.35 TB/s
HBM3); the host link PCIe Gen5 x16 (~64 GB/s peak each way, ~50 GB/s reached, the rate torch's
offload prefetch assumes by default)."""
