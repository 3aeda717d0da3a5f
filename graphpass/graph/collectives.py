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
    """FP8 in a distributed graph (docs/distributed.md): where the all-gathers quantize (before
    the collective with a group amax, or after it), and what graphpass does not do (FP8
    all-gather of FSDP2's weights, amaxes reduced over data-parallel ranks or weight shards)."""
    notes = [FSDP_FP8] if fsdp else []
    moved = {node.meta["val"].dtype
             for gm in (fw, bw) for node in gm.graph.nodes
             if node.op == "call_function"
             and getattr(node.target, "__name__", "").startswith("all_gather_into_tensor")
             and isinstance(node.meta.get("val"), torch.Tensor)}
    high = sorted(str(d).removeprefix("torch.") for d in moved if d.is_floating_point)
    if torch.uint8 in moved:  # passes/fp8_all_gather.py: FP8 bytes, as uint8
        notes.append(Decision(What.FP8_DISTRIBUTED, "fp8", (
            "tensor parallelism: sequence-parallel inputs and gradients are quantized before "
            "their all-gathers, with the amax reduced (max) over the group as Transformer Engine "
            "does, and the all-gathers move FP8 bytes (uint8), so a gathered tensor has one "
            "scale, the same on every rank; a weight shard or a row-parallel input scales by "
            "this rank's shard")))
    if high:
        notes.append(Decision(What.FP8_DISTRIBUTED, "fp8", (
            f"tensor parallelism: all-gathers that move {', '.join(high)} are quantized after "
            "the collective (the fp8 all-gather notes say why), so a gathered input has one "
            "scale, the same on every rank; no amax is reduced across ranks there: a weight "
            "shard or a row-parallel input scales by this rank's shard")))
    return notes
