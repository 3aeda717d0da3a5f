"""Rowwise FP8 quantization of 3-D expert weights as Triton kernels.

``quantize_experts_rowwise`` computes what ``ops.experts_rowwise_torch`` computes for a stack
of expert weights ``x`` of shape (E, N, K), bit for bit: the rowwise copy (each row of each expert
scaled by its own amax along K: data (E, N, K), scale_inv (E, N, 1)) and/or the columnwise copy
(each column scaled by its own amax along N, written transposed: data (E, K, N), scale_inv
(E, K, 1)), with the arithmetic of :mod:`graphpass.fp8.recipes` (``row_scale``,
``compute_scale_from_amax``, ``scaled_cast``, ``reciprocal``).

Why: the torch code under Inductor makes each copy in its own kernels, reading the weight once
for the amaxes and again for the cast: 0.63 ms (rowwise) and 0.78 ms (columnwise) per
(16, 4096, 7168) bf16 weight on an H200, 1.40 ms for both. Here the amaxes of both copies come
from one read of x, and one more read writes every copy requested.

Kernels, and the bytes each moves per element of x (s bytes per input element, 2 for bf16):

* both copies, or the columnwise copy: two passes, 2s + 1 per copy written (bf16: 6 for both,
  5 for the columnwise copy alone).

  - ``_amax_kernel``: a program walks ``amax_n_chunk`` rows of one expert, ``amax_block`` tiles
    at a time over ``amax_block[1]`` columns, folds each tile's row maxima of |x| into the row
    amaxes with ``atomic_max`` and keeps its columns' maxima in registers until the end (one
    column atomic per column per chunk). The amaxes are int32 buffers holding fp32 bits: they
    are >= +0 (NaN is dropped before the max), where the integer order of the bits is the float
    order, so the atomic max is exact and independent of the order;
  - ``_cast_kernel``: a program walks ``cast_k_chunk`` columns of ``cast_block[0]`` rows, reads
    x again a tile at a time, turns the amaxes of its rows and columns into scales and writes
    the rowwise tile and, through the tile's transpose, the columnwise tile, so the loads and
    both stores run along contiguous memory. The programs of the first chunk (rows) and of the
    first rows (columns) also write scale_inv.

* the rowwise copy alone: ``_rows_kernel``, one pass. A program owns ``rows_block[0]`` whole rows,
  reads them for their amaxes and again for the cast while they are still in cache: s + 1 from
  memory when the second read hits (2s + 1 at most); no atomics.

The amaxes and scales add 4 bytes per row and per column. Measured on an H200 (torch 2.11,
Triton 3.6, ``benchmarks/quantize_kernels.py``), (16, 4096, 7168) bf16: both copies 1.28 ms
(amax pass 0.39, cast pass 0.90), rowwise 0.57 ms, columnwise 0.79 ms; 1.09x, 1.10x and 0.99x
the Inductor times above. The cast pass writing both copies moves its bytes at about 2.1 TB/s,
half the card's copy bandwidth: the rest of the gap to the byte count is there. Tiles of 8
elements a thread were slower on the H200 (``--sweep``, same shape: both copies 2.42 ms with
amax tiles of (16, 512) over 8 warps, whose column maxima are then reduced across warps at
every tile; 1.95 ms with (8, 512) over 4 warps), and so was a rowwise kernel holding whole rows
in registers for one read (0.62 against 0.57 ms: the second read hits the cache).

What a memory-bound loop lacks is bytes in flight. Those kernels ran every loop unpipelined:
a program loads a tile, waits for it, computes and stores it, then loads the next (Triton's
launch option ``num_stages`` pipelines only loops that hold a GEMM; the PTX is the same at
every value of it). As launched on sm_90 (``benchmarks/quantize_kernels.py --resources``, on
the CPU), the default cast kernel of both copies takes 127 registers: 4 programs of 4 warps an
SM, one (32, 128) bf16 tile each, 32 KiB in flight an SM; torchao's transposed cast, which ran
at about 3.95 TB/s, reads one (128, 128) tile, 32 KiB, a program of 4 warps. With
``cast_stages``, ``rows_stages`` or ``amax_stages`` above 1 a loop's loads of the next tiles
are asynchronous copies into shared memory (``tl.range``'s ``num_stages``) issued while a tile
is computed: the cast kernel of both copies at 3 stages takes 96 registers and 17 KiB of shared
memory, 5 programs an SM with two tiles each in flight, 80 KiB. Not yet timed: the defaults stay
the unpipelined loops the H200 measured, and ``--sweep`` times the depths.

Numerics (each bit-identical to the torch code):

* x: upcast to fp32 exactly (bf16 by widening its bits);
* amax: |x| with NaN replaced by 0 (``fmaxf`` semantics), max over the row/column, 0 for an
  empty one;
* scale: the amax floored at ``amax_epsilon``; ``fp8_max / amax`` by IEEE division
  (``tl.math.div_rn``: Triton's ``/`` on fp32 is an approximate division on CUDA); inf replaced by
  FLT_MAX; with ``power_2_scales`` the mantissa bits cleared; an amax of 0, inf or NaN gives 1.
  The special cases are decided on the bits, so they do not depend on whether the device flushes
  subnormals in comparisons;
* data: ``x32 * scale`` clamped to [-fp8_max, fp8_max] with selects (a NaN compares false and
  stays NaN), then cast round-to-nearest-even. A NaN becomes 0x7F with the sign of the product,
  as in torch's c10 conversion (the conversion instruction writes 0x7F whatever the sign). The
  product's NaN sign is whatever the device's multiply gives, here and in the torch code alike
  (a CPU keeps the operand's);
* scale_inv: ``1 / scale`` by IEEE division.

The fp32 -> fp8 conversion (``KernelConfig.cast``): on sm_89+ GPUs the ``cvt.rn.satfinite``
instruction through inline PTX (``"ptx"``). Triton's own conversion (``y.to(tl.float8e4nv)``)
lowers to the same instruction but gave wrong bytes (zeros) for part of the transposed copy on an
H200 with Triton 3.6, so it is not used. Elsewhere, and under Triton's interpreter (whose float8
conversion does not round to nearest even), an integer implementation of c10's
``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value`` (``"soft"``); on an H200 both give
the torch code's bits, the integer one 5% slower for both copies.

Triton is optional: without it this module imports and ``available`` says so. The kernels are
defined when this module is imported, and ``triton.jit`` decides then whether they run under the
interpreter: ``TRITON_INTERPRET=1`` must be in the environment before that import.

One module because its kernels, their launch configurations and the host-side checks that route
a weight to them share one set of layouts and bounds; this docstring, which derives them, is
about a seventh of it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from . import recipes

__all__ = [
    "KernelConfig",
    "available",
    "quantize_experts_rowwise",
    "quantize_experts_rowwise_for",
]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = (recipes.E4M3, recipes.E5M2)
_INT32_LIMIT = 2**31
_MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension: one program row per expert


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch settings of the kernels (powers of two; defaults measured on an
    H200: a cast tile of (32, 128) took 1.246 ms for both copies of a (16, 4096, 7168) bf16
    weight and 0.770 ms for the columnwise copy, against 1.276 and 0.784 ms with (64, 128);
    no other tile in ``benchmarks/quantize_kernels.py --sweep`` was faster, one tile a program
    included).

    ``amax_block``: the (rows, columns) tile the amax pass reads at a time; ``amax_n_chunk``: the
    rows one amax program walks down (a multiple of ``amax_block[0]``), keeping its columns'
    maxima in registers: one column atomic per column per chunk, one row atomic per row per
    tile. ``cast_block``: the cast pass's tile, whose rows are the contiguous runs of the
    transposed store; ``cast_k_chunk``: the columns one cast program walks along (a multiple of
    ``cast_block[1]``). ``rows_block``: the strip of rows one program of the rowwise-only kernel
    owns, and how many columns it reads at a time. ``rows_reverse``: that kernel's second read
    walks its rows from their last tile, which the first read loaded last, so that the tiles
    most likely still in cache are read first (in the DeepSeek-V3 layer the kernel moved its
    bytes at about 2.3 TB/s as if it read the rows twice from memory; not yet measured).
    ``fuse_rows``: the rowwise copy alone through that one-kernel path (else the two passes).
    ``cast``: how fp32 becomes fp8: ``"ptx"`` (the ``cvt.rn.satfinite`` instruction through
    inline PTX; sm_89+ GPUs) or ``"soft"`` (integer arithmetic: any device, and the
    interpreter); None picks ``"ptx"`` where it can run.
    ``amax_stages``, ``cast_stages``, ``rows_stages``: how deep Triton pipelines the loads of
    the amax pass's, the cast pass's and the rowwise kernel's loop (``tl.range``'s
    ``num_stages``): at S > 1 the loads of the next S - 1 tiles are in flight (``cp.async`` into
    shared memory, one tile's bytes per stage) while a tile is computed; at 1 a loop loads a
    tile, computes and stores it, then loads the next. These loops hold no GEMM, so Triton's
    launch option ``num_stages`` pipelines none of them: the kernels the H200 timed ran at 1
    (``tests/test_triton_compile.py`` checks which loops a depth pipelines).
    """

    amax_block: tuple[int, int] = (32, 512)
    amax_n_chunk: int = 512
    amax_warps: int = 4
    cast_block: tuple[int, int] = (32, 128)
    cast_k_chunk: int = 1024
    cast_warps: int = 4
    rows_block: tuple[int, int] = (2, 1024)
    rows_warps: int = 4
    rows_reverse: bool = False
    fuse_rows: bool = True
    cast: str | None = None
    amax_stages: int = 1
    cast_stages: int = 1
    rows_stages: int = 1

    def __post_init__(self) -> None:
        for b in (*self.amax_block, *self.cast_block, *self.rows_block):
            if b < 1 or b & (b - 1):
                raise ValueError(f"block sizes must be powers of two, got {self}")
        if self.amax_n_chunk < self.amax_block[0] or self.amax_n_chunk % self.amax_block[0]:
            raise ValueError(f"amax_n_chunk must be a multiple of amax_block[0], got {self}")
        if self.cast_k_chunk < self.cast_block[1] or self.cast_k_chunk % self.cast_block[1]:
            raise ValueError(f"cast_k_chunk must be a multiple of cast_block[1], got {self}")
        _check_stages(self, "amax_stages", "cast_stages", "rows_stages")
        if self.cast not in (None, *_CASTS):
            raise ValueError(f"cast must be one of {_CASTS} or None, got {self.cast!r}")


_CASTS = ("ptx", "soft")


def _check_stages(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be positive, got {config}")
DEFAULT_CONFIG = KernelConfig()


try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: available() says why they cannot run
    triton = None

if triton is not None:

    @triton.jit
    def _as_f32(v):
        """A float argument as fp32: Triton's launcher passes a Python float as fp32, Inductor's
        launch of the same kernel (``inductor_launches``) as fp64; fp64 arithmetic would round
        the scales differently."""
        return tl.cast(v, tl.float32)

    @triton.jit
    def _scales(amax, FP8_MAX, EPS, POW2: tl.constexpr):
        """(scale, scale_inv) of fp32 amaxes, as recipes.compute_scale_from_amax."""
        amax = tl.where(amax < EPS, EPS, amax)  # NaN < EPS is False: kept
        abits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        degenerate = (abits == 0) | (abits >= 0x7F800000)  # 0, inf, NaN
        divisor = tl.where(degenerate, 1.0, amax)  # its scale is replaced below
        scale = tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, divisor)
        sbits = scale.to(tl.int32, bitcast=True)
        sbits = tl.where(sbits == 0x7F800000, 0x7F7FFFFF, sbits)  # inf -> FLT_MAX
        if POW2:
            sbits = sbits & -0x800000  # 0xFF800000: sign and exponent
        sbits = tl.where(degenerate, 0x3F800000, sbits)  # 1.0
        scale = sbits.to(tl.float32, bitcast=True)
        return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)

    @triton.jit
    def _fp8_bits(x, scale, FP8_MAX, E5M2: tl.constexpr, CAST: tl.constexpr):
        """uint8 bits of fp8(clamp(x * scale, -FP8_MAX, FP8_MAX)), round-to-nearest-even, NaN
        as 0x7F with the product's sign (c10's conversion)."""
        y = x * scale
        y = tl.where(y > FP8_MAX, FP8_MAX, y)
        y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
        ybits = y.to(tl.int32, bitcast=True)
        sign = (ybits >> 24) & 0x80
        magnitude = ybits & 0x7FFFFFFF
        if CAST == "soft":
            # c10::detail::fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value in integers
            MANT: tl.constexpr = 2 if E5M2 else 3
            BIAS: tl.constexpr = 15 if E5M2 else 7
            SHIFT: tl.constexpr = 23 - MANT
            ROUND: tl.constexpr = ((BIAS - 127) << 23) + (1 << (SHIFT - 1)) - 1
            DENORM: tl.constexpr = ((127 - BIAS) + SHIFT + 1) << 23
            MIN_NORMAL: tl.constexpr = (128 - BIAS) << 23
            odd = (magnitude >> SHIFT) & 1
            normal = (magnitude + ROUND + odd) >> SHIFT
            magic = (tl.zeros_like(ybits) + DENORM).to(tl.float32, bitcast=True)
            small = (tl.abs(y) + magic).to(tl.int32, bitcast=True) - DENORM
            q = tl.where(magnitude < MIN_NORMAL, small, normal)
        else:
            # cvt d, a, b puts a in d's upper byte: elements 0-3 go to bytes 0-3. Inline PTX
            # rather than y.to(tl.float8e4nv): Triton 3.6's own conversion gave wrong bytes
            # (zeros) for part of the transposed copy on an H200.
            if E5M2:
                q8 = tl.inline_asm_elementwise(
                    "{ .reg .b16 lo, hi;\n"
                    "cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1;\n"
                    "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3;\n"
                    "mov.b32 $0, {lo, hi}; }",
                    "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
            else:
                q8 = tl.inline_asm_elementwise(
                    "{ .reg .b16 lo, hi;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
                    "mov.b32 $0, {lo, hi}; }",
                    "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
            q = q8.to(tl.int32) & 0x7F  # the sign is put back below, NaN's too
        q = tl.where(magnitude > 0x7F800000, 0x7F, q)  # NaN
        return (q | sign).to(tl.uint8)

    @triton.jit
    def _load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
        """x upcast to fp32 exactly. bf16 arrives as its int16 bits and is widened with a shift:
        the same instructions as a bf16 -> fp32 conversion on the GPU, and exact for
        subnormals under the interpreter, whose own bf16 conversion is not."""
        if BF16_BITS:
            bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
            return bits.to(tl.float32, bitcast=True)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _abs_no_nan(x):
        a = tl.abs(x)
        return tl.where(a == a, a, 0.0)  # NaN never reaches an amax (fmaxf)

    @triton.jit
    def _amax_kernel(x_ptr, row_amax_ptr, col_amax_ptr, N, K, N_CHUNK,
                     ROWS: tl.constexpr, COLS: tl.constexpr, BF16_BITS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """Row and/or column maxima of |x| into int32 buffers holding fp32 bits (amaxes are
        >= +0, where the integer order of the bits is the float order). A program walks
        N_CHUNK rows of BLOCK_K columns: its column maxima stay in registers until the end."""
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        x_ptr += e * N * K
        k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = k < K
        col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
        n_start = pid_n * N_CHUNK
        for n0 in tl.range(n_start, tl.minimum(n_start + N_CHUNK, N), BLOCK_N,
                            num_stages=STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            n_in = n < N
            a = _abs_no_nan(_load_f32(x_ptr + n[:, None] * K + k[None, :],
                                      n_in[:, None] & k_in[None, :], BF16_BITS))
            if ROWS:
                tl.atomic_max(row_amax_ptr + e * N + n,
                              tl.max(a, axis=1).to(tl.int32, bitcast=True), mask=n_in,
                              sem="relaxed")
            if COLS:
                col_max = tl.maximum(col_max, tl.max(a, axis=0))
        if COLS:
            tl.atomic_max(col_amax_ptr + e * K + k, col_max.to(tl.int32, bitcast=True),
                          mask=k_in, sem="relaxed")

    @triton.jit
    def _cast_kernel(x_ptr, row_amax_ptr, col_amax_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
                     N, K, K_CHUNK, FP8_MAX, EPS,
                     ROWS: tl.constexpr, COLS: tl.constexpr, POW2: tl.constexpr,
                     E5M2: tl.constexpr, CAST: tl.constexpr, BF16_BITS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """The rowwise and/or (transposed) columnwise copies of BLOCK_N rows over K_CHUNK
        columns, a tile at a time, and the scale_inv of those rows (programs of the first
        chunk) and columns (programs of the first rows)."""
        FP8_MAX, EPS = _as_f32(FP8_MAX), _as_f32(EPS)
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        base = e * N * K
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = n < N
        if ROWS:
            row_amax = tl.load(row_amax_ptr + e * N + n, mask=n_in, other=0).to(
                tl.float32, bitcast=True)
            row_scale, row_scale_inv = _scales(row_amax, FP8_MAX, EPS, POW2)
            if pid_k == 0:
                tl.store(s_ptr + e * N + n, row_scale_inv, mask=n_in)
        k_start = pid_k * K_CHUNK
        for k0 in tl.range(k_start, tl.minimum(k_start + K_CHUNK, K), BLOCK_K,
                            num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            k_in = k < K
            mask = n_in[:, None] & k_in[None, :]
            x = _load_f32(x_ptr + base + n[:, None] * K + k[None, :], mask, BF16_BITS)
            if ROWS:
                q = _fp8_bits(x, row_scale[:, None], FP8_MAX, E5M2, CAST)
                tl.store(q_ptr + base + n[:, None] * K + k[None, :], q, mask=mask)
            if COLS:
                col_amax = tl.load(col_amax_ptr + e * K + k, mask=k_in, other=0).to(
                    tl.float32, bitcast=True)
                col_scale, col_scale_inv = _scales(col_amax, FP8_MAX, EPS, POW2)
                qt = tl.trans(_fp8_bits(x, col_scale[None, :], FP8_MAX, E5M2, CAST))
                tl.store(qt_ptr + base + k[:, None] * N + n[None, :], qt,
                         mask=k_in[:, None] & n_in[None, :])
                if pid_n == 0:
                    tl.store(st_ptr + e * K + k, col_scale_inv, mask=k_in)

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, s_ptr, N, K, FP8_MAX, EPS,
                     POW2: tl.constexpr, E5M2: tl.constexpr, CAST: tl.constexpr,
                     BF16_BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     REVERSE: tl.constexpr, STAGES: tl.constexpr):
        """The rowwise copy alone: a program owns BLOCK_N whole rows, reads them once for their
        amaxes and again (from cache, just read; with REVERSE from the last tile) for the
        cast."""
        FP8_MAX, EPS = _as_f32(FP8_MAX), _as_f32(EPS)
        pid_n = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)
        x_ptr += e * N * K
        q_ptr += e * N * K
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = n < N
        row_max = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            a = _abs_no_nan(_load_f32(x_ptr + n[:, None] * K + k[None, :],
                                      n_in[:, None] & (k < K)[None, :], BF16_BITS))
            row_max = tl.maximum(row_max, tl.max(a, axis=1))
        scale, scale_inv = _scales(row_max, FP8_MAX, EPS, POW2)
        tl.store(s_ptr + e * N + n, scale_inv, mask=n_in)
        if REVERSE:
            last = (K - 1) // BLOCK_K * BLOCK_K
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                _rows_tile(x_ptr, q_ptr, n, n_in, last - k0, K, scale, FP8_MAX, E5M2, CAST,
                           BF16_BITS, BLOCK_K)
        else:
            for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                _rows_tile(x_ptr, q_ptr, n, n_in, k0, K, scale, FP8_MAX, E5M2, CAST, BF16_BITS,
                           BLOCK_K)

    @triton.jit
    def _rows_tile(x_ptr, q_ptr, n, n_in, k0, K, scale, FP8_MAX, E5M2: tl.constexpr,
                   CAST: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_K: tl.constexpr):
        """The rowwise copy of the rows ``n`` over the columns from ``k0``, one tile."""
        k = k0 + tl.arange(0, BLOCK_K)
        mask = n_in[:, None] & (k < K)[None, :]
        x = _load_f32(x_ptr + n[:, None] * K + k[None, :], mask, BF16_BITS)
        tl.store(q_ptr + n[:, None] * K + k[None, :],
                 _fp8_bits(x, scale[:, None], FP8_MAX, E5M2, CAST), mask=mask)


_INDUCTOR_LAUNCHES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphpass_triton_inductor_launches", default=False)


@contextlib.contextmanager
def inductor_launches() -> Iterator[None]:
    """Within it, the kernels launch through ``torch.library.wrap_triton``: traced (by
    ``fp8/inductor.py``'s quantize inlining, on fake tensors) they become Inductor's own
    launches of the same kernels in the compiled graph's code, not a call of the graph op from
    it. The host side of a launch (the op's dispatch and checks, Triton's launcher) then costs
    what Inductor's generated code costs. Inductor compiles a user kernel with floating-point
    contraction allowed, where these launches ask for none: for sm_90 every kernel variant's
    machine code is the same either way (``tests/test_triton_compile.py``), so the bits are."""
    token = _INDUCTOR_LAUNCHES.set(True)
    try:
        yield
    finally:
        _INDUCTOR_LAUNCHES.reset(token)


def launched(kernel):
    """``kernel`` as the quantize functions launch it: itself, or under ``inductor_launches``
    wrapped by ``torch.library.wrap_triton``."""
    if _INDUCTOR_LAUNCHES.get():
        return torch.library.wrap_triton(kernel)
    return kernel


def _interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when this
    module was imported: ``triton.jit`` decides at definition)."""
    return triton is not None and not isinstance(_cast_kernel, triton.runtime.JITFunction)


def interpreter_unsupported() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None: triton before 3.7 (3.6,
    torch 2.11's) turns a loop bound they compute, ``range(a, tl.minimum(b, c))``, into a
    one-element numpy array whose ``__index__`` numpy 2 refuses ("only 0-dimensional arrays can
    be converted to Python scalars"); its compiler on a GPU takes them."""
    if triton is None:
        return "triton is not installed"
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        return (f"triton {triton.__version__}'s interpreter cannot run these kernels' computed "
                "loop bounds under numpy 2 (triton 3.7's can)")
    return None


def available(x: Tensor) -> str | None:
    """None when the kernels can run on ``x``: a CUDA tensor with triton importable, or any
    tensor with triton importable and ``TRITON_INTERPRET=1`` set (Triton's interpreter, on the
    host; the variable must be set before triton and this module are imported). Otherwise why
    not, in a few words."""
    if triton is None:
        return "triton is not installed"
    if x.device.type == "cuda" or _interpreted():
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return (f"{x.device.type} tensor and TRITON_INTERPRET was set after triton_quantize "
                f"was imported")
    return f"{x.device.type} tensor and TRITON_INTERPRET is not set"


def _check(x: Tensor, fp8_dtype: torch.dtype, fp8_max: float) -> None:
    if x.dim() != 3:
        raise ValueError(f"expected (E, N, K) expert weights, got a {x.dim()}-D tensor "
                         f"of shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"expected a bfloat16, float16 or float32 tensor, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {x.stride()} for shape "
                         f"{tuple(x.shape)}")
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be {recipes.E4M3} or {recipes.E5M2}, got {fp8_dtype}")
    top = torch.finfo(fp8_dtype).max
    if not 0.0 < fp8_max <= top:
        raise ValueError(f"fp8_max must be in (0, {top}] for {fp8_dtype}, got {fp8_max}")
    e, n, k = x.shape
    if n * k >= _INT32_LIMIT:
        raise ValueError(f"one expert of (N, K) = ({n}, {k}) has 2**31 elements or more; the "
                         f"kernels index within an expert in int32")
    if e > _MAX_GRID_Z:
        raise ValueError(f"{e} experts: the kernels' launch grid takes at most {_MAX_GRID_Z}")


def _empty_outputs(x: Tensor, fp8_dtype: torch.dtype, rows: bool, cols: bool) -> list[Tensor]:
    """The copies of an empty ``x``: empty data, and scale_inv 1 for every (empty) row or
    column (an empty row's amax is 0, so its scale is 1)."""
    e, n, k = x.shape
    out: list[Tensor] = []
    if rows:
        out += [torch.empty((e, n, k), dtype=fp8_dtype, device=x.device),
                torch.ones((e, n, 1), dtype=torch.float32, device=x.device)]
    if cols:
        out += [torch.empty((e, k, n), dtype=fp8_dtype, device=x.device),
                torch.ones((e, k, 1), dtype=torch.float32, device=x.device)]
    return out


def _cast_mode(x: Tensor, cfg: KernelConfig) -> str:
    if _interpreted() or x.device.type != "cuda" or \
            torch.cuda.get_device_capability(x.device) < (8, 9):
        if cfg.cast not in (None, "soft"):
            raise ValueError(f"cast={cfg.cast!r} needs an sm_89+ GPU and the compiled kernels")
        return "soft"
    return cfg.cast or "ptx"


def _launch_options() -> dict:
    # no multiply-add contraction (there is nothing to contract; this keeps it so); Inductor's
    # launches take no such option (see inductor_launches)
    return {} if _interpreted() or _INDUCTOR_LAUNCHES.get() else {"enable_fp_fusion": False}


def _amax_pass(xs: Tensor, rows: bool, cols: bool, cfg: KernelConfig
               ) -> tuple[Tensor | None, Tensor | None]:
    """The row and/or column amaxes of (E, N, K) ``xs`` (``x``, or bf16 ``x`` as int16), as
    int32 tensors holding the fp32 bits (E, N) and (E, K)."""
    e, n, k = xs.shape
    i32 = dict(dtype=torch.int32, device=xs.device)
    row_amax = torch.zeros((e, n), **i32) if rows else None
    col_amax = torch.zeros((e, k), **i32) if cols else None
    bn, bk = cfg.amax_block
    launched(_amax_kernel)[(triton.cdiv(k, bk), triton.cdiv(n, cfg.amax_n_chunk), e)](
        xs, row_amax, col_amax, n, k, cfg.amax_n_chunk, ROWS=rows, COLS=cols,
        BF16_BITS=xs.dtype == torch.int16, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg.amax_stages,
        num_warps=cfg.amax_warps,
        **_launch_options())
    return row_amax, col_amax


def _cast_pass(xs: Tensor, row_amax: Tensor | None, col_amax: Tensor | None, out: list[Tensor],
               *, fp8_max: float, power_2_scales: bool, amax_epsilon: float, e5m2: bool,
               cast: str, cfg: KernelConfig) -> None:
    """Writes ``out`` (the copies of ``_outputs``) from ``xs`` and its amaxes."""
    e, n, k = xs.shape
    rows, cols = row_amax is not None, col_amax is not None
    q, s = (out[0].view(torch.uint8), out[1]) if rows else (None, None)
    qt, st = (out[-2].view(torch.uint8), out[-1]) if cols else (None, None)
    bn, bk = cfg.cast_block
    launched(_cast_kernel)[(triton.cdiv(k, cfg.cast_k_chunk), triton.cdiv(n, bn), e)](
        xs, row_amax, col_amax, q, s, qt, st, n, k, cfg.cast_k_chunk, float(fp8_max),
        float(amax_epsilon),
        ROWS=rows, COLS=cols, POW2=bool(power_2_scales), E5M2=e5m2, CAST=cast,
        BF16_BITS=xs.dtype == torch.int16, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg.cast_stages,
        num_warps=cfg.cast_warps,
        **_launch_options())


def _outputs(x: Tensor, fp8_dtype: torch.dtype, rows: bool, cols: bool) -> list[Tensor]:
    e, n, k = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    out: list[Tensor] = []
    if rows:
        out += [torch.empty((e, n, k), dtype=fp8_dtype, device=x.device),
                torch.empty((e, n, 1), **f32)]
    if cols:
        out += [torch.empty((e, k, n), dtype=fp8_dtype, device=x.device),
                torch.empty((e, k, 1), **f32)]
    return out


def quantize_experts_rowwise(
    x: Tensor,
    *,
    fp8_dtype: torch.dtype,
    fp8_max: float,
    power_2_scales: bool,
    amax_epsilon: float,
    rows: bool,
    cols: bool,
    config: KernelConfig | None = None,
) -> list[Tensor]:
    """Rowwise FP8 copies of contiguous (E, N, K) expert weights ``x`` (bf16, fp16 or fp32):
    ``[data (E, N, K), scale_inv (E, N, 1)]`` if ``rows``, then ``[data (E, K, N), scale_inv
    (E, K, 1)]`` if ``cols``; data in ``fp8_dtype`` (E4M3 or E5M2), scale_inv fp32, all
    contiguous. Bit-identical to ``ops.experts_rowwise_torch`` for the recipe with these
    parameters (see the module docstring for how each step matches). ``available(x)`` says
    whether it can run on ``x``; ValueError for a tensor it does not take."""
    _check(x, fp8_dtype, fp8_max)
    reason = available(x)
    if reason is not None:
        raise RuntimeError(f"the Triton quantize kernels cannot run: {reason}")
    if not (rows or cols):
        return []
    if x.numel() == 0:
        return _empty_outputs(x, fp8_dtype, rows, cols)
    cfg = config or DEFAULT_CONFIG
    # Triton launches on the current CUDA device: make it x's (Inductor's code does, traced)
    with torch.cuda.device(x.device) if x.is_cuda and not _INDUCTOR_LAUNCHES.get() \
            else contextlib.nullcontext():
        return _quantize(x, fp8_dtype=fp8_dtype, fp8_max=fp8_max, power_2_scales=power_2_scales,
                         amax_epsilon=amax_epsilon, rows=rows, cols=cols, cfg=cfg)


def _quantize(x: Tensor, *, fp8_dtype: torch.dtype, fp8_max: float, power_2_scales: bool,
              amax_epsilon: float, rows: bool, cols: bool, cfg: KernelConfig) -> list[Tensor]:
    """The copies of non-empty ``x``: the rowwise-only kernel or the two passes."""
    cast = _cast_mode(x, cfg)
    xs = x.view(torch.int16) if x.dtype == torch.bfloat16 else x  # see _load_f32
    out = _outputs(x, fp8_dtype, rows, cols)
    e5m2 = fp8_dtype == recipes.E5M2
    if rows and not cols and cfg.fuse_rows:
        e, n, k = x.shape
        bn, bk = cfg.rows_block
        launched(_rows_kernel)[(triton.cdiv(n, bn), e)](
            xs, out[0].view(torch.uint8), out[1], n, k, float(fp8_max), float(amax_epsilon),
            POW2=bool(power_2_scales), E5M2=e5m2, CAST=cast, BF16_BITS=xs.dtype == torch.int16,
            BLOCK_N=bn, BLOCK_K=bk, REVERSE=cfg.rows_reverse, STAGES=cfg.rows_stages,
            num_warps=cfg.rows_warps, **_launch_options())
        return out
    row_amax, col_amax = _amax_pass(xs, rows, cols, cfg)
    _cast_pass(xs, row_amax, col_amax, out, fp8_max=fp8_max, power_2_scales=power_2_scales,
               amax_epsilon=amax_epsilon, e5m2=e5m2, cast=cast, cfg=cfg)
    return out


_USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


def quantize_experts_rowwise_for(x: Tensor, recipe: recipes.Recipe | str, role: str,
                                 usage: str, *, config: KernelConfig | None = None
                                 ) -> list[Tensor]:
    """``quantize_experts_rowwise`` with the fp8 dtype, fp8 max, power-of-2 setting and amax
    epsilon that ``recipe`` gives ``role``: a drop-in for ``ops.experts_rowwise_torch(x,
    recipe, role, usage)`` (usage ``"rowwise"``, ``"columnwise"`` or ``"both"``). Any recipe's
    parameters are taken, as the torch function takes them; the rowwise recipes
    (``"rowwise"``, ``"rowwise_pow2"``) are the ones whose GEMMs read these scales."""
    if usage not in _USAGES:
        raise ValueError(f"unknown quantize usage {usage!r}; valid usages are {tuple(_USAGES)}")
    r = recipes.as_recipe(recipe)
    dtype = recipes.fp8_dtype(r, role)
    rows, cols = _USAGES[usage]
    return quantize_experts_rowwise(x, fp8_dtype=dtype, fp8_max=recipes.fp8_max(dtype),
                                    power_2_scales=r.power_2_scales,
                                    amax_epsilon=r.amax_epsilon, rows=rows, cols=cols,
                                    config=config)
