"""On a GPU, Inductor's code runs graphpass's FP8 ops itself: the Triton quantize kernels as its
user kernels, torch's FP8 GEMMs as its extern calls.

The expert weights' and the token groups' rowwise quantizes run graphpass's Triton kernels
(``fp8/triton_quantize.py``, ``fp8/triton_grouped.py``). Left as the graph op, every call costs
the op's dispatch, its checks and Triton's launcher on the host: on an H200 the 8,192-token
experts step took 7.60 ms for 5.54 ms of kernels, graphpass's ops about 4.7 to 6.7 ms of host
time a step under the profiler. ``fp8/inductor.py``'s quantize inlining traces the op's code with
each launch a ``torch.library.wrap_triton`` one, so Inductor compiles the kernels as its own
user kernels and its wrapper launches them, the outputs allocated and written in place. The FP8
GEMMs of ``kernels="scaled_mm"`` are inlined the same way, as the op's code: ``torch._scaled_mm``
and ``torch._scaled_grouped_mm`` become Inductor's extern calls, each operand held to the
graph's stride order (a TN-only FP8 GEMM's); a GEMM whose code reads the offsets on the host
stays the op.

Checked here without a GPU (a CUDA build of torch and triton: torch 2.11's and 2.15's wheels):
a graph of quantizes on fake CUDA tensors compiled by Inductor for an sm_90 device, with
``benchmarks/cuda_peak.py``'s patches (no CUDA call, no kernel run; Triton's frontend targets
sm_90, so torch's analysis of what each kernel writes runs as on the GPU machine).
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import graphpass  # noqa: E402
from graphpass.fp8 import ops, providers, recipes  # noqa: E402
from graphpass.fp8 import triton_quantize as tq  # noqa: E402

pytestmark = pytest.mark.skipif(torch.version.cuda is None,
                                reason="Inductor's CUDA code needs a CUDA build of torch")


def _fake_outputs(x, recipe, role, usage, offs=None):
    """The op's outputs as empty tensors on x's device: its fake implementation indexes the
    tensor (``x[0]``, ``amax[..., None]``), which asks the CUDA driver for a fake CUDA tensor's
    device, and this machine has none (a GPU machine's tracing runs the op's own)."""
    if x.dim() == 2 and offs is None:
        return ops._quantize_fake(x, recipe, role, usage)
    dtype = recipes.fp8_dtype(recipes.as_recipe(recipe), role)
    out = []
    for columnwise in ops._COLUMNWISE[usage]:
        if offs is not None:
            t, k = x.shape
            groups = offs.shape[0]
            out += ([x.new_empty((k, providers.aligned_tokens(t, groups)), dtype=dtype),
                     x.new_empty((groups, k), dtype=torch.float32)] if columnwise else
                    [x.new_empty((t, k), dtype=dtype), x.new_empty((t, 1), dtype=torch.float32)])
        else:
            e, n, k = x.shape
            rows, cols = (k, n) if columnwise else (n, k)
            out += [x.new_empty((e, rows, cols), dtype=dtype),
                    x.new_empty((e, rows, 1), dtype=torch.float32)]
    return out


@contextlib.contextmanager
def _sm90():
    import cuda_peak

    with contextlib.ExitStack() as stack:
        for patch in cuda_peak._sm90_patches(cuda_peak._Allocations()):
            stack.enter_context(patch)
        stack.enter_context(mock.patch.object(tq, "_interpreted", lambda: False))
        stack.enter_context(mock.patch.object(ops.quantize, "_abstract_fn", _fake_outputs))
        stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False,
                                                         compile_threads=1))
        yield


def _compiled_source(fn, shapes, fuse_quantize=True) -> str:
    """Inductor's wrapper code for ``fn`` on fake CUDA tensors of ``shapes`` ((shape, dtype))."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with _sm90():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes]
            gm = make_fx(fn, select_decomp_table(), tracing_mode="real")(*args)
        backend = graphpass.backend(fp8="rowwise", kernels="scaled_mm",
                                    fuse_quantize=fuse_quantize)
        patches = {k: v for k, v in backend._inductor_patches(args).items()
                   if k != "custom_partitioner_fn"}
        with torch._inductor.config.patch(patches):
            return compile_fx_inner(gm, args).source_code


def _call(source: str) -> str:
    return source[source.index("def call("):]


# usage: graphpass's kernels in launch order, and the amax buffers Inductor zero-fills first
# (the rows' and the columns' for both copies, the columns' for the columnwise copy)
LAUNCHES = [("both", ("_amax_kernel", "_cast_kernel"), 2),
            ("columnwise", ("_amax_kernel", "_cast_kernel"), 1),
            ("rowwise", ("_rows_kernel",), 0)]


def _assert_launches(call: str, kernels: tuple[str, ...], fills: int) -> None:
    """The wrapper runs ``kernels`` and ``fills`` zero fills, nothing else: no call of the op, no
    copy of a buffer a kernel writes (the outputs allocated once and written in place)."""
    assert "graphpass.quantize" not in call, call
    launched = re.findall(r"(\w+)\.run\(", call)
    ours = [re.sub(r"_\d+$", "", k) for k in launched if not re.search(r"_zeros_\d+$", k)]
    assert ours == list(kernels), call
    assert len(launched) - len(ours) == fills, call
    # torch 2.15 guards a user kernel's inputs with copy_if_misaligned (a copy only for a
    # pointer off 16 bytes, which the allocator never gives)
    assert not re.search(r"clone\(|copy_|extern_kernels",
                         call.replace("copy_if_misaligned(", "")), call


def _tokens(usage):
    return lambda x, offs: torch.ops.graphpass.quantize(x, "rowwise", "grad", usage, offs)


def _weights(usage):
    return lambda w: torch.ops.graphpass.quantize(w, "rowwise", "weight", usage)


TOKENS = [((256, 128), torch.bfloat16), ((4,), torch.int32)]
WEIGHTS = [((4, 64, 128), torch.bfloat16)]


@pytest.mark.parametrize("usage,kernels,fills", LAUNCHES)
def test_token_group_quantizes_are_inductors_own_launches(usage, kernels, fills):
    _assert_launches(_call(_compiled_source(_tokens(usage), TOKENS)), kernels, fills)


@pytest.mark.parametrize("usage,kernels,fills", LAUNCHES)
def test_expert_weight_quantizes_are_inductors_own_launches(usage, kernels, fills):
    _assert_launches(_call(_compiled_source(_weights(usage), WEIGHTS)), kernels, fills)


def test_float_arguments_are_fp32_inside_the_kernels():
    """Inductor passes a Python float to a user kernel as fp64, Triton's launcher as fp32: the
    kernels take FP8_MAX and EPS to fp32 first, so the scales round as in the op."""
    source = _compiled_source(_tokens("both"), TOKENS)
    assert re.search(r"'FP8_MAX': 'fp(32|64)'", source)  # torch 2.11 and 2.15: fp64
    for kernel in (tq._cast_kernel, tq._rows_kernel, __import__(
            "graphpass.fp8.triton_grouped", fromlist=["_cast_kernel"])._cast_kernel):
        assert "FP8_MAX, EPS = _as_f32(FP8_MAX), _as_f32(EPS)" in kernel.src


def test_opaque_quantizes_stay_the_op():
    """``fuse_quantize=False`` keeps every quantize one op, these included."""
    call = _call(_compiled_source(_tokens("both"), TOKENS, fuse_quantize=False))
    assert "graphpass.quantize" in call
    assert not re.findall(r"(_\w+_kernel)_\d+\.run\(", call)


# --- the FP8 GEMMs ----------------------------------------------------------------------------

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
_GEMM = torch.ops.graphpass.fp8_gemm


def _extern_calls(call: str) -> list[str]:
    return re.findall(r"extern_kernels\.(\w+)|torch\.ops\.graphpass\.(\w+)", call)


def test_a_dense_gemm_is_inductors_extern_call():
    call = _call(_compiled_source(
        lambda a, sa, b, sb: [_GEMM(a, sa, b, sb, "tensorwise", "input,weight", torch.bfloat16,
                                    None, "scaled_mm")],
        [((256, 128), E4), ((), torch.float32), ((64, 128), E4), ((), torch.float32)]))
    assert _extern_calls(call) == [("_scaled_mm", "")], call
    # b is passed transposed as it is (TN), nothing copied
    assert "reinterpret_tensor(b_1, (128, 64), (1, 128), 0)" in call, call


def test_a_token_grouped_gemm_is_inductors_extern_call():
    call = _call(_compiled_source(
        lambda a, sa, b, sb, offs: [_GEMM(a, sa, b, sb, "rowwise", "input,weight",
                                          torch.bfloat16, None, "scaled_mm", offs)],
        [((256, 128), E4), ((256, 1), torch.float32), ((4, 64, 128), E4),
         ((4, 64, 1), torch.float32), ((4,), torch.int32)]))
    assert _extern_calls(call) == [("_scaled_grouped_mm", "")], call


def test_a_gemm_whose_operand_is_computed_keeps_the_k_major_layout():
    """An operand computed from a transposed tensor is written K-major (row-major) for the
    TN-only GEMM: the inlined GEMM holds its operands to the graph's stride order
    (``prims.inductor_force_stride_order``), as the op's fixed stride order did."""
    def step(x, b, sa, sb):
        a = torch.ops.aten.clone.default((x.t() * 2).to(E4), memory_format=torch.contiguous_format)
        return [_GEMM(a, sa, b, sb, "tensorwise", "input,weight", torch.bfloat16, None,
                      "scaled_mm")]

    call = _call(_compiled_source(step, [((128, 256), torch.bfloat16), ((64, 128), E4),
                                         ((), torch.float32), ((), torch.float32)]))
    assert _extern_calls(call) == [("_scaled_mm", "")], call
    operand = re.search(r"extern_kernels\._scaled_mm\((\w+),", call).group(1)
    assert re.search(rf"{operand} = empty_strided_cuda\(\(256, 128\), \(128, 1\)", call), call


@pytest.mark.parametrize("why", ["a GEMM per group", "the reference provider"])
def test_a_gemm_whose_code_does_not_trace_stays_the_op(why):
    """The tensorwise recipe's E5M2 gradients over token groups run one ``_scaled_mm`` per group,
    the group sizes read on the host: no trace, the op stays; so does every GEMM of another
    provider than ``scaled_mm``."""
    if why == "a GEMM per group":
        def fn(a, sa, b, sb, offs):
            return [_GEMM(a, sa, b, sb, "tensorwise", "grad,weight", torch.bfloat16, None,
                          "scaled_mm", offs)]
        shapes = [((256, 64), E5), ((4,), torch.float32), ((4, 128, 64), E4),
                  ((4,), torch.float32), ((4,), torch.int32)]
    else:
        def fn(a, sa, b, sb):
            return [_GEMM(a, sa, b, sb, "tensorwise", "input,weight", torch.bfloat16, None,
                          "reference")]
        shapes = [((256, 128), E4), ((), torch.float32), ((64, 128), E4), ((), torch.float32)]
    # the GEMM per group is graphpass's op in the compiled code: a warning names it; another
    # provider is the user's choice, said in the report, and no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert set(_extern_calls(_call(_compiled_source(fn, shapes)))) == {("", "fp8_gemm")}
    opaque = [str(w.message) for w in caught if w.category is graphpass.OpaqueOpWarning]
    assert len(opaque) == (why == "a GEMM per group"), opaque
    assert all(re.fullmatch(r"graphpass: fp8_gemm\w* \(graphpass\.fp8_gemm\.default\) stays "
                            r"graphpass's op in Inductor's code, its dispatch and checks on the "
                            r"host every step: its code did not trace \(.+\)", m) for m in opaque)


def test_a_launch_torch_cannot_analyse_leaves_the_op():
    """Where torch cannot compile a kernel's Triton IR to see what it writes (no target), it takes
    every argument as written, the quantize's input included, which Inductor's scheduler then
    failed on (``KeyError``, torch 2.11): the trace is refused and the quantize stays the op."""
    from triton.runtime import driver

    def no_target():
        raise RuntimeError("no GPU target")

    with mock.patch.object(type(driver), "active", property(lambda self: mock.MagicMock(
            get_current_target=no_target))), \
            pytest.warns(graphpass.OpaqueOpWarning, match=r"quantize\w* \(graphpass\.quantize"
                         r"\.default\) stays graphpass's op in Inductor's code"):
        call = _call(_compiled_source(_weights("both"), WEIGHTS))
    assert "graphpass.quantize" in call, call


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_a_dense_gemm_with_bias_is_inductors_extern_call(out_dtype):
    """With a bias: fused into ``torch._scaled_mm`` for a bf16 output; added after it for an fp32
    one (``_scaled_mm`` refuses a bf16 bias there), an Inductor kernel after the extern call."""
    call = _call(_compiled_source(
        lambda a, sa, b, sb, bias: [_GEMM(a, sa, b, sb, "tensorwise", "input,weight", out_dtype,
                                          bias, "scaled_mm")],
        [((256, 128), E4), ((), torch.float32), ((64, 128), E4), ((), torch.float32),
         ((64,), torch.bfloat16)]))
    assert _extern_calls(call) == [("_scaled_mm", "")], call
    fused = re.search(r"extern_kernels\._scaled_mm\([^\n]*\bbias_1\b", call) is not None
    assert fused == (out_dtype == torch.bfloat16), call
