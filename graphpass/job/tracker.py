"""torch's ``MemTracker`` and ``FSDPMemTracker``, recording what ``graphpass.estimate`` needs.

Contract: :func:`step_tracker` returns one of torch's trackers (``torch.distributed._tools``)
with four additions, none of which changes what torch counts:

- it runs compiled code: a ``TorchDispatchMode`` that ignores compile internals, so dynamo
  compiles with the tracker off and the compiled graphs run under it (torch otherwise skips
  compiling, and runs the model eagerly, while a non-infra dispatch mode is on the stack);
- the step's phase and micro-batch (set by ``job/estimate.py``) and the compiled graph pass
  running (``GraphPass``, set by ``job/graphs.py``) key the highest total seen in each stretch
  (:class:`Sample`), with the breakdown and the innermost running module there;
- what the loss phase allocates, and the model output it is given (``mark_loss``), are a part of
  their own (``Part.LOGITS_AND_LOSS``), moved out of the category torch gave them.

torch's categories map onto :class:`~graphpass.job.result.Part` by their names (``PART_OF``):
both trackers' category enums are private and differ between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat
from .._compat.mem_tracker import fsdp_mem_tracker_class, mem_tracker_class, untyped_storages
from .result import Part, Phase

# torch's MemTracker (_MemRefType) and FSDPMemTracker (_FSDPRefType) categories, by value.
PART_OF: dict[str, Part] = {
    "Parameter": Part.PARAMETERS, "Sharded Param": Part.PARAMETERS,
    "Buffer": Part.BUFFERS,
    "Gradient": Part.GRADIENTS, "Sharded Grad": Part.GRADIENTS,
    "Optstate": Part.OPTIMIZER_STATE, "OptState": Part.OPTIMIZER_STATE,
    "Unsharded Param": Part.FSDP_BUFFERS, "Unsharded Grad": Part.FSDP_BUFFERS,
    "All Gather": Part.FSDP_BUFFERS, "Reduce Scatter": Part.FSDP_BUFFERS,
    "Activation": Part.ACTIVATIONS,
    "Temp": Part.TRANSIENTS,
    "Other": Part.INPUTS, "Inputs": Part.INPUTS,
}
_TOTAL = "Total"


class GraphPass(NamedTuple):
    """One compiled graph's forward or backward, while it runs."""

    graph: int
    """The graph's index in the order graphpass partitioned them."""
    backward: bool


class Key(NamedTuple):
    """A stretch of the step whose highest total is kept."""

    phase: Phase
    micro_batch: int
    graph: GraphPass | None
    """The compiled graph pass running, None outside every compiled graph."""


@dataclass
class Sample:
    """The highest total of one stretch, what was alive there, and the module running."""

    total: int
    parts: dict[Part, int]
    module: str


class _Recording:
    """The additions to a torch tracker (mixed in before it: ``StepTracker``)."""

    phase: Phase = Phase.ZERO_GRAD
    micro_batch: int = 0
    graph_source: Any = None
    """What names the compiled graph pass running (``job/graphs.EstimateGraphs.current``)."""

    @property
    def graph(self) -> GraphPass | None:
        return self.graph_source.current if self.graph_source is not None else None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _init_recording(self) -> None:
        self.samples: dict[tuple[str, Key], Sample] = {}  # (device, key) -> highest
        self._loss_storages = WeakIdKeyDictionary()  # storage -> its tracker info

    # --- what torch's tracker calls ------------------------------------------------------

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        new = [st for st in untyped_storages(t) if st not in self._WINFO]  # type: ignore[attr-defined]
        super()._track(reftype, t)  # type: ignore[misc]
        if self.phase is Phase.LOSS and self.graph is None:
            for st in new:
                self._mark(st)

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)  # type: ignore[misc]
        self.record()

    # --- for job/estimate.py -------------------------------------------------------------

    def mark_loss(self, output: Any) -> None:
        """Count the tensors of ``output`` (the model's output) as logits and loss."""
        if isinstance(output, Mapping):  # a Hugging Face ModelOutput
            output = list(output.values())
        for leaf in _compat.tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                for st in untyped_storages(leaf):
                    self._mark(st)

    def record(self) -> None:
        """Keep the current total where it is the highest of its stretch."""
        key = Key(self.phase, self.micro_batch, self.graph)
        for dev, snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            device = str(dev)
            best = self.samples.get((device, key))
            if best is None or snap[_TOTAL] > best.total:
                self.samples[(device, key)] = Sample(snap[_TOTAL], self._parts(dev, snap),
                                                     self._module())

    # --- helpers ---------------------------------------------------------------------------

    def _mark(self, st: Any) -> None:
        info = self._WINFO.get(st)  # type: ignore[attr-defined]
        if info is not None:
            self._loss_storages[st] = info[0]

    def _parts(self, dev: torch.device, snap: dict[Any, int]) -> dict[Part, int]:
        parts = dict.fromkeys(Part, 0)
        for ref, n in snap.items():
            if ref != _TOTAL:
                parts[PART_OF[ref.value]] += n
        for info in list(self._loss_storages.values()):
            if info.device == dev:
                part = PART_OF[info.reftype.value]
                moved = min(info.mem_consumed, parts[part])
                parts[part] -= moved
                parts[Part.LOGITS_AND_LOSS] += moved
        return parts

    def _module(self) -> str:
        """The innermost module running (the longest of ModTracker's parents)."""
        names = [p for p in self._mod_tracker.parents if p != "Global"]  # type: ignore[attr-defined]
        return max(names, key=lambda p: (p.count("."), len(p)), default="")


class StepTracker(_Recording, mem_tracker_class()):  # type: ignore[misc]
    """torch's ``MemTracker`` with the step's recording (one process, or tensor parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self._init_recording()


def fsdp_step_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """torch's ``FSDPMemTracker`` of an FSDP2 root module with the step's recording."""
    class FSDPStepTracker(_Recording, fsdp_mem_tracker_class()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(model, optimizer)
            self._init_recording()

    return FSDPStepTracker()
