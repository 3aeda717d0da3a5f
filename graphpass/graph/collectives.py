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
