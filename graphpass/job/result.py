"""What ``graphpass.estimate`` returns: one training step's predicted peak per device, pure data.

``job/estimate.py`` runs the step and fills a :class:`JobEstimate`; the ``graphpass fit`` command
reads it. A part of the step's memory is a :class:`Part`, a stretch of the step a :class:`Phase`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from ..report.totals import format_bytes


class Part(Enum):
    """What a byte at the peak holds. torch's ``MemTracker`` categories map onto these
    (``job/tracker.py``: ``PART_OF``)."""

    PARAMETERS = "parameters"
    """The parameters this rank keeps: the whole model, or FSDP2's shards."""
    BUFFERS = "buffers"
    """The modules' registered buffers (rotary tables, norms' running statistics)."""
    GRADIENTS = "gradients"
    """The ``.grad`` of the parameters (FSDP2: the sharded gradients)."""
    OPTIMIZER_STATE = "optimizer state"
    """What the optimizer keeps between steps (Adam's moments, SGD's momentum) and what its step
    allocates."""
    FSDP_BUFFERS = "FSDP buffers"
    """FSDP2's unsharded parameters and gradients, all-gather and reduce-scatter buffers."""
    ACTIVATIONS = "saved activations"
    """Tensors the forward made that are alive: what autograd saves for the backward."""
    TRANSIENTS = "transients"
    """The backward's temporaries: gradients of activations and an op's scratch."""
    LOGITS_AND_LOSS = "logits and loss"
    """The model's output and what the loss function allocates from it."""
    INPUTS = "inputs"
    """The step's input tensors and anything else tracked that is none of the above."""


class Phase(Enum):
    """A stretch of one training step, in the order it runs."""

    ZERO_GRAD = "zero_grad"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer step"


@dataclass(frozen=True)
class PhasePeak:
    """The highest the step's memory reaches in one phase (over all micro-batches)."""

    phase: Phase
    bytes: int
    micro_batch: int
    """Which micro-batch (0-based) reached it; 0 for the optimizer step and zero_grad."""
    module: str
    """The innermost module running there (``""`` outside every module)."""


@dataclass(frozen=True)
class JobEstimate:
    """One training step's predicted peak memory on one device (one rank)."""

    peak_bytes: int
    """The predicted peak of the step, in bytes, on this rank's compute device."""
    breakdown: Mapping[Part, int]
    """What is alive at the peak, per part; the values sum to ``peak_bytes``."""
    phase: Phase
    """The phase the peak falls in."""
    module: str
    """The innermost module running at the peak (MemTracker's module tracking; ``""`` where no
    module runs, as in the loss or the optimizer step)."""
    micro_batch: int
    """The micro-batch (0-based) in which the peak falls."""
    phases: tuple[PhasePeak, ...]
    """The peak of every phase that ran, in the step's order."""
    notes: tuple[str, ...]
    """What is counted as it allocates, what is estimated instead, and any default taken."""
    world_size: int = 1
    rank: int = 0
    micro_batches: int = 1
    step_time_s: float | None = None
    """The step's predicted time from graphpass's roofline over the compiled graphs (the
    ``roofline`` of their reports), where one is known; None elsewhere."""
    report: Any = None
    """The merged :class:`graphpass.Report` of the compiled graphs, None where nothing compiled."""
    budget: Mapping[Part, int] = field(default_factory=dict)
    """With ``Config(memory_budget=...)``: the bytes of the budget each part takes at the peak,
    after graphpass planned every compiled graph within what the parts outside them leave
    (``job/budget.py``; a note gives the numbers); empty without a budget."""

    def fits(self, device_bytes: int, *, reserve_bytes: int = 0) -> bool:
        """Whether the step fits a device of ``device_bytes`` with ``reserve_bytes`` kept free
        (the allocator's fragmentation, the CUDA context, NCCL's buffers: none of them is
        predicted here)."""
        return self.peak_bytes + reserve_bytes <= device_bytes

    def headroom(self, device_bytes: int) -> int:
        """``device_bytes`` minus the peak (negative: it does not fit)."""
        return device_bytes - self.peak_bytes

    def phase_peak(self, phase: Phase) -> PhasePeak | None:
        """The peak of ``phase``, None where the step did not run it."""
        return next((p for p in self.phases if p.phase is phase), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (enums by value)."""
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": {p.value: b for p, b in self.breakdown.items()},
            "phase": self.phase.value, "module": self.module, "micro_batch": self.micro_batch,
            "phases": [{"phase": p.phase.value, "bytes": p.bytes, "micro_batch": p.micro_batch,
                        "module": p.module} for p in self.phases],
            "notes": list(self.notes), "world_size": self.world_size, "rank": self.rank,
            "micro_batches": self.micro_batches, "step_time_s": self.step_time_s,
            "budget": {p.value: b for p, b in self.budget.items()},
        }

    def __str__(self) -> str:
        where = f"{self.phase.value}" + (f" in {self.module}" if self.module else "")
        if self.micro_batches > 1:
            where += f", micro-batch {self.micro_batch + 1} of {self.micro_batches}"
        rank = f" (rank {self.rank} of {self.world_size})" if self.world_size > 1 else ""
        lines = [f"step peak (predicted){rank}: {format_bytes(self.peak_bytes)} at {where}"]
        width = max(len(p.value) for p in Part)
        for part, n in self.breakdown.items():
            if n:
                lines.append(f"  {part.value:<{width}}  {format_bytes(n):>11}")
        lines.append("per phase:")
        for p in self.phases:
            at = f" in {p.module}" if p.module else ""
            lines.append(f"  {p.phase.value:<{width}}  {format_bytes(p.bytes):>11}{at}")
        if self.budget:
            lines.append("memory budget, taken at the peak:")
            for part, n in self.budget.items():
                lines.append(f"  {part.value:<{width}}  {format_bytes(n):>11}")
        if self.step_time_s is not None:
            lines.append(f"step time (roofline, compiled graphs): {self.step_time_s * 1e3:.3g} ms")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
