"""Distributed training under graphpass: a fake process group for per-rank planning, and the
report's note naming the collectives each graph runs.

Tensor- and sequence-parallel blocks (DTensor) trace into graphs with torch's functional
collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ...) and
per-rank shapes; graphpass partitions them like any other graph, so its report is that rank's.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.fx as fx


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Plan rank ``rank`` of ``world_size`` without GPUs or other processes: torch's fake process
    group (its test utility; every collective returns at once without communicating), the
    default group for the duration. Build the mesh and parallelize inside it."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("per-rank planning needs torch built with torch.distributed")
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists; plan inside it (its ranks are real) or "
            "call fake_process_group() in a process that has none")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} of world_size {world_size}")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def collective_notes(fw: fx.GraphModule, bw: fx.GraphModule) -> list[str]:
    """One note per graph with collectives: which, how many, and the bytes each rank receives."""
    notes = []
    for name, gm in (("forward", fw), ("backward", bw)):
        counts: Counter[str] = Counter()
        received: Counter[str] = Counter()
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                continue
            if target.namespace != "_c10d_functional" or target.__name__.startswith("wait_tensor"):
                continue
            op = target.__name__.split(".")[0]
            counts[op] += 1
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                received[op] += val.numel() * val.element_size()
        if counts:
            from .report import format_bytes

            parts = ", ".join(f"{op} x{n} ({format_bytes(received[op])} out)"
                              for op, n in sorted(counts.items()))
            notes.append(f"collectives in the {name}: {parts}")
    return notes


FSDP_FP8_NOTE = (
    "fp8 under FSDP2: each weight is quantized after FSDP's all-gather, from the unsharded weight "
    "(one scale per weight, as in one process); the all-gather moves the parameter dtype: FP8 "
    "all-gather (torchao's float8 FSDP weights) is not supported; activation amaxes are this "
    "rank's batch rows, not reduced across data-parallel ranks")


def fp8_distributed_notes(fw: fx.GraphModule, bw: fx.GraphModule, *, fsdp: bool) -> list[str]:
    """What graphpass does not do for FP8 in a distributed graph (docs/distributed.md): no FP8
    all-gather (FSDP2's weights, sequence-parallel inputs), no amax reduced across ranks."""
    notes = [FSDP_FP8_NOTE] if fsdp else []
    moved = sorted({str(node.meta["val"].dtype).removeprefix("torch.")
                    for gm in (fw, bw) for node in gm.graph.nodes
                    if node.op == "call_function"
                    and getattr(node.target, "__name__", "").startswith("all_gather_into_tensor")
                    and isinstance(node.meta.get("val"), torch.Tensor)})
    if moved:
        notes.append(
            f"fp8 under tensor parallelism: quantizes run after the all-gathers, which move "
            f"{', '.join(moved)} (FP8 all-gather of sequence-parallel inputs, as Transformer "
            "Engine does, is not supported), so a gathered input has one scale, the same on every "
            "rank; no amax is reduced across ranks: a weight shard or a row-parallel input "
            "scales by this rank's shard")
    return notes
