"""The two FP8 graph ops: ``graphpass::quantize`` and ``graphpass::fp8_gemm``.

They stay separate nodes so the partitioner sees the 1-byte tensors between them and can save,
recompute or offload them like any other value. Both have fake implementations (shapes only) and
the GEMM has a FLOP formula, so torch's partitioner and its budget solver can cost them.

One module because it registers the graph ops (``torch.library.custom_op``): each op's eager
code, fake implementation and FLOP formula sit beside its registration, and the quantize op
dispatches every layout (dense, 3-D experts, token groups) from one function. The token-group
paths (``_quantize_groups*``, about 250 lines) are the part that could move to a module of
their own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import providers, recipes, triton_grouped, triton_quantize


USAGES = ("rowwise", "columnwise", "both")
# The copies each usage makes, as ``columnwise`` flags, in output order.
_COLUMNWISE = {"rowwise": (False,), "columnwise": (True,), "both": (False, True)}


def _quantize(x: Tensor, recipe: str, role: str, usage: str,
              offs: Optional[Tensor] = None) -> list[Tensor]:
    """FP8 copies of a 2-D tensor in ``role`` under ``recipe``: ``[data, scale_inv]`` per usage.

    ``usage`` is ``"rowwise"`` (data (M, K)), ``"columnwise"`` (the transposed copy, data (K, M),
    blocks down x's columns, which TN-only FP8 GEMMs need for wgrad and dgrad) or ``"both"``
    (rowwise then columnwise, from one read of x, as Transformer Engine's quantizers do).
    See :mod:`graphpass.fp8.recipes` for the layouts.
    """
    if usage not in USAGES:
        raise ValueError(f"unknown quantize usage {usage!r}; valid usages are {USAGES}")
    if offs is not None:
        if uses_triton_group_kernel(x, recipe, offs):
            return triton_grouped.quantize_groups_rowwise_for(x, recipe, role, usage, offs)
        return groups_torch(x, recipe, role, usage, offs)
    if x.dim() == 3:
        # A group of matrices (one per MoE expert): each quantized on its own, so every scale,
        # tensorwise ones included, belongs to one expert (as in TE's GroupedLinear).
        if recipes.as_recipe(recipe).per_row:
            return _quantize_experts_rowwise(x, recipe, role, usage)
        if recipes.block_shape(recipe, role) is None:
            return _quantize_experts_tensorwise(x, recipe, role, usage)
        per_group = [_quantize(g, recipe, role, usage) for g in x.unbind(0)]
        return [torch.stack(parts) for parts in zip(*per_group)]
    out: list[Tensor] = []
    for columnwise in _COLUMNWISE[usage]:
        out += recipes.quantize(x, recipe, role, columnwise=columnwise)
    return out


class TokenScales(enum.Enum):
    """How the scales of a grouped (``offs``) quantize meet the token groups."""

    PER_ROW = "per_row"
    """No scale spans tokens of two groups by construction (blocks along K; rowwise's rows, a
    row being one token): the plain quantize."""
    PER_GROUP = "per_group"
    """One scale per token group (tensorwise)."""
    PER_GROUP_COLUMN = "per_group_column"
    """One scale per column of x and group, data in the 16-aligned token layout (rowwise's
    columnwise copy: ``_quantize_groups_rowwise``)."""
    PER_BLOCK = "per_block"
    """Blocks of ``GroupScales.block`` tokens, restarting at each group (the columnwise copy of
    1x128 blockwise, 1x32 mxfp8)."""


@dataclass(frozen=True)
class GroupScales:
    """The scales of a grouped quantize: their kind and, for ``PER_BLOCK``, the block length
    along the tokens."""

    kind: TokenScales
    block: int = 0


def group_scales(recipe: recipes.Recipe | str, role: str, columnwise: bool) -> GroupScales:
    """How a grouped (``offs``) quantize of ``role`` under ``recipe`` scales the tokens."""
    rec = recipes.as_recipe(recipe)
    if rec.per_row:
        return GroupScales(TokenScales.PER_GROUP_COLUMN if columnwise else TokenScales.PER_ROW)
    block = rec.block(role)
    if block is None:
        return GroupScales(TokenScales.PER_GROUP)
    if columnwise:
        return GroupScales(TokenScales.PER_BLOCK, block[1])
    return GroupScales(TokenScales.PER_ROW)


def grouped_scale_blocks(tokens: int, groups: int, block: int) -> int:
    """Scale columns of a columnwise block-scaled grouped quantize: every group starts a new
    block, so at most ceil(tokens / block) + groups - 1 blocks; one more keeps it simple."""
    return -(-tokens // block) + groups


def _quantize_groups(x: Tensor, recipe: str, role: str, columnwise: bool,
                     offs: Tensor) -> list[Tensor]:
    """Quantize (T, K) ``x`` whose rows are groups of tokens, one group per expert: group g is
    rows ``offs[g-1]:offs[g]`` (``offs[-1]`` of 0), as ``torch._grouped_mm``'s offsets.

    Each group is quantized on its own wherever a scale could span groups, i.e. padded per group:

    * tensorwise: one scale per group (rowwise and columnwise alike; TE ``GroupedLinear``), shape
      (G,); an empty group gets scale 1;
    * blockwise / mxfp8 rowwise: blocks run along K inside a row, so this is the plain quantize;
    * blockwise / mxfp8 columnwise (data (K, T), blocks along the tokens, the wgrad operand):
      blocks restart at each group's first token and a group's partial last block is padded
      with zeros (gets the amax of its own tokens). Scales are (K, ceil(T/B) + G); group g's
      blocks are the columns from ``sum(ceil(n_h / B) for h < g)`` on; unused columns hold scale
      1 (blockwise) or the E8M0 byte 127 (mxfp8, also 1).
    * rowwise columnwise (the wgrad operand): one scale per column of x and group, (G, K), and
      data (K, P) in the 16-aligned token layout the 2d x 2d grouped GEMM reads
      (``providers.aligns_tokens``): P = ``ceil(T/16)*16 + 16*G`` (a static bound), group g's
      tokens in order from its 16-aligned start (each group's size rounded up to a multiple of
      16, summed over the groups before it), every other column zero FP8 bytes.

    Every other columnwise copy is (K, T), group g in the columns ``offs[g-1]:offs[g]``. Rows at
    or past ``offs[-1]`` belong to no group: the GEMMs never read them (where a group decides the
    scale their data is 0; the aligned layout holds none of them).
    """
    if x.dim() != 2:
        raise ValueError(f"a grouped quantize takes a 2-D (tokens, K) tensor, got {tuple(x.shape)}")
    t, k = x.shape
    rec = recipes.as_recipe(recipe)
    dtype = rec.dtype(role)
    scales = group_scales(rec, role, columnwise)
    if scales.kind is TokenScales.PER_ROW:  # rows are independent; mxfp8 quantizes whole 32-row
        pad = -t % rec.multiple if rec.whole_blocks else 0  # blocks: pad, cut
        data, scale = recipes.quantize(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x,
                                       recipe, role, columnwise=columnwise)
        return [data[:t], scale[:t]]
    if scales.kind is TokenScales.PER_GROUP:
        return _quantize_groups_tensorwise(x, recipe, role, columnwise, offs)
    if scales.kind is TokenScales.PER_GROUP_COLUMN:
        return _quantize_groups_rowwise(x, recipe, role, offs)
    block = scales.block
    if rec.scaling is recipes.Scaling.BLOCKWISE:
        return _quantize_groups_blockwise(x, recipe, role, offs, block)
    check_token_groups(offs, t)  # the loop below reads them on the host
    data = torch.zeros((k, t) if columnwise else (t, k), dtype=dtype, device=x.device)
    scale = torch.full((k, grouped_scale_blocks(t, offs.shape[0], block)), rec.unit_scale,
                       device=x.device, dtype=rec.scale_dtype)
    start, col = 0, 0
    for end in offs.tolist():
        n = end - start
        if n > 0:
            xg = x[start:end]  # whole blocks only (mxfp8 needs them): the group zero-padded
            pad = -n % block
            xg = torch.nn.functional.pad(xg, (0, 0, 0, pad)) if pad else xg
            d, s = recipes.quantize(xg, recipe, role, columnwise=columnwise)
            if columnwise:
                data[:, start:end] = d[:, :n]
            else:
                data[start:end] = d
            scale[:, col:col + s.shape[1]] = s
            col += s.shape[1]
        start = end
    return [data, scale]


def _quantize_groups_blockwise(x: Tensor, recipe: str, role: str, offs: Tensor,
                               block: int) -> list[Tensor]:
    """``_quantize_groups`` for blockwise's columnwise copy (blocks of ``block`` tokens), without
    a loop over groups or a host sync: each token's block column from ``offs`` on the device
    (its group's first column, the running count of whole blocks before it, plus its place in
    the group over ``block``), each block's amax one scatter-max of |x| (max is exact, and a
    group's zero padding adds nothing to it), every token scaled by its block's scale. Bit for
    bit the loop's result: rows past ``offs[-1]`` are 0, the unused scale columns 1."""
    t, k = x.shape
    groups = offs.shape[0]
    columns = grouped_scale_blocks(t, groups, block)
    x32 = x.to(torch.float32)
    group = providers.group_of_rows(offs, t)
    starts, ends = providers.group_bounds(offs)
    blocks = (ends - starts + block - 1) // block
    first = torch.cumsum(blocks, 0) - blocks  # each group's first scale column
    inside = group < groups
    g = group.clamp(max=groups - 1)
    tokens = torch.arange(t, device=x.device)
    column = torch.where(inside, first[g] + (tokens - starts[g]) // block, columns)
    a = x32.abs()
    a = torch.where(torch.isnan(a) | ~inside[:, None], 0.0, a)  # NaN ignored, as _abs_amax
    amax = x32.new_zeros(columns + 1, k).scatter_reduce(
        0, column[:, None].expand(t, k), a, "amax")[:columns]
    scale = recipes.blockwise_scale(amax, recipe, role, x.dtype)
    used = torch.arange(columns, device=x.device) < blocks.sum()
    scale_inv = torch.where(used[:, None], recipes.reciprocal(scale), 1.0)
    token_scale = torch.cat([scale, scale.new_ones(1, k)])[column]  # (T, K)
    data = recipes.scaled_cast(torch.where(inside[:, None], x32, 0.0), token_scale, recipe, role)
    return [data.t().contiguous(), scale_inv.t().contiguous()]


def _quantize_experts_tensorwise(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    """Tensorwise (G, N, K) expert weights, one scale per expert, in one pass over all experts
    (a loop of per-expert quantizes was 10 kernel launches per expert): bit-identical to it, since
    max is exact and everything after the amax is elementwise."""
    x32 = x.to(torch.float32)
    amax = recipes._abs_amax(x32, (1, 2)) if x32.numel() else x32.new_zeros(x.shape[0])
    scale = recipes.tensorwise_scale(amax, recipe, role)
    data = recipes.scaled_cast(x32, scale[:, None, None], recipe, role)
    scale_inv = recipes.reciprocal(scale)
    out: list[Tensor] = []
    for columnwise in _COLUMNWISE[usage]:
        d = data.transpose(-2, -1) if columnwise else data
        out += [d.contiguous(), scale_inv.clone() if out else scale_inv]
    return out


def _quantize_groups_tensorwise(x: Tensor, recipe: str, role: str, columnwise: bool,
                                offs: Tensor) -> list[Tensor]:
    """``_quantize_groups`` for tensorwise, without a loop over groups or a host sync: each row's
    group from ``offs`` on the device, the groups' amaxes by a scatter-max of the rows' amaxes (max
    is exact, so each equals the group's own amax), every row scaled by its group's scale. Rows
    past ``offs[-1]`` are 0 (inf and NaN too); an empty group's amax is 0, so its scale is 1."""
    t, groups = x.shape[0], offs.shape[0]
    x32 = x.to(torch.float32)
    group = providers.group_of_rows(offs, t)  # `groups` for rows past the end
    row_amax = recipes._abs_amax(x32, (1,)) if x32.numel() else x32.new_zeros(t)
    amax = x32.new_zeros(groups + 1).scatter_reduce(0, group, row_amax, "amax")[:groups]
    scale = recipes.tensorwise_scale(amax, recipe, role)
    inside = (group < groups)[:, None]
    row_scale = torch.cat([scale, scale.new_ones(1)])[group][:, None]
    data = recipes.scaled_cast(torch.where(inside, x32, 0.0), row_scale, recipe, role)
    return [(data.t() if columnwise else data).contiguous(), recipes.reciprocal(scale)]


def _quantize_experts_rowwise(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    """Rowwise (G, N, K) expert weights: ``experts_rowwise_torch``'s bits. On CUDA with triton,
    graphpass's Triton kernels (``triton_quantize``: both copies' amaxes from one read of the
    weights), which Inductor's code launches itself (``inductor.triton_weight_quantize``): on an
    H200 1.09x Inductor's fused code for both copies of a (16, 4096, 7168) weight, 1.10x for a
    (256, 4096, 7168) one, level for a columnwise copy alone (``benchmarks/quantize_kernels.py``,
    docs/numbers.md)."""
    if uses_triton_weight_kernel(x):
        return triton_quantize.quantize_experts_rowwise_for(x, recipe, role, usage)
    return experts_rowwise_torch(x, recipe, role, usage)


def experts_rowwise_torch(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    """The recipe's torch code for rowwise (G, N, K) expert weights, in one pass over all
    experts: every row is scaled on its own, so this is bit-identical to each expert quantized
    alone. Scales (G, R, 1). The reference the Triton kernels are held to."""
    x32 = x.to(torch.float32)
    out: list[Tensor] = []
    for columnwise in _COLUMNWISE[usage]:
        out += recipes.rowwise_quantize(x32.transpose(-2, -1) if columnwise else x32, recipe, role)
    return out


def uses_triton_weight_kernel(x: Tensor) -> bool:
    """Whether a rowwise quantize of 3-D expert weights ``x`` runs graphpass's Triton kernels."""
    return why_not_triton_weight_kernel(x) is None


def why_not_triton_weight_kernel(x: Tensor) -> str | None:
    """None where a rowwise quantize of expert weights ``x`` runs graphpass's Triton kernels (a
    contiguous 3-D CUDA tensor of a dtype they take, with triton installed), else why not."""
    return _why_not_triton_tensor(x, 3, "the weight is", "its", "a stack of expert matrices") \
        or triton_quantize.available(x)


def _why_not_triton_tensor(x: Tensor, dim: int, subject: str, its: str,
                           shape: str) -> str | None:
    """Why graphpass's Triton kernels cannot take ``x`` (a contiguous ``dim``-D CUDA tensor of
    bf16, fp16 or fp32), in a few words about ``subject``; None where they can."""
    if x.device.type != "cuda":
        return f"{subject} on {x.device.type}"
    if x.dim() != dim:
        return f"{subject} {x.dim()}-D, not {shape}"
    if not x.is_contiguous():
        return f"{subject} not contiguous"
    if x.dtype not in triton_quantize._INPUT_DTYPES:
        return f"{its} dtype is {x.dtype}"
    return None


def groups_torch(x: Tensor, recipe: recipes.Recipe | str, role: str, usage: str,
                 offs: Tensor) -> list[Tensor]:
    """The recipe's torch code for token-grouped (T, K) ``x`` (``_quantize_groups`` per copy),
    whatever the device: what Inductor inlines, and the reference ``triton_grouped``'s kernels
    are held to."""
    out = []
    for columnwise in _COLUMNWISE[usage]:
        out += _quantize_groups(x, recipe, role, columnwise, offs)
    return out


def uses_triton_group_kernel(x: Tensor, recipe: recipes.Recipe | str, offs: Tensor) -> bool:
    """Whether a quantize of token-grouped ``x`` (group ends ``offs``) under ``recipe`` runs
    graphpass's Triton kernels (``triton_grouped``)."""
    return why_not_triton_group_kernel(x, recipe, offs) is None


def why_not_triton_group_kernel(x: Tensor, recipe: recipes.Recipe | str,
                                offs: Tensor) -> str | None:
    """None where a token-grouped quantize of ``x`` runs graphpass's Triton kernels
    (``triton_grouped``: both copies from two reads of x, the columnwise one written straight
    into the 16-aligned token layout): a rowwise recipe, a contiguous 2-D CUDA tensor of a
    dtype they take, int32 group ends on its device, copies that int32 indexes, triton
    installed. Else why not, in a few words."""
    if not recipes.as_recipe(recipe).per_row:
        return f"{recipes.as_recipe(recipe).name} scales are not rowwise"
    why = _why_not_triton_tensor(x, 2, "the tokens are", "their", "(tokens, features)")
    if why is not None:
        return why
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device:
        return f"the group ends are {offs.dtype} {tuple(offs.shape)} on {offs.device}"
    return triton_grouped.too_large(*x.shape, offs.shape[0]) or triton_quantize.available(x)


def _quantize_groups_rowwise(x: Tensor, recipe: str, role: str, offs: Tensor) -> list[Tensor]:
    """The columnwise rowwise copy of token-grouped (T, K) ``x`` (the wgrad operand), each of x's
    columns scaled per token group: scales (G, K) fp32, group g's K scales contiguous, the
    (G * K) layout ``torch._scaled_grouped_mm``'s 2d x 2d form reads; data (K, P) in the
    16-aligned token layout that form needs (every group starting at a multiple of 16 tokens):
    P = ``providers.aligned_tokens(T, G)``, ``ceil(T/16)*16 + 16*G``, group g's tokens from its
    aligned start on, every other column zero FP8 bytes (``providers.aligned_token_sources``).

    One pass, no loop over groups, no host sync: the groups' column amaxes are reduced over row
    chunks (``_group_column_amax``; max is exact, so bit-identical to each group quantized
    alone), and the data is a gather over the P columns: each column's token and group from the
    aligned group ends (a searchsorted), its token's row of x scaled by the group's scales, or 0.
    Inductor compiles the gather, scale, cast and transpose into one pointwise kernel, with no
    scatter and no second pass over the copy. Each column's bits are those of its token quantized
    in place (the cast is elementwise). Rows past ``offs[-1]`` are in no column; an empty group
    has no column and scales 1."""
    t, k = x.shape
    groups = offs.shape[0]
    # |x| and its max in x's own dtype (exact): no fp32 copy of x for the reduction to read
    a = x.abs()
    a = torch.where(torch.isnan(a), 0.0, a)
    amax = _group_column_amax(a, offs).to(torch.float32)
    scale = recipes.tensorwise_scale(amax, recipe, role)  # elementwise: one per (group, column)
    group, token, valid = providers.aligned_token_sources(offs, providers.aligned_tokens(t, groups))
    column_scale = torch.cat([scale, scale.new_ones((1, k))])[group]  # (P, K)
    # (P, K): the gather; offsets past the tokens (which the GEMM refuses: check_token_groups)
    # would index past x
    x32 = x[token.clamp(max=max(t - 1, 0))].to(torch.float32)
    data = recipes.scaled_cast(torch.where(valid[:, None], x32, 0.0), column_scale, recipe, role)
    return [data.t().contiguous(), recipes.reciprocal(scale)]


SEGMENT_ROWS = 128  # rows per chunk of _group_column_amax's first, regular reduction


def _group_column_amax(a: Tensor, offs: Tensor, chunk: int = SEGMENT_ROWS) -> Tensor:
    """Each token group's column maxima of (T, K) ``a >= 0`` (no NaN), (G, K): group g is rows
    ``offs[g-1]:offs[g]``, rows past ``offs[-1]`` in none, an empty group's maxima 0. No atomics
    and no host sync: a scatter-max of every element into its group's row (the first version) cost
    1.1 ms per (8192, 7168) operand on an H200, its atomics contending 512 to one address.

    Instead, the maxima of whole ``chunk``-row chunks (one regular reduction over ``a``); a group
    takes those of the chunks that lie inside it, plus the maxima of its own rows in the chunk
    where it starts and the chunk where it ends (a gather of 2 x ``chunk`` rows per group, masked
    to the group). Max is exact, so this equals each group's own maximum bit for bit."""
    t, k = a.shape
    groups = offs.shape[0]
    n_chunks = -(-t // chunk)
    padded = torch.nn.functional.pad(a, (0, 0, 0, n_chunks * chunk - t))
    chunk_max = padded.view(n_chunks, chunk, k).amax(1)  # (C, K)
    starts, ends = providers.group_bounds(offs)
    first = torch.arange(n_chunks, device=a.device) * chunk  # each chunk's first row
    whole = (first[None, :] >= starts[:, None]) & (first[None, :] + chunk <= ends[:, None])
    inner = torch.where(whole[:, :, None], chunk_max[None], 0).amax(1)  # (G, K)
    # the chunks holding each group's first and last rows; an empty group's mask is all False
    edge = torch.stack([starts // chunk, (ends - 1).clamp(min=0) // chunk], 1).clamp(
        max=n_chunks - 1)  # (G, 2)
    rows = edge[:, :, None] * chunk + torch.arange(chunk, device=a.device)  # (G, 2, chunk)
    mine = (rows >= starts[:, None, None]) & (rows < ends[:, None, None])
    outer = torch.where(mine[..., None], padded[rows], 0).amax((1, 2))  # (G, K)
    return torch.maximum(inner, outer)


def _quantize_groups_fake(x: Tensor, recipe: str, role: str, columnwise: bool,
                          offs: Tensor) -> list[Tensor]:
    rec = recipes.as_recipe(recipe)
    scales = group_scales(rec, role, columnwise)
    t, k = x.shape
    if scales.kind is TokenScales.PER_ROW:
        per_row = 1 if rec.per_row else -(-k // rec.block(role)[1])
        return [x.new_empty((t, k), dtype=rec.dtype(role)),
                x.new_empty((t, per_row), dtype=rec.scale_dtype)]
    data = x.new_empty((k, t) if columnwise else (t, k), dtype=rec.dtype(role))
    if scales.kind is TokenScales.PER_GROUP:
        return [data, x.new_empty((offs.shape[0],), dtype=torch.float32)]
    if scales.kind is TokenScales.PER_GROUP_COLUMN:  # the 16-aligned token layout
        return [x.new_empty((k, providers.aligned_tokens(t, offs.shape[0])), dtype=data.dtype),
                x.new_empty((offs.shape[0], k), dtype=torch.float32)]
    return [data, x.new_empty((k, grouped_scale_blocks(t, offs.shape[0], scales.block)),
                              dtype=rec.scale_dtype)]


# The metadata (size, stride, dtype) of a quantize's outputs, per input metadata and arguments:
# the fake implementation traces the recipe once per distinct input (a few per model) instead of
# at every quantize node each compile creates (the tiny Llama's plan() made 94 per compile,
# 19% of plan()'s time).
_FAKE_OUTPUTS: dict[tuple, tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]] = {}


def _quantize_fake(x: Tensor, recipe: str, role: str, usage: str,
                   offs: Optional[Tensor] = None) -> list[Tensor]:
    if offs is not None:
        out = []
        for columnwise in _COLUMNWISE[usage]:
            out += _quantize_groups_fake(x, recipe, role, columnwise, offs)
        return out
    key = (tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, recipe, role, usage)
    if not all(type(d) is int for d in key[0] + key[1]):  # symbolic sizes: trace every time
        return _quantize_traced(x, recipe, role, usage)
    if key not in _FAKE_OUTPUTS:
        out = _quantize_traced(x, recipe, role, usage)
        if any(t.storage_offset() != 0 for t in out):  # a view: only the trace is exact
            return out
        _FAKE_OUTPUTS[key] = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in out)
        return out
    return [x.new_empty_strided(size, stride, dtype=dtype)
            for size, stride, dtype in _FAKE_OUTPUTS[key]]


def _quantize_traced(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    # The recipe is plain tensor arithmetic, so it runs on fake tensors and gives exact
    # metadata; a group's metadata is one member's with the group dimension in front (tracing
    # one member, not DeepSeek-V3's 256: 0.1 s instead of 13 s per quantize under fake tensors).
    if x.dim() == 3:
        return [t.new_empty((x.shape[0], *t.shape)) for t in _quantize(x[0], recipe, role, usage)]
    return _quantize(x, recipe, role, usage)


def check_token_groups(offs: Tensor, tokens: int) -> None:
    """Raise ValueError where ``offs`` are not token groups' ends over ``tokens`` rows as
    ``torch._grouped_mm`` reads them: 1-D, none negative, none decreasing, the last at most
    ``tokens`` (rows past it are in no group). Read on the host where they already are (a CPU
    tensor); on CUDA that would be a host sync every step, and they are not read (as torch's
    own grouped GEMM does not). A group past the tokens would read rows that are not there.

    The GEMMs check (``fp8_gemm``: on the CPU they read the offsets on the host anyway), and so
    does the quantize that loops over the groups on the host (mxfp8's columnwise copy); the
    other quantizes read nothing on the host (the property that keeps them free of host syncs
    on CUDA) and, given such offsets, compute copies no GEMM then takes."""
    if offs.device.type != "cpu" or offs.dim() != 1 or not offs.numel():
        return
    ends = offs.tolist()
    why = ""
    if ends[0] < 0:
        why = f"the first is negative ({ends[0]})"
    elif any(b < a for a, b in zip(ends, ends[1:])):
        at = next(i for i, (a, b) in enumerate(zip(ends, ends[1:])) if b < a)
        why = f"they decrease (offs[{at}] = {ends[at]}, offs[{at + 1}] = {ends[at + 1]})"
    elif ends[-1] > tokens:
        why = f"the last ({ends[-1]}) is past the {tokens} token rows"
    if why:
        shown = ends if len(ends) <= 8 else [*ends[:4], "...", *ends[-4:]]
        raise ValueError(
            f"graphpass fp8: token group offsets {shown} are not group ends over {tokens} token "
            f"rows: {why}. torch._grouped_mm's offsets are each group's end, non-decreasing, the "
            f"last at most the rows of x (rows past it belong to no group)")


def _quantize_op(x: Tensor, recipe: str, role: str, usage: str,
                 offs: Optional[Tensor] = None) -> list[Tensor]:
    # Run eagerly (codegen="eager", block recipes, quantizes Inductor leaves as one op), a
    # tensorwise pair from one amax: the columnwise copy is the rowwise one transposed, bit for
    # bit (same scale, elementwise cast), so one 1-byte transpose replaces a second amax and cast
    # over x. Inductor inlines ``_quantize`` itself (fp8/inductor.py) and fuses both copies.
    if usage == "both" and recipes.as_recipe(recipe).per_tensor and x.dim() == 2 and offs is None:
        data, scale_inv = recipes.quantize(x, recipe, role)
        return [data, scale_inv, data.t().clone(memory_format=torch.contiguous_format),
                scale_inv.clone()]
    return _quantize(x, recipe, role, usage, offs)


quantize = torch.library.custom_op("graphpass::quantize", _quantize_op, mutates_args=())
quantize.register_fake(_quantize_fake)


# FP8 all-gather (passes/fp8_all_gather.py): each rank's amax, reduced over the group by the
# graph's all-reduce, then each rank quantizes its shard with the group's amax.
@torch.library.custom_op("graphpass::amax", mutates_args=())
def amax(x: Tensor) -> Tensor:
    """The fp32 amax of ``x`` as tensorwise scaling reads it (NaN ignored), shape ()."""
    return recipes.tensor_amax(x)


@amax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


def _quantize_amax(x: Tensor, amax: Tensor, recipe: str, role: str) -> list[Tensor]:
    """The rowwise tensorwise quantization of a 2-D ``x`` scaled by ``amax`` (not ``x``'s own):
    ``[data, scale_inv]``."""
    return list(recipes.quantize(x, recipe, role, amax=amax))


quantize_amax = torch.library.custom_op("graphpass::quantize_amax", _quantize_amax,
                                        mutates_args=())
quantize_amax.register_fake(_quantize_amax)  # plain tensor arithmetic: exact on fake tensors


# FP8 GEMMs are TN-only (cuBLASLt on Hopper, TE): both operands row-major, K contiguous. Under
# Inductor an inlined quantize may write its FP8 copy in its input's stride order (a transposed
# gradient's), so the GEMM asks Inductor for its inputs in the strides of the traced graph, where
# every quantize output is contiguous (inlined on CUDA, fp8/inductor.py's ``_inline_gemm``, it
# holds them to that order itself); ``_k_major`` below guards any other caller.
def _fp8_gemm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    recipe: str,
    roles: str,
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    kernel: str,
    offs: Optional[Tensor] = None,
) -> Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)``: a TN GEMM, both operands K-major. With 3-D
    operands (G, M, K) and (G, N, K), one such GEMM per group: (G, M, N).

    ``roles`` is ``"<role of a>,<role of b>"`` (``input,weight`` for fprop, ``grad,weight`` for
    dgrad, ``grad,input`` for wgrad, ``input,grad`` for the wgrad of a weight stored [in, out]);
    ``kernel`` names the provider that runs it. ``recipe`` is a ``Recipe.key``: the recipe
    says how each GEMM accumulates (``Recipe.fast_accumulation``: by default fast where neither
    operand is a gradient, i.e. the forward GEMM).

    With ``offs`` (``torch._grouped_mm``'s group ends over the tokens, see ``_quantize_groups``
    for the scale layouts): a (T, K) x b (G, N, K) gives (T, N), token group g times b[g]
    (forward, dgrad); a (M, T) x b (N, T) gives (G, M, N), group g's tokens contracted
    (wgrad; under the rowwise recipe a (M, P) and b (N, P) in the 16-aligned token layout
    ``_quantize_groups_rowwise`` writes, ``providers.aligns_tokens``, group g's tokens from its
    aligned start). Rows past ``offs[-1]`` are 0 from the reference provider and the CPU emulation,
    and unwritten on CUDA, as torch's ``_grouped_mm`` leaves them; empty groups' wgrad outputs
    are 0.
    """
    a_role, b_role = roles.split(",")
    fast = recipes.get_recipe(recipe).fast_accumulation(a_role, b_role)
    a, b = _k_major(a), _k_major(b)
    provider = providers.get(kernel)
    if offs is not None:
        # the tokens: a's rows (forward, dgrad), the contraction (wgrad: in the 16-aligned
        # layout a bound on them)
        check_token_groups(offs, a.shape[0] if b.dim() == 3 else a.shape[1])
        return provider.grouped_gemm(a, a_scale_inv, b, b_scale_inv, offs, recipe, a_role, b_role,
                                     out_dtype, bias, fast_accum=fast)
    if a.dim() == 3:  # batched: one GEMM per group (MoE expert), same layouts
        return provider.batched_gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role,
                                     out_dtype, bias, fast_accum=fast)
    return provider.gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype, bias,
                         fast_accum=fast)


fp8_gemm = torch.library.custom_op("graphpass::fp8_gemm", _fp8_gemm, mutates_args=(),
                                   tags=(torch.Tag.needs_fixed_stride_order,))


def _k_major(t: Tensor) -> Tensor:
    """``t`` with its last dimension contiguous, copied only where it is not."""
    k_major = t.stride(-1) == 1 and all(s >= t.shape[-1] for s in t.stride()[:-1])
    return t if k_major else t.contiguous()


@fp8_gemm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, recipe, roles, out_dtype, bias, kernel, offs=None):
    if offs is not None and b.dim() == 2:
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
    return a.new_empty((*a.shape[:-1], b.shape[-2]), dtype=out_dtype)


@register_flop_formula(torch.ops.graphpass.fp8_gemm)
def _gemm_flops(a_shape, a_scale_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    *groups, m, k = a_shape
    return 2 * (groups[0] if groups else 1) * m * b_shape[-2] * k


# The graph ops, for passes that insert or match them (importing this module registers them).
QUANTIZE = torch.ops.graphpass.quantize.default
FP8_GEMM = torch.ops.graphpass.fp8_gemm.default
AMAX = torch.ops.graphpass.amax.default
QUANTIZE_AMAX = torch.ops.graphpass.quantize_amax.default
