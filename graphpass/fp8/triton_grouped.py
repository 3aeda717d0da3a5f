"""Rowwise FP8 quantization of a token-grouped MoE activation as two Triton kernels.

``quantize_groups_rowwise_both`` computes what ``ops._quantize(x, recipe, role, "both", offs)``
computes under the rowwise recipe for token-grouped (T, K) ``x`` (tokens sorted by expert, group
g the rows ``offs[g-1]:offs[g]``, ``offs`` int32 (G,) group ends, ``torch._grouped_mm``'s
offsets), bit for bit:

* the rowwise copy (``recipes.quantize``): data (T, K), each row scaled by its own amax along K,
  scale_inv (T, 1) fp32; every row, rows past ``offs[-1]`` included;
* the columnwise copy (``ops._quantize_groups_rowwise``, the wgrad operand): data (K, P) in the
  16-aligned token layout (P = ``providers.aligned_tokens(T, G)`` = ``ceil(T/16)*16 + 16*G``;
  group g's tokens from its aligned start, the groups' sizes rounded up to multiples of 16 and
  summed before it; every other column zero bytes; rows past ``offs[-1]`` in no column), each
  (group, column of x) scaled by the amax of that column over the group's tokens, scale_inv
  (G, K) fp32 (an empty group's scales 1).

Why: Inductor's fusion of the torch code reads x about four times for the two copies and the
amax passes, and its transposed stores are strided (about 0.46 ms, 1.3 TB/s, for one
(8192, 7168) bf16 activation on an H200). Here:

* pass 1, ``_amax_kernel``: each program reads a (T_CHUNK, BLOCK_K) strip of x once, group by
  group: the groups its rows touch are found from ``offs`` in registers (a comparison of the
  chunk's first and last row with every group end), and each group's rows inside the chunk are
  walked in (BLOCK_T, BLOCK_K) tiles, keeping the group's column maxima in registers and folding
  them into the zero-initialised (G, K) amaxes with one ``atomic_max`` per column per (group,
  chunk); each tile's row maxima go into the (T,) row amaxes with one ``atomic_max`` per row per
  tile (one per row per BLOCK_K columns). Rows past ``offs[-1]`` are walked as a group of their
  own whose column maxima are dropped. Amaxes are >= 0 (NaN dropped before the max), so the
  integer atomic max on their bits is an exact max, independent of the order;
* pass 2, ``_cast_kernel``: each program owns BLOCK_P columns of the aligned layout over
  K_CHUNK columns of x. Each aligned column's group, token and whether it holds one come from
  ``offs`` in registers (the aligned group ends are a cumulative sum of the rounded sizes); the
  columns past the last group's aligned end take the rows past ``offs[-1]`` in order (there are
  at least that many: ``aligned_tokens`` bounds every group's padding), so every row of x is read
  by exactly one program per K chunk. It reads its rows of x a (BLOCK_P, BLOCK_K) tile at a time
  (a gather of whole rows: loads along K), writes the rowwise tile with the rows' scales and,
  through the tile's transpose, the columnwise tile at its aligned columns (stores along the
  tokens, coalesced), each run of 16 aligned columns (one group's: the groups' aligned ranges
  start at multiples of 16) taking its group's column scales; padding columns are written as
  zero bytes in the same store, so the (K, P) copy needs no memset. The rowwise scale_inv is
  written by the programs of the first K chunk, the columnwise scale_inv (G, K) by the programs
  of each K chunk, groups strided over them.

Bytes per element of x, with s bytes per input element (2 for bf16): x is read twice and one
byte written per copy: 2s + 2 (6 for bf16; 10 for fp32), against about 4s + 2 (10 for bf16) for
the torch code under Inductor; the floor of reading x once per copy is s + 1 per copy (3 for
bf16, 6 for both). Beside that: the padding columns (at most 16 * G + 15 bytes per column of x),
the amaxes (4 bytes per row and per (group, column), zeroed, written by atomics, read back) and
the scales (4 bytes per row and per (group, column)). The rowwise copy alone
(``usage="rowwise"``) is ``triton_quantize``'s one-kernel rowwise path on x seen as one expert
(2s + 1 bytes per element, the second read from cache).

Numerics: those of :mod:`graphpass.fp8.triton_quantize` (whose ``_scales``, ``_fp8_bits``,
``_load_f32`` and ``_abs_no_nan`` these kernels call): amaxes of |x| in fp32 with NaN ignored,
``recipes.compute_scale_from_amax`` by IEEE division, the saturating round-to-nearest-even cast
(inline PTX on sm_89+, the integer ``soft`` cast elsewhere and under Triton's interpreter),
``1 / scale`` by IEEE division.

``offs`` stays on the device (no host sync); T, K and G are static. ``offs`` must be
nondecreasing with ``offs[-1] <= T`` (``torch._grouped_mm``'s rule; not checked, which would
sync): ends past T are read as T, so no access leaves x or the outputs.

Triton is imported with ``triton_quantize`` (optional: without it ``available`` says so and the
functions raise); ``TRITON_INTERPRET=1`` in the environment before triton and these modules are
imported runs the kernels on the host, under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from . import providers, recipes
from . import triton_quantize as _tq

__all__ = [
    "GroupedKernelConfig",
    "available",
    "quantize_groups_rowwise_both",
    "quantize_groups_rowwise",
    "quantize_groups_rowwise_for",
]

triton = _tq.triton
available = _tq.available
_INT32_LIMIT = 2**31
_USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


@dataclass(frozen=True)
class GroupedKernelConfig:
    """Tile shapes and launch settings of the grouped kernels (powers of two). The cast tile:
    both copies of (8192, 7168) bf16 tokens in 16 groups took 0.238 ms with (16, 128) against
    0.258 with (32, 128) and 0.313 with (64, 128) on an H200 (``benchmarks/quantize_kernels.py
    --sweep``, one run; the columnwise copy alone 0.201 against 0.219 and 0.244 ms).

    ``amax_block``: the (rows, columns) tile the amax pass reads at a time; ``amax_t_chunk``:
    the rows one amax program walks down (its groups' column maxima stay in registers: one
    column atomic per column per group per chunk). ``cast_block``: the cast pass's tile
    (aligned columns, columns of x); its first dimension is the contiguous run of each
    transposed store. ``cast_k_chunk``: the columns of x one cast program walks along (a
    multiple of ``cast_block[1]``). ``cast``: ``"ptx"``, ``"soft"`` or None, as
    ``triton_quantize.KernelConfig.cast``; ``amax_stages``, ``cast_stages``: how deep Triton
    pipelines the loads of each pass's loop over tiles, as ``triton_quantize.KernelConfig``'s
    (1: not at all, the kernels the H200 timed). The
    rowwise copy alone runs ``triton_quantize``'s rowwise kernel with its default tiles
    (``triton_quantize.DEFAULT_CONFIG``).
    """

    amax_block: tuple[int, int] = (32, 512)
    amax_t_chunk: int = 512
    amax_warps: int = 4
    cast_block: tuple[int, int] = (16, 128)
    cast_k_chunk: int = 1024
    cast_warps: int = 4
    cast: str | None = None
    amax_stages: int = 1
    cast_stages: int = 1

    def __post_init__(self) -> None:
        for b in (*self.amax_block, *self.cast_block):
            if b < 1 or b & (b - 1):
                raise ValueError(f"block sizes must be powers of two, got {self}")
        if self.amax_t_chunk < 1:
            raise ValueError(f"amax_t_chunk must be positive, got {self}")
        if self.cast_k_chunk < self.cast_block[1] or self.cast_k_chunk % self.cast_block[1]:
            raise ValueError(f"cast_k_chunk must be a multiple of cast_block[1], got {self}")
        _tq._check_stages(self, "amax_stages", "cast_stages")
        if self.cast not in (None, "ptx", "soft"):
            raise ValueError(f"cast must be 'ptx', 'soft' or None, got {self.cast!r}")


DEFAULT_CONFIG = GroupedKernelConfig()


if triton is not None:
    import triton.language as tl

    _scales = _tq._scales
    _fp8_bits = _tq._fp8_bits
    _load_f32 = _tq._load_f32
    _abs_no_nan = _tq._abs_no_nan
    _as_f32 = _tq._as_f32

    @triton.jit
    def _amax_kernel(x_ptr, offs_ptr, row_amax_ptr, col_amax_ptr, T, K, G, T_CHUNK,
                     ROWS: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, G_PAD: tl.constexpr, STAGES: tl.constexpr):
        """Row maxima of |x| (if ROWS) and each group's column maxima, into int32 buffers
        holding fp32 bits. A program walks T_CHUNK rows of BLOCK_K columns group by group."""
        pid_k = tl.program_id(0)
        pid_t = tl.program_id(1)
        k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = k < K
        r0 = pid_t * T_CHUNK
        r1 = tl.minimum(r0 + T_CHUNK, T)
        gi = tl.arange(0, G_PAD)
        ends = tl.minimum(tl.load(offs_ptr + gi, mask=gi < G, other=T), T)  # T: never <= a row
        g_lo = tl.sum((ends <= r0).to(tl.int32), axis=0)  # the group of row r0 (G: past the end)
        g_hi = tl.sum((ends <= r1 - 1).to(tl.int32), axis=0)
        for g in range(g_lo, g_hi + 1):
            start = tl.load(offs_ptr + tl.maximum(g - 1, 0))
            start = tl.minimum(tl.where(g > 0, start, 0), T)
            end = tl.load(offs_ptr + tl.minimum(g, G - 1))
            end = tl.minimum(tl.where(g < G, end, T), T)
            lo = tl.maximum(start, r0)
            hi = tl.minimum(end, r1)
            col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
            for n0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):
                n = n0 + tl.arange(0, BLOCK_T)
                n_in = n < hi
                a = _abs_no_nan(_load_f32(x_ptr + n[:, None] * K + k[None, :],
                                          n_in[:, None] & k_in[None, :], BF16_BITS))
                if ROWS:
                    tl.atomic_max(row_amax_ptr + n, tl.max(a, axis=1).to(tl.int32, bitcast=True),
                                  mask=n_in, sem="relaxed")
                col_max = tl.maximum(col_max, tl.max(a, axis=0))
            # the group's scalar conditions broadcast to the block first: a block mask of
            # booleans (triton 3.9's interpreter refuses a block and-ed with a scalar bool)
            kept = (tl.zeros_like(k) + g < G) & (tl.zeros_like(k) + hi > lo)
            tl.atomic_max(col_amax_ptr + g * K + k, col_max.to(tl.int32, bitcast=True),
                          mask=k_in & kept, sem="relaxed")

    @triton.jit
    def _cast_kernel(x_ptr, offs_ptr, row_amax_ptr, col_amax_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                     T, K, G, P, K_CHUNK, FP8_MAX, EPS,
                     ROWS: tl.constexpr, POW2: tl.constexpr, E5M2: tl.constexpr,
                     CAST: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_K: tl.constexpr, G_PAD: tl.constexpr, ALIGN: tl.constexpr,
                     STAGES: tl.constexpr):
        """BLOCK_P columns of the aligned layout over K_CHUNK columns of x: the columnwise copy
        of those columns (padding as zero bytes) and, if ROWS, the rowwise copy of their rows
        (the columns past the last group's aligned end holding the rows past offs[-1])."""
        FP8_MAX, EPS = _as_f32(FP8_MAX), _as_f32(EPS)
        pid_k = tl.program_id(0)
        pid_p = tl.program_id(1)
        gi = tl.arange(0, G_PAD)
        g_in = gi < G
        ends = tl.minimum(tl.load(offs_ptr + gi, mask=g_in, other=0), T)
        starts = tl.minimum(tl.load(offs_ptr + gi - 1, mask=g_in & (gi > 0), other=0), T)
        sizes = tl.where(g_in, tl.maximum(ends - starts, 0), 0)
        aligned = (sizes + ALIGN - 1) // ALIGN * ALIGN
        aligned_ends = tl.cumsum(aligned, axis=0)
        shift = starts - (aligned_ends - aligned)  # token = aligned column + shift
        total = tl.sum(aligned, axis=0)  # the last group's aligned end
        last = tl.minimum(tl.load(offs_ptr + G - 1), T)
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        group = tl.sum(((aligned_ends[None, :] <= p[:, None]) & g_in[None, :]).to(tl.int32),
                       axis=1)
        mine = group[:, None] == gi[None, :]
        token = p + tl.sum(tl.where(mine, shift[None, :], 0), axis=1)
        in_group = (group < G) & (token < tl.sum(tl.where(mine, ends[None, :], 0), axis=1))
        if ROWS:
            tail = last + (p - total)  # the rows past offs[-1], in order
            has_row = in_group | ((group >= G) & (tail < T) & (p < P))
            row = tl.where(in_group, token, tl.where(has_row, tail, 0))
            amax = tl.load(row_amax_ptr + row, mask=has_row, other=0).to(tl.float32,
                                                                          bitcast=True)
            row_scale, row_scale_inv = _scales(amax, FP8_MAX, EPS, POW2)
            if pid_k == 0:
                tl.store(s_ptr + row, row_scale_inv, mask=has_row)
        else:
            has_row = in_group
            row = tl.where(in_group, token, 0)
        # Each run of SUB aligned columns lies in one group's aligned range (the ranges start at
        # multiples of ALIGN): its group, a scalar per run, picks that run's column scales. A
        # static loop over the runs keeps the K loop free of a dynamic inner loop, which
        # Triton's pipeliner would not take.
        SUB: tl.constexpr = BLOCK_P if BLOCK_P < ALIGN else ALIGN
        run = tl.arange(0, BLOCK_P) // SUB
        k_start = pid_k * K_CHUNK
        k_end = tl.minimum(k_start + K_CHUNK, K)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            k_in = k < K
            x = _load_f32(x_ptr + row[:, None] * K + k[None, :], has_row[:, None] & k_in[None, :],
                          BF16_BITS)
            if ROWS:
                q = _fp8_bits(x, row_scale[:, None], FP8_MAX, E5M2, CAST)
                tl.store(q_ptr + row[:, None] * K + k[None, :], q,
                         mask=has_row[:, None] & k_in[None, :])
            scale = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(BLOCK_P // SUB):
                g = tl.sum(tl.where(tl.arange(0, BLOCK_P) == j * SUB, group, 0), axis=0)
                # g broadcast to the block first: triton 3.9's interpreter refuses a block
                # and-ed with a scalar bool
                in_run = k_in & (tl.zeros_like(k) + g < G)
                g_amax = tl.load(col_amax_ptr + g * K + k, mask=in_run, other=0).to(
                    tl.float32, bitcast=True)
                s, _ = _scales(g_amax, FP8_MAX, EPS, POW2)
                scale = tl.where((run == j)[:, None], s[None, :], scale)
            xt = tl.where(in_group[:, None], x, 0.0)  # padding and past the end: +0 bytes
            qt = tl.trans(_fp8_bits(xt, scale, FP8_MAX, E5M2, CAST))
            tl.store(qt_ptr + k[:, None] * P + p[None, :], qt,
                     mask=k_in[:, None] & (p < P)[None, :])
        for g in range(pid_p, G, tl.num_programs(1)):  # scale_inv (G, K), groups strided
            for k0 in range(k_start, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_in = k < K
                g_amax = tl.load(col_amax_ptr + g * K + k, mask=k_in, other=0).to(tl.float32,
                                                                                   bitcast=True)
                _, s_inv = _scales(g_amax, FP8_MAX, EPS, POW2)
                tl.store(st_ptr + g * K + k, s_inv, mask=k_in)


def _check(x: Tensor, offs: Tensor, fp8_dtype: torch.dtype, fp8_max: float) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected token-grouped (T, K) x, got a {x.dim()}-D tensor of shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in _tq._INPUT_DTYPES:
        raise ValueError(f"expected a bfloat16, float16 or float32 tensor, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {x.stride()} for shape "
                         f"{tuple(x.shape)}")
    if offs.dim() != 1 or offs.shape[0] < 1 or offs.dtype != torch.int32:
        raise ValueError(f"expected offs as int32 (G,) group ends, G >= 1, got {offs.dtype} "
                         f"of shape {tuple(offs.shape)}")
    if offs.device != x.device:
        raise ValueError(f"offs on {offs.device}, x on {x.device}: both on one device")
    if fp8_dtype not in _tq._FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be {recipes.E4M3} or {recipes.E5M2}, got {fp8_dtype}")
    top = torch.finfo(fp8_dtype).max
    if not 0.0 < fp8_max <= top:
        raise ValueError(f"fp8_max must be in (0, {top}] for {fp8_dtype}, got {fp8_max}")
    why = too_large(*x.shape, offs.shape[0])
    if why is not None:
        raise ValueError(why)


def too_large(t: int, k: int, groups: int) -> str | None:
    """Why (T, K) tokens in ``groups`` groups are past what the kernels index (int32), or None."""
    p = providers.aligned_tokens(t, groups)
    if k * max(t, p) >= _INT32_LIMIT or groups * k >= _INT32_LIMIT:
        return (f"(T, K) = ({t}, {k}) with {groups} groups: a copy or the (G, K) amaxes past "
                f"2**31 elements, which the kernels index in int32")
    return None


def _outputs(x: Tensor, groups: int, fp8_dtype: torch.dtype, rows: bool, cols: bool,
             empty: bool) -> list[Tensor]:
    """The copies' tensors: uninitialised, or for an empty ``x`` their values (an empty row or
    column's amax is 0: scale_inv 1; the aligned copy of no tokens is zero bytes)."""
    t, k = x.shape
    dev = x.device
    fill = torch.ones if empty else torch.empty
    out: list[Tensor] = []
    if rows:
        out += [torch.empty((t, k), dtype=fp8_dtype, device=dev),
                fill((t, 1), dtype=torch.float32, device=dev)]
    if cols:
        p = providers.aligned_tokens(t, groups)
        data_t = (torch.zeros if empty else torch.empty)((k, p), dtype=torch.uint8, device=dev)
        out += [data_t.view(fp8_dtype), fill((groups, k), dtype=torch.float32, device=dev)]
    return out


def quantize_groups_rowwise(
    x: Tensor,
    offs: Tensor,
    *,
    fp8_dtype: torch.dtype,
    fp8_max: float,
    power_2_scales: bool,
    amax_epsilon: float,
    rows: bool = True,
    cols: bool = True,
    config: GroupedKernelConfig | None = None,
) -> list[Tensor]:
    """Rowwise FP8 copies of contiguous token-grouped (T, K) ``x`` (bf16, fp16 or fp32; group g
    the rows ``offs[g-1]:offs[g]`` of int32 (G,) ``offs`` on x's device): ``[data (T, K),
    scale_inv (T, 1)]`` if ``rows``, then ``[data (K, P), scale_inv (G, K)]`` in the 16-aligned
    token layout if ``cols`` (P = ``providers.aligned_tokens(T, G)``); data in ``fp8_dtype``,
    scale_inv fp32, all contiguous. Bit-identical to ``recipes.rowwise_quantize`` and
    ``ops._quantize_groups_rowwise`` of a recipe with these parameters (see the module
    docstring). ``available(x)`` says whether it can run on ``x``; ValueError for a tensor it
    does not take."""
    _check(x, offs, fp8_dtype, fp8_max)
    reason = available(x)
    if reason is not None:
        raise RuntimeError(f"the Triton quantize kernels cannot run: {reason}")
    if not (rows or cols):
        return []
    cfg = config or DEFAULT_CONFIG
    t, k = x.shape
    groups = offs.shape[0]
    if x.numel() == 0:
        return _outputs(x, groups, fp8_dtype, rows, cols, empty=True)
    cast = _tq._cast_mode(x, cfg)
    if not cols:  # one kernel: each strip of rows read for its amaxes, then again from cache
        got = _tq.quantize_experts_rowwise(
            x.unsqueeze(0), fp8_dtype=fp8_dtype, fp8_max=fp8_max, power_2_scales=power_2_scales,
            amax_epsilon=amax_epsilon, rows=True, cols=False,
            config=dataclasses.replace(_tq.DEFAULT_CONFIG, cast=cast))
        return [got[0].squeeze(0), got[1].squeeze(0)]  # methods, not indexing: see ops
    xs = x.view(torch.int16) if x.dtype == torch.bfloat16 else x  # see _tq._load_f32
    bf16_bits = xs.dtype == torch.int16
    i32 = dict(dtype=torch.int32, device=x.device)
    row_amax = torch.zeros((t,), **i32) if rows else None
    col_amax = torch.zeros((groups, k), **i32)
    g_pad = max(16, triton.next_power_of_2(groups))  # the groups' ends, in registers
    bt, bk = cfg.amax_block
    _tq.launched(_amax_kernel)[(triton.cdiv(k, bk), triton.cdiv(t, cfg.amax_t_chunk))](
        xs, offs, row_amax, col_amax, t, k, groups, cfg.amax_t_chunk, ROWS=rows,
        BF16_BITS=bf16_bits, BLOCK_T=bt, BLOCK_K=bk, G_PAD=g_pad, STAGES=cfg.amax_stages,
        num_warps=cfg.amax_warps,
        **_tq._launch_options())
    out = _outputs(x, groups, fp8_dtype, rows, cols, empty=False)
    q, s = (out[0].view(torch.uint8), out[1]) if rows else (None, None)
    qt, st = out[-2].view(torch.uint8), out[-1]
    p = qt.shape[1]
    bp, bk = cfg.cast_block
    _tq.launched(_cast_kernel)[(triton.cdiv(k, cfg.cast_k_chunk), triton.cdiv(p, bp))](
        xs, offs, row_amax, col_amax, q, s, qt, st, t, k, groups, p, cfg.cast_k_chunk,
        float(fp8_max), float(amax_epsilon), ROWS=rows, POW2=bool(power_2_scales),
        E5M2=fp8_dtype == recipes.E5M2, CAST=cast, BF16_BITS=bf16_bits, BLOCK_P=bp, BLOCK_K=bk,
        G_PAD=g_pad, ALIGN=providers.TOKEN_ALIGN, STAGES=cfg.cast_stages,
        num_warps=cfg.cast_warps,
        **_tq._launch_options())
    return out


def quantize_groups_rowwise_both(x: Tensor, offs: Tensor, *, fp8_dtype: torch.dtype,
                                 fp8_max: float, power_2_scales: bool, amax_epsilon: float,
                                 config: GroupedKernelConfig | None = None) -> list[Tensor]:
    """Both rowwise copies of token-grouped (T, K) ``x``: ``[data (T, K), scale_inv (T, 1),
    data (K, P), scale_inv (G, K)]``, bit-identical to ``ops._quantize(x, recipe, role, "both",
    offs)`` under a rowwise recipe with these parameters. 2 reads of x and 1 byte written per
    copy: 6 bytes per element for bf16 (see the module docstring)."""
    return quantize_groups_rowwise(x, offs, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                   power_2_scales=power_2_scales, amax_epsilon=amax_epsilon,
                                   rows=True, cols=True, config=config)


def quantize_groups_rowwise_for(x: Tensor, recipe: recipes.Recipe | str, role: str, usage: str,
                                offs: Tensor, *, config: GroupedKernelConfig | None = None
                                ) -> list[Tensor]:
    """``quantize_groups_rowwise`` with the fp8 dtype, fp8 max, power-of-2 setting and amax
    epsilon that ``recipe`` gives ``role``: under a rowwise recipe (``"rowwise"``,
    ``"rowwise_pow2"``) a drop-in for ``ops._quantize(x, recipe, role, usage, offs)`` (usage
    ``"rowwise"``, ``"columnwise"`` or ``"both"``). Another recipe's parameters are taken as
    ``recipes.rowwise_quantize`` and ``ops._quantize_groups_rowwise`` take them (e.g. E5M2
    gradients of ``"tensorwise"``), which is not what ``ops._quantize`` does with ``offs``
    under that recipe."""
    if usage not in _USAGES:
        raise ValueError(f"unknown quantize usage {usage!r}; valid usages are {tuple(_USAGES)}")
    r = recipes.as_recipe(recipe)
    dtype = recipes.fp8_dtype(r, role)
    rows, cols = _USAGES[usage]
    return quantize_groups_rowwise(x, offs, fp8_dtype=dtype, fp8_max=recipes.fp8_max(dtype),
                                   power_2_scales=r.power_2_scales, amax_epsilon=r.amax_epsilon,
                                   rows=rows, cols=cols, config=config)
