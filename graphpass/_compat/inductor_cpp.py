"""Guards of Inductor's C++ (CPU) code generation against its known miscompiles: the loop split
(``guard_cpp_loop_split``) and the compiler's bf16 tile transpose (``guard_cpp_bf16_transpose``).
Each wraps a function of torch's in place, for every compile of the process once installed, and
says in its docstring which versions and compilers need it."""

from __future__ import annotations

import functools
from typing import Any

import torch


def guard_cpp_loop_split() -> None:
    """Keep Inductor's C++ (CPU) loop split off the fused groups it mishandles; idempotent.

    ``CppScheduling.try_loop_split`` (torch 2.11-2.13 at least) splits a loop ``i`` indexed as
    ``i // d`` into ``d * i0 + i1`` to avoid a division in the inner loop. It does not check that
    ``d`` divides the loop's size: for a size that is no multiple of ``d`` the split loop runs
    ``d * (size // d)`` times and the tail is never written (seen as wrong FP8 bytes of a 1x128
    quantize of a (2, 200, 136) stack, K = 136). And it checks that the fused nodes have as many
    loop dimensions as each other, not the same sizes: two nodes of shapes (512, 128) and
    (128, 512), a quantize's rowwise and columnwise copies fused into one kernel, end in
    ``AssertionError: ({y0: 512, y1: 1, y2: 128}, {y0: 128, y1: 4, y2: 128})`` (torch 2.13;
    2.11 has no assertion there). The guard leaves such groups unsplit, as torch itself does
    for any group it cannot split; every other group is split as torch splits it. It wraps the
    method on torch's class, so it holds for every compile in the process once installed (by
    ``fp8.inductor.post_grad_pass``): only the groups above compile differently.
    """
    try:
        from torch._inductor.codegen import cpp
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    scheduling = getattr(cpp, "CppScheduling", None)
    split = getattr(scheduling, "try_loop_split", None)
    if split is None or getattr(split, "graphpass_guard", False):
        return

    def try_loop_split(self: Any, nodes: Any) -> Any:
        return nodes if _loop_split_unsafe(nodes) else split(self, nodes)

    try_loop_split.graphpass_guard = True  # type: ignore[attr-defined]
    scheduling.try_loop_split = try_loop_split


def _loop_split_unsafe(nodes: Any) -> bool:
    """Whether the fused ``nodes`` have loops of different sizes, or a loop ``i`` indexed as
    ``i // d`` whose size ``d`` may not divide (``guard_cpp_loop_split``)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    sizes = set()
    for node in nodes:
        buffer = getattr(node, "node", None)
        if not hasattr(buffer, "get_default_sizes_body"):
            return False  # not a group torch splits (it asserts ComputedBuffers): its decision
        (index_size, _), body, _ = buffer.get_default_sizes_body()
        sizes.add(tuple(index_size))
        for expr in body.indexing_exprs.values():
            if not isinstance(expr, sympy.Expr):
                continue
            for div in expr.find(FloorDiv):
                var, divisor = div.args
                size = body.var_ranges.get(var)  # None: the dividend is no loop variable
                if size is None:
                    continue
                divides = (isinstance(divisor, sympy.Integer)
                           and isinstance(size, (int, sympy.Integer))
                           and int(size) % int(divisor) == 0)
                if not divides:
                    return True
    return len(sizes) > 1


def guard_cpp_bf16_transpose() -> None:
    """Compile Inductor's C++ (CPU) code with ``-fno-dse`` where the compiler otherwise gets its
    512-bit bf16 tile transpose wrong (``_cpp_bf16_tile_transpose_miscompiled``); idempotent.

    A columnwise copy is a transposed load: on an AVX-512 CPU Inductor's C++ code reads a bf16
    input in 32x32 tiles, each through ``transpose_mxn<at::BFloat16, 32, 32>`` into a stack
    buffer (ATen's ``vec512_bfloat16.h``, torch 2.11 and 2.13 alike). GCC 12.2 (Debian 12's g++)
    at Inductor's -O3 gives wrong code for a kernel that calls it twice, two columnwise copies
    fused into one kernel (the wgrad operands of ``o_proj`` in the tiny Llama's backward): it
    clones the function for the constant sizes (ipa-cp), turns the loop that stores the
    transposed rows into ``memcpy(dst, d, 2048)`` from the local ``__m512i d[32]`` and expands it
    inline as ``rep movsq``; its RTL dead-store elimination then deletes the stores of ``d[1..30]``
    that the copy reads. The tile is stack garbage, NaN FP8 bytes among it (tens of thousands of
    NaNs in o_proj's weight gradient, a different count each run). Plain ``torch.compile`` of
    ``a.t().contiguous(), b.t().contiguous()`` on two bf16 (128, 256) tensors is wrong the same
    way; a kernel with one transpose inlines it and is right, and so is an AVX2 CPU (16x16 tiles,
    another code path). ``-fno-dse`` keeps those stores (as do -fno-ipa-cp-clone,
    -fno-tree-loop-distribute-patterns or -O2); it changes no arithmetic, so every kernel keeps
    its bits, and the fused quantizes stay fused at full vector width. Inductor has no setting
    for the compiler's flags: the guard wraps ``cpp_builder._get_optimization_cflags``, which
    every C++ build's command line (part of each kernel's cache key) takes its -O flags from,
    so it holds for every compile in the process once installed (by the backend, where it
    inlines quantizes). Where the probe passes (no AVX-512, a 256-bit ``simdlen``, a compiler
    that gets it right) nothing is installed and nothing changes."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    cflags = getattr(cpp_builder, "_get_optimization_cflags", None)
    if cflags is None or getattr(cflags, "graphpass_guard", False):
        return
    if not _cpp_bf16_tile_transpose_miscompiled():
        return
    is_gcc = getattr(cpp_builder, "_is_gcc", lambda compiler: True)

    def optimization_cflags(cpp_compiler: str, *args: Any, **kwargs: Any) -> Any:
        flags, ldflags = cflags(cpp_compiler, *args, **kwargs)
        if is_gcc(cpp_compiler) and "fno-dse" not in flags:
            flags = [*flags, "fno-dse"]
        return flags, ldflags

    optimization_cflags.graphpass_guard = True  # type: ignore[attr-defined]
    cpp_builder._get_optimization_cflags = optimization_cflags


_TRANSPOSE_PROBE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const at::BFloat16* in_ptr0, const at::BFloat16* in_ptr1,
                       at::BFloat16* out_ptr0, at::BFloat16* out_ptr1)
{
    #pragma omp parallel
    {
        #pragma omp for
        for (int64_t x0 = 0; x0 < 64; x0 += 32)
            for (int64_t x1 = 0; x1 < 64; x1 += 32)
            {
                alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp0[32*32];
                transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr0 + x0 + 64L*x1, 64L, tmp0, 32L);
                for (long x0_inner = 0; x0_inner < 32; x0_inner++)
                {
                    auto tmp1 = at::vec::Vectorized<at::BFloat16>::loadu(tmp0 + 32L*x0_inner, 32);
                    tmp1.store(out_ptr0 + x1 + 64L*x0 + 64L*x0_inner, 32);
                }
            }
        #pragma omp for
        for (int64_t x0 = 0; x0 < 64; x0 += 32)
            for (int64_t x1 = 0; x1 < 64; x1 += 32)
            {
                alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp0[32*32];
                transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr1 + x0 + 64L*x1, 64L, tmp0, 32L);
                for (long x0_inner = 0; x0_inner < 32; x0_inner++)
                {
                    auto tmp1 = at::vec::Vectorized<at::BFloat16>::loadu(tmp0 + 32L*x0_inner, 32);
                    tmp1.store(out_ptr1 + x1 + 64L*x0 + 64L*x0_inner, 32);
                }
            }
    }
}
"""


def _cpp_bf16_tile_transpose_miscompiled() -> bool:
    """Whether Inductor's C++ toolchain here, at the vector width it picks now, miscompiles its
    32x32 bf16 tile transpose (``guard_cpp_bf16_transpose``): only with 512-bit vectors, found
    by compiling and running the kernel Inductor writes for two transposed bf16 copies (its own
    compiler, flags and code cache: about 1 s of g++ once per machine, a load afterwards)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
    except Exception:  # pragma: no cover - no C++ vector ISA: no 32x32 tiles
        return False
    if not isa or isa.bit_width() != 512:
        return False
    return _transpose_probe_fails(str(isa))


@functools.lru_cache(maxsize=None)
def _transpose_probe_fails(isa: str) -> bool:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    try:
        kernel = CppPythonBindingsCodeCache.load_pybinding(
            ["const at::BFloat16*"] * 2 + ["at::BFloat16*"] * 2, _TRANSPOSE_PROBE)
    except Exception:  # pragma: no cover - no compiler: Inductor's CPU code fails on its own
        return False
    a = torch.arange(64 * 64, dtype=torch.float32).view(64, 64).to(torch.bfloat16)
    b = -a
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    kernel(a, b, out_a, out_b)
    return not (torch.equal(out_a, a.t()) and torch.equal(out_b, b.t()))
