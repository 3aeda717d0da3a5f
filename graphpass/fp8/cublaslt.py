"""cuBLASLt's rules for FP8 GEMM operands that the CPU emulations do not enforce, shared by the
``scaled_mm`` and ``te`` providers (both end in cuBLASLt). Both show on an H100 (torch 2.11) and
are guarded on the CPU by ``tests/test_fp8_experts.py``:

* the contraction dimension must be a multiple of 16 (a token group's wgrad contracts over its
  own tokens, e.g. 100): zero columns appended to both operands add nothing, so padding is exact;
* a scale must sit at the start of its own allocation: cuBLASLt answers
  ``CUBLAS_STATUS_NOT_SUPPORTED`` for a view at an offset, which one group's scale in the
  per-group vector is.

``check_scaled_grouped_mm`` holds ``torch._scaled_grouped_mm``'s rules for rowwise scales
(torch 2.13: ``_scaled_grouped_mm_cuda`` in aten/src/ATen/native/cuda/Blas.cpp and the meta
registration ``_meta_grouped_mm_common``), which its CPU emulation (providers.py) checks on every
call, so the CPU tests hold graphpass's calls to what the CUDA kernel accepts.
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


def check_scaled_grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                            offs: Tensor | None) -> None:
    """Raise ValueError where the CUDA ``torch._scaled_grouped_mm`` (rowwise fp32 scales) would
    refuse its operands, or (the last rule, not checked by torch) compute garbage:

    * a and b E4M3, 2-D or 3-D; offsets (1-D int32) exactly when one of them is 2-D;
    * a row-major, b column-major in their last two dimensions, row strides 16-byte aligned;
    * a's last dimension and both of b's last two dimensions multiples of 16; 3-D operands'
      contraction dimensions equal;
    * fp32 scales: for a 2-D operand 1-D and contiguous, with (2d x 2d: G times) as many elements
      as a's rows (b's columns); for a 3-D one 2-D, contiguous in the last dimension, (G, rows);
    * 2d x 2d (groups along the contraction): every group starts at a multiple of 16 tokens, the
      TMA alignment of the contraction (torchao aligns its token groups to 16 for this kernel).
    """
    def fail(why: str) -> None:
        raise ValueError(f"torch._scaled_grouped_mm would refuse this call: {why}")

    e4m3 = torch.float8_e4m3fn
    if a.dtype != e4m3 or b.dtype != e4m3:
        fail(f"operands must be E4M3, got {a.dtype} and {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        fail(f"operands must be 2-D or 3-D, got {a.dim()}-D and {b.dim()}-D")
    if not (a.stride(-1) == 1 and a.stride(-2) > 1):
        fail(f"a must be row-major, strides {a.stride()}")
    if not (b.stride(-2) == 1 and b.stride(-1) > 1):
        fail(f"b must be column-major, strides {b.stride()}")
    if a.stride(-2) % 16 or b.stride(-1) % 16:
        fail(f"row strides must be multiples of 16 bytes, got {a.stride()} and {b.stride()}")
    if a.shape[-1] % 16 or b.shape[-2] % 16 or b.shape[-1] % 16:
        fail(f"a's last dimension and b's last two must be multiples of 16, got "
             f"{tuple(a.shape)} and {tuple(b.shape)}")
    two_d = a.dim() == 2 or b.dim() == 2
    if (a.dim() == 3 or b.dim() == 3) and a.shape[-1] != b.shape[-2]:
        fail(f"contraction dimensions differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if two_d != (offs is not None):
        fail("offsets are needed exactly when an operand is 2-D")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        fail(f"offsets must be 1-D int32, got {offs.dtype} of shape {tuple(offs.shape)}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        fail(f"rowwise scales must be fp32, got {scale_a.dtype} and {scale_b.dtype}")
    groups = offs.shape[0] if a.dim() == 2 and b.dim() == 2 else 1
    for name, scale, mat, dim in (("scale_a", scale_a, a, 0), ("scale_b", scale_b, b, 1)):
        if mat.dim() == 2:
            if scale.dim() != 1 or not scale.is_contiguous():
                fail(f"{name} must be 1-D and contiguous, got {tuple(scale.shape)}")
            if scale.shape[0] != mat.shape[dim] * groups:
                fail(f"{name} must have {mat.shape[dim] * groups} elements, got {scale.shape[0]}")
        else:
            if scale.dim() != 2 or scale.stride(-1) != 1:
                fail(f"{name} must be 2-D, contiguous in its last dimension")
            if tuple(scale.shape) != (mat.shape[0], mat.shape[1 + dim]):
                fail(f"{name} must be {(mat.shape[0], mat.shape[1 + dim])}, got "
                     f"{tuple(scale.shape)}")
    if a.dim() == 2 and b.dim() == 2:
        ends = offs.tolist()
        if any(e % 16 for e in ends[:-1]) or (ends and ends[-1] > a.shape[1]):
            fail(f"2d x 2d groups must start at multiples of 16 tokens, ends {ends}")
