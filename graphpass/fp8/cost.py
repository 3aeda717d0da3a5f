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

MoE experts (a 3-D weight, one GEMM per expert, grouped into one kernel) are ``groups`` such
linears of M tokens each (the capacity of a ``bmm`` expert, the average of token groups), summed.
Experts with few tokens each are bound by reading their weights (DeepSeek-V3's 256 experts of
about 160 tokens each on one GPU): FP8 GEMMs read half the weight bytes, but a quantize every
step reads and writes the weight's 6 bytes an element, more than the GEMMs save.
``weight_cached`` estimates the weights quantized once per optimizer step
(``fp8_weight_cache=True`` with gradient accumulation), the weight's quantize not counted: its
share per micro-batch goes to nothing as micro-batches accumulate. The lowering does not decide
by it (the cache is a memory option, which never changes numerics); its note says where the
cache would make FP8 the faster.

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

    def fp8_time(self) -> str:
        """The FP8 side of the estimate, in words."""
        return f"FP8 GEMMs {_time(self.fp8_gemms)} + quantizes {_time(self.quantizes)}"

    def describe(self) -> str:
        return f"{self.gpu.name} roofline: {self.fp8_time()} > bf16 GEMMs {_time(self.bf16)}"


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def linear_estimate(m: float, n: int, k: int, *, groups: int = 1, input_sharers: int = 1,
                    input_quantized: bool = False, weight_cached: bool = False,
                    gpu: Device = H100) -> Estimate:
    """The roofline estimate of a linear's forward, dgrad and wgrad GEMMs (module docstring):
    ``groups`` linears of ``m`` tokens each for MoE experts; ``weight_cached``: the weight
    quantized once per optimizer step, its quantize not counted."""
    flops = 2 * m * n * k
    # (operand a, operand b, output) elements of fprop, dgrad and wgrad
    gemms = ((m * k, n * k, m * n), (m * n, n * k, m * k), (m * n, m * k, n * k))
    bf16 = sum(max(flops / gpu.bf16_flops, 2 * (a + b + o) / gpu.bandwidth) for a, b, o in gemms)
    fp8 = sum(max(flops / gpu.fp8_flops, (a + b + 2 * o) / gpu.bandwidth) for a, b, o in gemms)
    x = 0 if input_quantized else m * k / max(input_sharers, 1)
    w = 0 if weight_cached else n * k
    quantizes = 6 * (x + w + m * n) / gpu.bandwidth
    return Estimate(groups * bf16, groups * fp8, groups * quantizes, gpu)
