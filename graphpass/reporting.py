"""The report of one partition: what the forward saves, what the passes decided, what it costs.

Built in two steps because torch's partitioner edits the joint graph: what is read from the joint
graph (the step's FLOPs, FP8 coverage) is read before the min-cut, the rest from the forward and
backward modules it returns.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from . import _compat
from ._version import __version__
from .config import Config
from .decisions import Decision, Plan, What
from .fp8.inductor import fusion_notes, quantize_code
from .graph.collectives import (collective_notes, fp8_distributed_notes,
                                fsdp_weight_gather_notes, weight_gather_notes)
from .graph.flops import step_flops
from .graph.foreign import foreign_notes
from .graph.gemms import coverage
from .graph.joint import primal_input_indices
from .graph.offload_copies import copy_notes, offload_copies
from .graph.outcome import outcome_notes, weight_once_outcome
from .graph.peak import step_peak
from .graph.saved import saved_rows
from .report import Report

_last_report: Report | None = None


class ReportBuilder:
    """Reads the joint graph after the passes; then :meth:`saved` and :meth:`build` read each
    partition of it."""

    def __init__(self, joint: fx.GraphModule, plan: Plan, config: Config, *,
                 num_fwd_outputs: int) -> None:
        self.plan, self.config, self.num_fwd_outputs = plan, config, num_fwd_outputs
        self.estimated: dict[str, str] = {}  # ops whose FLOPs were estimated: why
        self.step_flops = step_flops(joint, self.estimated)
        self.fp8_coverage = coverage(joint) if config.fp8 else None
        self.parameter_names = {p.name for p in plan.parameters}

    def saved(self, fw: fx.GraphModule, bw: fx.GraphModule,
              input_sources: dict[str, str] | None = None) -> Report:
        """The saved-tensor rows of one partition, alone."""
        return Report(rows=saved_rows(fw, bw, num_fwd_outputs=self.num_fwd_outputs,
                                      static_input_names=self.parameter_names,
                                      input_sources=input_sources or {}))

    def build(self, fw: fx.GraphModule, bw: fx.GraphModule, *, input_sources: Sequence[str | None],
              fsdp: bool, assumed: dict[str, list[str]]) -> Report:
        """The report of the partition used: rows, every decision as a note, and the meta.

        ``input_sources`` are the user's names of the graph inputs (dynamo's sources), in order;
        ``fsdp`` whether any is a weight FSDP2 manages; ``assumed`` the unbacked sizes that were
        given a hint (``_compat.assumed_sizes``).
        """
        primals = self.plan.primals
        # Dynamo's graph inputs: one per primal, or per DTensor two primals (torch 2.13+).
        index = primal_input_indices(primals)
        named = ({p.name: input_sources[i] for p, i in zip(primals, index) if i is not None}
                 if set(index) == set(range(len(input_sources))) else {})
        report = self.saved(fw, bw, {k: v for k, v in named.items() if v})
        outcome, recompute_flops = outcome_notes(fw, bw, num_fwd_outputs=self.num_fwd_outputs)
        lowered = any(d.what is What.LOWERED for d in self.plan.decisions)
        report.decisions = [
            *weight_once_outcome(self.plan.decisions, bw),
            *self._partitioning_notes(),
            *(Decision(What.FLOPS_ESTIMATED, "flops", f"{op} ({why})")
              for op, why in self.estimated.items()),
            *self._fusion_notes(),
            *outcome,
            *copy_notes(offload_copies(fw, bw), synchronous=self.config.offload_stream is False),
            *collective_notes(fw, bw),  # a tensor/sequence-parallel rank's communication
            # SimpleFSDP: each weight's all-gather, its dtype and bytes
            *weight_gather_notes(fw, bw, self.parameter_names, named),
            # FSDP2: each weight's all-gather before the graph, its dtype and bytes
            *(fsdp_weight_gather_notes(fw, self.parameter_names, named) if fsdp else []),
            *foreign_notes((fw, bw)),  # other libraries' layers: in the graph or outside it
            *(fp8_distributed_notes(fw, bw, fsdp=fsdp, parameter_names=self.parameter_names)
              if lowered else []),
            *(Decision(What.SIZES_ASSUMED, "sizes", why) for why in _compat.assumed_sizes_why(assumed)),
        ]
        report.notes = [str(d) for d in report.decisions]
        report.meta = _meta(self.config)
        report.meta.update(step_flops=self.step_flops, recompute_flops=recompute_flops)
        with quantize_code(self.config):
            report.meta["step_peak"] = step_peak(
                fw, bw, num_fwd_outputs=self.num_fwd_outputs,
                parameter_names=self.parameter_names, runtime=self.config.codegen).to_dict()
        if self.fp8_coverage is not None:
            report.meta["fp8_coverage"] = self.fp8_coverage
        return report

    def _partitioning_notes(self) -> list[Decision]:
        """What the passes changed about how torch's min-cut partitions the graph after them."""
        if not self.plan.torch_offloading:
            return []
        return [Decision(What.TORCH_OFFLOADING, self.plan.torch_offloading,
                         "offload=False; for the tensors it marked for offload")]

    def _fusion_notes(self) -> list[Decision]:
        """Where the backend leaves quantizes as one op although ``fuse_quantize`` asks to inline
        them: say which and why."""
        config = self.config
        if config.codegen != "inductor" or not config.fuse_quantize or config.fp8 is None:
            return []
        return fusion_notes(device_types={p.meta["val"].device.type for p in self.plan.primals
                                          if isinstance(p.meta.get("val"), torch.Tensor)},
                            recipe=config.fp8_recipe)


def remember(report: Report) -> None:
    """Keep ``report`` for :func:`last_report`."""
    global _last_report
    _last_report = report


def last_report() -> Report | None:
    """The report of the most recent partition in this process (``None`` before any).

    A convenience for one compiled graph: a model that compiles to several graphs (graph breaks)
    has one report per graph; ``Backend.report()`` merges those of one backend, and
    ``graphpass.plan`` returns them merged.
    """
    return _last_report


def _meta(config: Config) -> dict[str, Any]:
    return {"graphpass": __version__, "torch": _compat.TORCH_VERSION_STR, "config": config.as_dict()}
