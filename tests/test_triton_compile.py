"""graphpass's Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests of test_triton_quantize.py and
test_triton_grouped.py) runs a kernel as Python: it checks the arithmetic but not what Triton's
compiler refuses. On an H200 `_cast_kernel` of triton_grouped.py failed to compile ("Loop-carried
variable amax has initial type <['64'], fp32> but is re-assigned to <['128'], fp32>") while every
interpreter test passed. Here each kernel launch the quantize functions make, for the variants
they launch (rows, columns or both; bf16, fp16 and fp32 inputs; E4M3 and E5M2; power-of-2
scales; the CUDA fp8 cast by PTX), is recorded instead of run and compiled by
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` down to a cubin, with the ptxas Triton's wheel
carries: the same compiler passes as on the GPU machine, without one (``benchmarks/_sm90.py``,
which ``quantize_kernels.py --resources`` uses too).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from graphpass.fp8 import recipes, triton_grouped as tg, triton_quantize as tq  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _sm90 import compile_launch, launches as _launches  # noqa: E402
from _sm90 import source as _source, tool  # noqa: E402


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
    # the sweep's settings: pipelined loops, the rowwise kernel's reversed second read, a cast
    # block of several runs of aligned columns
    common = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False, amax_epsilon=0.0)
    weights, tokens = torch.randn(2, 48, 80, dtype=torch.bfloat16), torch.randn(100, 80,
                                                                               dtype=torch.bfloat16)
    for stages in (2, 4):
        cfg = tq.KernelConfig(amax_stages=stages, cast_stages=stages, rows_stages=stages)
        for rows, cols in ((True, True), (True, False)):
            out.append((f"experts-{'both' if cols else 'rows'}-stages{stages}",
                        lambda w=weights, r=rows, c=cols, cfg=cfg: tq.quantize_experts_rowwise(
                            w, rows=r, cols=c, config=cfg, **common)))
        out.append((f"groups-both-stages{stages}", lambda x=tokens, s=stages:
                    tg.quantize_groups_rowwise(x, offs, config=tg.GroupedKernelConfig(
                        amax_stages=s, cast_stages=s, cast_block=(64, 128)), **common)))
    out.append(("experts-rows-reversed", lambda w=weights: tq.quantize_experts_rowwise(
        w, rows=True, cols=False, config=tq.KernelConfig(rows_reverse=True), **common)))
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

    nvdisasm = tool("nvdisasm")
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


@pytest.mark.parametrize("family", ["experts", "groups"])
def test_a_pipelining_depth_pipelines_every_loop_over_tiles(compile_results, family):
    """``amax_stages``, ``cast_stages`` and ``rows_stages`` above 1 turn each kernel's loop
    over tiles into asynchronous copies of the next tiles into shared memory (``cp.async``, a
    buffer per stage); at 1 none. Triton's launch option ``num_stages`` alone pipelines none of
    these loops (they hold no GEMM): the kernels' PTX is the same at every value of it."""
    common = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False, amax_epsilon=0.0)
    if family == "experts":
        x = torch.randn(2, 64, 256, dtype=torch.bfloat16)
        calls = {depth: [lambda r=r, c=c, d=depth: tq.quantize_experts_rowwise(
                    x, rows=r, cols=c, config=tq.KernelConfig(
                        amax_stages=d, cast_stages=d, rows_stages=d), **common)
                    for r, c in ((True, True), (True, False))] for depth in (1, 3)}
    else:
        x = torch.randn(256, 256, dtype=torch.bfloat16)
        offs = torch.tensor([64, 64, 200, 240], dtype=torch.int32)
        calls = {depth: [lambda d=depth: tg.quantize_groups_rowwise(
                    x, offs, config=tg.GroupedKernelConfig(amax_stages=d, cast_stages=d),
                    **common)] for depth in (1, 3)}
    seen = {}
    for depth, fns in calls.items():
        for call in fns:
            for fn, args, kwargs in _launches(call):
                ptx = {}
                for num_stages in (1, 3) if depth == 1 else (3,):
                    kernel = compile_launch(fn, args, kwargs, specialise=True,
                                            options={"num_stages": num_stages})
                    ptx[num_stages] = kernel.asm["ptx"].split(".target", 1)[1]
                    shared = kernel.metadata.shared
                if depth == 1:
                    assert ptx[1] == ptx[3], f"{fn.__name__}: num_stages changed the code"
                seen[(fn.__name__, depth)] = ("cp.async" in ptx[3], shared)
    assert {name for name, _ in seen} == ({"_amax_kernel", "_cast_kernel", "_rows_kernel"}
                                          if family == "experts" else
                                          {"_amax_kernel", "_cast_kernel"})
    for (name, depth), (pipelined, shared) in seen.items():
        assert pipelined == (depth > 1), f"{name} at depth {depth}"
        if depth > 1:
            assert shared > seen[(name, 1)][1], f"{name}: no stage buffers at depth {depth}"


def test_the_default_kernels_fit_in_registers_and_say_their_occupancy(compile_results):
    """As launched on sm_90, no default kernel spills registers (ptxas ``-v``), and the programs
    an SM holds and the input bytes they have in flight follow from its registers and shared
    memory (``quantize_kernels.py --resources`` prints them for every sweep configuration):
    the default cast kernel of a weight's both copies holds 4 programs of one (32, 128) bf16
    tile; at 3 stages, 5 programs of two tiles each."""
    import _sm90

    common = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False, amax_epsilon=0.0)
    w = torch.empty(4, 256, 1024, dtype=torch.bfloat16)
    x, offs = torch.empty(512, 1024, dtype=torch.bfloat16), torch.tensor([256, 512],
                                                                        dtype=torch.int32)
    calls = [lambda r=r, c=c: tq.quantize_experts_rowwise(w, rows=r, cols=c, **common)
             for r, c in ((True, True), (True, False), (False, True))]
    calls += [lambda r=r: tg.quantize_groups_rowwise(x, offs, rows=r, cols=True, **common)
              for r in (True, False)]
    for call in calls:
        for fn, args, kwargs in _launches(call):
            r = _sm90.resources(compile_launch(fn, args, kwargs, specialise=True))
            assert r.spill_bytes == 0 and 0 < r.registers <= 255, (fn.__name__, r)
            assert _sm90.programs_per_sm(r) >= 1
    (fn, args, kwargs), = [launch for launch in _launches(calls[0])
                           if launch[0].__name__ == "_cast_kernel"]
    one = _sm90.resources(compile_launch(fn, args, kwargs, specialise=True))
    assert _sm90.in_flight(one, kwargs, 2) == _sm90.programs_per_sm(one) * 32 * 128 * 2
    (fn, args, kwargs), = [launch for launch in _launches(
        lambda: tq.quantize_experts_rowwise(w, rows=True, cols=True, config=tq.KernelConfig(
            cast_stages=3), **common)) if launch[0].__name__ == "_cast_kernel"]
    three = _sm90.resources(compile_launch(fn, args, kwargs, specialise=True))
    assert three.shared >= 2 * 32 * 128 * 2  # two stage buffers of a bf16 tile
    assert _sm90.in_flight(three, kwargs, 2) > _sm90.in_flight(one, kwargs, 2)
