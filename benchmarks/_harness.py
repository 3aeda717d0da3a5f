"""Timing and memory measurement of one training step, shared by step_time.py and gpu_report.py.

A step is forward + backward of a compiled model with gradients set to None first, as a training
step after ``zero_grad`` does. It is timed on ``torch.utils.benchmark``'s clock (the wall clock,
the accelerator synchronized before each reading); on CUDA its memory is read from the caching
allocator's counters, on CPU memory is not measured (torch keeps no allocator statistics for CPU
tensors).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch._inductor.config
from torch.utils.benchmark.utils.common import set_torch_threads
from torch.utils.benchmark.utils.timer import timer as clock

WARMUP = 3


@dataclass
class Result:
    model: str
    config: str
    ms: float | None = None
    """Median milliseconds of the timed steps."""
    peak_gib: float | None = None
    """``torch.cuda.max_memory_allocated`` over the timed steps, everything included."""
    activation_bytes: int | None = None
    """Measured saved activations: bytes allocated after the forward minus before it (weights and
    inputs), minus the output the caller holds. What ``graphpass.plan`` predicts."""
    step_peak_bytes: int | None = None
    """Peak of one step minus what weights, inputs and the step's gradients hold."""
    fp8_share: float | None = None
    """The FP8 share of the step's GEMM FLOPs, where graphpass compiled it with FP8 on."""
    note: str = ""


def reason(error: BaseException) -> str:
    """The innermost error's first clause: dynamo wraps a backend's error (``inner_exception``,
    not always ``__cause__``), and graphpass's messages go on after a ';' or ', or use' with
    alternatives a table has no room for."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return first.split(";")[0].split(", or use")[0]


GRAPHS = "CUDA graphs"  # the words of a config's label that runs under Inductor's CUDA graphs
CUDAGRAPHS = "cudagraphs"  # the benchmark switch in a config's options that asks for them


def cuda_graphs(options: dict[str, Any] | None
                ) -> tuple[dict[str, Any] | None, ContextManager[Any]]:
    """A config's ``options`` without the ``CUDAGRAPHS`` switch (None where nothing else is
    left: torch.compile's default), and the context to compile and run it in: Inductor's
    ``triton.cudagraphs`` on where the switch was, nothing otherwise."""
    rest = {k: v for k, v in (options or {}).items() if k != CUDAGRAPHS}
    on = bool(options and options.get(CUDAGRAPHS))
    context = (torch._inductor.config.patch({"triton.cudagraphs": True}) if on
               else contextlib.nullcontext())
    return rest or None, context


def picked(label: str, configs: Sequence[str] | None,
           opt_in: Sequence[str] = (GRAPHS,)) -> bool:
    """Whether a config runs under a ``--configs`` filter: its label contains one of
    ``configs`` (every config when None). A label with one of ``opt_in`` in it (``CUDA graphs``)
    runs under a filter only when one of ``configs`` says those words too, so the filters of the
    GPU scripts' stages keep their configs and their time. Callers run their baseline whatever
    it says."""
    if configs is None:
        return True
    for words in opt_in:
        if words in label and not any(words in c for c in configs):
            return False
    return any(c in label for c in configs)


def is_gemm(kernel: str) -> bool:
    """Whether a kernel's name is a GEMM's: cuBLAS(Lt) and CUTLASS, cuDNN attention apart."""
    name = kernel.lower()
    return (any(k in name for k in ("nvjet", "gemm", "cutlass"))
            and not any(k in name for k in ("sdpa", "fmha", "flash", "attention")))


def step_ms(step: Callable[[], None], steps: int) -> float:
    """Median milliseconds of one call of ``step`` over ``steps`` calls, each read on torch's
    benchmark clock (``torch.utils.benchmark``'s ``timer``: it synchronizes the accelerator before
    each reading, so a CUDA step is timed to its end). ``step`` runs ``steps`` times, no more: the
    callers warm up first, where ``Timer.timeit(1)`` would run two untimed calls before each timed
    one (three steps for each one measured). As under ``Timer``, the steps run on one intra-op
    thread."""
    times = []
    with set_torch_threads(1):
        for _ in range(steps):
            start = clock()
            step()
            times.append(clock() - start)
    return statistics.median(times) * 1e3


def measure(result: Result, model: torch.nn.Module, inputs: Sequence[torch.Tensor],
            compiled: Callable[..., torch.Tensor], device: torch.device, steps: int,
            warmup: int = WARMUP) -> Result:
    """Time ``steps`` steps after ``warmup`` (the first compiles) and, on CUDA, measure memory.

    The backward is seeded with a gradient of ones allocated once, outside the measured window,
    so no loss computed in eager mode adds saved tensors of its own to what is measured.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grad_out: list[torch.Tensor] = []  # allocated on the first forward, kept for every step

    def forward() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for x in inputs:
            x.grad = None
        return compiled(*inputs)

    def backward(out: torch.Tensor) -> None:
        if not grad_out:
            grad_out.append(torch.ones_like(out))
        out.backward(grad_out[0])

    def step() -> None:
        backward(forward())

    try:
        for _ in range(warmup):
            step()
        result.ms = step_ms(step, steps)
        if device.type == "cuda":
            _measure_memory(result, forward, backward, params, inputs, device)
    except Exception as e:  # a provider refusing this device, an out-of-memory, a kernel error
        result.note = f"failed: {reason(e)}"
    return result


def _measure_memory(result: Result, forward: Callable[[], torch.Tensor],
                    backward: Callable[[torch.Tensor], None], params: list[torch.Tensor],
                    inputs: Sequence[torch.Tensor], device: torch.device) -> None:
    """One more step between the allocator's counters: saved bytes after the forward, and the
    step's peak above weights, inputs and gradients."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    out = forward()  # sets every gradient to None first, so ``before`` below holds none
    # forward() freed the previous step's gradients before allocating anything, so the
    # allocated bytes before it equal what is allocated once they are gone:
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated(device)
    backward(out)
    torch.cuda.synchronize()
    grads = sum(storage_bytes(t.grad) for t in [*params, *inputs] if t.grad is not None)
    out_bytes = storage_bytes(out)
    del out
    # After the backward only weights, inputs, grad_out and gradients remain allocated.
    steady = torch.cuda.memory_allocated(device) - grads
    result.activation_bytes = after_forward - steady - out_bytes
    result.step_peak_bytes = torch.cuda.max_memory_allocated(device) - steady - grads
    result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
