"""One rank of ``tests/test_simple_fsdp_gloo.py``: torchtitan's SimpleFSDP over gloo.

    python tests/_simple_fsdp_worker.py simple_fsdp OUT_DIR RANK WORLD STORE

The tiny Llama language model (1 block, hidden 256, vocabulary 256) in float32, wrapped by
SimpleFSDP's ``data_parallel(mode="fully_shard")`` with torchtitan's mixed-precision policy
(bf16 parameters for the compute, fp32 gradient reduction), compiled whole with graphpass FP8
(tensorwise, reference kernels, eager codegen), 3 SGD steps of 2 micro-batches each (gradient
accumulation), three times: with the weights' FP8 all-gather (``fp8_weight_all_gather=True``),
without it (bf16 gathers), and with it under ``fp8_weight_cache=True`` (the FP8 shards and their
amax all-reduce once per optimizer step); then with and without the FP8 all-gather under FP8
blockwise, with 16 sequences (128 tokens a rank and micro-batch). A dispatch mode records every
collective the compiled micro-batches call (op, dtype, shape, bytes), the weight cache's op and
the all-reduce inside it. Each rank writes ``OUT_DIR/simple_fsdp-<rank>.pt``; the test compares.
"""

from __future__ import annotations

import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import graphpass  # noqa: E402
from graphpass.fp8 import weight_cache  # noqa: E402

from graphpass.models import llama

STEPS = 3
MICRO = 2  # micro-batches per optimizer step
LR = 0.5
BATCH = 4  # the global batch; each rank takes BATCH // world rows
COLLECTIVES = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")


class Recorder(TorchDispatchMode):
    """Every functional collective called while it is on: (op, input dtype, input shape,
    output dtype, output bytes), in call order."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # dynamo runs the compiled code under it (it skips frames under other modes)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, tuple, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is weight_cache.QUANTIZE_WEIGHT_SHARDS:
            # recorded, and run with the recorder on: the all-reduce inside it is recorded too
            shards = args[0]
            self.calls.append(("quantize_weight_shards", str(shards[0].dtype).removeprefix(
                "torch."), (len(shards),), "", 0))
            with self:
                return weight_cache._quantize_weight_shards(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            x = args[0]
            self.calls.append((name, str(x.dtype).removeprefix("torch."), tuple(x.shape),
                               str(out.dtype).removeprefix("torch."),
                               out.numel() * out.element_size()))
        return out


class LM(nn.Module):
    """The language model and its loss, one graph."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(tokens).float().flatten(0, 1), targets.flatten())


def _run(rank: int, world: int, weight_all_gather: bool, cache: bool = False,
         recipe: str = "tensorwise") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer import simple_fsdp
    from torchtitan.experiments.graph_trainer.simple_fsdp import (MixedPrecisionPolicy,
                                                                   data_parallel)

    torch._dynamo.reset()
    graphpass.clear_weight_cache()
    simple_fsdp._wrap_class_cache.clear()  # its classes keep the first wrapping's properties
    # blockwise GEMMs need multiples of 128 tokens: 16 sequences of 32, 128 a rank and
    # micro-batch
    batch = BATCH if recipe == "tensorwise" else 8 * MICRO
    model, (tokens,) = llama.build("tiny_lm", layers=1, batch=batch, dtype=torch.float32)
    targets = torch.randint(0, 256, tokens.shape, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (world,))
    model = data_parallel(model, mesh, mode="fully_shard", mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    backend = graphpass.backend(codegen="eager", fp8=recipe, kernels="reference",
                                fp8_weight_all_gather=weight_all_gather, fp8_weight_cache=cache)
    step = torch.compile(LM(model), backend=backend)
    # this rank's rows, one per micro-batch
    micro = list(zip(*(t.chunk(world)[rank].chunk(MICRO) for t in (tokens, targets))))
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)  # as torchtitan's optimizers
    losses, grads, calls, stats = [], [], [], []
    for i in range(STEPS):
        opt.zero_grad()
        before = graphpass.weight_cache_stats()
        calls.append([])
        for m, batch in enumerate(micro):
            recorder = Recorder()
            # the first micro-batch compiles, unrecorded; the others run the compiled code
            with recorder if i or m else contextlib.nullcontext():
                loss = step(*batch)
                (loss / MICRO).backward()
            calls[-1].append(recorder.calls)
            losses.append(loss.detach())
        after = graphpass.weight_cache_stats()
        stats.append((after.quantized - before.quantized, after.reused - before.reused))
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    (report,) = backend.partitioner.reports
    return dict(losses=losses, grads=grads, params=params, calls=calls, shapes=shapes,
                notes=list(report.notes), stats=stats, peak=report.meta.get("step_peak"))


RUNS = {"fp8": (True, False), "bf16": (False, False), "cached": (True, True),
        # blockwise: the weights whose shards are whole 128-row tiles gather FP8 and tile scales
        "blockwise": (True, False, "blockwise"), "blockwise_bf16": (False, False, "blockwise")}
"""(fp8_weight_all_gather, fp8_weight_cache, recipe) of each run."""


def simple_fsdp(rank: int, world: int, out: str) -> None:
    results = {name: _run(rank, world, *RUNS[name]) for name in RUNS}
    torch.save(results, os.path.join(out, f"simple_fsdp-{rank}.pt"))


def main(argv: list[str]) -> None:
    scenario, out, rank, world, store = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    torch.set_num_threads(1)  # both ranks sum in the same order
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        globals()[scenario](rank, world, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
