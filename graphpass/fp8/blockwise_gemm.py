"""``fp8="blockwise"`` on torch's own cuBLASLt blockwise FP8 GEMM (``kernels="scaled_mm"``).

torch >= 2.10 exposes cuBLASLt's DeepSeek-V3 GEMM on Hopper as ``torch.nn.functional.scaled_mm``
with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (cuBLAS >= 12.9). The operands are
graphpass's blockwise ones (:mod:`graphpass.fp8.recipes`): activations and gradients in 1x128
blocks along K, weights in 128x128 tiles, E4M3, fp32 ``scale_inv`` (decoding scales, as torch
reads them). Every GEMM of a lowered linear is one of torch's two pairings:

    fprop  a = X (1x128)         b = W (128x128)             (1x128, 128x128)
    dgrad  a = dY (1x128)        b = W columnwise (128x128)  (1x128, 128x128)
    wgrad  a = dY col (1x128)    b = X col (1x128)           (1x128, 1x128)

Only the scales' layouts differ from graphpass's (row-major, unpadded). torch's checks
(``torch/_meta_registrations.py``, ``_check_scaled_mm_sizes_v2``, and ScaledBlas.cpp on the
GPU) want, for ``a`` (M, K) and ``b`` (N, K) passed as ``b.t()``:

* a 1x128 scale of ``a``: shape (M, K/128), stride (1, M): column-major;
* a 1x128 scale of ``b``: shape (N, K/128), stride (1, N);
* a 128x128 scale of ``b``: shape (L4, N/128), stride (1, L4), L4 = K/128 rounded up to a multiple
  of 4: graphpass's (N/128, K/128) tile scales, each row padded to L4, transposed.

``tests/test_fp8_lowering.py`` checks these layouts against torch's own checks on fake CUDA
tensors, and their meaning against the reference provider, on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _compat
from . import recipes, torch_gemms

SCALING = recipes.Scaling.BLOCKWISE  # the scaling of the recipes this GEMM runs


def unsupported(device: torch.device) -> str | None:
    """None where torch's blockwise FP8 GEMM runs on ``device``, else why not."""
    why = torch_gemms.blockwise_scaled_mm_missing()
    if why:
        return why
    if device.type != "cuda":
        return f"torch's blockwise FP8 GEMM (cuBLASLt) has no {device.type} kernel"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return ("torch's blockwise FP8 GEMM runs on sm90 (Hopper) only, not compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    cuda = _compat.cuda_version()
    if cuda is not None and cuda < (12, 9):
        return f"torch's blockwise FP8 GEMM needs cuBLAS >= 12.9 (this torch has CUDA {cuda})"
    return None


def _tiled(role: str) -> bool:
    """Whether ``role``'s blockwise scales are 128x128 tiles (weights), not 1x128 blocks."""
    return recipes.BLOCKWISE.block(role) == (128, 128)


def scale_layouts(a_scale_inv: Tensor, b_scale_inv: Tensor, a_role: str,
                  b_role: str) -> tuple[Tensor, str, Tensor, str]:
    """torch's ``(scale_a, recipe_a, scale_b, recipe_b)`` for the GEMM ``a @ b.T`` of blockwise
    operands in ``a_role`` and ``b_role`` (the recipe names are ``ScalingType`` member names)."""
    if _tiled(a_role):
        raise ValueError(f"torch's blockwise GEMM takes 128x128 scales on its second operand "
                         f"only, not a {a_role} as the first")
    scale_a = _column_major(a_scale_inv)
    if not _tiled(b_role):
        return scale_a, "BlockWise1x128", _column_major(b_scale_inv), "BlockWise1x128"
    k_blocks = b_scale_inv.shape[1]
    l4 = -(-k_blocks // 4) * 4
    padded = torch.nn.functional.pad(b_scale_inv.float(), (0, l4 - k_blocks), value=1.0)
    return scale_a, "BlockWise1x128", padded.contiguous().t(), "BlockWise128x128"


def fast_accumulation(fast_accum: bool, b_role: str) -> bool:
    """Whether the blockwise GEMM whose second operand is a ``b_role`` may accumulate fast:
    never with that operand's 128x128 scales (cuBLASLt refuses it)."""
    return fast_accum and not _tiled(b_role)


def _column_major(scale: Tensor) -> Tensor:
    """A 2-D scale with stride (1, rows): the transpose of its row-major transpose."""
    return scale.float().t().contiguous().t()


def gemm(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor, a_role: str,
         b_role: str, out_dtype: torch.dtype, bias: Optional[Tensor], *,
         fast_accum: bool = False) -> Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)`` on torch's blockwise GEMM (a, b K-major).

    ``fast_accum`` holds for 1x128 x 1x128 GEMMs only: cuBLASLt has no fast accumulation with
    128x128 scales (torch raises "scaled_gemm doesn't support fast accum with 128x128 blockwise
    scaling", seen on an H200 with torch 2.11), so the GEMMs with a weight operand accumulate
    precisely whatever ``Config.fp8_accumulate`` says; ``fast_accumulation`` says the same."""
    scale_a, recipe_a, scale_b, recipe_b = scale_layouts(a_scale_inv, b_scale_inv, a_role, b_role)
    out = torch_gemms.blockwise_scaled_mm(a, b.t(), scale_a=scale_a, recipe_a=recipe_a,
                                      scale_b=scale_b, recipe_b=recipe_b, out_dtype=out_dtype,
                                      use_fast_accum=fast_accumulation(fast_accum, b_role))
    return out if bias is None else out + bias.to(out_dtype)
