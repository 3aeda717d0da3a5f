"""``memory_budget`` for a whole job: a budget per device that first accounts for what lives
outside the compiled graphs, then leaves the rest to graphpass's planner inside them.

Contract: ``graphpass.estimate`` with ``Config(memory_budget=B)`` runs the step once without a
budget; :func:`outside_graphs` is the most that lives outside the compiled graphs while one of
them runs (each graph pass's highest total, less graphpass's predicted peak of that pass, which
holds the graph's own parameters, inputs, saved tensors and transients). Every graph is then
partitioned again with ``memory_budget=B - outside`` (``passes/memory_budget.py`` plans its
recompute and offload within it), and :func:`budgeted` says what of ``B`` each part took at the
job's peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import Config
from ..report.totals import format_bytes
from .result import JobEstimate, Part

# A fraction of the device's memory is of an H100's when no CUDA device is present, as the
# per-graph budget reads it (passes/memory_budget.py).
H100_MEMORY = 80 * 2**30


def job_budget(config: Config | None) -> int | None:
    """The job's budget in bytes, None without one."""
    budget = getattr(config, "memory_budget", None) if config is not None else None
    if budget is None:
        return None
    if isinstance(budget, float):
        import torch

        total = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
                 else H100_MEMORY)
        return int(budget * total)
    return int(budget)


def outside_graphs(tracker: Any, graphs: Any, result: JobEstimate) -> int:
    """The most bytes alive outside the compiled graphs while one of them runs."""
    if graphs is None or not graphs.reports:
        return result.peak_bytes
    worst = 0
    for (_, key), sample in tracker.samples.items():
        if key.graph is None or key.graph.graph >= len(graphs.reports):
            continue
        peak = graphs.reports[key.graph.graph].meta.get("step_peak") or {}
        own = peak.get("backward_peak" if key.graph.backward else "forward_peak", 0)
        worst = max(worst, sample.total + graphs.correction(key.graph) - own)
    return worst


def budgeted(result: JobEstimate, budget: int, outside: int, per_graph: int) -> JobEstimate:
    """``result`` with the budget's shares (its breakdown at the peak) and a note."""
    fits = "fits" if result.peak_bytes <= budget else "is over"
    note = (f"memory_budget {format_bytes(budget)} per device: {format_bytes(outside)} lives "
            f"outside the compiled graphs while they run, so graphpass planned each graph within "
            f"{format_bytes(per_graph)}; the step's predicted peak {format_bytes(result.peak_bytes)}"
            f" {fits} the budget")
    shares = {part: n for part, n in result.breakdown.items() if n}
    return dataclasses.replace(result, budget=shares, notes=(*result.notes, note))
