"""FP8 GEMM kernel providers behind one small interface, and the choice among them.

A provider computes ``dequant(a) @ dequant(b).T (+ bias)`` for operands quantized by
:mod:`graphpass.fp8.recipes` (both K-major, i.e. Transformer Engine's TN layout).

* ``reference``: pure torch on any device; dequantizes exactly and accumulates in fp32.
* ``scaled_mm``: ``torch._scaled_mm`` (CUDA sm89+, and the CPU emulation); tensorwise and
  rowwise scaling, expert GEMMs with E4M3 operands on ``torch._scaled_grouped_mm`` (sm90+;
  emulated on the CPU), and blockwise on Hopper through torch's cuBLASLt blockwise GEMM
  (:mod:`graphpass.fp8.blockwise_gemm`).
* ``te``: Transformer Engine's ``general_gemm`` (see :mod:`graphpass.fp8.te`).

Accumulation (``Config.fp8_accumulate``, carried by the recipe: ``Recipe.fast_accumulation``):
each GEMM gets ``fast_accum``, True for the forward GEMM and False for dgrad and wgrad under the
default ``"te"`` (Transformer Engine's
``use_split_accumulator`` off for fprop, on for the gradients; torchao's float8 sets
``use_fast_accum`` the same way). Hopper's FP8 tensor cores accumulate in fewer than fp32's bits
unless the sum is promoted to fp32 registers every so many products (split accumulation), which
costs throughput. ``reference`` accumulates in fp32 in every mode: it models the precise one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import blockwise_gemm, cudnn, recipes, torch_gemms
from .cublaslt import check_scaled_grouped_mm, own_scalar, pad_contraction
from .jobs import TOKEN_ALIGN, Provider, aligns_tokens, per_expert_gemm, per_group_gemm

NAMES = ("te", "scaled_mm", "reference")


class Reference(Provider):
    name = "reference"

    def supports(self, recipe: recipes.Recipe | str, device: torch.device) -> str | None:
        return None

    def gemm(self, a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype, bias, *,
             fast_accum=False):
        # fp32 accumulation of exact products whatever ``fast_accum`` says: the precise mode
        a32 = recipes.dequantize(a, a_scale_inv, recipe, a_role)
        b32 = recipes.dequantize(b, b_scale_inv, recipe, b_role)
        out = a32 @ b32.t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)


class ScaledMM(Provider):
    name = "scaled_mm"

    def supports(self, recipe: recipes.Recipe | str, device: torch.device) -> str | None:
        rec = recipes.as_recipe(recipe)
        if rec.scaling is blockwise_gemm.SCALING:
            return blockwise_gemm.unsupported(device)
        if not rec.per_tensor and not rec.per_row:
            return (f"torch._scaled_mm runs fp8='tensorwise', 'rowwise' or 'blockwise' here, "
                    f"not {rec.quantization_key!r}")
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return "torch._scaled_mm needs a CUDA device of compute capability 8.9 or newer"
        if device.type not in ("cuda", "cpu"):
            return f"torch._scaled_mm has no {device.type} kernel"
        return None

    def gemm(self, a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype, bias, *,
             fast_accum=False):
        rec = recipes.as_recipe(recipe)
        if rec.scaling is blockwise_gemm.SCALING:
            return blockwise_gemm.gemm(a, a_scale_inv, b, b_scale_inv, a_role, b_role, out_dtype,
                                       bias, fast_accum=fast_accum)
        # cuBLASLt on Hopper is TN-only: mat2 must be column-major, which b.t() of a row-major
        # (N, K) tensor is. Bias must be bf16/fp16 and is refused with an fp32 output, so add it
        # afterwards in those cases. Its operand rules: fp8/cublaslt.py.
        if rec.per_row:
            return _scaled_mm_rowwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias,
                                      fast_accum=fast_accum)
        fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
        a, b = pad_contraction(a, b)
        out = torch_gemms.scaled_mm(
            a, b.t(), scale_a=own_scalar(a_scale_inv), scale_b=own_scalar(b_scale_inv),
            bias=bias if fused_bias else None, out_dtype=out_dtype, use_fast_accum=fast_accum,
        )
        if bias is not None and not fused_bias:
            out = out + bias.to(out_dtype)
        return out


    def grouped_gemm(self, a, a_scale_inv, b, b_scale_inv, offs, recipe, a_role, b_role, out_dtype,
                     bias, *, fast_accum=False):
        """Token-grouped GEMM (``fp8_gemm`` with offsets), as one ``torch._scaled_grouped_mm``
        where both operands are E4M3: rowwise, tensorwise under ``fp8_format="e4m3"``, and
        tensorwise HYBRID's forward (``rowwise_grouped_2d3d``: forward, dgrad;
        ``rowwise_grouped_2d2d``: wgrad, on rowwise operands in the 16-aligned token layout
        (``aligns_tokens``), on tensorwise ones in (K, T); a tensorwise scale given to each row it
        scales). Else (HYBRID's E5M2 gradients, which the grouped kernel refuses) one
        ``_scaled_mm`` per group."""
        if recipes.as_recipe(recipe).per_row and _rowwise_grouped_runs(a, bias):
            if b.dim() == 3:
                return rowwise_grouped_2d3d(a, a_scale_inv, b, b_scale_inv, offs, out_dtype,
                                            fast_accum=fast_accum)
            return rowwise_grouped_2d2d(a, a_scale_inv, b, b_scale_inv, offs, out_dtype,
                                        fast_accum=fast_accum, aligned=aligns_tokens(recipe))
        if _tensorwise_grouped_runs(recipe, a, b, bias):
            return tensorwise_grouped(a, a_scale_inv, b, b_scale_inv, offs, out_dtype,
                                      fast_accum=fast_accum)
        return per_group_gemm(a, a_scale_inv, b, b_scale_inv, offs, recipe, a_role, b_role,
                              out_dtype, bias, self, fast_accum=fast_accum)

    def batched_gemm(self, a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype,
                     bias, *, fast_accum=False):
        """3-D operands (``fp8_gemm`` of ``bmm`` experts): one 3d x 3d
        ``torch._scaled_grouped_mm`` (``rowwise_batched``) where both operands are E4M3, as for
        token groups; else one ``_scaled_mm`` per expert."""
        if recipes.as_recipe(recipe).per_row and _rowwise_grouped_runs(a, bias):
            return rowwise_batched(a, a_scale_inv, b, b_scale_inv, out_dtype,
                                   fast_accum=fast_accum)
        if _tensorwise_grouped_runs(recipe, a, b, bias):
            return tensorwise_batched(a, a_scale_inv, b, b_scale_inv, out_dtype,
                                      fast_accum=fast_accum)
        return per_expert_gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype,
                               bias, self, fast_accum=fast_accum)


# --- rowwise: torch._scaled_mm and torch._scaled_grouped_mm with one fp32 scale per row -------
#
# Operand rules (torch 2.13's checks in aten/src/ATen/native/cuda/Blas.cpp and its meta
# registrations, enforced on the CPU by fp8/cublaslt.py): E4M3 operands, a row-major and b
# column-major, contraction and b's other dimension multiples of 16, fp32 scales, bf16 output.
# _scaled_mm: scale_a (M, 1), scale_b (1, N), both contiguous. _scaled_grouped_mm: 2d x 3d
# scale_a (T,), scale_b (G, N); 3d x 3d (G, M) and (G, N); 2d x 2d (G * M,) and (G * N,), group g's
# scales contiguous. The kernels write bf16 only: another out_dtype is the bf16 result cast.


def _scaled_mm_rowwise(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                       out_dtype: torch.dtype, bias: Optional[Tensor], *,
                       fast_accum: bool = False) -> Tensor:
    """One rowwise ``torch._scaled_mm``: a (M, K) with scales (M, 1), b (N, K) with (N, 1)."""
    a, b = pad_contraction(a, b)
    fused_bias = bias is not None and bias.dtype == torch.bfloat16
    out = torch_gemms.scaled_mm(a, b.t(), scale_a=own_rows(a_scale_inv, (-1, 1)),
                            scale_b=own_rows(b_scale_inv, (1, -1)),
                            bias=bias if fused_bias else None, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)
    out = out.to(out_dtype)
    if bias is not None and not fused_bias:
        out = out + bias.to(out_dtype)
    return out


def own_rows(scale: Tensor, shape: tuple[int, ...]) -> Tensor:
    """fp32 per-row scales in ``shape``, contiguous and at the start of their own allocation."""
    s = scale.float().reshape(shape).contiguous()
    return s.clone() if s.storage_offset() else s


def _rowwise_grouped_runs(a: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether rowwise grouped GEMMs run as one ``torch._scaled_grouped_mm``: on CUDA where the
    kernel exists (sm90+), and on the CPU through its emulation (fp8/cublaslt.py, which checks
    the kernel's operand rules); no bias (the kernel takes none)."""
    if bias is not None:
        return False
    if a.device.type == "cpu":
        return True
    return (a.device.type == "cuda" and torch_gemms.has_scaled_grouped_mm()
            and torch.cuda.get_device_capability(a.device) >= (9, 0))


def grouped_mm_call(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                    offs: Optional[Tensor], *, fast_accum: bool = False) -> Tensor:
    """One rowwise ``torch._scaled_grouped_mm`` (bf16 out); on the CPU its emulation."""
    if a.device.type == "cpu":
        return scaled_grouped_mm_emulated(a, b, scale_a, scale_b, offs)
    return torch_gemms.scaled_grouped_mm(a, b, scale_a=scale_a, scale_b=scale_b, offs=offs,
                                     out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def rowwise_grouped_2d3d(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                         offs: Tensor, out_dtype: torch.dtype, *,
                         fast_accum: bool = False) -> Tensor:
    """Forward or dgrad over token groups: a (T, K) rowwise (scales (T, 1)) times expert b
    (G, N, K) rowwise (scales (G, N, 1)), one grouped call. Rows past ``offs[-1]`` are what the
    kernel leaves there, as for torch's own ``_grouped_mm`` (its output is ``empty_strided``):
    unwritten on CUDA, 0 in the CPU emulation. Zeroing them was a ``torch.where`` over the
    whole output inside this op, where Inductor cannot fuse it: four passes a step over the
    routed experts' outputs (0.43 ms at 8,192 tokens and 1.72 ms at 32,768 on an H200, by the
    profile's call counts), for rows no routed token owns."""
    t, groups, n = a.shape[0], b.shape[0], b.shape[1]
    out = grouped_mm_call(a, b.transpose(-2, -1), own_rows(a_scale_inv, (t,)),
                          own_rows(b_scale_inv, (groups, n)), offs, fast_accum=fast_accum)
    return out.to(out_dtype)


def group_of_rows(offs: Tensor, t: int) -> Tensor:
    """Each of ``t`` rows' token group from ``offs`` (int64, ``len(offs)`` past the last group),
    on the device: no host sync."""
    return torch.searchsorted(offs, torch.arange(t, device=offs.device, dtype=offs.dtype),
                              right=True).long()


def group_bounds(offs: Tensor) -> tuple[Tensor, Tensor]:
    """Each token group's first row and the row past its last (int64), on the device."""
    ends = offs.long()
    return torch.cat([ends.new_zeros(1), ends[:-1]]), ends


def aligned_tokens(tokens: int, groups: int, align: int = TOKEN_ALIGN) -> int:
    """Columns of the aligned token layout of ``tokens`` tokens in ``groups`` groups: a static
    bound, ``ceil(T / align) * align + align * G``, on every group's size rounded up to a multiple
    of ``align`` (at most ``T + (align - 1) * G`` in all)."""
    return -(-tokens // align) * align + align * groups


def aligned_group_ends(offs: Tensor, align: int = TOKEN_ALIGN) -> Tensor:
    """Each token group's end in the aligned layout (int64, on the device): the groups' sizes
    rounded up to multiples of ``align``, summed up to and including the group."""
    return torch.cumsum(_aligned_sizes(offs, align), 0)


def _aligned_sizes(offs: Tensor, align: int) -> Tensor:
    """Each token group's size rounded up to a multiple of ``align`` (int64)."""
    starts, ends = group_bounds(offs)
    return (ends - starts + align - 1) // align * align


def aligned_token_sources(offs: Tensor, columns: int,
                          align: int = TOKEN_ALIGN) -> tuple[Tensor, Tensor, Tensor]:
    """The aligned token layout of ``columns`` columns, as a gather: for each column, its token
    group (int64; ``len(offs)`` past the last group's aligned end), the token (row of x) it holds,
    and whether it holds one (False in a group's padding and past the last group; its token is
    then 0). Group g's tokens fill its columns from ``aligned_group_ends(offs)[g-1]`` on, in
    order; tokens past ``offs[-1]`` are in no column. On the device: no host sync."""
    groups = offs.shape[0]
    starts, ends = group_bounds(offs)
    sizes = _aligned_sizes(offs, align)
    aligned_ends = torch.cumsum(sizes, 0)
    aligned_starts = aligned_ends - sizes
    column = torch.arange(columns, device=offs.device)
    group = torch.searchsorted(aligned_ends, column, right=True)
    g = group.clamp(max=groups - 1)
    token = starts[g] + column - aligned_starts[g]
    valid = (group < groups) & (token < ends[g])
    return group, torch.where(valid, token, 0), valid


def rowwise_grouped_2d2d(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                         offs: Tensor, out_dtype: torch.dtype, *, fast_accum: bool = False,
                         aligned: bool = True) -> Tensor:
    """Wgrad over token groups: a (M, T') and b (N, T'), both columnwise copies with per-group
    scales (G, M) and (G, N); out (G, M, N), group g's tokens contracted. The kernel needs each
    group to start at a multiple of 16 tokens (the contraction's alignment).

    ``aligned`` (the rowwise recipe's copies, ``aligns_tokens``): the operands are in the aligned
    token layout the quantize wrote (``aligned_token_sources``: T' = ``aligned_tokens(T, G)``,
    padding columns zero FP8 bytes, which add nothing), taken as they are with the aligned group
    ends, computed from ``offs`` on the device. Else (tensorwise copies, (M, T) with groups at
    ``offs``): each operand's tokens are first moved to the aligned layout by one scatter
    (``index_copy_``) on the device. Either way no per-group copy, no host sync. An empty
    group's output is 0."""
    if aligned:
        aligned_offs = aligned_group_ends(offs).to(torch.int32)
    else:
        positions, aligned_offs, columns = aligned_token_positions(offs, a.shape[1])
        a, b = (_scatter_tokens(x, positions, columns) for x in (a, b))
    out = grouped_mm_call(a, b.t(), own_rows(a_scale_inv, (-1,)),
                          own_rows(b_scale_inv, (-1,)), aligned_offs, fast_accum=fast_accum)
    return out.to(out_dtype)


def aligned_token_positions(offs: Tensor, t: int,
                            align: int = TOKEN_ALIGN) -> tuple[Tensor, Tensor, int]:
    """Where each of ``t`` tokens goes in the aligned token layout, as a scatter (the tensorwise
    wgrad's operands, quantized in (K, T)): (positions (T,) int64, the aligned groups' ends as
    int32 offsets, the layout's columns, ``aligned_tokens(t, G)``). Tokens past ``offs[-1]`` go
    after the last group."""
    groups = offs.shape[0]
    starts, ends = group_bounds(offs)
    padded_sizes = _aligned_sizes(offs, align)
    padded_ends = torch.cumsum(padded_sizes, 0)
    base = torch.cat([padded_ends - padded_sizes, padded_ends[-1:]])  # where each group starts
    first = torch.cat([starts, ends[-1:]])  # ... and started (past the end: offs[-1])
    group = group_of_rows(offs, t)
    positions = base[group] + torch.arange(t, device=offs.device) - first[group]
    return positions, padded_ends.to(torch.int32), aligned_tokens(t, groups, align)


def _scatter_tokens(x: Tensor, positions: Tensor, padded: int) -> Tensor:
    """(R, T) FP8 ``x`` with its columns moved to ``positions`` in an (R, padded) zero tensor."""
    out = x.new_zeros((x.shape[0], padded), dtype=torch.uint8)
    out.index_copy_(1, positions, x.view(torch.uint8))
    return out.view(x.dtype)


def rowwise_batched(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                    out_dtype: torch.dtype, *, fast_accum: bool = False) -> Tensor:
    """bmm experts' forward, dgrad or wgrad: a (G, M, K) and b (G, N, K), rowwise scales (G, M, 1)
    and (G, N, 1), as one 3d x 3d ``torch._scaled_grouped_mm`` (no offsets); a contraction that
    is not a multiple of 16 (a wgrad over an expert's capacity) is zero-padded, exactly."""
    a, b = pad_contraction(a, b)
    groups, m, n = a.shape[0], a.shape[1], b.shape[1]
    out = grouped_mm_call(a, b.transpose(-2, -1), own_rows(a_scale_inv, (groups, m)),
                          own_rows(b_scale_inv, (groups, n)), None, fast_accum=fast_accum)
    return out.to(out_dtype)


def scaled_grouped_mm_emulated(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                               offs: Optional[Tensor]) -> Tensor:
    """``torch._scaled_grouped_mm`` (rowwise scales, bf16 out) on the CPU, which has no kernel
    for it: the CUDA kernel's operand rules checked first (``cublaslt.check_scaled_grouped_mm``),
    then each group's ``(a * scale_a) @ (b * scale_b)`` in fp32, rounded once to bf16: the
    reference provider's arithmetic. Rows of a 2d x 3d output past ``offs[-1]`` are 0."""
    check_scaled_grouped_mm(a, b, scale_a, scale_b, offs)
    a32, b32 = a.float(), b.float()
    if offs is None:  # 3d x 3d
        out = (a32 * scale_a[:, :, None]) @ (b32 * scale_b[:, None, :])
        return out.to(torch.bfloat16)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # 2d x 3d
        out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=torch.bfloat16)
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = ((a32[s:e] * scale_a[s:e, None]) @ (b32[g] * scale_b[g])).to(out.dtype)
        return out
    m, n, groups = a.shape[0], b.shape[1], len(ends)  # 2d x 2d
    sa, sb = scale_a.reshape(groups, m), scale_b.reshape(groups, n)
    out = a.new_zeros((groups, m, n), dtype=torch.bfloat16)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[g] = ((a32[:, s:e] * sa[g, :, None]) @ (b32[s:e] * sb[g])).to(out.dtype)
    return out


def _tensorwise_grouped_runs(recipe: recipes.Recipe | str, a: Tensor, b: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a tensorwise grouped or batched GEMM runs as one ``torch._scaled_grouped_mm``:
    both operands E4M3 (every GEMM under ``fp8_format="e4m3"``, the forward under HYBRID, whose
    E5M2 gradients the kernel refuses), where the rowwise grouped GEMMs run."""
    return (recipes.as_recipe(recipe).per_tensor and a.dtype == b.dtype == recipes.E4M3
            and _rowwise_grouped_runs(a, bias))


def tensorwise_grouped(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                       offs: Tensor, out_dtype: torch.dtype, *,
                       fast_accum: bool = False) -> Tensor:
    """A tensorwise GEMM over token groups as the rowwise grouped call of the same products: the
    kernel scales rows of a and columns of b, so each scale is given to each row it scales, in
    its own contiguous allocation. Forward and dgrad (b (G, N, K)): a (T, K) with one scale per
    token group becomes (T,) (rows past ``offs[-1]`` take the last group's; their outputs are
    ``rowwise_grouped_2d3d``'s), b's one per expert (G, N). Wgrad (a (M, T), b (N, T), one scale
    per group each, not in the aligned token layout: ``aligns_tokens``): (G, M) and (G, N)."""
    groups = offs.shape[0]
    if b.dim() == 3:
        rows = group_of_rows(offs, a.shape[0]).clamp(max=groups - 1)
        return rowwise_grouped_2d3d(a, a_scale_inv.float()[rows], b,
                                    _per_group(b_scale_inv, b.shape[1]), offs, out_dtype,
                                    fast_accum=fast_accum)
    return rowwise_grouped_2d2d(a, _per_group(a_scale_inv, a.shape[0]), b,
                                _per_group(b_scale_inv, b.shape[0]), offs, out_dtype,
                                fast_accum=fast_accum, aligned=False)


def tensorwise_batched(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                       out_dtype: torch.dtype, *, fast_accum: bool = False) -> Tensor:
    """A tensorwise batched GEMM (``bmm`` experts: a (G, M, K), b (G, N, K), one scale per
    expert each) as the rowwise 3d x 3d call of the same products: each expert's scale given to
    each of its rows, (G, M) and (G, N). Close to one ``_scaled_mm`` per expert on CUDA, not
    always bit-identical (fp32 accumulation in another order: an H100 with torch 2.11 differed
    in the last bf16 bit at (4, 128, 128, 256)); the loop was 256 GEMM launches and a stack per
    DeepSeek-V3 layer: its FP8 step went from 210.7 to 162.5 ms."""
    return rowwise_batched(a, _per_group(a_scale_inv, a.shape[1]), b,
                           _per_group(b_scale_inv, b.shape[1]), out_dtype, fast_accum=fast_accum)


def _per_group(scale_inv: Tensor, size: int) -> Tensor:
    """One fp32 scale per group (G scales) given to each of its ``size`` rows or columns: (G, size),
    the layout ``torch._scaled_grouped_mm`` reads its per-row and per-column scales in."""
    return scale_inv.float().reshape(-1, 1).expand(-1, size).contiguous()


@functools.lru_cache(maxsize=None)
def get(name: str) -> Provider:
    if name == "reference":
        return Reference()
    if name == "scaled_mm":
        return ScaledMM()
    if name == "te":
        from .te import TransformerEngine

        return TransformerEngine()
    raise ValueError(f"unknown FP8 kernel provider {name!r}; valid providers are: {', '.join(NAMES)}")


def te_available() -> bool:
    return te_status().version is not None


@dataclass(frozen=True)
class TEStatus:
    """Whether Transformer Engine imports here: its version, or why not."""

    version: str | None
    error: str = ""  # the import's exception, when TE is installed but does not import
    installed: bool = False

    def describe(self) -> str:
        if self.version is not None:
            return f"Transformer Engine {self.version}"
        if self.installed:
            return f"TE present but failed to import: {self.error}"
        return "Transformer Engine not installed"


@functools.lru_cache(maxsize=None)
def te_status() -> TEStatus:
    """Import ``transformer_engine.pytorch`` once. A broken install (a missing CUDA library, an
    ABI mismatch with this torch) raises OSError or RuntimeError, not only ImportError; it is told
    apart from an absent one so that ``auto``'s fallback says which it was."""
    installed = importlib.util.find_spec("transformer_engine") is not None
    try:
        with cudnn.torch_cudnn_for_te():
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any failure means: not usable here; say why)
        return TEStatus(None, f"{type(e).__name__}: {e}", installed)
    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("transformer_engine")
        except importlib.metadata.PackageNotFoundError:
            version = "of unknown version"
    return TEStatus(str(version), "", True)


def resolve(kernels: str, recipe: recipes.Recipe | str, device: torch.device) -> tuple[Provider, str]:
    """The provider for ``Config(kernels=...)`` and, for ``auto``, which one and why (a report
    note: no fallback is silent); ``""`` for a provider the user named."""
    if kernels == "auto":
        te = te_status()
        if device.type != "cuda":
            return get("reference"), (
                f"kernels='auto' chose reference on {device.type}: the te and scaled_mm FP8 GEMMs "
                f"are used on CUDA only ({te.describe()})")
        skipped = []
        if te.version is None:
            skipped.append(te.describe())
        else:
            reason = get("te").supports(recipe, device)
            if reason is None:
                return get("te"), f"kernels='auto' chose te ({te.describe()})"
            skipped.append(f"te: {reason}")
        reason = get("scaled_mm").supports(recipe, device)
        if reason is None:
            return get("scaled_mm"), f"kernels='auto' chose scaled_mm: {'; '.join(skipped)}"
        skipped.append(f"scaled_mm: {reason}")
        return get("reference"), f"kernels='auto' chose reference: {'; '.join(skipped)}"
    if kernels == "te" and not te_available():
        raise ValueError(
            f"kernels='te' needs Transformer Engine ({te_status().describe()}): pip install "
            "'graphpass[te]' on a CUDA machine, or use kernels='auto', 'scaled_mm' or 'reference'"
        )
    provider = get(kernels)
    reason = provider.supports(recipe, device)
    if reason:
        raise ValueError(f"kernels={kernels!r} cannot run here: {reason}; use kernels='auto' or "
                         "'reference'")
    return provider, ""


def environment_key(kernels: str, recipe: str | None) -> str:
    """What a lowered graph depends on beyond its config: the provider ``kernels`` resolves to on
    this machine's devices, and TE's version. Part of the partitioner's cache key, so a cache
    never serves a graph lowered for another provider."""
    if recipe is None:
        return ""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    parts = [te_status().describe()]
    for device in devices:
        if device.type == "cuda":
            parts.append(f"capability {torch.cuda.get_device_capability(device)}")
        try:
            parts.append(f"{device.type}: {resolve(kernels, recipe, device)[0].name}")
        except ValueError as e:  # the lowering raises it too; its message keys the outcome
            parts.append(f"{device.type}: {e}")
    return "; ".join(parts)
