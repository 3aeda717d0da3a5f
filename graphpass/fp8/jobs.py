"""One GEMM of a grouped or batched FP8 GEMM, as the providers (``providers.py``, ``te.py``)
receive it."""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor


class Job(NamedTuple):
    """One GEMM of a grouped or batched GEMM: ``out = dequant(a) @ dequant(b).T (+ bias)``,
    written into ``out``, a view of the whole result."""

    a: Tensor
    a_scale_inv: Tensor
    b: Tensor
    b_scale_inv: Tensor
    out: Tensor
    bias: Optional[Tensor] = None
