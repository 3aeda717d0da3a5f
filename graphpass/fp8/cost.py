"""Whether a linear's FP8 GEMMs beat bf16's on the target GPU: a roofline of an H100.

An FP8 GEMM does its FLOPs at twice bf16's peak but pays for its quantizes: each of the linear's
three tensors (input X, weight W, output gradient dY) is read twice in bf16 (the amax, then the
cast) and written as two FP8 copies (rowwise and columnwise), 6 bytes per element. Where a
dimension is small (grouped-query k/v projections, MLA's down-projections, short sequences),
the GEMMs are short and those bytes are not: FP8 is slower than bf16.

The model, for one linear of M tokens, K inputs and N outputs (forward Y = X W^T, dgrad
dX = dY W, wgrad dW = dY^T X: each 2*M*N*K FLOPs):

* a GEMM takes ``max(FLOPs / peak, bytes / bandwidth)``, bytes being its two operands (2 bytes an
  element in bf16, 1 in FP8) and its bf16 output (2 bytes);
* FP8 adds the quantizes, ``6 * (M*K / sharers + N*K + M*N) / bandwidth``, where ``sharers`` is
  the number of lowered linears reading the same X (q, k and v quantize their input once); where
  another reader of X is lowered anyway, X's quantize is paid already and costs this linear
  nothing (keeping it bf16 would also keep a bf16 X saved for its wgrad, and under sequence
  parallelism all-gather X in bf16).

GEMMs whose bf16 estimate is under ``MIN_JUDGED_S`` are not judged: at that size kernel launches
(a few microseconds each) dominate, which a roofline does not model, and the FP8 GEMM the user
asked for is kept. The numbers are an H100 SXM's dense peaks (NVIDIA's datasheet: 989 TFLOP/s
bf16, 1,979 TFLOP/s FP8, 3.35 TB/s HBM3); they are used for every device, a CPU graph included
(``graphpass.plan`` on a machine without a GPU plans for an H100). The device is
``graph/roofline.py``'s, the one the memory budget times its choices with.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.roofline import H100, Device

MIN_JUDGED_S = 20e-6


@dataclass(frozen=True)
class Estimate:
    """A linear's three GEMMs in seconds on ``gpu``: bf16, and FP8 GEMMs plus quantizes."""

    bf16: float
    fp8_gemms: float
    quantizes: float
    gpu: Device = H100

    @property
    def fp8(self) -> float:
        return self.fp8_gemms + self.quantizes

    @property
    def faster_in_bf16(self) -> bool:
        return self.bf16 >= MIN_JUDGED_S and self.fp8 > self.bf16

    def describe(self) -> str:
        us = 1e6
        return (f"{self.gpu.name} roofline: FP8 GEMMs {self.fp8_gemms * us:.1f} us + quantizes "
                f"{self.quantizes * us:.1f} us > bf16 GEMMs {self.bf16 * us:.1f} us")


def linear_estimate(m: int, n: int, k: int, *, input_sharers: int = 1,
                    input_quantized: bool = False, gpu: Device = H100) -> Estimate:
    """The roofline estimate of a linear's forward, dgrad and wgrad GEMMs (module docstring)."""
    flops = 2 * m * n * k
    # (operand a, operand b, output) elements of fprop, dgrad and wgrad
    gemms = ((m * k, n * k, m * n), (m * n, n * k, m * k), (m * n, m * k, n * k))
    bf16 = sum(max(flops / gpu.bf16_flops, 2 * (a + b + o) / gpu.bandwidth) for a, b, o in gemms)
    fp8 = sum(max(flops / gpu.fp8_flops, (a + b + 2 * o) / gpu.bandwidth) for a, b, o in gemms)
    x = 0 if input_quantized else m * k / max(input_sharers, 1)
    quantizes = 6 * (x + n * k + m * n) / gpu.bandwidth
    return Estimate(bf16, fp8, quantizes, gpu)
