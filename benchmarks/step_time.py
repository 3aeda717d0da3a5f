"""Time one training step (forward + backward) of an example layer compiled by graphpass: bf16
against FP8 per recipe and kernel provider.

    python benchmarks/step_time.py                       # every model, recipe and provider
    python benchmarks/step_time.py --models llama --recipes tensorwise --kernels scaled_mm te
    python benchmarks/step_time.py --models experts    # token-grouped expert GEMMs alone
    python benchmarks/step_time.py --models llama --recipes tensorwise --fp8-cache act_input all

On CUDA it runs the real-size layer in bf16 under Inductor and reports the median of CUDA-event
timings and the peak memory allocated. Without CUDA it runs the tiny size on CPU with
codegen="eager" (Inductor's C++ compile of every config would take minutes on 2 cores), only to
keep the script working: those timings say nothing about FP8 on a GPU.

Every run starts with torch.compile's default (bf16 under Inductor, torch's partitioner: the
``vs bf16`` baseline) and graphpass bf16, and ends with torchao's float8 training under
torch.compile's default (where torchao imports), so FP8 rows compare with both in the same run.
Under Inductor, each tensorwise row has an "opaque q" twin with ``fuse_quantize=False`` (every
quantize one extern op instead of inlined and fused) and a "precise acc" twin with
``fp8_accumulate="precise"`` (no fast accumulation in the forward GEMM), so the table shows what
the fusion and the accumulation mode buy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphpass from a checkout
import graphpass  # noqa: E402
from graphpass.fp8 import providers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import WARMUP, Result, cuda_graphs, measure, reason  # noqa: E402
from memory import CACHE_LEVELS  # noqa: E402

RECIPES = ("tensorwise", "blockwise", "mxfp8")
KERNELS = ("reference", "scaled_mm", "te")


def backend_for(options: dict[str, object] | None, model: torch.nn.Module, codegen: str) -> Any:
    """The ``torch.compile`` backend of a config: torch.compile's default (Inductor, or aot_eager
    where ``codegen`` is eager) for None and for ``{"torchao": True}``, which first converts
    ``model``'s linears to torchao's float8 training (ImportError without torchao), else
    ``graphpass.backend`` of the options (ValueError for options Config refuses)."""
    if options is None or options.get("torchao"):
        if options:
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model)
        return "inductor" if codegen == "inductor" else "aot_eager"
    return graphpass.backend(codegen=codegen, **options)


def run_config(model_name: str, label: str, options: dict[str, object] | None, size: str,
               codegen: str, device: torch.device, steps: int, *, layers: int = 1,
               warmup: int = WARMUP) -> Result:
    """One config's step: ``options`` are graphpass's, or None for torch.compile's default
    (Inductor with torch's own partitioner, no graphpass), or ``{"torchao": True}`` for torchao
    float8 training under torch.compile's default; ``CUDAGRAPHS: True`` among them (or alone,
    for torch.compile's default) compiles and runs under Inductor's CUDA graphs
    (``triton.cudagraphs``; nothing under aot_eager)."""
    result = Result(model_name, label)
    options, graphs = cuda_graphs(options)
    # A fresh model per config: the peak then counts this config's weights, grads and step only.
    torch._dynamo.reset()
    build = importlib.import_module(
        "_experts" if model_name == "experts" else f"graphpass.models.{model_name}").build
    model, inputs = build(size, layers=layers, device=device, dtype=torch.bfloat16)
    try:
        backend = backend_for(options, model, codegen)
    except ImportError as e:
        result.note = f"skipped: torchao not importable ({e})"
        return result
    except ValueError as e:  # Config validation refuses e.g. scaled_mm with blockwise
        result.note = f"skipped: {reason(e)}"
        return result
    compiled = torch.compile(model, backend=backend)
    with graphs:
        return measure(result, model, inputs, compiled, device, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # experts: 16 routed experts of DeepSeek-V3's shapes over 8k tokens, torch._grouped_mm with
    # offsets (benchmarks/_experts.py)
    parser.add_argument("--models", nargs="+", default=["llama", "deepseek", "experts"],
                        choices=["llama", "deepseek", "experts"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    # te is tried by default only where it imports; naming it explicitly reports why it cannot run.
    parser.add_argument("--kernels", nargs="+", choices=KERNELS,
                        default=[k for k in KERNELS if k != "te" or providers.te_available()])
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is shown")
    parser.add_argument("--size", choices=["tiny", "real"],
                        help="model size (default: real on CUDA, tiny on CPU)")
    parser.add_argument("--codegen", choices=["inductor", "eager"],
                        help="graphpass code generation (default: inductor on CUDA, eager on CPU)")
    parser.add_argument("--fp8-cache", nargs="+", default=[], choices=CACHE_LEVELS,
                        help="also run each FP8 config with these fp8_cache levels")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("real" if device.type == "cuda" else "tiny")
    codegen = args.codegen or ("inductor" if device.type == "cuda" else "eager")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        "CPU (no CUDA): tiny-size smoke run, timings are not representative of FP8 on a GPU")
    print(f"one training step (fw+bw), 1 layer, size={size}, bf16, codegen={codegen}, median of "
          f"{args.steps} steps after {WARMUP} warm-up; torch {torch.__version__}; {where}")
    print("vs bf16: speedup, the bf16 torch.compile default's median / this median, both from "
          "this run")

    baseline_label = "bf16 torch.compile default"
    configs: list[tuple[str, dict[str, object] | None]] = [(baseline_label, None),
                                                           ("bf16", {"fp8": None})]
    for r in args.recipes:
        for k in args.kernels:
            configs.append((f"{r}/{k}", {"fp8": r, "kernels": k}))
            configs += [(f"{r}/{k} cache={c}", {"fp8": r, "kernels": k, "fp8_cache": c})
                        for c in args.fp8_cache]
            if r == "tensorwise" and codegen == "inductor":  # the quantize inlining's worth
                configs.append((f"{r}/{k} opaque q", {"fp8": r, "kernels": k,
                                                      "fuse_quantize": False}))
                configs.append((f"{r}/{k} precise acc", {"fp8": r, "kernels": k,
                                                         "fp8_accumulate": "precise"}))
    configs.append(("torchao float8", {"torchao": True}))

    header = f"{'model':<9} {'config':<36} {'median ms':>10} {'vs bf16':>8} {'peak GiB':>9}  note"
    print(header)
    print("-" * len(header))
    for model_name in args.models:
        baseline: float | None = None
        for label, options in configs:
            r = run_config(model_name, label, options, size, codegen, device, args.steps)
            baseline = r.ms if label == baseline_label else baseline
            ms = f"{r.ms:.2f}" if r.ms is not None else "-"
            speedup = f"{baseline / r.ms:.2f}x" if r.ms and baseline else "-"
            peak = f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-"
            print(f"{r.model:<9} {r.config:<36} {ms:>10} {speedup:>8} {peak:>9}  {r.note}",
                  flush=True)


if __name__ == "__main__":
    main()
