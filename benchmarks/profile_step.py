"""Where one compiled training step spends its GPU time: the top kernels of one config.

    PYTHONPATH=. python benchmarks/profile_step.py --model llama --fp8 tensorwise --kernels scaled_mm
    PYTHONPATH=. python benchmarks/profile_step.py --model llama              # bf16, for comparison

One real-size layer, bf16 weights, a few steps after warm-up under ``torch.profiler``; prints the
kernels by total CUDA time (self time, summed over the profiled steps, divided by the step count),
the time spent in GEMM kernels (attention apart) and in everything else, the ATen ops that
launched kernels outside Inductor's code, with their input shapes, and what holds the step's
memory peak: one more step under the caching allocator's history, the blocks live at its peak
summed by the line that allocated them (``benchmarks/_memory_history.py``; ``--code-dir`` keeps
the generated wrappers those lines are in, to set beside ``benchmarks/cuda_peak.py --live``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # experts: benchmarks/_experts.py
import graphpass  # noqa: E402
import _memory_history  # noqa: E402
from _harness import is_gemm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=["llama", "gpt", "deepseek", "experts"])
    parser.add_argument("--fp8", default=None, choices=["tensorwise", "blockwise", "mxfp8", "rowwise"])
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--fuse-quantize", default=None, choices=["true", "false"])
    parser.add_argument("--default-backend", action="store_true",
                        help="torch.compile's default (Inductor, torch's partitioner), no graphpass")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--code-dir", type=Path, default=None,
                        help="copy the generated code the peak's blocks were allocated in here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA device")

    module = "_experts" if args.model == "experts" else f"graphpass.models.{args.model}"
    model, inputs = importlib.import_module(module).build(
        "real", layers=1, device="cuda", dtype=torch.bfloat16)
    if args.default_backend:
        backend = "inductor"
    else:
        options: dict[str, object] = {"fp8": args.fp8}
        if args.fp8:
            options["kernels"] = args.kernels
            if args.fuse_quantize:
                options["fuse_quantize"] = args.fuse_quantize == "true"
        backend = graphpass.backend(**options)
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        # as the timed step (benchmarks/_harness.py): gradients set to None first, or each
        # backward would add into the last step's gradients, one eager ``add`` per parameter
        # and input that takes a gradient (11 on the Llama layer) no timed step runs
        model.zero_grad(set_to_none=True)
        for x in inputs:
            x.grad = None
        out = compiled(*inputs)
        out.backward(torch.ones_like(out))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / args.steps / 1e3
    print(f"{args.model}, {'torch default' if args.default_backend else backend!r}: "
          f"{total:.2f} ms of kernels per step; {wall:.2f} ms per step unprofiled (the rest is "
          f"the GPU waiting on the host: Python, launches, host syncs)")

    gemm = sum(e.self_device_time_total for e in events if is_gemm(e.key)) / args.steps / 1e3
    print(f"GEMM kernels: {gemm:.2f} ms ({gemm / total:.0%}); other: {total - gemm:.2f} ms")
    print(f"{'ms/step':>8} {'calls/step':>10}  kernel")
    for e in events[:args.top]:
        print(f"{e.self_device_time_total / args.steps / 1e3:8.3f} {e.count / args.steps:10.1f}  "
              f"{e.key[:110]}")
    eager_ops(step, args.steps, args.top)
    peak_memory(step, args.top, args.code_dir)


def eager_ops(step, steps: int, top: int) -> None:
    """The ATen ops that launched device work, with their input shapes, from a second profile
    with the CPU side recorded (kept apart from the kernel times above, which CPU events would
    count twice): extern kernels (GEMMs, attention), eager ops outside Inductor's code (an
    autograd accumulation's ``add``) and copies, so an eager kernel of the list above can be
    traced to the op and tensors that launched it. Inductor's own Triton kernels have no ATen
    op and do not appear."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"\nATen ops that launched kernels (their own kernels' time), by input shapes:")
    print(f"{'ms/step':>8} {'calls/step':>10}  op  input shapes")
    for e in ops[:top]:
        print(f"{e.self_device_time_total / steps / 1e3:8.3f} {e.count / steps:10.1f}  "
              f"{e.key}  {str(e.input_shapes)[:120]}")


def peak_memory(step, top: int, code_dir: Path | None) -> None:
    """The blocks live at the step's memory peak, by the line that allocated them."""
    torch.cuda.empty_cache()
    peak, blocks = _memory_history.peak_blocks(_memory_history.record(step))
    print("\nMemory peak of one step (the caching allocator's history):")
    print("\n".join(_memory_history.report(peak, blocks, top)))
    if code_dir is not None:
        for path in _memory_history.copy_generated(blocks, code_dir):
            print(f"generated code kept: {path}")


if __name__ == "__main__":
    main()
