"""Distributed training under graphpass: a fake process group for per-rank planning (the report
names each graph's collectives: ``graph/collectives.py``).

Tensor- and sequence-parallel blocks (DTensor) trace into graphs with torch's functional
collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ...) and
per-rank shapes; graphpass partitions them like any other graph, so its report is that rank's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _compat
from .graph.collectives import FSDP_FP8

# The report's note on FP8 under FSDP2, as it reads (a test of a sharded model looks for it).
FSDP_FP8_NOTE = str(FSDP_FP8)


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
    dist.init_process_group("fake", store=_compat.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
