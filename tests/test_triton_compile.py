"""graphpass's Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests of test_triton_quantize.py and
test_triton_grouped.py) runs a kernel as Python: it checks the arithmetic but not what Triton's
compiler refuses. On an H200 `_cast_kernel` of triton_grouped.py failed to compile ("Loop-carried
variable amax has initial type <['64'], fp32> but is re-assigned to <['128'], fp32>") while every
interpreter test passed. Here each kernel launch the quantize functions make, for the variants
they launch (rows, columns or both; bf16, fp16 and fp32 inputs; E4M3 and E5M2; power-of-2
scales; the CUDA fp8 cast by PTX), is recorded instead of run and compiled by
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` down to a cubin, with the ptxas Triton's wheel
carries: the same compiler passes as on the GPU machine, without one.
"""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

from graphpass.fp8 import recipes, triton_grouped as tg, triton_quantize as tq  # noqa: E402

_POINTER = {torch.int16: "*i16", torch.int32: "*i32", torch.uint8: "*u8", torch.float32: "*fp32",
            torch.bfloat16: "*bf16", torch.float16: "*fp16"}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the
    launch instead of running it."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _source(fn, args: tuple, kwargs: dict) -> tuple[object, dict]:
    """The ``ASTSource`` of one recorded launch (argument types from the values passed, as
    Triton's launcher derives them) and its compile options (num_warps, enable_fp_fusion)."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constants = {}, {}
    for name, param in zip(names, fn.params):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} = {value!r} of no Triton type")
    return ASTSource(fn, signature, constants), options


def _launches(call) -> list:
    """The kernel launches ``call()`` makes, as on a CUDA tensor of an sm_90 GPU: the
    interpreter off, every kernel recorded rather than run, the fp8 cast by PTX."""
    launches: list = []
    kernels = [(tq, "_amax_kernel"), (tq, "_cast_kernel"), (tq, "_rows_kernel"),
               (tg, "_amax_kernel"), (tg, "_cast_kernel")]
    with mock.patch.object(tq, "_interpreted", lambda: False), \
            mock.patch.object(tq, "available", lambda x: None), \
            mock.patch.object(tg, "available", lambda x: None), \
            mock.patch.object(tq, "_cast_mode", lambda x, cfg: "ptx"):
        patches = [mock.patch.object(m, name, _Recorder(getattr(m, name), launches))
                   for m, name in kernels]
        for p in patches:
            p.start()
        try:
            call()
        finally:
            for p in patches:
                p.stop()
    return launches


def _variants() -> list[tuple[str, object]]:
    """(id, call) for every variant of the weight and token-grouped quantizes."""
    out = []
    offs = torch.tensor([10, 10, 40, 90], dtype=torch.int32)  # an empty group, rows past the end
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fp8, pow2 in ((recipes.E4M3, True), (recipes.E5M2, False)):
            name = f"{str(dtype)[6:]}-{str(fp8)[6:]}-{'pow2' if pow2 else 'exact'}"
            common = dict(fp8_dtype=fp8, fp8_max=torch.finfo(fp8).max, power_2_scales=pow2,
                          amax_epsilon=0.0)
            weights = torch.randn(2, 48, 80, dtype=dtype)
            tokens = torch.randn(100, 80, dtype=dtype)
            for rows, cols in ((True, True), (True, False), (False, True)):
                which = "both" if rows and cols else "rows" if rows else "cols"
                out.append((f"experts-{which}-{name}", lambda w=weights, r=rows, c=cols, kw=common:
                            tq.quantize_experts_rowwise(w, rows=r, cols=c, **kw)))
                out.append((f"groups-{which}-{name}", lambda x=tokens, r=rows, c=cols, kw=common:
                            tg.quantize_groups_rowwise(x, offs, rows=r, cols=c, **kw)))
    # the sweep's pipelining depths (num_stages), both copies of bf16
    common = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False, amax_epsilon=0.0)
    weights, tokens = torch.randn(2, 48, 80, dtype=torch.bfloat16), torch.randn(100, 80,
                                                                               dtype=torch.bfloat16)
    out.append(("experts-rows-reversed", lambda w=weights: tq.quantize_experts_rowwise(
        w, rows=True, cols=False, config=tq.KernelConfig(rows_reverse=True), **common)))
    for stages in (1, 4):
        out.append((f"experts-both-stages{stages}", lambda w=weights, s=stages:
                    tq.quantize_experts_rowwise(w, rows=True, cols=True,
                                                config=tq.KernelConfig(stages=s), **common)))
        out.append((f"groups-both-stages{stages}", lambda x=tokens, s=stages:
                    tg.quantize_groups_rowwise(x, offs, config=tg.GroupedKernelConfig(stages=s),
                                               **common)))
    return out


def _compile_all() -> dict[str, list[str]]:
    """Each distinct launch of every variant compiled for sm_90: {variant id: failures}."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    compiled: dict[str, str | None] = {}  # one compile per distinct source and options
    failures: dict[str, list[str]] = {}
    for vid, call in _variants():
        failures[vid] = []
        for fn, args, kwargs in _launches(call):
            src, options = _source(fn, args, kwargs)
            key = f"{src.hash()}-{sorted(options.items())}"
            if key not in compiled:
                try:
                    kernel = triton.compile(src, target=target, options=options)
                    compiled[key] = None if "cubin" in kernel.asm else "no cubin came out"
                except Exception as e:  # the compiler's refusal, reported per variant
                    compiled[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
            if compiled[key] is not None:
                failures[vid].append(f"{fn.__name__}: {compiled[key]}")
    return failures


@pytest.fixture(scope="module")
def compile_results():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no ASTSource/GPUTarget compile entry: {e}")
    if tq._interpreted():
        pytest.skip("TRITON_INTERPRET=1 replaces triton.jit: the kernels are not compilable")
    start = time.monotonic()
    results = _compile_all()
    print(f"compiled graphpass's Triton kernels for sm_90 in {time.monotonic() - start:.1f} s")
    return results


@pytest.mark.parametrize("variant", [vid for vid, _ in _variants()])
def test_kernels_compile_for_sm90(compile_results, variant):
    assert compile_results[variant] == [], "\n".join(compile_results[variant])


def test_a_kernel_the_compiler_refuses_is_reported(compile_results):
    """The check can fail: a kernel whose loop changes a carried variable's shape is refused."""
    from triton.backends.compiler import GPUTarget
    import triton.language as tl

    @triton.jit
    def bad(x_ptr, N, B: tl.constexpr):
        acc = tl.zeros([B], dtype=tl.float32)
        for i in range(0, N):
            acc = tl.zeros([2 * B], dtype=tl.float32) + tl.load(x_ptr + i)
        tl.store(x_ptr + tl.arange(0, B), tl.sum(acc, axis=0))

    src, options = _source(bad, (torch.empty(4), 4), {"B": 16})
    with pytest.raises(Exception, match="Loop-carried variable"):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _sass(cubin: bytes) -> list[str]:
    """The instructions of a cubin, without their addresses (Triton's wheel's nvdisasm)."""
    import os
    import re
    import subprocess
    import tempfile

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip("this triton wheel carries no nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in out.splitlines()
            if "/*" in line]


def test_machine_code_is_the_same_with_floating_point_contraction(compile_results):
    """Inductor compiles a user kernel with contraction allowed (``enable_fp_fusion`` left on:
    ``triton_quantize.inductor_launches``) where graphpass's own launches turn it off: the bf16
    variants' sm_90 machine code is the same either way, so Inductor's launches give the op's
    bits. (Every variant was checked the same way: 42 launches, identical.)"""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    seen = set()
    for vid, call in _variants():
        if not vid.split("-")[2] == "bfloat16":
            continue
        for fn, args, kwargs in _launches(call):
            src, options = _source(fn, args, kwargs)
            key = (src.hash(), tuple(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            sass = [_sass(triton.compile(src, target=target, options={
                **options, "enable_fp_fusion": fuse}).asm["cubin"]) for fuse in (False, True)]
            assert sass[0] and sass[0] == sass[1], f"{vid} {fn.__name__}"
    assert len(seen) >= 10
