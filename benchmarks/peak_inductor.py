"""The step peak graphpass predicts under ``codegen="inductor"`` against the CPU allocator's
peak of the compiled step, with the graphs read node by node and as Inductor's code runs them.

    PYTHONPATH=. python benchmarks/peak_inductor.py

Each example is compiled with ``graphpass.backend(codegen="inductor")`` (Inductor's C++ code on
the CPU), warmed up, then one training step ``model(x).sum().backward()`` runs under torch's
profiler with ``profile_memory``: its allocator's running total sees every allocation, the
buffers Inductor's code allocates with ``empty_strided_cpu`` included (MemTracker's dispatch mode
does not). One thread: the CPU attention and bf16 GEMM kernels allocate per-thread scratch
inside the op, which no graph shows. ``.grad`` is left unset, so the gradients the backward
returns become it, as the prediction counts. tests/test_peak.py asserts the Llama and GPT rows
at two layers within 0.1%, the DeepSeek one within 1% (the CPU attention backward's per-thread
buffers, inside the op; docs/memory/step-peak.md, "Under Inductor").
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.graph.peak import step_peak  # noqa: E402

# (example, layers, seq, dtype)
CASES = [("llama", 1, 2048, torch.float32), ("llama", 1, 2048, torch.bfloat16),
         ("llama", 2, 512, torch.float32), ("gpt", 1, 2048, torch.float32),
         ("gpt", 2, 512, torch.float32), ("deepseek", 1, 512, torch.float32),
         ("deepseek", 2, 512, torch.float32)]


def allocator_peak(step, resident: int) -> int:
    """The CPU allocator's peak over one step ``step()``: what it held at most beyond what was
    live before (torch's profiler reports every allocation), plus ``resident``."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size,
                           event.extra_fields.total_allocated))
    events.sort()
    # the allocator's running total carries what earlier profiles left: count from this step's start
    start = events[0][2] - events[0][1]
    return resident + max(total for _, _, total in events) - start


def measure(name: str, layers: int, seq: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(measured, predicted from the graphs node by node, predicted as Inductor runs them)."""
    backend_module = importlib.import_module("graphpass.backend")
    graphs, real = [], backend_module.run

    def capturing(*args, **kwargs):
        fw, bw, report, selected = real(*args, **kwargs)
        graphs.append((fw, bw, kwargs["num_fwd_outputs"]))
        return fw, bw, report, selected

    torch._dynamo.reset()
    backend_module.run = capturing
    try:
        torch.manual_seed(0)
        model, (x,) = importlib.import_module(f"graphpass.models.{name}").build(
            "tiny", layers=layers, seq=seq, dtype=dtype)
        backend = graphpass.backend(codegen="inductor")
        step = torch.compile(lambda x: model(x).sum(), backend=backend)
        step(x).backward()
    finally:
        backend_module.run = real
    model.zero_grad(set_to_none=True)
    x.grad = None
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters())
    measured = allocator_peak(lambda: step(x).backward(), resident + x.untyped_storage().nbytes())
    (fw, bw, num_fwd_outputs), = graphs
    as_is = step_peak(fw, bw, num_fwd_outputs=num_fwd_outputs, parameter_names=set(),
                      fused=False).bytes
    return measured, as_is, backend.report().meta["step_peak"]["bytes"]


def main() -> None:
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the partitioner
    torch._functorch.config.enable_autograd_cache = False
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, one thread, Inductor's C++ code\n")
    print("| example | measured | graphs node by node | as Inductor runs them |")
    print("|---|---|---|---|")
    for name, layers, seq, dtype in CASES:
        measured, as_is, fused = measure(name, layers, seq, dtype)
        label = f"{name}, {layers} layer{'s' if layers > 1 else ''}, seq {seq}, " + \
            str(dtype).removeprefix("torch.")
        print(f"| {label} | {measured:,} B | {as_is / measured - 1:+.1%} | "
              f"{fused - measured:+,} B ({fused / measured - 1:+.1%}) |", flush=True)


if __name__ == "__main__":
    main()
