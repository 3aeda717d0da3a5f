"""benchmarks/cuda_peak.py: Inductor's CUDA code for graphpass's partitioned graphs, generated and
run on fake tensors without a GPU (a CUDA build of torch; the CPU wheel skips).

The saved activations after the forward are a count graphpass.plan makes exactly and the GPU
measured equal to it (docs/numbers.md): the CUDA wrapper's allocations must give the same bytes,
for FP8 and for bf16 under torch's own partitioner. The step peak must hold at least the inputs
and those activations, and the backward must free every saved tensor."""

import sys
from pathlib import Path

import pytest
import torch

import graphpass
from _benchmarks import load

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    return load("cuda_peak")


def _planned_activations(options):
    sys.path.insert(0, str(ROOT))
    from graphpass.models import llama

    model, inputs = llama.build("tiny", layers=1, device="meta", dtype=torch.bfloat16)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(**options))
    saved_inputs = sum(r.bytes for r in report.rows if r.op == "input" and r.is_activation)
    return report.activation_bytes - saved_inputs


@pytest.mark.parametrize("options", [
    {"fp8": "tensorwise", "kernels": "scaled_mm", "order_backward": True},
    {"memory": "default", "order_backward": False},
], ids=["fp8", "bf16-default"])
def test_cuda_code_saves_what_the_plan_counts(options):
    tool = _tool()
    why = tool.available()
    if why is not None:
        pytest.skip(why)
    got = tool.cuda_step_peak("llama", "tiny", options)
    planned = _planned_activations(options)
    if options.get("fp8"):
        assert got["activations"] == planned
    else:
        # torch's own partitioner: Inductor's CUDA code holds 768 B more on this layer (428,544
        # against 427,776 B; not stride padding, which this test turned off to check; not yet
        # attributed). At real size the GPU measured the plan's bytes.
        assert planned <= got["activations"] <= planned * 1.01
    # after the forward, the inputs and the activations are all live
    assert got["total"] >= got["inputs"] + got["activations"] > got["inputs"]
    assert got["total"] == got["base"] + got["above"]
    # the backward freed every saved tensor (nothing of this tool's may hold one through it, or
    # the peak counts them all to the end): the step leaves its outputs alone
    assert got["left"] == got["outputs"] > 0


def test_inlined_quantizes_on_cuda_hold_no_bf16_copy_of_their_input():
    """On CUDA a quantize's inlined loops compute its elementwise producer themselves
    (``fp8/inductor._input``): the Llama-3-8B layer's backward then writes no bf16 SwiGLU output
    or gradient (8192 x 14336, 224 MiB each) beside their FP8 copies. Stored inputs give
    1,249.02 MiB above weights, inputs and gradients on torch 2.11; not storing them 1,201.01."""
    tool = _tool()
    why = tool.available()
    if why is not None:
        pytest.skip(why)
    got = tool.cuda_step_peak("llama", "real", {"fp8": "tensorwise", "kernels": "scaled_mm"},
                              live=40)
    assert got["above"] < 1_225 * 2**20, got["above"] / 2**20
    swiglu = [name for _, name, shape, dtype in got["largest"]
              if shape == (8192, 14336) and dtype == "bfloat16"]
    # the forward's two saved GEMM outputs and the down projection's data gradient
    assert len(swiglu) == 3, got["largest"]
    # and the step's kernels move less: 11.18 GB by Inductor's estimate with stored inputs
    moved = sum(gb * n for code in got["sources"].values() for _, gb, n in tool.kernel_bytes(code))
    assert 8 < moved < 10, moved


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_order_backward_puts_the_fp8_llama_step_peak_under_bf16s(recipe):
    """``order_backward`` on CUDA (``fp8/gemm_order.py``): each FP8 GEMM's operand copies made
    after the GEMM before it, the gradients quantized from buffers of their own. The Llama-3-8B
    layer's Inductor CUDA code (torch 2.11) then holds 913.02 (tensorwise), 913.17 (rowwise) and
    915.02 MiB (blockwise, cuBLASLt's GEMMs as ops) above weights, inputs and gradients, against
    1,201.01, 1,169.43 and 1,204.04 MiB without it and bf16's 1,009.05
    (``test_the_backward_writes_into_donated_saved_tensors``; torch 2.15's blockwise code: 979.04
    against 1,197.04 MiB); the saved
    activations are the same, and the kernels move more bytes (11.68 against 9.72 GB,
    tensorwise: the gradients written and read once more, the SwiGLU backward's inputs read
    once per copy)."""
    tool = _tool()
    why = tool.available()
    if why is not None:
        pytest.skip(why)
    options = {"fp8": recipe, "kernels": "auto" if recipe == "blockwise" else "scaled_mm"}
    off = tool.cuda_step_peak("llama", "real", options)
    on = tool.cuda_step_peak("llama", "real", {**options, "order_backward": True},
                             predict=recipe != "rowwise")
    assert on["activations"] == off["activations"]
    assert on["above"] < 0.85 * off["above"], (on["above"] / 2**20, off["above"] / 2**20)
    assert on["above"] < 1_058_062_336, on["above"] / 2**20  # bf16's, measured on an H200
    if on["predicted"] is not None:
        # the step-peak model runs the quantizes in the same order (gemm_order.planned_order):
        # 2,064,769,024 against the code's 1,964,048,896 B, tensorwise (1.247 of it without
        # the order), and 1,966,145,536 B, blockwise
        assert abs(on["predicted"].bytes / on["total"] - 1) < 0.06, (on["predicted"].bytes,
                                                                      on["total"])


def test_the_backward_writes_into_donated_saved_tensors():
    """torch.compile donates the saved tensors to the backward (AOTAutograd's
    ``bw_donated_idxs``), and Inductor writes a kernel's output into one where it dies. On the
    Llama-3-8B layer in bf16 the SwiGLU backward's second (8192, 14336) output goes into a saved
    GEMM output: the step peak is then the H200's measured 1009.05 MiB above weights, inputs and
    gradients (1,058,062,336 B; without the donation the fake run allocated a fifth such tensor:
    1,233.05 MiB)."""
    tool = _tool()
    why = tool.available()
    if why is not None:
        pytest.skip(why)
    got = tool.cuda_step_peak("llama", "real", {"memory": "default"})
    assert got["above"] == 1_058_062_336, got["above"] / 2**20


def test_kernel_bytes_counts_the_step_launches_only():
    """Each kernel's source embeds a benchmark harness that launches it, and so does the end of
    the module: only the step's own launches count."""
    tool = _tool()
    meta = ("inductor_meta={{'grid_type': 'Grid1D', 'kernel_name': '{0}', 'mutated_arg_names': "
            "[], 'kernel_num_gb': {1}}}")
    source = "\n".join([
        "triton_poi_a = async_compile.triton('triton_poi_a', '''",
        meta.format("triton_poi_a", 0.5),
        "def get_args():", "    return ()", "    triton_poi_a.run(*args, stream=stream0)", "''')",
        "triton_red_b = async_compile.triton('triton_red_b', '''",
        meta.format("triton_red_b", 0.25), "''')",
        "class Runner:", "    def call(self, args):",
        "        triton_poi_a.run(buf0, buf1, 16, stream=stream0)",
        "        buf2 = extern_kernels.mm(buf1, w)",
        "        triton_red_b.run(buf2, buf3, 16, stream=stream0)",
        "        buf4 = torch.ops.graphpass.fp8_gemm.default(buf3, s, w8, t, 'tensorwise')",
        "        triton_poi_a.run(buf4, buf5, 16, stream=stream0)",
        "def get_args():", "    triton_poi_a.run(*args)", "    triton_red_b.run(*args)",
    ])
    assert sorted(tool.kernel_bytes(source)) == [("triton_poi_a", 0.5, 2),
                                                 ("triton_red_b", 0.25, 1)]
    assert tool.extern_calls(source) == {"extern_kernels.mm": 1, "torch.ops.graphpass.fp8_gemm": 1}


@pytest.mark.parametrize("model, options", [
    ("llama", {"fp8": "tensorwise", "kernels": "scaled_mm"}),
    ("deepseek", {}),
], ids=["llama-fp8", "deepseek-bf16"])
def test_the_step_peak_model_on_cuda_graphs_follows_inductors_cuda_code(model, options):
    """graphpass's step-peak model on the partitioned graphs with their tensors on ``cuda`` (what
    the backend reports on a GPU) against the peak of Inductor's CUDA code for the same graphs:
    within 1% on the tiny examples (measured: 2,509,832 against 2,494,464 B and 3,186,688
    against 3,187,712 B; the FP8 GEMMs inlined as extern calls, whose outputs Inductor may
    place in a freed buffer, took 16 KiB off the tiny Llama's code, 2,510,848 B before). At
    real size the DeepSeek-V3 layer's are equal to the byte, the H200's measurement
    (docs/numbers.md)."""
    tool = _tool()
    why = tool.available()
    if why is not None:
        pytest.skip(why)
    got = tool.cuda_step_peak(model, "tiny", options, predict=True)
    assert got["predicted"].device == "cuda"
    assert abs(got["predicted"].bytes / got["total"] - 1) < 0.01, (got["predicted"].bytes,
                                                                     got["total"])
