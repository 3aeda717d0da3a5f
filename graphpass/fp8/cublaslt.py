"""cuBLASLt's rules for FP8 GEMM operands that the CPU emulations do not enforce, shared by the
``scaled_mm`` and ``te`` providers (both end in cuBLASLt). Both were found on an H100
(2026-11-23) and are guarded on the CPU by ``tests/test_fp8_experts.py``:

* the contraction dimension must be a multiple of 16 (a token group's wgrad contracts over its
  own tokens, e.g. 100): zero columns appended to both operands add nothing, so padding is exact;
* a scale must sit at the start of its own allocation: cuBLASLt answers
  ``CUBLAS_STATUS_NOT_SUPPORTED`` for a view at an offset, which one group's scale in the
  per-group vector is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pad_contraction(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` (both K-major) with zero columns up to a multiple of 16."""
    pad = -a.shape[-1] % 16
    if not pad:
        return a, b
    return pad_last(a, pad), pad_last(b, pad)


def pad_last(t: Tensor, pad: int) -> Tensor:
    """``t`` with ``pad`` zero columns appended (FP8 zeros are zero bytes; pad has no FP8 kernel)."""
    return torch.nn.functional.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


def own_scalar(scale: Tensor) -> Tensor:
    """A one-element fp32 scale in an allocation of its own."""
    s = scale.reshape(()).float()
    return s.clone() if s.storage_offset() else s
