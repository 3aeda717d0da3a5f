"""The collectives a partitioned graph runs (tensor/sequence-parallel communication), for the
report.

Tensor- and sequence-parallel blocks (DTensor) trace into graphs with torch's functional
collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ...) and
per-rank shapes; graphpass partitions them like any other graph, so its report is that rank's.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

from .. import _compat
from ..decisions import Decision, What
from ..report import format_bytes


def collective_notes(fw: fx.GraphModule, bw: fx.GraphModule) -> list[Decision]:
    """One note per graph with collectives: which, how many, and the bytes each rank receives."""
    notes = []
    for name, gm in (("forward", fw), ("backward", bw)):
        counts: Counter[str] = Counter()
        received: Counter[str] = Counter()
        for node in gm.graph.nodes:
            target = node.target
            if node.op != "call_function" or not _compat.is_op_overload(target):
                continue
            if target.namespace != "_c10d_functional" or target.__name__.startswith("wait_tensor"):
                continue
            op = target.__name__.split(".")[0]
            counts[op] += 1
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                received[op] += val.numel() * val.element_size()
        if counts:
            parts = ", ".join(f"{op} x{n} ({format_bytes(received[op])} out)"
                              for op, n in sorted(counts.items()))
            notes.append(Decision(What.COLLECTIVES, "distributed", f"{name}: {parts}"))
    return notes


FSDP_FP8 = Decision(What.FP8_DISTRIBUTED, "fp8", (
    "FSDP2: each weight is quantized after FSDP's all-gather, from the unsharded weight (one "
    "scale per weight, as in one process); the all-gather moves the parameter dtype: FP8 "
    "all-gather (torchao's float8 FSDP weights) is not supported; activation amaxes are this "
    "rank's batch rows, not reduced across data-parallel ranks"))


def fp8_distributed_notes(fw: fx.GraphModule, bw: fx.GraphModule, *, fsdp: bool) -> list[Decision]:
    """What graphpass does not do for FP8 in a distributed graph (docs/distributed.md): no FP8
    all-gather (FSDP2's weights, sequence-parallel inputs), no amax reduced across ranks."""
    notes = [FSDP_FP8] if fsdp else []
    moved = sorted({str(node.meta["val"].dtype).removeprefix("torch.")
                    for gm in (fw, bw) for node in gm.graph.nodes
                    if node.op == "call_function"
                    and getattr(node.target, "__name__", "").startswith("all_gather_into_tensor")
                    and isinstance(node.meta.get("val"), torch.Tensor)})
    if moved:
        notes.append(Decision(What.FP8_DISTRIBUTED, "fp8", (
            f"tensor parallelism: quantizes run after the all-gathers, which move "
            f"{', '.join(moved)} (FP8 all-gather of sequence-parallel inputs, as Transformer "
            "Engine does, is not supported), so a gathered input has one scale, the same on every "
            "rank; no amax is reduced across ranks: a weight shard or a row-parallel input "
            "scales by this rank's shard")))
    return notes
